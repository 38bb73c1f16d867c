#!/usr/bin/env bash
# tpsim under Slurm's srun (direct launch, --mpi=pmix), on a one-node Slurm of its own:
#   srun_test.sh TPSIM
# starts munged, slurmctld and slurmd in a scratch folder (its own key, sockets, ports and spool;
# nothing under /etc or /var), then checks that srun -n P runs the world of mpirun -n P: the same
# report and the same files, byte for byte, as one process at P = 2 and 4, and that a rank's
# injected throw and a P that does not divide the world end every task with exit 3 and 2, and a
# task's SIGKILL ends the step. Exit 77 (skipped) where Slurm and munge are not installed
# (tools/install_deps.sh --tests), the test is not root (slurmd starts the tasks as their user) or
# the one-node Slurm does not come up or start a task.
set -euo pipefail
tpsim=$1
source "$(dirname "$0")/same_run.sh"
for tool in munged slurmctld slurmd srun sinfo; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool (Debian's slurm-wlm)"; exit 77; }
done
[ "$(id -u)" -eq 0 ] || { echo "SKIP: slurmd needs root"; exit 77; }

tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for log in "$tmp"/*.log; do echo "--- $log"; tail -20 "$log"; done >&2
  exit 1
}

# munged: a fresh key, its socket in the scratch folder.
mkdir -m 700 "$tmp/munge"
head -c 1024 /dev/urandom >"$tmp/munge/key"
chmod 400 "$tmp/munge/key"
munged --force --foreground --socket="$tmp/munge/socket" --key-file="$tmp/munge/key" \
  --pid-file="$tmp/munge/pid" --log-file="$tmp/munged.log" --seed-file="$tmp/munge/seed" >/dev/null 2>&1 &
pids+=($!)

# Two free ports below the usual ephemeral range, for slurmctld and slurmd.
listening() { (: >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for _ in $(seq 20); do
  port=$((20000 + RANDOM % 12000))
  listening "$port" || listening $((port + 1)) || break
done
host=$(hostname -s)
mkdir "$tmp/ctld" "$tmp/d"
cat >"$tmp/slurm.conf" <<EOF
ClusterName=tpsimtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge/socket
CredType=cred/munge
StateSaveLocation=$tmp/ctld
SlurmdSpoolDir=$tmp/d
TmpFS=$tmp
SlurmctldPidFile=$tmp/ctld.pid
SlurmdPidFile=$tmp/d.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF=$tmp/slurm.conf
for _ in $(seq 50); do [ -S "$tmp/munge/socket" ] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" >/dev/null 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  [ "$(sinfo -h -o %t 2>/dev/null)" = "idle" ] && break
  sleep 0.2
done
if [ "$(sinfo -h -o %t 2>/dev/null)" != "idle" ]; then
  # Slurm itself does not run here (a host name that does not resolve, ports refused): not tpsim's.
  echo "SKIP: the one-node Slurm did not come up: $(sinfo 2>&1)"
  for log in "$tmp"/*.log; do echo "--- $log"; tail -20 "$log"; done
  exit 77
fi

# Slurm launches a task here at all (srun reaches its controller and the node's daemon), or this
# machine is not one Slurm runs on.
if ! timeout -k 5 60 srun -n 1 true >"$tmp/smoke.log" 2>&1; then
  echo "SKIP: srun cannot start a task on the one-node Slurm: $(cat "$tmp/smoke.log")"
  exit 77
fi

# srun -n P, more tasks than cores (-O), direct launch over PMIx; rc is its exit code.
launch() {
  local p=$1
  shift
  set +e
  timeout -k 5 120 srun -n "$p" -O --mpi=pmix --kill-on-bad-exit=0 "$tpsim" "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  set -e
  [ "$rc" -ne 124 ] || fail "srun -n $p tpsim $*: hung"
}

for p in 2 4; do
  for args in "run --layer mlp --tp 4 --gtp-remat 3 --batch 3" "run --layer row --tp 4 -S --input-is-parallel --seq 12"; do
    "$tpsim" $args --save "$tmp/one" >"$tmp/one.txt" 2>&1 || fail "tpsim $args: exit $?"
    launch "$p" $args --save "$tmp/spread"
    [ "$rc" -eq 0 ] || { cat "$tmp/err"; fail "srun -n $p tpsim $args: exit $rc"; }
    grep -q "^tpsim: [0-9]* ranks over $p MPI processes" "$tmp/err" ||
      fail "srun -n $p tpsim $args: no process map on stderr: $(cat "$tmp/err")"
    same_run "srun -n $p tpsim $args" "$tmp/one.txt" "$tmp/one" "$tmp/out" "$tmp/spread"
    rm -rf "$tmp/one" "$tmp/spread"
  done
done

# A rank's throw: every task ends with exit 3 and says why; srun passes the 3 on.
launch 2 run --layer mlp --tp 4 --inject 3:1:throw --timeout 5
[ "$rc" -eq 3 ] || { cat "$tmp/err"; fail "an injected throw: srun exit $rc, expected 3"; }
n=$(grep -c "^tpsim run: the simulated world failed: rank 3 failed: injected fault: rank 3 throws" "$tmp/err" || true)
[ "$n" -eq 2 ] || fail "$n tasks reported rank 3's fault, expected 2: $(cat "$tmp/err")"
# 4 ranks over 3 tasks: exit 2 from each.
launch 3 run --layer mlp --tp 4
[ "$rc" -eq 2 ] || { cat "$tmp/err"; fail "4 ranks over 3 tasks: srun exit $rc, expected 2"; }
n=$(grep -c "^tpsim run: --tp x --gtp-remat: a world of 4 ranks cannot spread over 3 processes" "$tmp/err" || true)
[ "$n" -eq 3 ] || fail "$n tasks reported the placement error, expected 3: $(cat "$tmp/err")"
# A task killed mid-run (SIGKILL, while rank 3 stalls): Slurm's PMIx plugin cancels the step, so
# the other task goes too, at once and not after --timeout; no task is left running.
start=$(date +%s)
(launch 2 run --layer mlp --tp 4 --inject 3:1:stall --timeout 60 --seed 8675309; echo "$rc" >"$tmp/rc") &
launcher=$!
tasks() {
  pgrep -f -- "--seed 8675309" | while read -r pid; do
    [ "$(ps -o comm= -p "$pid")" = tpsim ] && echo "$pid"
  done || true
}
victim=""
for _ in $(seq 100); do
  for pid in $(tasks); do
    tr '\0' '\n' </proc/"$pid"/environ 2>/dev/null | grep -qx PMIX_RANK=1 && victim=$pid
  done
  [ -n "$victim" ] && break
  sleep 0.1
done
[ -n "$victim" ] || fail "task 1 did not start"
sleep 1
kill -KILL "$victim"
wait "$launcher" || true
elapsed=$(($(date +%s) - start))
[ "$(cat "$tmp/rc")" -ne 0 ] || fail "srun exit 0 after a task's SIGKILL"
grep -q "task 1: Killed" "$tmp/err" || fail "srun did not report task 1's SIGKILL: $(cat "$tmp/err")"
[ "$elapsed" -lt 30 ] || fail "after task 1's SIGKILL the job took $elapsed s (--timeout 60)"
sleep 0.5
[ -z "$(tasks)" ] || fail "tasks left running after the step ended: $(tasks)"
echo "srun: P = 2 and 4 bit for bit with one process; a throw exits 3 and a bad P 2 from every task; a SIGKILLed task ends the step"
