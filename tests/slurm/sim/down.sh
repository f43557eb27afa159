#!/usr/bin/env bash
# Tear down the simulated Slurm cluster of tests/slurm/sim/up.sh (or of the recipe it came from):
# jobs, daemons, node namespaces, bridge, /etc/hosts lines, Slurm state. Safe to run twice.
set -u
SIM=${TW_SIM_DIR:-/tmp/tw-slurm-sim}
timeout 5 scancel --quiet --user=root 2>/dev/null || true
# only host pids: a slurmd pid file written inside a node's pid namespace says "1" (the host's init)
for sig in TERM KILL; do
  for f in "$SIM"/pids/*.launcher "$SIM"/pids/slurmctld.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null)
    [ "${pid:-1}" -gt 1 ] && kill -s "$sig" "$pid" 2>/dev/null
  done
  [ "$sig" = TERM ] && sleep 1
done
rm -f "$SIM"/pids/*
[ -s /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null && rm -f /run/munge/munged.pid
for ns in $(ip netns list 2>/dev/null | awk '/^twnode/{print $1}'); do
  # anything still running in a node (slurmd, left-over steps) goes with it
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  ip netns del "$ns"; rm -rf "/etc/netns/$ns"   # deleting it deletes its eth0, and with it the host end vethN
done
for l in $(ip -o link show master twbr0 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}'); do
  ip link del "$l" 2>/dev/null
done
ip link del twbr0 2>/dev/null
sed -i '/# tw-slurm-sim$/d' /etc/hosts
rm -rf "$SIM/state" "$SIM/spool"
echo "slurm-sim: down"
