# Sourced by the scripts of launch/slurm/ and launch/run_671b.sh once they know the checkout ($root):
# picks the Python that runs the launcher (and, through it, every process of the job).
#   MEGATRON_GKD_PYTHON   interpreter to use (default: $root/.venv/bin/python, else python3 on PATH)
if [ -z "${MEGATRON_GKD_PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then
    MEGATRON_GKD_PYTHON="$root/.venv/bin/python"
  else
    MEGATRON_GKD_PYTHON=python3
  fi
fi
