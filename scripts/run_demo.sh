#!/usr/bin/env bash
# Sets up the virtualenv (scripts/setup_env.sh) and runs the main job on its embedded default, the
# distillation demo (configs/demo_cpu.yaml): on-policy distillation of a small Qwen3 student from a teacher
# the project trained itself (assets/demo) on multi-digit addition; a TP=2 Megatron student under torchrun,
# colocated vLLM rollout, the teacher served on loopback, eval of 500 held-out problems before, during and
# after, checkpoints, an HF export, then a plot (metrics.png) and a summary of the accuracy gained.
# Extra arguments are config overrides (section.key=value). MEGATRON_GKD_OUTPUT_DIR sets the run directory;
# rerunning the command resumes (or, once finished, only reports) the run there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
TASK=${MEGATRON_GKD_TASK_DIR:-outputs/demo_task}
OUT=${MEGATRON_GKD_OUTPUT_DIR:-outputs/demo}
"$VENV/bin/python" -m megatron_gkd.recipes.arithmetic --out "$TASK"
start=$(date +%s)
# torchrun sets OMP_NUM_THREADS=1 per rank anyway; setting it here saves its four-line banner saying so.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/torchrun" --standalone --nproc_per_node 2 launch/pretrain_gkd.py --config configs/demo_cpu.yaml \
  "data.train_path=$TASK/train.jsonl" "data.eval_path=$TASK/eval.jsonl" "trainer.output_dir=$OUT" "$@"
exec "$VENV/bin/python" -m megatron_gkd.recipes.report "$OUT" --teacher assets/demo/teacher \
  --wall-time "$(($(date +%s) - start))"
