#!/usr/bin/env bash
# Wheels the HTTP server needs on the lent GPU machines, whose image lacks them (it has aiohttp,
# anyio, h11, prometheus-client, but no FastAPI stack or pyzmq; fastapi 0.165 also imports
# opentelemetry-api and annotated-doc, uvicorn click; compressed-tensors, for its checkpoints'
# configs, with loguru), into .whl/ (git-ignored), for Python 3.12 manylinux. Run here, from the repository root:
#   bash benchmarks/device_wheels.sh
# then name ".whl" in the device call's carry and start its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# The versions are the ones pyproject resolves on this machine (pip list), so both ends agree.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
version() { python3 -m pip show "$1" 2>/dev/null | sed -n "s/^Version: //p" || true; }
PACKAGES=(fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
          pyzmq opentelemetry-api annotated-doc click orjson httptools
          py-spy compressed-tensors loguru)
specs=()
for name in "${PACKAGES[@]}"; do
    v="$(version "$name")"
    specs+=("$name${v:+==$v}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
du -sh .whl
