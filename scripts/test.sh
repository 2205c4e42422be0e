#!/usr/bin/env bash
# Set up and run the test suite (CPU; GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
python3 -m pytest -q -p no:cacheprovider "$@"
