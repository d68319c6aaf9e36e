#!/usr/bin/env bash
# PPO as two separate Slurm jobs: the critic job first (critic.sbatch), then the actor job (actor.sbatch), which may
# start once the critic job has started (--dependency=after), reads the critic's address from
# <exp-dir>/critic_address and stops the critic job when it ends.
#
#   launchers/slurm/two_jobs.sh [--critic-sbatch "OPTIONS"] [--actor-sbatch "OPTIONS"] [--wait] [--dry-run]
#                               [--] [--actor-config NAME --critic-config NAME --exp-dir DIR --actor K=V ... ...]
#   e.g. GPUS_PER_NODE=8 launchers/slurm/two_jobs.sh --critic-sbatch "-N 1 --gpus-per-node=8 --ntasks-per-node=8" \
#          --actor-sbatch "-N 4 --gpus-per-node=8 --ntasks-per-node=8" -- --actor model.checkpoint=/ckpt/policy
#
# Both jobs get the same trailing options (each uses its own). Prints `critic <jobid>` and `actor <jobid>`.
# --wait: wait for both jobs to end; exit status non-zero if either failed (the first failure's).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
critic_opts="" actor_opts="" wait=0 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --critic-sbatch) critic_opts="$2"; shift 2 ;;
    --actor-sbatch) actor_opts="$2"; shift 2 ;;
    --wait) wait=1; shift ;;
    --dry-run) dry=1; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
read -r -a copts <<< "$critic_opts"
read -r -a aopts <<< "$actor_opts"

if [ "$dry" = 1 ]; then
  echo sbatch --parsable "${copts[@]}" "$here/critic.sbatch" "$@"
  echo sbatch --parsable --dependency=after:CRITIC_JOB_ID --export=ALL,CRITIC_JOB_ID=CRITIC_JOB_ID \
    "${aopts[@]}" "$here/actor.sbatch" "$@"
  exit 0
fi
critic_id="$(sbatch --parsable "${copts[@]}" "$here/critic.sbatch" "$@")"
critic_id="${critic_id%%;*}"
echo "critic $critic_id"
actor_id="$(sbatch --parsable --dependency="after:$critic_id" --export="ALL,CRITIC_JOB_ID=$critic_id" \
  "${aopts[@]}" "$here/actor.sbatch" "$@")" || { scancel "$critic_id"; exit 1; }
actor_id="${actor_id%%;*}"
echo "actor $actor_id"
[ "$wait" = 1 ] || exit 0

exit_code() {  # the job's exit status as Slurm recorded it (ExitCode=status:signal), or 255 if unknown
  local ec
  ec="$(scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^ExitCode=//p' | head -n 1)"
  if [ -z "$ec" ]; then echo 255; elif [ "${ec#*:}" != 0 ]; then echo $((128 + ${ec#*:})); else echo "${ec%%:*}"; fi
}
while [ -n "$(squeue -h -j "$actor_id,$critic_id" -o %i 2>/dev/null)" ]; do sleep 2; done
actor_rc="$(exit_code "$actor_id")" critic_rc="$(exit_code "$critic_id")"
echo "actor job $actor_id: exit status $actor_rc; critic job $critic_id: exit status $critic_rc"
[ "$actor_rc" = 0 ] || exit "$actor_rc"
exit "$critic_rc"
