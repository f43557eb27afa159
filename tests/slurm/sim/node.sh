#!/usr/bin/env bash
# One node of the simulated Slurm cluster (tests/slurm/sim/up.sh): start it, or inject a fault
# into it without touching the other nodes. Needs root.
#
#   node.sh start     twnode2   # start its slurmd in its namespaces (up.sh uses this)
#   node.sh crash     twnode2   # SIGKILL everything in the node (slurmd, stepds, tasks): a power cut
#   node.sh restore   twnode2   # after a crash: a fresh slurmd in the same network namespace, resumed
#   node.sh partition twnode2   # cut its link to the bridge (host end of its veth down)
#   node.sh heal      twnode2   # link up again; resume it if Slurm marked it down
#
# TW_SIM_PIDNS=0 starts slurmd without a pid namespace of its own (default: one per node).
set -euo pipefail
SIM=${TW_SIM_DIR:-/tmp/tw-slurm-sim}
cmd=${1:?usage: node.sh start|crash|restore|partition|heal twnodeN}
n=${2:?usage: node.sh $cmd twnodeN}
i=${n#twnode}
# slurmd must not keep the caller's open files: a lock it holds (`flock f node.sh`) would stay held
for fd in /proc/$$/fd/*; do fd=${fd##*/}; [ "$fd" -gt 2 ] && [ "$fd" != 255 ] && eval "exec $fd>&-"; done 2>/dev/null || true
[ -e "/var/run/netns/$n" ] || { echo "node.sh: no namespace $n (cluster not up?)" >&2; exit 1; }

slurmd_alive() {  # a live slurmd (not a zombie) in the node's network namespace
  local p
  for p in $(ip netns pids "$n"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmd ] && return 0
  done
  return 1
}

start() {
  local pidns=""
  [ "${TW_SIM_PIDNS:-1}" = 1 ] && pidns="--pid --fork --kill-child --mount-proc"
  # the host's DNS server is unreachable from a node, so a lookup missing from /etc/hosts (torch's
  # reverse lookup of ::ffff:a.b.c.d) would hang 10 s; with this resolv.conf it fails at once
  mkdir -p "/etc/netns/$n"; echo "nameserver 127.0.0.1" >"/etc/netns/$n/resolv.conf"  # `ip netns exec` uses it too
  # nsenter, not `ip netns exec` (that remounts /sys and slurmd then fails); env -i so the daemon
  # inherits nothing from the caller (a test's process tag would make it look like a leak);
  # setsid + redirects so it outlives the caller and holds none of its pipes.
  # sh stays as the node's init and reaps orphans: slurmd does not, and an unreaped zombie in a
  # job's process group keeps its step COMPLETING forever (proctrack/pgid).
  # Each node has its own /dev/shm (a tmpfs in its mount namespace), gone when the node crashes: a node's memory.
  setsid nsenter --net="/var/run/netns/$n" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    unshare --uts --mount $pidns sh -c "hostname $n; mount --bind /etc/netns/$n/resolv.conf /etc/resolv.conf
      mount -t tmpfs -o size=${TW_SIM_SHM:-512m},mode=1777 tmpfs /dev/shm
      /usr/sbin/slurmd -D -N $n & wait" \
    </dev/null >>"$SIM/log/slurmd-$n.out" 2>&1 &
  echo $! >"$SIM/pids/slurmd-$n.launcher"
}

resume_if_down() {  # RESUME is only accepted for DOWN/DRAIN/FAIL nodes
  if scontrol show node "$n" -o | grep -qE 'State=[A-Z+]*(DOWN|DRAIN|FAIL)'; then
    scontrol update nodename="$n" state=resume 2>/dev/null || true  # it may have come back meanwhile
  fi
}

state() {  # sinfo's state of the node; -N for all nodes: `sinfo -n NODE` alone can be stale
  sinfo -h -N -o '%N %t' | awk -v n="$n" '$1 == n {print $2}'
}

wait_responding() {  # until Slurm sees the node (no '*' in sinfo's state), at most $1 s
  local t
  for t in $(seq 1 $(($1 * 5))); do
    case $(state) in *'*'* | '') ;; *) return 0 ;; esac
    [ $((t % 10)) = 0 ] && resume_if_down
    sleep 0.2
  done
  echo "node.sh: $n not responding after $1 s: $(state)" >&2
  return 1
}

case $cmd in
  start) start ;;
  crash)
    # the pid namespace's init (sh) dying takes all in it along; the loop catches forks in flight
    for _ in $(seq 1 25); do
      pids=$(ip netns pids "$n"); [ -z "$pids" ] && exit 0
      # frozen first, then killed: as in a power cut, no process there sees another die and acts on it (an agent
      # journaling its fencing once the supervisor beside it is gone)
      kill -STOP $pids 2>/dev/null || true
      kill -9 $pids 2>/dev/null || true
      sleep 0.2
    done
    echo "node.sh: processes left in $n: $(ip netns pids "$n" | tr '\n' ' ')" >&2; exit 1 ;;
  restore)
    if ! slurmd_alive; then
      since=$(date +%FT%T)
      start
      # registered once slurmctld has this slurmd's start time (same clock, ISO times sort)
      for _ in $(seq 1 150); do
        st=$(scontrol show node "$n" -o | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
        [[ "$st" > "$since" || "$st" = "$since" ]] && break
        sleep 0.2
      done
      [[ "$st" > "$since" || "$st" = "$since" ]] || { echo "node.sh: $n's slurmd did not register" >&2; exit 1; }
    fi
    resume_if_down
    wait_responding 30 ;;
  partition) ip link set "veth$i" down ;;
  heal)
    ip link set "veth$i" up
    # SIGHUP makes slurmd re-register now rather than at slurmctld's next ping of the node
    for p in $(ip netns pids "$n"); do
      [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmd ] && kill -HUP "$p"
    done
    resume_if_down
    wait_responding 30 ;;
  *) echo "node.sh: unknown command $cmd" >&2; exit 2 ;;
esac
