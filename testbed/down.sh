#!/usr/bin/env bash
# Stop what testbed/up.sh started: the managed jobs and warm pools its API server runs, Slurm
# jobs, the SkyPilot API server (and the job controllers it spawned), the probe server, sshd,
# slurmd/slurmctld, munge (only if up.sh started it). Leaves packages, the login user and all
# state/logs in place, so the next up.sh is fast. `down.sh --purge` also deletes the bed's state
# (GPUDOOR_TESTBED_ROOT).
# The whole script is one function, parsed before it runs: editing the file while it runs
# cannot change what a running instance executes.
main() {
set -uo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

[[ "$(id -u)" == 0 ]] || { echo "testbed/down.sh must run as root" >&2; exit 1; }

# Managed jobs and warm pools the server still runs are ended through it first: left unfinished in its
# state, the next server start would recover them and the next test run find their GPUs taken.
if [[ -f "$STATE_DIR/env" ]] && curl -fsS --max-time 5 "$API_ENDPOINT/api/health" >/dev/null 2>&1; then
  (
    set -a
    # shellcheck disable=SC1091
    source "$STATE_DIR/env"
    set +a
    "$PY" "$TESTBED_DIR/lib/end_jobs.py" --timeout "${GPUDOOR_TESTBED_END_JOBS_TIMEOUT:-300}"
  ) || log "some managed jobs did not end (see above); their Slurm jobs are cancelled next"
fi

if [[ -f "$BED_RUN/slurmctld.pid" ]] && pid_alive "$BED_RUN/slurmctld.pid"; then
  jobs="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
  if [[ -n "${jobs// /}" ]]; then
    log "cancelling Slurm jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 40); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.5; done
  fi
fi

stop_api_server || STILL_RUNNING=1
rm -f "$BED_RUN/api-server.fingerprint" "$BED_RUN/api-server.ready"

log "stopping probe server, sshd"
stop_pidfile "$BED_RUN/probe.pid" 1
stop_pidfile "$BED_RUN/sshd.pid"

log "stopping slurm"
for n in "${SLURMD_NODES[@]}"; do stop_pidfile "$BED_RUN/slurmd-$n.pid"; done
stop_pidfile "$BED_RUN/slurmctld.pid"

# Anything the Slurm login user still runs (SkyPilot's skylet, ssh control masters, ...).
if id "$LOGIN_USER" >/dev/null 2>&1; then
  user_pids="$(ps -u "$LOGIN_USER" -o pid= 2>/dev/null | tr '\n' ' ')"
  if [[ -n "${user_pids// /}" ]]; then
    log "stopping processes of $LOGIN_USER: $user_pids"
    # shellcheck disable=SC2086
    kill -TERM $user_pids 2>/dev/null || true
    sleep 1
    user_pids="$(ps -u "$LOGIN_USER" -o pid= 2>/dev/null | tr '\n' ' ')"
    # shellcheck disable=SC2086
    [[ -n "${user_pids// /}" ]] && kill -KILL $user_pids 2>/dev/null || true
  fi
fi

# What the bed left in /tmp while it ran: the server's temporary files (its TMPDIR), its HA recovery logs
# (SkyPilot writes them to /tmp whatever TMPDIR says), and the scripts SkyPilot's runtime wrote as the login
# user for each job's setup and run (a job killed or preempted never removes its own).
log "removing the bed's temporary files"
rm -rf "${BED_RUN:?}/tmp" /tmp/jobs_ha_recovery.log /tmp/pool_ha_recovery.log
if id "$LOGIN_USER" >/dev/null 2>&1; then
  find /tmp -maxdepth 1 -mindepth 1 -user "$LOGIN_USER" \( -name 'sky_app_*' -o -name 'sky_setup_*' -o -name 'sky_task_*' \) \
    -exec rm -rf {} + 2>/dev/null || true
fi

if [[ -f "$BED_RUN/munged.started-by-testbed" ]]; then
  log "stopping munge"
  stop_pidfile /run/munge/munged.pid
  rm -f "$BED_RUN/munged.started-by-testbed"
fi

if [[ "${1:-}" == "--purge" ]]; then
  case "$BED_ROOT" in
    /|/var|/var/lib|/home|/tmp|"") echo "refusing to purge $BED_ROOT" >&2; exit 1 ;;
  esac
  log "purging $BED_ROOT, $STATE_DIR and SkyPilot's cluster dirs of $LOGIN_USER"
  rm -rf "$BED_ROOT" "$STATE_DIR" "$LOGIN_HOME/sky-clusters" /tmp/gpudoor-sky-runtime
fi
if [[ -n "${STILL_RUNNING:-}" ]]; then
  log "test bed down, but some of its server's processes still run (above)"
  exit 1
fi
log "test bed down"
}

main "$@"
