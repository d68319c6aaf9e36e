# Shared by ppo.sbatch, critic.sbatch and actor.sbatch (sourced once ALIGNER_ROOT is known). Bash >= 4.4.
#
# aligner_parse_args "$@"     --actor-config NAME --critic-config NAME --exp-dir DIR --ready-timeout S
#                             --critic-address HOST:PORT --actor K=V ... --critic K=V ...   (the local launcher's)
# aligner_setup               python, step root, container flags, env.sh; call after the variables are final
# node_addr NODELIST          address of the list's first node (Slurm's NodeAddr, normally its host name)
# component_srun GROUP NAME NODES TASKS_PER_NODE GPUS_PER_NODE MASTER_ADDR MASTER_PORT OUTPUT -- CMD...
#                             start one component as its own step in the background (GROUP "" = not a het job;
#                             ALIGNER_COLOCATED=1: the step shares the job's CPUs and GPUs with the other, --overlap)
# reap PID                    wait for a background process even across trapped signals; returns its status
# stop_step JOBID NAME PID S  SIGTERM a step's tasks (clean stop), then kill it after S seconds
# aligner_token ROLE           the run's critic secret in ALIGNER_CRITIC_TOKEN (exported; srun passes it on, no
#                             command line shows it): kept if set; else ROLE=critic makes one and ROLE=actor reads
#                             it from <exp-dir>/critic_token (written owner-only by a separate critic job)
# log / fail MESSAGE          prefixed lines on the job's output / error

log() { echo "[${ALIGNER_TAG:-aligner} $(date +%H:%M:%S)] $*"; }
fail() { echo "[${ALIGNER_TAG:-aligner} $(date +%H:%M:%S)] error: $*" >&2; }

# Overrides may also come from the environment (space-separated), e.g. sbatch --export=ALL,ACTOR_OVERRIDES="a=1 b=2".
aligner_parse_args() {
  read -r -a ACTOR_ARGS <<< "${ACTOR_OVERRIDES:-}"
  read -r -a CRITIC_ARGS <<< "${CRITIC_OVERRIDES:-}"
  local into=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --actor-config) ACTOR_CONFIG="$2"; shift 2; into="" ;;
      --critic-config) CRITIC_CONFIG="$2"; shift 2; into="" ;;
      --exp-dir) EXP_DIR="$2"; shift 2; into="" ;;
      --ready-timeout) CRITIC_READY_TIMEOUT="$2"; shift 2; into="" ;;
      --critic-address) CRITIC_ADDRESS="$2"; shift 2; into="" ;;
      --actor) into=actor; shift ;;
      --critic) into=critic; shift ;;
      -h|--help) sed -n '/^# Usage/,/^#$/p' "${ALIGNER_SCRIPT:-$0}"; exit 0 ;;
      --*) fail "unknown option $1 (options: --actor-config --critic-config --exp-dir --ready-timeout" \
                "--critic-address --actor K=V... --critic K=V...)"; exit 2 ;;
      *=*)
        case "$into" in
          actor) ACTOR_ARGS+=("$1") ;;
          critic) CRITIC_ARGS+=("$1") ;;
          *) fail "override $1 does not follow --actor or --critic: say which job it is for"; exit 2 ;;
        esac
        shift ;;
      *) fail "unexpected argument $1 (overrides are KEY=VALUE after --actor or --critic)"; exit 2 ;;
    esac
  done
}

