#!/usr/bin/env bash
# trainwarden's simulated multi-node Slurm cluster, for tests/slurm (needs root):
# real Slurm 22.05 daemons (Debian's slurm-wlm + munge, installed with apt-get when missing),
# one network namespace and hostname per node (twnodeN = 192.168.251.(10+N)), and by default one
# pid namespace per node too (TW_SIM_PIDNS=0: none). slurmctld and munged run on the host as
# "twctl" (192.168.251.1). The filesystem is shared by all nodes, like NFS on a real cluster.
#
#   tests/slurm/sim/up.sh [NODES]      # default 3; then `srun -N2 hostname` works from the host
#   tests/slurm/sim/node.sh crash|restore|partition|heal twnodeN   # faults, one node at a time
#   tests/slurm/sim/down.sh            # jobs, daemons, namespaces, bridge, /etc/hosts lines
#
# Idempotent: a running cluster (this one or one from the same recipe) is torn down first.
# Fails (exit 1) unless every node is idle at the end. Logs: $TW_SIM_DIR/log (/tmp/tw-slurm-sim).
set -euo pipefail
NODES=${1:-3}
SIM=${TW_SIM_DIR:-/tmp/tw-slurm-sim}
NET=192.168.251          # the simulated cluster's own subnet, only inside namespaces made here
HERE=$(cd "$(dirname "$0")" && pwd)
DAEMON_ENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin)  # daemons inherit nothing from the caller
# nor its open files: a lock held by a caller (`flock f up.sh`) would stay held by the daemons
for fd in /proc/$$/fd/*; do fd=${fd##*/}; [ "$fd" -gt 2 ] && [ "$fd" != 255 ] && eval "exec $fd>&-"; done 2>/dev/null || true

[ "$(id -u)" = 0 ] || { echo "slurm-sim: needs root" >&2; exit 1; }
if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  echo "slurm-sim: installing slurm-wlm and munge" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
"$HERE/down.sh" >/dev/null 2>&1 || true
mkdir -p "$SIM"/{spool,state,log,pids}

# --- munge (authentication between slurm daemons) ---
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge && dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key 2>/dev/null || true; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
# munged runs as user munge, so its pid file lives in its own run dir; reuse one that is alive
if ! { [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
  "${DAEMON_ENV[@]}" runuser -u munge -- /usr/sbin/munged --force --pid-file=/run/munge/munged.pid 2>/dev/null \
    || "${DAEMON_ENV[@]}" /usr/sbin/munged --force --pid-file=/run/munge/munged.pid
fi

# --- network: one bridge, one namespace per node ---
ip link add twbr0 type bridge
ip addr add "$NET.1/24" dev twbr0
ip link set twbr0 up
sed -i '/# tw-slurm-sim$/d' /etc/hosts
echo "$NET.1 twctl # tw-slurm-sim" >>/etc/hosts
for i in $(seq 1 "$NODES"); do
  n=twnode$i; ip=$NET.$((10 + i))
  ip netns add "$n"
  ip link add "veth$i" type veth peer name eth0 netns "$n"
  ip link set "veth$i" master twbr0 up
  ip -n "$n" addr add "$ip/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
  ip -n "$n" route add default via "$NET.1"
  echo "$ip $n # tw-slurm-sim" >>/etc/hosts
done

# --- slurm.conf: real daemons, plugins that need no cgroups ---
mkdir -p /etc/slurm
cat >/etc/slurm/slurm.conf <<EOF
# written by tests/slurm/sim/up.sh (trainwarden's simulated cluster)
ClusterName=twsim
SlurmctldHost=twctl($NET.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SIM/state
SlurmdSpoolDir=$SIM/spool/%n
SlurmctldPidFile=$SIM/pids/slurmctld.pid
# written from inside the node's pid namespace (so "1"): never signal a pid read from it
SlurmdPidFile=$SIM/pids/slurmd-%n.nspid
SlurmctldLogFile=$SIM/log/slurmctld.log
SlurmdLogFile=$SIM/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
MpiDefault=none
SchedulerType=sched/backfill
NodeName=twnode[1-$NODES] CPUs=4 RealMemory=2000 State=UNKNOWN
PartitionName=sim Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
cp /etc/slurm/slurm.conf "$SIM/slurm.conf"

# slurmctld checks that its hostname is SlurmctldHost's, hence its own uts namespace
setsid "${DAEMON_ENV[@]}" unshare --uts sh -c "hostname twctl; exec /usr/sbin/slurmctld -D -i" \
  </dev/null >>"$SIM/log/slurmctld.out" 2>&1 &
echo $! >"$SIM/pids/slurmctld.launcher"
for i in $(seq 1 "$NODES"); do "$HERE/node.sh" start "twnode$i"; done

# wait until every node is idle (fresh state: UNKNOWN until each slurmd registered)
idle=0
for t in $(seq 1 120); do
  idle=$(sinfo -h -N -o '%t' 2>/dev/null | grep -cx idle || true)
  [ "$idle" -ge "$NODES" ] && break
  [ "$t" = 60 ] && scontrol update nodename="twnode[1-$NODES]" state=resume 2>/dev/null || true
  sleep 0.5
done
sinfo -N -o '%N %t %c'
[ "$idle" -ge "$NODES" ] || { echo "slurm-sim: only $idle of $NODES nodes idle; see $SIM/log" >&2; exit 1; }
echo "slurm-sim: $NODES nodes up (twnode[1-$NODES], pid namespaces: ${TW_SIM_PIDNS:-1}); logs in $SIM/log"
