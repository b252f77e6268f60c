#!/usr/bin/env bash
# Distillation from DeepSeek-V3 671B on Atlas 800T A2 nodes (8 x Ascend 910B 64 GB): the teacher is
# served by vLLM-Ascend across the teacher nodes (Ray), the student trains on the others, as
# launch/run_671b.sh does on GPUs. Preset: configs/ascend_deepseek_v3_671b.yaml.
#   sbatch --nodes=6 launch/ascend/run_671b.sh teacher.serve.model=DIR student.checkpoint=DIR data.train_path=FILE
#   launch/ascend/run_671b.sh --dry-run --nodes 6 teacher.serve.model=configs/hf/deepseek-v3 student.checkpoint=configs/hf/qwen3-8b data.train_path=x.jsonl
#SBATCH --job-name=gkd-ascend-671b
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
root=${MEGATRON_GKD_ROOT:-$( [ -f "$here/../pretrain_gkd.py" ] && cd "$here/../.." && pwd || echo "${SLURM_SUBMIT_DIR:-.}")}
source "$root/launch/ascend/common.sh"
exec "$MEGATRON_GKD_PYTHON" -m megatron_gkd.launcher combined --config "$root/configs/ascend_deepseek_v3_671b.yaml" \
  --device "${MEGATRON_GKD_DEVICE:-ascend-910b-64gb}" "$@"