aligner_setup() {
  # A container (enroot/pyxis) sees the code at CONTAINER_ROOT and has its own python; otherwise the checkout's.
  CONTAINER_FLAGS=()
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    STEP_ROOT="${CONTAINER_ROOT:-/opt/aligner}"
    PYTHON="${PYTHON:-python}"
    HOST_PYTHON="${HOST_PYTHON:-python3}"
    CONTAINER_FLAGS=(--container-image="$CONTAINER_IMAGE" --container-workdir="$STEP_ROOT")
    [ -n "${CONTAINER_MOUNTS:-}" ] && CONTAINER_FLAGS+=(--container-mounts="$CONTAINER_MOUNTS")
  else
    STEP_ROOT="$ALIGNER_ROOT"
    if [ -z "${PYTHON:-}" ]; then
      if [ -x "$ALIGNER_ROOT/.venv/bin/python" ]; then PYTHON="$ALIGNER_ROOT/.venv/bin/python"; else PYTHON=python3; fi
    fi
    HOST_PYTHON="${HOST_PYTHON:-$PYTHON}"
  fi
  # shellcheck source=launchers/slurm/env.sh
  . "$ALIGNER_ROOT/launchers/slurm/env.sh"
  case "$EXP_DIR" in /*) ;; *) EXP_DIR="${SLURM_SUBMIT_DIR:-$PWD}/$EXP_DIR" ;; esac
  mkdir -p "$EXP_DIR/logs"
}

aligner_token() {
  local file="$EXP_DIR/critic_token"
  if [ -z "${ALIGNER_CRITIC_TOKEN:-}" ]; then
    if [ "$1" = critic ]; then
      ALIGNER_CRITIC_TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
      (umask 077 && printf '%s\n' "$ALIGNER_CRITIC_TOKEN" > "$file.tmp" && mv "$file.tmp" "$file")
    elif [ -f "$file" ]; then
      ALIGNER_CRITIC_TOKEN="$(cat "$file")"
    else
      fail "no critic secret: set ALIGNER_CRITIC_TOKEN or start the critic job (it writes $file) first"
      return 2
    fi
  fi
  export ALIGNER_CRITIC_TOKEN
}

node_addr() {
  local host addr
  host="$(scontrol show hostnames "$1" | head -n 1)"
  addr="$(scontrol show node -o "$host" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')"
  echo "${addr:-$host}"
}

component_srun() {
  local group="$1" name="$2" nodes="$3" tpn="$4" gpn="$5" maddr="$6" mport="$7" out="$8"
  shift 9  # ... and the "--"
  local args=(--job-name="$name" --nodes="$nodes" --ntasks="$((nodes * tpn))" --ntasks-per-node="$tpn"
              --kill-on-bad-exit=1 --export="ALL,MASTER_ADDR=$maddr,MASTER_PORT=$mport")
  [ -z "${CONTAINER_IMAGE:-}" ] && args+=(--chdir="$STEP_ROOT")  # in a container: --container-workdir
  [ -n "$group" ] && args+=(--het-group="$group")
  [ "${ALIGNER_COLOCATED:-0}" = 1 ] && args+=(--overlap)  # both jobs' steps on the same CPUs and GPUs
  [ "${gpn:-0}" -gt 0 ] && args+=(--gpus-per-node="$gpn")
  [ -n "$out" ] && args+=(--output="$out")
  srun "${args[@]}" "${CONTAINER_FLAGS[@]}" "$@" &
}

reap() {
  local pid="$1"
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" 2>/dev/null; done
  wait "$pid" 2>/dev/null
}

wait_pid() {  # wait_pid PID SECONDS -> 0 if it ended in time
  local pid="$1" i
  for ((i = 0; i < $2; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 1
  done
  ! kill -0 "$pid" 2>/dev/null
}

stop_step() {
  local job="$1" name="$2" pid="$3" grace="$4" id
  kill -0 "$pid" 2>/dev/null || return 0
  # scancel signals the step's tasks themselves; a SIGTERM sent to srun would make srun SIGKILL them instead.
  for id in $(squeue -h -s -j "$job" -o "%i %j" 2>/dev/null | awk -v n="$name" '$2 == n {print $1}'); do
    scancel --signal=TERM "$id" 2>/dev/null
  done
  if ! wait_pid "$pid" "$grace"; then
    fail "$name did not stop within $grace s of SIGTERM: killing it"
    kill -TERM "$pid" 2>/dev/null
    wait_pid "$pid" 30 || kill -KILL "$pid" 2>/dev/null
  fi
}

tail_log() { [ -f "$1" ] && { echo "--- last lines of $1 ---"; tail -n "${2:-40}" "$1"; } >&2; }

# The critic server prints this once every endpoint answered (wait_critic.py --ready-line): Triton's health endpoint
# answers before the endpoints are loaded.
CRITIC_READY_LINE="critic server ready at"
# triton_aborted_at_start LOG: the critic's tritonserver ended on a signal while it started (the python backend's
# intermittent boost::interprocess::lock_exception, seen in CI; triton-inference-server/server#8882): nothing was
# served yet, so starting the critic again is safe (the local launcher does the same; a cause that stays fails
# again).
triton_aborted_at_start() { grep -q "Triton failed to start" "$1" 2>/dev/null && grep -q "Signal (" "$1" 2>/dev/null; }

# critic_start_again READY ATTEMPT LOG PID -> 0 when the critic step (PID) should be started once more: wait_critic.py
# said it ended before it was ready (READY 3), on the first attempt, with no stop signal (the caller's stop_signal),
# and its LOG shows tritonserver's abort at start; the ended step is reaped and the abort reported.
critic_start_again() {
  [ "$1" -eq 3 ] && [ "$2" -eq 1 ] && [ -z "${stop_signal:-}" ] && triton_aborted_at_start "$3" || return 1
  reap "$4"
  fail "the critic's tritonserver aborted as it started (nothing was served): starting the critic job again"
  tail_log "$3" 20
}
