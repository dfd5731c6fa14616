# Shared settings of the Slurm + SkyPilot test bed; sourced by up.sh and down.sh.
# Every value can be overridden from the environment.

TESTBED_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO_ROOT="$(cd "$TESTBED_DIR/.." && pwd)"

# Everything the bed owns on the machine lives under one root.
BED_ROOT="${GPUDOOR_TESTBED_ROOT:-/var/lib/gpudoor-testbed}"
# HOME of the SkyPilot API server: ~/.sky (state, config, catalogs), ~/.slurm/config, the SSH key.
BED_HOME="${GPUDOOR_TESTBED_HOME:-$BED_ROOT/home}"
BED_RUN="$BED_ROOT/run"          # pid files
BED_LOG="${GPUDOOR_TESTBED_LOG_DIR:-$BED_ROOT/log}"
BED_NODE="$BED_ROOT/node"        # tools the Slurm jobs use: curl/uv wrappers, uv, shared uv cache
BED_DEV="$BED_ROOT/dev"          # empty files standing in for GPU devices
BED_SLURM="$BED_ROOT/slurm"      # slurmctld state, slurmd spool dirs
BED_SSHD="$BED_ROOT/sshd"        # sshd config + host key
STATE_DIR="$TESTBED_DIR/.state"  # env file for clients (gitignored)

VENV="${GPUDOOR_TESTBED_VENV:-$REPO_ROOT/.venv}"
PY="$VENV/bin/python"

# Names the tests and the project see.
SLURM_CLUSTER="${GPUDOOR_TESTBED_CLUSTER:-gpudoor-bed}"   # Host in ~/.slurm/config = SkyPilot region
LOGIN_USER="${GPUDOOR_TESTBED_USER:-gpudoor}"
SSH_PORT="${GPUDOOR_TESTBED_SSH_PORT:-2222}"
# Not SkyPilot's default local port (46580): a client pointed here treats the server as remote
# and never auto-starts a second server with its own HOME when the bed is down. Below Linux's ephemeral
# range (32768-60999): no client connection of the machine (nor its TIME_WAIT) can hold the port at start.
API_PORT="${GPUDOOR_TESTBED_API_PORT:-29590}"
PROBE_PORT="${GPUDOOR_TESTBED_PROBE_PORT:-29591}"
API_ENDPOINT="http://127.0.0.1:$API_PORT"
PROBE_URL="http://127.0.0.1:$PROBE_PORT"

LOGIN_HOME="/home/$LOGIN_USER"
SSH_KEY="$BED_HOME/.ssh/gpudoor-bed"

SLURM_CONF_DIR=/etc/slurm
SLURMD_NODES=(bed-l4 bed-h200 bed-east bed-west)

log() { printf '[testbed %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# pid_alive FILE: the process named in a pid file exists and is not a zombie.
pid_alive() {
  local f="$1" pid state
  [[ -s "$f" ]] || return 1
  pid="$({ tr -dc 0-9 <"$f"; } 2>/dev/null)"
  [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
  state="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)"
  [[ -n "$state" && "$state" != Z ]]
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# stop_pidfile FILE [GROUP]: TERM (then KILL) the process in FILE; GROUP=1 signals its process group.
stop_pidfile() {
  local f="$1" group="${2:-0}" pid target i
  if pid_alive "$f"; then
    pid="$({ tr -dc 0-9 <"$f"; } 2>/dev/null)"
    [[ -n "$pid" ]] || { rm -f "$f"; return 0; }
    target="$pid"
    [[ "$group" == 1 ]] && target="-$pid"
    kill -TERM -- "$target" 2>/dev/null || true
    for i in $(seq 1 40); do
      pid_alive "$f" || break
      sleep 0.25
    done
    if pid_alive "$f" || { [[ "$group" == 1 ]] && pgrep -g "$pid" >/dev/null; }; then
      kill -KILL -- "$target" 2>/dev/null || true
      sleep 0.5
    fi
  fi
  rm -f "$f"
}

# The API server's processes: those that carry the marker up.sh puts into the server's environment (the
# server, the consolidated job controllers, which run in sessions of their own), and SkyPilot's processes in
# the folder up.sh starts the server in, its HOME: its request executors write their process title
# (`SkyPilot:executor:...`) over their environment, so the marker cannot be read there. An executor that
# outlived its server (the server killed by its PID, say) is found the same way.
marked_pids() {
  local marker="GPUDOOR_TESTBED_OWNER=api-server:$API_PORT:$BED_HOME" dir pid
  for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
    if { [[ "$(head -c 9 "$dir/cmdline" 2>/dev/null | tr -d '\0')" == "SkyPilot:" ]] &&
      [[ "$(readlink "$dir/cwd" 2>/dev/null)" == "$BED_HOME" ]]; } ||
      { tr '\0' '\n' <"$dir/environ"; } 2>/dev/null | grep -qxF "$marker"; then
      echo "$pid"
    fi
  done
}

# stop_api_server: the bed's API server and every process of it, including the request executors and job
# controllers of a server that was killed by its PID (they would hold its port): TERM, then KILL. Returns 1,
# naming them, if any is still there. down.sh calls it, and up.sh before it starts a server.
stop_api_server() {
  local left
  # The server and every process it spawned (its workers, the job controllers, in sessions of their own) are asked to
  # stop at once, and waited for together: the server's own shutdown waits on its workers.
  left="$(marked_pids | tr '\n' ' ')"
  log "stopping SkyPilot API server and its processes: $left"
  if pid_alive "$BED_RUN/api-server.pid"; then
    kill -TERM -- "-$({ tr -dc 0-9 <"$BED_RUN/api-server.pid"; } 2>/dev/null)" 2>/dev/null || true
  fi
  # shellcheck disable=SC2086
  [[ -n "${left// /}" ]] && { kill -TERM $left 2>/dev/null || true; }
  for _ in $(seq 1 40); do
    pid_alive "$BED_RUN/api-server.pid" || break
    sleep 0.25
  done
  stop_pidfile "$BED_RUN/api-server.pid" 1  # KILLs it if it is still there
  left="$(marked_pids | tr '\n' ' ')"
  if [[ -n "${left// /}" ]]; then
    log "killing API-server processes that did not stop: $left"
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
    for _ in $(seq 1 20); do
      # shellcheck disable=SC2086
      left="$(for pid in $left; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done | tr '\n' ' ')"
      [[ -z "${left// /}" ]] && break
      sleep 0.25
    done
    if [[ -n "${left// /}" ]]; then
      log "API-server processes still running after SIGKILL: $left"
      return 1
    fi
  fi
  return 0
}
