# Sourced by the scripts of launch/ascend/ once they know the checkout ($root): the Python of
# launch/slurm/common.sh, the CANN environment when it is installed, and the npu platform for every
# process the launcher starts (docs/ascend.md lists the variables).
source "$root/launch/slurm/common.sh"
for cann_env in "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}/set_env.sh" \
                /usr/local/Ascend/nnal/atb/set_env.sh; do
  # shellcheck disable=SC1090
  if [ -f "$cann_env" ]; then source "$cann_env"; fi
done
export MEGATRON_GKD_PLATFORM=${MEGATRON_GKD_PLATFORM:-npu}
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}
