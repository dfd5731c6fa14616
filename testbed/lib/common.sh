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
# and never auto-starts a second server with its own HOME when the bed is down.
API_PORT="${GPUDOOR_TESTBED_API_PORT:-46590}"
PROBE_PORT="${GPUDOOR_TESTBED_PROBE_PORT:-46591}"
API_ENDPOINT="http://127.0.0.1:$API_PORT"
PROBE_URL="http://127.0.0.1:$PROBE_PORT"

LOGIN_HOME="/home/$LOGIN_USER"
SSH_KEY="$BED_HOME/.ssh/gpudoor-bed"

SLURM_CONF_DIR=/etc/slurm
SLURMD_NODES=(bed-l4 bed-h200)

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
