# NCCL, CUDA and Python environment for aligner's Slurm jobs: the one place to tune it for a cluster.
# Sourced by ppo.sbatch, critic.sbatch and actor.sbatch before any srun; srun passes the environment to every task.
# Every value is a default: a variable already set (in your shell, `sbatch --export`, or a site file) wins.
# Site-specific additions (modules, network interfaces): put them in a file and set ALIGNER_SITE_ENV=/path/to/it.

# --- CUDA ---
# megatron-core orders tensor-parallel communication and compute on one CUDA connection (required for TP overlap).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# Fewer fragmentation OOMs when rollout and training shapes alternate.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

# --- NCCL ---
# A failed or stuck collective ends the process (and srun --kill-on-bad-exit the step) instead of hanging the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# InfiniBand: retry longer before declaring a link dead (large jobs see transient congestion).
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
# Uncomment and adapt to your fabric:
# export NCCL_SOCKET_IFNAME=ib0          # interface for NCCL's bootstrap and socket transport
# export NCCL_IB_HCA=mlx5                # which HCAs to use
# export NCCL_NVLS_ENABLE=0              # NVLink SHARP (multicast) off, where the fabric manager does not support it

# --- Python and libraries ---
export PYTHONUNBUFFERED=1                 # log lines reach the job's output as they happen
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"  # no fork warnings from HF tokenizers
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one rank per GPU: no CPU thread oversubscription
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"    # compute nodes read converted checkpoints; they download nothing

if [ -n "${ALIGNER_SITE_ENV:-}" ]; then
  # shellcheck disable=SC1090
  . "$ALIGNER_SITE_ENV"
fi
