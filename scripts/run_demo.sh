#!/usr/bin/env bash
# Sets up the virtualenv (scripts/setup_env.sh) and runs the main job on its embedded default:
# a tiny Megatron-Core GPT trained with tensor parallelism 2 on the CPU under gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/torchrun" --standalone --nproc_per_node 2 launch/smoke_mcore.py "$@"
