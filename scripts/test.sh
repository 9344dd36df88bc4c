#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. CI runs this.
set -euo pipefail
. "$(dirname "$0")/_setup.sh"
cd "$ROOT"
python -m pytest --durations=15 "$@"
