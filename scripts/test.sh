#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. CI runs this.
# Each phase prints when it starts and how long it took; a test that hangs fails after the per-test
# timeout in pyproject.toml (pytest-timeout, with every thread's stack) instead of eating CI's budget.
set -euo pipefail
T0=$SECONDS
stamp() { echo "=== [test.sh +$((SECONDS - T0))s] $*"; }
stamp "set-up of .venv"
. "$(dirname "$0")/_setup.sh"
cd "$ROOT"
stamp "main suite (tests/)"
# two workers, each test file in one of them (its module fixtures load a model once); one torch thread
# each (tests/conftest.py). HISPEC_TEST_WORKERS=0 runs the suite in this one process.
python -m pytest --durations=15 -n "${HISPEC_TEST_WORKERS:-2}" --dist loadfile "$@"
# vLLM + HiSpec (tests_vllm/) in vLLM's own virtualenv; HISPEC_SKIP_VLLM=1 leaves them out
if [ "${HISPEC_SKIP_VLLM:-0}" != 1 ] && [ "$#" -eq 0 ]; then
    stamp "set-up of .venv-vllm"
    . "$ROOT/scripts/_setup_vllm.sh"
    stamp "vLLM suite (tests_vllm/)"
    "$VLLM_VENV/bin/python" -m pytest -p no:cacheprovider --durations=10 tests_vllm
fi
stamp "done"
