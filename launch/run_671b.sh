#!/usr/bin/env bash
# Distillation from DeepSeek-V3 671B: brings up the teacher service on the teacher nodes (vLLM with
# TP x PP across nodes over Ray, FP8 weights as released; the planner picks the smallest layout that
# fits --device, 2 nodes x 8 H100 80 GB by default), waits until it answers, trains the student on the
# other nodes against it (teacher.client=zmq, teacher.address, a shared secret), and stops the teacher
# when training ends or fails. Preset: configs/deepseek_v3_671b.yaml; any --config or option given
# here wins (options of `python -m megatron_gkd.launcher --help`).
#
#   sbatch --nodes=4 launch/run_671b.sh teacher.serve.model=DSV3_DIR student.checkpoint=DIR data.train_path=FILE
#   salloc --nodes=4 --gpus-per-node=8 launch/run_671b.sh ...                  # inside an allocation
#   launch/run_671b.sh --dry-run --nodes 4 teacher.serve.model=configs/hf/deepseek-v3 student.checkpoint=configs/hf/qwen3-8b data.train_path=x.jsonl
#   launch/run_671b.sh --local --nproc-per-node 2 --config CPU.yaml ...        # one machine, no Slurm (tiny models)
#SBATCH --job-name=gkd-671b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
root=${MEGATRON_GKD_ROOT:-$( [ -f "$here/pretrain_gkd.py" ] && cd "$here/.." && pwd || echo "${SLURM_SUBMIT_DIR:-.}")}
source "$root/launch/slurm/common.sh"
exec "$MEGATRON_GKD_PYTHON" -m megatron_gkd.launcher combined --config "$root/configs/deepseek_v3_671b.yaml" \
  --device "${MEGATRON_GKD_DEVICE:-h100-80gb}" "$@"
