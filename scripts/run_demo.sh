#!/usr/bin/env bash
# Sets up the virtualenv (scripts/setup_env.sh) and runs the main job on its embedded default: a short
# on-policy distillation on the CPU (configs/cpu_tiny.yaml): a TP=2 Megatron student, colocated vLLM
# rollout, a teacher service on loopback, eval, checkpoints, an HF export and a printed summary.
# Extra arguments are config overrides (section.key=value). MEGATRON_GKD_OUTPUT_DIR sets the run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
ASSETS=${MEGATRON_GKD_ASSETS:-outputs/tiny_assets}
OUT=${MEGATRON_GKD_OUTPUT_DIR:-outputs/cpu_tiny}
"$VENV/bin/python" -m megatron_gkd.recipes.tiny --out "$ASSETS"
exec "$VENV/bin/torchrun" --standalone --nproc_per_node 2 launch/pretrain_gkd.py --config configs/cpu_tiny.yaml \
  "student.checkpoint=$ASSETS/student" "teacher.serve.model=$ASSETS/teacher" \
  "data.train_path=$ASSETS/train.jsonl" "data.eval_path=$ASSETS/eval.jsonl" "trainer.output_dir=$OUT" "$@"
