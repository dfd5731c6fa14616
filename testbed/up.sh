#!/usr/bin/env bash
# Bring up the local test bed: a Slurm cluster on this machine (four fake-GPU nodes), reached
# over SSH on 127.0.0.1, and a SkyPilot API server whose managed-jobs controller runs in
# consolidation mode, so tests can run real `sky.jobs.launch` jobs on real Slurm.
#
# Run as root. Idempotent: a second run only checks what is already up (a few seconds).
# See testbed/README.md for what each piece is for.
#
# Environment (all optional):
#   GPUDOOR_TESTBED_ROOT          everything the bed owns        (default /var/lib/gpudoor-testbed)
#   GPUDOOR_TESTBED_HOME          HOME of the API server         (default $ROOT/home)
#   GPUDOOR_TESTBED_LOG_DIR       logs                           (default $ROOT/log)
#   GPUDOOR_TESTBED_API_PORT      API server port                (default 29590)
#   GPUDOOR_TESTBED_ADMIN_POLICY  module.Class -> `admin_policy:` in the server config
#                                 (default: the project's policy; empty: none)
#   GPUDOOR_TESTBED_PLUGINS       the server's plugins file (SKYPILOT_SERVER_PLUGINS_CONFIG)
#                                 (default: deploy/skypilot/plugins.yaml; empty: none)
#   GPUDOOR_TESTBED_READY_TIMEOUT seconds to wait for SkyPilot to see every partition (default 240)
#   GPUDOOR_TESTBED_RESTART_SERVER=1  restart the API server even if nothing it reads changed (what a
#                                 team's server restart does: every process of the old one ends first)
# Writes testbed/.state/env (exports for clients) and prints it.
# The whole script is one function, parsed before it runs: editing the file while it runs
# cannot change what a running instance executes.
main() {
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# The bed's API server runs what a team's runs (deploy/skypilot): the project's admin policy and its server
# plugins, whoever brings the bed up (CI, `make test`, a developer). Set either to empty for a stock server.
GPUDOOR_TESTBED_ADMIN_POLICY="${GPUDOOR_TESTBED_ADMIN_POLICY-gpudoor_pipelines.launch.server.policy.GpuDoorPolicy}"
GPUDOOR_TESTBED_PLUGINS="${GPUDOOR_TESTBED_PLUGINS-$REPO_ROOT/deploy/skypilot/plugins.yaml}"

# A caller that already loaded testbed/.state/env must not leak client settings into the
# daemons started here.
unset SKYPILOT_API_SERVER_ENDPOINT SKYPILOT_DISABLE_LOCAL_API_SERVER SKYPILOT_CONFIG SKYPILOT_GLOBAL_CONFIG SKYPILOT_PROJECT_CONFIG \
  SKY_RUNTIME_DIR SKYPILOT_API_SERVER_LOCAL_PORT GPUDOOR_TESTBED_PROBE_URL
export SKYPILOT_DISABLE_USAGE_COLLECTION=1

[[ "$(id -u)" == 0 ]] || { echo "testbed/up.sh must run as root" >&2; exit 1; }

T0=$SECONDS
FAILED_STEP=""
on_exit() {
  local rc=$?
  if [[ $rc != 0 ]]; then
    {
      echo
      echo "testbed/up.sh FAILED (exit $rc)${FAILED_STEP:+ during: $FAILED_STEP}"
      echo "Logs: $BED_LOG"
      echo "  api-server.log  slurmctld.log  slurmd-*.log  sshd.log  probe.log  wait_ready.log  apt.log  pip.log"
      if [[ -s "$BED_LOG/api-server.log" ]]; then
        echo "--- last lines of $BED_LOG/api-server.log"
        tail -n 25 "$BED_LOG/api-server.log"
      fi
    } >&2
  fi
}
trap on_exit EXIT
step() { FAILED_STEP="$*"; log "$*"; }

mkdir -p "$BED_ROOT" "$BED_RUN" "$BED_RUN/tmp" "$BED_LOG" "$BED_NODE/bin" "$BED_DEV" "$BED_SLURM" "$BED_SSHD" "$STATE_DIR"
chmod 755 "$BED_ROOT" "$BED_NODE" "$BED_NODE/bin"

# write_if_changed DEST MODE: stdin -> DEST when the content differs; returns 0 if it wrote.
write_if_changed() {
  local dest="$1" mode="$2" tmp
  tmp="$(mktemp)"
  cat >"$tmp"
  if [[ -f "$dest" ]] && cmp -s "$tmp" "$dest"; then
    rm -f "$tmp"
    return 1
  fi
  mkdir -p "$(dirname "$dest")"
  install -m "$mode" "$tmp" "$dest"
  rm -f "$tmp"
  return 0
}

# ---------------------------------------------------------------- packages
step "Debian packages"
PKGS=(slurm-wlm slurmctld slurmd munge openssh-server openssh-client rsync curl)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing: ${missing[*]} (log: $BED_LOG/apt.log)"
  {
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${PKGS[@]}"
  } >"$BED_LOG/apt.log" 2>&1
fi

step "Python venv ($VENV)"
[[ -x "$PY" ]] || { echo "no venv at $VENV (set GPUDOOR_TESTBED_VENV)" >&2; exit 1; }
if ! "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m
assert m.version("skypilot") == "0.14.1", m.version("skypilot")
m.version("python-hostlist")  # pulled by the slurm extra
EOF
then
  log "installing skypilot[slurm]==0.14.1 into $VENV (log: $BED_LOG/pip.log)"
  "$VENV/bin/pip" install 'skypilot[slurm]==0.14.1' >"$BED_LOG/pip.log" 2>&1
fi
SITE_PACKAGES="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The connectivity-probe hook (see lib/gpudoor_testbed_probe.py); inert unless
# GPUDOOR_TESTBED_PROBE_URL is set.
write_if_changed "$SITE_PACKAGES/gpudoor_testbed_probe.py" 644 <"$TESTBED_DIR/lib/gpudoor_testbed_probe.py" || true
echo "import gpudoor_testbed_probe" | write_if_changed "$SITE_PACKAGES/gpudoor_testbed_probe.pth" 644 || true

# ---------------------------------------------------------------- munge
step "munge"
if [[ ! -s /etc/munge/munge.key ]]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  # munged refuses to run as root: start it as its own user.
  su -s /bin/sh munge -c /usr/sbin/munged
  touch "$BED_RUN/munged.started-by-testbed"
  for _ in $(seq 1 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.25; done
  munge -n | unmunge >/dev/null
fi

# ---------------------------------------------------------------- login user
step "login user $LOGIN_USER"
if ! id "$LOGIN_USER" >/dev/null 2>&1; then
  useradd -m -d "$LOGIN_HOME" -s /bin/bash "$LOGIN_USER"
fi
# A new account is locked ('!'); sshd (UsePAM no) refuses locked accounts even for keys.
usermod -p '*' "$LOGIN_USER"
install -d -o "$LOGIN_USER" -g "$LOGIN_USER" -m 755 "$LOGIN_HOME"
install -d -o "$LOGIN_USER" -g "$LOGIN_USER" -m 700 "$LOGIN_HOME/.ssh"
install -d -o "$LOGIN_USER" -g "$LOGIN_USER" -m 755 "$LOGIN_HOME/.config" "$LOGIN_HOME/.config/pip"

# ---------------------------------------------------------------- node tools
step "node tools (uv, curl/uv wrappers)"
UV_VERSION="${GPUDOOR_TESTBED_UV_VERSION:-0.13.9}"
if [[ "$("$BED_NODE/uv/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION "* ]]; then
  log "installing uv $UV_VERSION from PyPI into $BED_NODE/uv (log: $BED_LOG/pip.log)"
  rm -rf "$BED_NODE/uv"
  "$VENV/bin/pip" install --target "$BED_NODE/uv" "uv==$UV_VERSION" >>"$BED_LOG/pip.log" 2>&1
  chmod -R a+rX "$BED_NODE/uv"
fi
render() { sed -e "s|@BED_NODE@|$BED_NODE|g" -e "s|@UV_BIN@|$1|g" "$2"; }
render uv "$TESTBED_DIR/node/curl.in" | write_if_changed "$BED_NODE/bin/curl" 755 || true
render uv "$TESTBED_DIR/node/uv.in" | write_if_changed "$BED_NODE/bin/uv" 755 || true
render uvx "$TESTBED_DIR/node/uv.in" | write_if_changed "$BED_NODE/bin/uvx" 755 || true
install -d -o "$LOGIN_USER" -g "$LOGIN_USER" -m 755 "$BED_NODE/uv-cache"

# Login shell of the Slurm user. SkyPilot runs every command as `bash --login -c ...` over
# SSH and srun carries that environment into the job steps, where HOME is switched to a
# per-cluster folder: so the settings live in env vars, not in files under ~.
write_if_changed "$LOGIN_HOME/.bash_profile" 644 <<EOF || true
# Written by gpudoor testbed/up.sh.
export PATH="$BED_NODE/bin:\$PATH"
export PIP_CONFIG_FILE="$LOGIN_HOME/.config/pip/pip.conf"
export UV_PYTHON_DOWNLOADS=never
export UV_CACHE_DIR="$BED_NODE/uv-cache"
export UV_SYSTEM_CERTS=1
export SSL_CERT_FILE="\${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
[ -f "\$HOME/.bashrc" ] && . "\$HOME/.bashrc"
EOF
chown "$LOGIN_USER:$LOGIN_USER" "$LOGIN_HOME/.bash_profile"

# pip settings of this machine (root's `pip config list`: on-disk wheels, local simple
# indexes, constraints, CA bundle) as the login user's pip config, so a workload's
# `pip install` on the node finds the on-disk wheels instead of downloading.
"$PY" - "$VENV/bin/pip" <<'EOF' | write_if_changed "$LOGIN_HOME/.config/pip/pip.conf" 644 || true
import subprocess, sys
out = subprocess.run([sys.argv[1], "config", "list"], capture_output=True, text=True).stdout
settings = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if not name or scope not in ("global", ":env:", "install"):
        continue
    value = value.strip().strip("'\"")
    settings.setdefault(scope if scope == "install" else "global", {})[name] = value
print("# Written by gpudoor testbed/up.sh from root's `pip config list`.")
for section in ("global", "install"):
    if section in settings:
        print(f"[{section}]")
        for name, value in sorted(settings[section].items()):
            print(f"{name} = {value}")
EOF

# ---------------------------------------------------------------- slurm
step "slurm"
# Five H200s: the bed's h200 (three GPUs) and inference (two) pools share the partition, and the tests
# that use one pool run side by side with those that use the other.
for n in 0 1; do touch "$BED_DEV/l4-$n"; done
# One L4 each for east and west: partitions no other test holds, so a test can fill one and see the other free.
touch "$BED_DEV/east-l4-0" "$BED_DEV/west-l4-0"
for n in 0 1 2 3 4; do touch "$BED_DEV/h200-$n"; done
chmod 666 "$BED_DEV"/*
HOST_SHORT="$(hostname -s)"
SLURM_CHANGED=0
write_if_changed "$SLURM_CONF_DIR/slurm.conf" 644 <<EOF && SLURM_CHANGED=1
# Written by gpudoor testbed/up.sh: one machine, four slurmd daemons standing in for four GPU
# nodes (SkyPilot reads one GPU type per node, so each GPU type gets its own node; east and west
# are one-L4 partitions of their own).
ClusterName=$SLURM_CLUSTER
SlurmctldHost=$HOST_SHORT(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
# No cgroups on this machine: track processes by parent pid, no task containment, and no
# cgroup.conf at all (slurmd 22.05 rejects CgroupPlugin=disabled).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Let the nodes declare more CPUs/memory than the machine has: SkyPilot asks for
# 4 vCPU + 16 GB per GPU by default.
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
KillWait=5
MinJobAge=60
InactiveLimit=0
StateSaveLocation=$BED_SLURM/ctld
SlurmdSpoolDir=$BED_SLURM/spool/%n
SlurmctldPidFile=$BED_RUN/slurmctld.pid
SlurmdPidFile=$BED_RUN/slurmd-%n.pid
SlurmctldLogFile=$BED_LOG/slurmctld.log
SlurmdLogFile=$BED_LOG/slurmd-%n.log
SlurmctldPort=6817
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=bed-l4 NodeHostname=$HOST_SHORT NodeAddr=127.0.0.1 Port=6818 CPUs=16 RealMemory=64000 Gres=gpu:l4:2 State=UNKNOWN
NodeName=bed-h200 NodeHostname=$HOST_SHORT NodeAddr=127.0.0.1 Port=6819 CPUs=16 RealMemory=64000 Gres=gpu:h200:5 State=UNKNOWN
NodeName=bed-east NodeHostname=$HOST_SHORT NodeAddr=127.0.0.1 Port=6820 CPUs=16 RealMemory=64000 Gres=gpu:l4:1 State=UNKNOWN
NodeName=bed-west NodeHostname=$HOST_SHORT NodeAddr=127.0.0.1 Port=6821 CPUs=16 RealMemory=64000 Gres=gpu:l4:1 State=UNKNOWN
# Time limits keep SkyPilot from warning that jobs may wait behind reservations.
PartitionName=onprem Nodes=bed-l4 Default=YES DefaultTime=04:00:00 MaxTime=1-00:00:00 State=UP
PartitionName=h200 Nodes=bed-h200 DefaultTime=04:00:00 MaxTime=1-00:00:00 State=UP
PartitionName=east Nodes=bed-east DefaultTime=04:00:00 MaxTime=1-00:00:00 State=UP
PartitionName=west Nodes=bed-west DefaultTime=04:00:00 MaxTime=1-00:00:00 State=UP
EOF
# Fake GPUs: empty regular files as devices (a GRES with only Count= leaves the node INVAL).
write_if_changed "$SLURM_CONF_DIR/gres.conf" 644 <<EOF && SLURM_CHANGED=1
# Written by gpudoor testbed/up.sh.
AutoDetect=off
NodeName=bed-l4 Name=gpu Type=l4 File=$BED_DEV/l4-[0-1]
NodeName=bed-h200 Name=gpu Type=h200 File=$BED_DEV/h200-[0-4]
NodeName=bed-east Name=gpu Type=l4 File=$BED_DEV/east-l4-0
NodeName=bed-west Name=gpu Type=l4 File=$BED_DEV/west-l4-0
EOF
if [[ -f "$SLURM_CONF_DIR/cgroup.conf" ]]; then
  mv "$SLURM_CONF_DIR/cgroup.conf" "$SLURM_CONF_DIR/cgroup.conf.disabled-by-testbed"
  SLURM_CHANGED=1
fi
mkdir -p "$BED_SLURM/ctld" "$BED_SLURM/spool/bed-l4" "$BED_SLURM/spool/bed-h200" "$BED_SLURM/spool/bed-east" \
  "$BED_SLURM/spool/bed-west"
# SkyPilot's job executor on the node resolves every name in SLURM_JOB_NODELIST
# (socket.gethostbyname): the node names must resolve, to this machine.
if ! grep -qE "^127\.0\.0\.1[[:space:]]+${SLURMD_NODES[*]}[[:space:]]+# gpudoor-testbed" /etc/hosts; then
  sed -i '/# gpudoor-testbed$/d' /etc/hosts
  echo "127.0.0.1 ${SLURMD_NODES[*]} # gpudoor-testbed" >>/etc/hosts
fi

slurm_all_up() {
  pid_alive "$BED_RUN/slurmctld.pid" || return 1
  local n
  for n in "${SLURMD_NODES[@]}"; do pid_alive "$BED_RUN/slurmd-$n.pid" || return 1; done
}
if [[ $SLURM_CHANGED == 1 ]] && slurm_all_up; then
  log "slurm config changed: restarting slurm (running jobs are lost)"
fi
if [[ $SLURM_CHANGED == 1 ]] || ! slurm_all_up; then
  for n in "${SLURMD_NODES[@]}"; do stop_pidfile "$BED_RUN/slurmd-$n.pid"; done
  stop_pidfile "$BED_RUN/slurmctld.pid"
  slurmctld -c
  for _ in $(seq 1 40); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.25; done
  for n in "${SLURMD_NODES[@]}"; do slurmd -N "$n"; done
  SLURM_CHANGED=1
fi
step "slurm nodes idle"
for _ in $(seq 1 60); do
  states="$(sinfo -h -N -o '%N %t' | sort -u)"
  if ! grep -qvE ' (idle|mix|alloc)$' <<<"$states"; then break; fi
  # A node left DOWN/DRAIN by an earlier run comes back with an explicit resume.
  for n in $(awk '$2 ~ /down|drain|drng|fail/ {print $1}' <<<"$states" | sort -u); do
    scontrol update NodeName="$n" State=RESUME 2>/dev/null || true
  done
  sleep 0.5
done
sinfo -h -N -o '%N %t' | sort -u | grep -qvE ' (idle|mix|alloc)$' && {
  sinfo -N -o '%N %P %G %t %E' >&2; exit 1; }

# ---------------------------------------------------------------- sshd
step "sshd on 127.0.0.1:$SSH_PORT"
[[ -f "$BED_SSHD/ssh_host_ed25519_key" ]] || ssh-keygen -q -t ed25519 -N '' -f "$BED_SSHD/ssh_host_ed25519_key"
SSHD_CHANGED=0
write_if_changed "$BED_SSHD/sshd_config" 644 <<EOF && SSHD_CHANGED=1
# Written by gpudoor testbed/up.sh: key-only login for the Slurm user, loopback only.
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $BED_SSHD/ssh_host_ed25519_key
PidFile $BED_RUN/sshd.pid
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin no
AllowUsers $LOGIN_USER
AuthorizedKeysFile .ssh/authorized_keys
# SkyPilot multiplexes many commands over a few connections.
MaxSessions 100
MaxStartups 100:30:200
ClientAliveInterval 30
Subsystem sftp /usr/lib/openssh/sftp-server
EOF
mkdir -p /run/sshd && chmod 755 /run/sshd
if [[ $SSHD_CHANGED == 1 ]] || ! pid_alive "$BED_RUN/sshd.pid"; then
  stop_pidfile "$BED_RUN/sshd.pid"
  /usr/sbin/sshd -t -f "$BED_SSHD/sshd_config"
  /usr/sbin/sshd -f "$BED_SSHD/sshd_config" -E "$BED_LOG/sshd.log"
  for _ in $(seq 1 40); do port_open "$SSH_PORT" && break; sleep 0.25; done
fi

# ---------------------------------------------------------------- SkyPilot state HOME
step "SkyPilot state HOME $BED_HOME"
mkdir -p "$BED_HOME/.ssh" "$BED_HOME/.slurm" "$BED_HOME/.sky"
chmod 700 "$BED_HOME" "$BED_HOME/.ssh"
[[ -f "$SSH_KEY" ]] || ssh-keygen -q -t ed25519 -N '' -C gpudoor-testbed -f "$SSH_KEY"
install -o "$LOGIN_USER" -g "$LOGIN_USER" -m 600 "$SSH_KEY.pub" "$LOGIN_HOME/.ssh/authorized_keys"

step "ssh + slurm as $LOGIN_USER"
ssh_login() {
  ssh -i "$SSH_KEY" -p "$SSH_PORT" -o BatchMode=yes -o StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=10 \
    "$LOGIN_USER@127.0.0.1" "$@"
}
probe_out="$(ssh_login 'bash --login -c "command -v curl; sinfo -h -o %P"')"
grep -q "^$BED_NODE/bin/curl$" <<<"$probe_out" || {
  echo "login shell does not put the curl wrapper first: $probe_out" >&2; exit 1; }
grep -q '^onprem' <<<"$probe_out" || { echo "sinfo over ssh failed: $probe_out" >&2; exit 1; }

# SkyPilot finds Slurm clusters in ~/.slurm/config (SSH-config syntax; Host = cluster name).
write_if_changed "$BED_HOME/.slurm/config" 600 <<EOF || true
# Written by gpudoor testbed/up.sh. Infra strings: slurm/$SLURM_CLUSTER/<partition>.
Host $SLURM_CLUSTER
  HostName 127.0.0.1
  Port $SSH_PORT
  User $LOGIN_USER
  IdentityFile $SSH_KEY
EOF

# The first GPU request downloads catalogs/v8/common/*.csv from GitHub; seed them instead.
CATALOG_VERSION="$("$PY" - <<'EOF'
import re, sysconfig, pathlib
src = pathlib.Path(sysconfig.get_paths()["purelib"], "sky/skylet/constants.py").read_text()
print(re.search(r"^CATALOG_SCHEMA_VERSION = '([^']+)'", src, re.M).group(1))
EOF
)"
CLIENT_RUNTIME="$BED_ROOT/client"   # SKY_RUNTIME_DIR of clients: their catalogs, locks, dbs
for base in "$BED_HOME" "$CLIENT_RUNTIME"; do
  for f in accelerators.csv metadata.csv; do
    write_if_changed "$base/.sky/catalogs/$CATALOG_VERSION/common/$f" 644 <"$TESTBED_DIR/catalog/$f" || true
  done
done
# The API server asks pypi.org once a day whether a newer SkyPilot exists: answer from a
# cache that never expires.
echo '{"release_version": null, "cached_at": 4102444800}' |
  write_if_changed "$BED_HOME/.sky/version_cache.json" 644 || true

SERVER_CONFIG="$BED_HOME/.sky/config.yaml"
{
  echo "# Written by gpudoor testbed/up.sh."
  echo "allowed_clouds:"
  echo "  - slurm"
  echo "jobs:"
  echo "  controller:"
  echo "    # The managed-jobs controller runs inside the API server (no controller cluster)."
  echo "    consolidation_mode: true"
  echo "slurm:"
  echo "  allowed_clusters:"
  echo "    - $SLURM_CLUSTER"
  echo "  cluster_configs:"
  echo "    $SLURM_CLUSTER:"
  echo "      # Per-cluster state and runtime of SkyPilot on the login node / compute nodes."
  echo "      workdir: $LOGIN_HOME/sky-clusters"
  echo "      tmpdir: /tmp/gpudoor-sky-runtime"
  if [[ -n "${GPUDOOR_TESTBED_ADMIN_POLICY:-}" ]]; then
    echo "admin_policy: $GPUDOOR_TESTBED_ADMIN_POLICY"
  fi
} | write_if_changed "$SERVER_CONFIG" 644 || true
CLIENT_CONFIG="$CLIENT_RUNTIME/config.yaml"
{
  echo "# Written by gpudoor testbed/up.sh: client-side SkyPilot config (SKYPILOT_GLOBAL_CONFIG)."
  echo "allowed_clouds:"
  echo "  - slurm"
} | write_if_changed "$CLIENT_CONFIG" 644 || true

# ---------------------------------------------------------------- probe server
step "loopback probe server on :$PROBE_PORT"
if ! pid_alive "$BED_RUN/probe.pid" || ! port_open "$PROBE_PORT"; then
  stop_pidfile "$BED_RUN/probe.pid"
  setsid "$PY" "$TESTBED_DIR/lib/probe_server.py" "$PROBE_PORT" >"$BED_LOG/probe.log" 2>&1 </dev/null &
  echo $! >"$BED_RUN/probe.pid"
  for _ in $(seq 1 40); do port_open "$PROBE_PORT" && break; sleep 0.25; done
  port_open "$PROBE_PORT"
fi

# ---------------------------------------------------------------- API server
step "SkyPilot API server on $API_ENDPOINT"
log "admin policy: ${GPUDOOR_TESTBED_ADMIN_POLICY:-none}; plugins: ${GPUDOOR_TESTBED_PLUGINS:-none}"
# The deployment's key for the run identity on jobs (gpudoor-signature): the launcher signs with it,
# the server's policy keeps a job's dagster-* labels only when they are signed with it.
LABEL_KEY_FILE="$STATE_DIR/label.key"
if [[ ! -s "$LABEL_KEY_FILE" ]]; then
  (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$LABEL_KEY_FILE")
fi
LABEL_KEY="$(cat "$LABEL_KEY_FILE")"
SERVER_ENV=(
  HOME="$BED_HOME"
  # down.sh finds the server's processes by this marker (job controllers run in their own sessions).
  GPUDOOR_TESTBED_OWNER="api-server:$API_PORT:$BED_HOME"
  # The project importable by the server (admin policy), also before `pip install -e .`.
  PYTHONPATH="$REPO_ROOT"
  # The admin policy (when enabled) applies the bed's fleet: pools on the bed's partitions.
  GPUDOOR_FLEET_FILE="$REPO_ROOT/testbed/fleet.yaml"
  GPUDOOR_POLICY_LABEL_KEY="$LABEL_KEY"
  SKYPILOT_DISABLE_USAGE_COLLECTION=1
  # The consolidated controller launches clusters through the SDK against the *local* server
  # (SKYPILOT_API_SERVER_ENDPOINT cleared): tell it which port that is.
  SKYPILOT_API_SERVER_LOCAL_PORT="$API_PORT"
  GPUDOOR_TESTBED_PROBE_URL="$PROBE_URL"
  # SkyPilot sizes its worker pools and the number of consolidated job-controller processes
  # (~160 MB each, 8 launches each) from the machine's memory: 23 GB gives 12 controllers.
  # 8 GB gives 2, plenty for a test bed and lighter on a 2-core machine.
  SKYPILOT_POD_MEMORY_GB_LIMIT="${GPUDOOR_TESTBED_SERVER_MEMORY_GB:-8}"
  # The server's and its controllers' temporary files (task configs, SSH logs) in a folder of the bed's,
  # removed by down.sh: /tmp stays as the bed found it.
  TMPDIR="$BED_RUN/tmp"
  NO_PROXY=127.0.0.1,localhost
  no_proxy=127.0.0.1,localhost
)
if [[ -n "${GPUDOOR_TESTBED_PLUGINS:-}" ]]; then
  # The server's plugins (deploy/skypilot/plugins.yaml: the managed-jobs table read in the request's process).
  SERVER_ENV+=(SKYPILOT_SERVER_PLUGINS_CONFIG="$GPUDOOR_TESTBED_PLUGINS")
fi
# Restart the server when anything it reads at start-up changed.
SERVER_FINGERPRINT="$(cat "$SERVER_CONFIG" "$BED_HOME/.slurm/config" "$SLURM_CONF_DIR/slurm.conf" \
  "$SLURM_CONF_DIR/gres.conf" "$SITE_PACKAGES/gpudoor_testbed_probe.py" ${GPUDOOR_TESTBED_PLUGINS:+"$GPUDOOR_TESTBED_PLUGINS"} \
  <(printf '%s\n' "${SERVER_ENV[@]}") \
  | sha256sum | cut -d' ' -f1)"
server_healthy() { curl -fsS --max-time 5 "$API_ENDPOINT/api/health" >/dev/null 2>&1; }
SERVER_READY=0
if [[ "${GPUDOOR_TESTBED_RESTART_SERVER:-}" != 1 ]] && pid_alive "$BED_RUN/api-server.pid" && server_healthy &&
   [[ "$(cat "$BED_RUN/api-server.fingerprint" 2>/dev/null)" == "$SERVER_FINGERPRINT" ]]; then
  log "API server already up"
  # Set once SkyPilot saw every partition through this server (below).
  if [[ -f "$BED_RUN/api-server.ready" ]]; then SERVER_READY=1; fi
else
  # A restart asked for, of a server that reads what it read before, keeps what SkyPilot saw through it (the
  # state is the server's HOME): it is not checked again.
  if [[ "$(cat "$BED_RUN/api-server.fingerprint" 2>/dev/null)" == "$SERVER_FINGERPRINT" && -f "$BED_RUN/api-server.ready" ]]; then
    SERVER_READY=1
  fi
  rm -f "$BED_RUN/api-server.ready"
  # Every process of the old server, not only the one in its pid file: its request executors outlive it and
  # one may hold the port.
  stop_api_server || { echo "processes of the old API server are still running (above)" >&2; exit 1; }
  if port_open "$API_PORT"; then
    echo "port $API_PORT is taken by another process (not started by this bed)" >&2
    exit 1
  fi
  if [[ $SLURM_CHANGED == 1 && -f "$BED_HOME/.sky/kv_cache.db" ]]; then
    # SkyPilot caches Slurm node info for 30 minutes.
    "$PY" -c 'import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute("DELETE FROM kv_cache WHERE key LIKE ?", ("slurm:%",)); c.commit()' \
      "$BED_HOME/.sky/kv_cache.db" || true
  fi
  [[ -f "$BED_LOG/api-server.log" ]] && mv -f "$BED_LOG/api-server.log" "$BED_LOG/api-server.prev.log"
  log "starting API server (log: $BED_LOG/api-server.log)"
  (cd "$BED_HOME" && exec env "${SERVER_ENV[@]}" setsid "$PY" -m sky.server.server \
    --host 127.0.0.1 --port "$API_PORT" >"$BED_LOG/api-server.log" 2>&1 </dev/null) &
  echo $! >"$BED_RUN/api-server.pid"
  echo "$SERVER_FINGERPRINT" >"$BED_RUN/api-server.fingerprint"
  for _ in $(seq 1 240); do
    server_healthy && break
    pid_alive "$BED_RUN/api-server.pid" || { echo "API server exited" >&2; exit 1; }
    sleep 0.5
  done
  server_healthy || { echo "API server not healthy after 120 s" >&2; exit 1; }
fi

# ---------------------------------------------------------------- client env
INFRA_ONPREM="slurm/$SLURM_CLUSTER/onprem"
INFRA_H200="slurm/$SLURM_CLUSTER/h200"
INFRA_EAST="slurm/$SLURM_CLUSTER/east"
INFRA_WEST="slurm/$SLURM_CLUSTER/west"
ENV_BODY="$(cat <<EOF
# SkyPilot client settings for the gpudoor test bed (written by testbed/up.sh).
export SKYPILOT_API_SERVER_ENDPOINT=$API_ENDPOINT
export SKYPILOT_DISABLE_USAGE_COLLECTION=1
# A client that loses the endpoint must fail, not start a private API server with its own HOME.
export SKYPILOT_DISABLE_LOCAL_API_SERVER=1
export SKYPILOT_GLOBAL_CONFIG=$CLIENT_CONFIG
export SKY_RUNTIME_DIR=$CLIENT_RUNTIME
export GPUDOOR_TESTBED_PROBE_URL=$PROBE_URL
export GPUDOOR_TESTBED_INFRA_ONPREM=$INFRA_ONPREM
export GPUDOOR_TESTBED_INFRA_H200=$INFRA_H200
export GPUDOOR_TESTBED_INFRA_EAST=$INFRA_EAST
export GPUDOOR_TESTBED_INFRA_WEST=$INFRA_WEST
export GPUDOOR_TESTBED_LOG_DIR=$BED_LOG
export GPUDOOR_TESTBED_SERVER_HOME=$BED_HOME
export GPUDOOR_TESTBED_ROOT=$BED_ROOT
export GPUDOOR_LABEL_KEY=$LABEL_KEY
# The fleet the bed's API server's policy reads: a launcher (gpudoor launch, the code location) routes by it too.
export GPUDOOR_FLEET_FILE=$REPO_ROOT/testbed/fleet.yaml
EOF
)"
echo "$ENV_BODY" | write_if_changed "$STATE_DIR/env" 644 || true
echo "$ENV_BODY" | write_if_changed "$BED_ROOT/env" 644 || true

if [[ $SERVER_READY == 0 ]]; then
  step "SkyPilot sees Slurm (sky.check, every partition usable)"
  (
    set -a
    # shellcheck disable=SC1091
    source "$STATE_DIR/env"
    set +a
    "$PY" "$TESTBED_DIR/lib/wait_ready.py" --timeout "${GPUDOOR_TESTBED_READY_TIMEOUT:-240}" \
      --cluster "$SLURM_CLUSTER" "$INFRA_ONPREM=L4:1" "$INFRA_H200=H200:1" "$INFRA_EAST=L4:1" "$INFRA_WEST=L4:1"
  ) 2>&1 | tee "$BED_LOG/wait_ready.log" >&2
fi
touch "$BED_RUN/api-server.ready"

FAILED_STEP=""
log "test bed up in $((SECONDS - T0)) s; logs in $BED_LOG; env in $STATE_DIR/env"
echo "$ENV_BODY" | sed 's/^export GPUDOOR_LABEL_KEY=.*/export GPUDOOR_LABEL_KEY=****  # in the env file/'  # never the key in a log
}

main "$@"
