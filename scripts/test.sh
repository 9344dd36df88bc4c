#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. CI runs this.
set -euo pipefail
. "$(dirname "$0")/_setup.sh"
cd "$ROOT"
python -m pytest --durations=15 "$@"
# vLLM + HiSpec (tests_vllm/) in vLLM's own virtualenv; HISPEC_SKIP_VLLM=1 leaves them out
if [ "${HISPEC_SKIP_VLLM:-0}" != 1 ] && [ "$#" -eq 0 ]; then
    . "$ROOT/scripts/_setup_vllm.sh"
    "$VLLM_VENV/bin/python" -m pytest -p no:cacheprovider --durations=10 tests_vllm
fi
