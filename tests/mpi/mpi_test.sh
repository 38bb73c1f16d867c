#!/usr/bin/env bash
# One check of a world spread over MPI processes (tests/mpi/CMakeLists.txt):
#   mpi_test.sh MPIEXEC DRIVER bitwise P            12 ranks over P processes = 12 ranks in one, bit for bit
#   mpi_test.sh MPIEXEC DRIVER placement P SIZE     SIZE ranks do not spread over P: exit 2 from every process
#   mpi_test.sh MPIEXEC DRIVER fault P SIZE FAULT   exit 3 from every process within the timeout, none left
#   mpi_test.sh MPIEXEC TPSIM run P                 tpsim run (and demo), every layer kind at T = 4, G = 3 (and G = 1,
#                                                   sequence parallel where it applies) over P processes = in one:
#                                                   the same report, the same files bit for bit; and
#                                                   with --verify none (generated, and --load), where each
#                                                   process holds only its ranks' shards: the same report
#   mpi_test.sh MPIEXEC TPSIM runfail P             tpsim run over P processes: a rank's injected throw
#                                                   ends every process with exit 3 and the same cause;
#                                                   4 ranks over 3 processes: exit 2 from every process;
#                                                   a refusal in one process alone: exit 2 from each at once,
#                                                   as for a NaN in a --load piece only one process reads
#                                                   and an injected fault that never fires
#   mpi_test.sh MPIEXEC DRIVER props P SEED CASES   split_props' random cases over P processes = in one process,
#                                                   line for line (each names its seed, case and configuration)
#   mpi_test.sh MPIEXEC TPSIM files P               tpsim run --trace (model clock) --save-checkpoint over P processes,
#                                                   and tpsim demo --trace: the same files, byte for byte, as in one
#                                                   process; the checkpoint loads back at another topology,
#                                                   in one process and, unverified, in 2: the same checkpoint
#   mpi_test.sh MPIEXEC TPSIM memory P              tpsim run --verify none over P processes: every process's peak
#                                                   within its estimate (at most 2x above it), and at most a
#                                                   quarter of one process's peak (generated and --load; from
#                                                   a checkpoint, within its estimate); a run the machine's P
#                                                   processes do not fit together, refused by each (exit 2)
#   mpi_test.sh MPIEXEC TPSIM verifypart P          tpsim run --layer mlp|column|row|embedding|grouped-* in parts
#                                                   over P processes (generated, --load, --load-checkpoint;
#                                                   faults in other processes' rows): one process's report and
#                                                   exit code
#   mpi_test.sh MPIEXEC TPSIM memorypart P          the same on a large MLP, column, row, embedding, experts: each
#                                                   peak within its estimate (at most 2x above it), at most
#                                                   0.4-0.5 of one process's peak, process 0's about the
#                                                   others'
#   mpi_test.sh MPIEXEC TPSIM bench P               tpsim bench --what mpi over P processes: process 0's table,
#                                                   every section and size, positive finite figures, no wrong
#                                                   element; in one process, exit 2 naming the flag
#   mpi_test.sh MPIEXEC GPUDRIVER gpulocal P        each process's local rank on the machine: 0 .. P-1, once each
#   mpi_test.sh MPIEXEC GPUDRIVER gpuid P           process 0's (made-up) NCCL id reaches every process intact
#   mpi_test.sh MPIEXEC GPUDRIVER gpusplit P        the splits' NCCL colors and keys over P processes = in one,
#                                                   and every process's collectives reach NCCL in issue order
#   mpi_test.sh MPIEXEC GPUDRIVER gpufault P FAULT  the same with an injected fault (a mismatch only the exchange
#                                                   sees): exit 3 from every process, the same diagnostic
#   mpi_test.sh MPIEXEC TPSIM gpufail P             tpsim run --backend gpu with ranks != processes, or (here) no
#                                                   GPU: exit 2 from every process, saying why
#   mpi_test.sh MPIEXEC TPSIM gpurun 1              one process on one GPU against the simulator; exit 77 (skip)
#                                                   without a usable GPU
set -euo pipefail
mpiexec=$1 driver=$2 mode=$3 p=$4
source "$(dirname "$0")/same_run.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
timeout_ms=3000

fail() { echo "FAIL: $*" >&2; exit 1; }
show() { echo "--- stdout"; cat "$tmp/out"; echo "--- stderr"; cat "$tmp/err"; }

# Runs the driver under mpiexec with a hang guard; sets rc and elapsed (ms). Each process reports
# its own exit status ("process exit N"): a launcher that outlives a killed process (Open MPI with
# orte_enable_recovery) does not pass them on. Each process writes its own files, joined in rank
# order into out and err: the launcher forwards a process's output in pieces of its own choosing,
# which interleave with another's mid-line.
spread() {
  local start=$(date +%s%N)
  rm -rf "$tmp/procs"
  mkdir "$tmp/procs"
  set +e
  timeout -k 5 100 "$mpiexec" -n "$p" \
    sh -c 'd=$1; shift; r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-$$}}
           "$@" >"$d/out.$r" 2>"$d/err.$r" & pid=$!
           echo "process pid $pid" >"$d/status.$r"; wait $pid; s=$?; echo "process exit $s" >>"$d/status.$r"; exit $s' \
    sh "$tmp/procs" "$driver" "$@" \
    >"$tmp/launcher" 2>&1
  rc=$?
  set -e
  : >"$tmp/out"
  cp "$tmp/launcher" "$tmp/err"
  for r in $(ls "$tmp/procs" | sed -n 's/^status\.//p' | sort -n); do
    # A process ended before its command started has no out or err.
    cat "$tmp/procs/out.$r" >>"$tmp/out" 2>/dev/null || true
    cat "$tmp/procs/status.$r" "$tmp/procs/err.$r" >>"$tmp/err" 2>/dev/null || true
  done
  elapsed=$(( ($(date +%s%N) - start) / 1000000 ))
  show
  [ "$rc" -ne 124 ] || fail "mpiexec hung"
  # No process left behind (a zombie whose parent the launcher ended is no longer running).
  sleep 0.5
  for pid in $(sed -n 's/^process pid //p' "$tmp/err"); do
    state=$(ps -o stat= -p "$pid" || true)
    [ -z "$state" ] || [[ "$state" == Z* ]] || fail "process $pid outlived mpiexec: $(ps -o stat=,args= -p "$pid")"
  done
  [ "$(grep -c "^process pid " "$tmp/err")" -eq "$p" ] || fail "expected $p processes started"
}

# Memory: "estimated peak of 686.9 MiB ..." in KiB.
peak_rss="$(dirname "$0")/peak_rss.py"
estimate() { grep -o "estimated peak of [0-9.]* [KMG]iB" "$1" | head -1 |
             awk '{ m = $5 == "GiB" ? 1048576 : $5 == "MiB" ? 1024 : 1; printf "%.0f", $4 * m }'; }
# The estimate of tpsim "$@" over $p processes (est) and each process's peak, at or under it; most:
# the largest peak. $one is one process's peak.
spread_peaks() {
  set +e
  timeout -k 5 100 "$mpiexec" -n "$p" "$tpsim" "$@" --max-memory 1 >/dev/null 2>"$tmp/err"
  set -e
  grep -q "for the largest process of $p (.* for the $p on this machine)" "$tmp/err" ||
    { cat "$tmp/err"; fail "no per-process estimate over $p processes"; }
  est=$(estimate "$tmp/err")
  timeout -k 5 100 "$mpiexec" -n "$p" python3 "$peak_rss" "$tmp/spread.peak.{rank}" "$tpsim" "$@" ||
    fail "mpiexec -n $p tpsim $*: exit $?"
  most=0
  for r in $(seq 0 $((p - 1))); do
    peak=$(cat "$tmp/spread.peak.$r")
    echo "tpsim $*: process $r: peak $peak KiB, estimate $est KiB; one process: $one KiB"
    [ "$peak" -le "$est" ] || fail "tpsim $*: process $r peaked at $peak KiB, above its estimate of $est KiB"
    [ "$peak" -le "$most" ] || most=$peak
  done
}
# One process's peak of tpsim "$@" (one), then spread_peaks; the estimate errs high, by at most 1.62
# on the runs of docs/distributed.md: at most twice the largest peak.
peaks_against_one() {
  python3 "$peak_rss" "$tmp/one.peak" "$tpsim" "$@" || fail "tpsim $*: exit $?"
  one=$(cat "$tmp/one.peak")
  spread_peaks "$@"
  [ "$est" -le $((2 * most)) ] || fail "estimate $est KiB, more than twice the largest peak ($most KiB)"
}

case "$mode" in
  bitwise)
    "$driver" 12 >"$tmp/one"
    spread 12
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    lines=$(wc -l <"$tmp/one")
    [ "$lines" -eq $((12 * 15)) ] || fail "one process printed $lines hashes, expected $((12 * 15))"
    diff <(sort "$tmp/one") <(sort "$tmp/out") || fail "the outputs of $p processes differ from one process's"
    ;;
  placement)
    spread "$5"
    [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
    n=$(grep -c "exit 2: a world of $5 ranks cannot spread over $p processes" "$tmp/err" || true)
    [ "$n" -eq "$p" ] || fail "$n processes reported the placement error, expected $p"
    ;;
  fault)
    size=$5 fault=$6
    spread "$size" "$timeout_ms" "$fault"
    exits=$(grep -c "^process exit 3$" "$tmp/err" || true)
    others=$(grep "^process exit " "$tmp/err" | grep -v "^process exit 3$" | grep -vc "^process exit 137$" || true)
    # Every process within the timeout (and the launch), plus the final agreement's.
    [ "$elapsed" -lt $((3 * timeout_ms + 20000)) ] || fail "took $elapsed ms"
    expected=$p
    [[ "$fault" != *:kill ]] || expected=$((p - 1))
    grep "^process [0-9]*: exit 3: " "$tmp/err" | sed 's/^process [0-9]*: exit 3: //' | sort >"$tmp/causes" || true
    # Once one process exits 3 the launcher may end the others (they have printed by then), unless
    # it is told to outlive a killed process.
    [ "$exits" -ge 1 ] && [ "$others" -eq 0 ] || fail "$exits processes exited 3, $others otherwise"
    [[ "$fault" != *:kill ]] || [ "$exits" -eq "$expected" ] || fail "$exits processes exited 3, expected $expected"
    [ "$(wc -l <"$tmp/causes")" -eq "$expected" ] || fail "$(wc -l <"$tmp/causes") processes reported the failure, expected $expected"
    # The launcher's own status: 3, or (after a killed process, when it outlives it) 0.
    [ "$rc" -eq 3 ] || { [[ "$fault" == *:kill ]] && [ "$rc" -eq 0 ]; } || fail "mpiexec exit $rc, expected 3"
    # The same diagnostic from every process; a timeout may be seen first by any of them.
    if [ "$(sort -u "$tmp/causes" | wc -l)" -ne 1 ]; then
      ! grep -qv "^sim: timeout: " "$tmp/causes" || fail "processes reported different failures"
    fi
    ;;
  run)
    tpsim=$driver
    for kind in column row embedding mlp grouped-column grouped-row; do
      case "$kind" in
        column | mlp) sp="-S" ;;
        row) sp="-S --input-is-parallel" ;;
        embedding) sp="--reduce-scatter-embeddings" ;;
        *) sp="" ;;
      esac
      grids=("--tp 4 -G 3 -b 3" "--tp 4 -b 3 --seq 12 $sp")
      [[ "$kind" != grouped-* ]] || grids=("--tp 4 -G 3 --tokens 24" "--tp 4")
      for grid in "${grids[@]}"; do
        args="run --layer $kind $grid"
        "$tpsim" $args --save "$tmp/one" >"$tmp/one.txt" 2>&1 || fail "tpsim $args: exit $?: $(cat "$tmp/one.txt")"
        # 4 ranks do not spread over 3 processes (tpsim_mpi_placement covers the refusal): 2 there.
        spread_p=$p
        [ $((4 % p)) -eq 0 ] || [[ "$grid" == *"-G 3"* ]] || spread_p=2
        set +e
        timeout -k 5 100 "$mpiexec" -n "$spread_p" "$tpsim" $args --save "$tmp/spread" >"$tmp/spread.txt" 2>"$tmp/err"
        rc=$?
        set -e
        [ "$rc" -eq 0 ] || { cat "$tmp/err"; fail "mpiexec -n $spread_p tpsim $args: exit $rc"; }
        same_run "tpsim $args over $spread_p processes" "$tmp/one.txt" "$tmp/one" "$tmp/spread.txt" "$tmp/spread"
        # Neither verified nor saved, generated and read back: each process holds only its ranks' shards.
        for more in "" "--load $tmp/one"; do
          "$tpsim" $args $more --verify none >"$tmp/one.txt" 2>&1 || fail "tpsim $args $more --verify none: exit $?"
          timeout -k 5 100 "$mpiexec" -n "$spread_p" "$tpsim" $args $more --verify none \
            >"$tmp/spread.txt" 2>"$tmp/err" ||
            { cat "$tmp/err"; fail "mpiexec -n $spread_p tpsim $args $more --verify none: exit $?"; }
          diff "$tmp/one.txt" "$tmp/spread.txt" ||
            fail "tpsim $args $more --verify none: the report of $spread_p processes differs from one process's"
        done
        rm -rf "$tmp/one" "$tmp/spread"
      done
    done
    # tpsim demo: T = 4.
    spread_p=$p
    [ $((4 % p)) -eq 0 ] || spread_p=2
    "$tpsim" demo >"$tmp/one.txt"
    timeout -k 5 100 "$mpiexec" -n "$spread_p" "$tpsim" demo >"$tmp/spread.txt" || fail "mpiexec tpsim demo: exit $?"
    diff "$tmp/one.txt" "$tmp/spread.txt" || fail "tpsim demo: the report of $spread_p processes differs"
    ;;
  runfail)
    driver=$2
    spread run --layer mlp --tp 4 --inject 3:1:throw --timeout 5
    [ "$rc" -eq 3 ] || fail "exit $rc, expected 3"
    n=$(grep -c "^tpsim run: the simulated world failed: rank 3 failed: injected fault: rank 3 throws" "$tmp/err" || true)
    [ "$n" -eq "$p" ] || fail "$n processes reported rank 3's fault, expected $p"
    p=3
    spread run --layer mlp --tp 4
    [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
    n=$(grep -c "^tpsim run: --tp x --gtp-remat: a world of 4 ranks cannot spread over 3 processes" "$tmp/err" || true)
    [ "$n" -eq 3 ] || fail "$n processes reported the placement error, expected 3"
    # A refusal one process meets alone (here its own --max-memory; on a cluster its machine's memory,
    # or a file only it reads) ends every process at once with exit 2, not at the world's timeout.
    p=2
    for refusing in 0 1; do
      printf '#!/bin/sh\n[ "${OMPI_COMM_WORLD_RANK:-0}" = %s ] && exec "%s" "$@" --max-memory 1K\nexec "%s" "$@"\n' \
        "$refusing" "$2" "$2" >"$tmp/one-refuses"
      chmod +x "$tmp/one-refuses"
      driver=$tmp/one-refuses
      spread run --layer mlp --tp 4 --timeout 60
      [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
      [ "$elapsed" -lt 30000 ] || fail "took $elapsed ms: the other process waited for the world's timeout"
      grep -q "^tpsim run: expected a run that fits in memory" "$tmp/err" || fail "the refusing process did not say why"
      grep -q "^tpsim run: process $refusing: expected a run that fits in memory" "$tmp/err" ||
        fail "the other process did not name it"
    done
    # As does one it meets after its ranks are done: an injected fault that never fires, on rank 3
    # of process 1 (it waited for the results' gather's timeout).
    driver=$2
    spread run --layer column --tp 4 --inject 3:99:corrupt:5:30 --timeout 60
    [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
    [ "$elapsed" -lt 30000 ] || fail "took $elapsed ms: process 0 waited for its timeout"
    never="sim: injected fault 3:99:corrupt:5:30 never fired: rank 3 issued 1 collectives"
    grep -q "^tpsim run: $never" "$tmp/err" || fail "process 1 did not say why"
    grep -q "^tpsim run: process 1: $never" "$tmp/err" || fail "process 0 did not name process 1's failure"
    # Each process reads only the pieces of a --load file its ranks hold (2^20 elements each): a NaN
    # in weight row 1024 of 2048, held by ranks 2 and 3, is read only by process 1, and agreed.
    driver=$2
    flags=(run --layer column --tp 4 --batch 2 --seq 8 --in-features 1024 --out-features 2048 --verify none)
    "$driver" "${flags[@]}" --save "$tmp/nan" >/dev/null || fail "tpsim run --save: exit $?"
    # Read so, the parameters' shards are those of one process: the same checkpoint, byte for byte.
    "$driver" "${flags[@]}" --load "$tmp/nan" --save-checkpoint "$tmp/ck-one" >/dev/null ||
      fail "tpsim run --save-checkpoint: exit $?"
    spread "${flags[@]}" --load "$tmp/nan" --save-checkpoint "$tmp/ck-spread"
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    diff -r "$tmp/ck-one" "$tmp/ck-spread" || fail "the checkpoint of 2 processes differs from one process's"
    # Generated: each process computes only the pieces its ranks hold, but draws the whole stream.
    spread "${flags[@]}" --save-checkpoint "$tmp/ck-generated"
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    diff -r "$tmp/ck-one" "$tmp/ck-generated" || fail "the checkpoint of 2 processes' generated data differs"
    # And from that checkpoint, whose pieces each process reads only where its ranks hold them.
    spread "${flags[@]}" --load-checkpoint "$tmp/ck-one" --save-checkpoint "$tmp/ck-again"
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    diff -r "$tmp/ck-one" "$tmp/ck-again" || fail "the checkpoint loaded and saved by 2 processes differs"
    python3 -c 'import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
at = 10 + int.from_bytes(b[8:10], "little") + 4 * (2**20 + 5)
b[at:at + 4] = bytes.fromhex("0000c07f")
open(p, "wb").write(b)' "$tmp/nan/weight.npy"
    nan="weight.npy: expected finite values, got 1 NaN or Inf, the first at flat index 1048581"
    "$driver" "${flags[@]}" --load "$tmp/nan" >"$tmp/one.txt" 2>&1 && fail "one process ran a NaN weight"
    grep -q "^tpsim run: $nan" "$tmp/one.txt" || fail "one process did not name the NaN: $(cat "$tmp/one.txt")"
    spread "${flags[@]}" --load "$tmp/nan"
    [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
    grep -q "^tpsim run: $nan" "$tmp/err" || fail "process 1 did not name the NaN"
    grep -q "^tpsim run: process 1: $nan" "$tmp/err" || fail "process 0 read the piece, or did not name process 1"
    ;;
  props)
    seed=$5 cases=$6
    "$driver" "$seed" "$p" "$cases" >"$tmp/one" || fail "split_props $seed $p $cases in one process: exit $?"
    spread "$seed" "$p" "$cases"
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    [ "$(grep -c " layer: " "$tmp/one")" -eq "$cases" ] || fail "one process printed no line for some layer cases"
    [ "$(grep -c " distopt: " "$tmp/one")" -ge "$cases" ] || fail "one process printed no line for some distopt cases"
    diff <(sort "$tmp/one") <(sort "$tmp/out") >"$tmp/diff" || {
      cat "$tmp/diff"
      fail "$p processes differ from one process in the cases above (< one process, > $p processes); replay with: split_props $seed $p $cases"
    }
    ;;
  files)
    tpsim=$driver
    # Grids whose ranks spread over 2 and 3 processes: 12 ranks, and 6 for the expert layer.
    for args in "--layer mlp --tp 4 -G 3 -b 3" "--layer grouped-column --tp 2 -G 3 --tokens 24" \
                "--layer embedding --tp 6 --reduce-scatter-embeddings --seq 12 --vocab 36" "--layer row --tp 6 -S --input-is-parallel --seq 12 -k 24"; do
      for where in one spread; do
        launch=()
        [ "$where" = one ] || launch=(timeout -k 5 100 "$mpiexec" -n "$p")
        set +e
        "${launch[@]}" "$tpsim" run $args --trace "$tmp/$where.json" --clock model --save-checkpoint "$tmp/$where.ckpt" \
          >"$tmp/$where.txt" 2>"$tmp/err"
        rc=$?
        set -e
        [ "$rc" -eq 0 ] || { cat "$tmp/$where.txt" "$tmp/err"; fail "$where: tpsim run $args: exit $rc"; }
      done
      diff <(sed "s|$tmp/one|DIR|g" "$tmp/one.txt") <(sed "s|$tmp/spread|DIR|g" "$tmp/spread.txt") ||
        fail "tpsim run $args: the report of $p processes differs from one process's"
      cmp "$tmp/one.json" "$tmp/spread.json" || fail "tpsim run $args --trace: the trace of $p processes differs"
      [ "$(ls "$tmp/one.ckpt")" = "$(ls "$tmp/spread.ckpt")" ] || fail "tpsim run $args: other checkpoint files"
      for f in "$tmp"/one.ckpt/*; do
        cmp "$f" "$tmp/spread.ckpt/$(basename "$f")" || fail "tpsim run $args --save-checkpoint: $(basename "$f") differs"
      done
      # The spread save is a checkpoint: one process loads it, at T = 2.
      kind=${args%% --tp*}
      "$tpsim" run $kind --tp 2 --load-checkpoint "$tmp/spread.ckpt" >"$tmp/load.txt" 2>&1 ||
        fail "tpsim run $kind --tp 2 --load-checkpoint: exit $?: $(cat "$tmp/load.txt")"
      # And the processes, unverified, each reading only its ranks' shards of the parameters: the
      # checkpoint they save is one process's.
      for where in one spread; do
        launch=()
        [ "$where" = one ] || launch=(timeout -k 5 100 "$mpiexec" -n 2)
        "${launch[@]}" "$tpsim" run $kind --tp 2 --load-checkpoint "$tmp/spread.ckpt" --verify none \
          --save-checkpoint "$tmp/$where.again" >"$tmp/$where.txt" 2>"$tmp/err" ||
          { cat "$tmp/err"; fail "$where: tpsim run $kind --tp 2 --load-checkpoint --verify none: exit $?"; }
      done
      diff <(sed "s|$tmp/one.again|DIR|g" "$tmp/one.txt") <(sed "s|$tmp/spread.again|DIR|g" "$tmp/spread.txt") ||
        fail "tpsim run $kind --load-checkpoint --verify none: the report of 2 processes differs from one process's"
      for f in "$tmp"/one.again/*; do
        cmp "$f" "$tmp/spread.again/$(basename "$f")" ||
          fail "--load-checkpoint --save-checkpoint: $(basename "$f") differs"
      done
      rm -rf "$tmp"/one.* "$tmp"/spread.*
    done
    "$tpsim" demo --trace "$tmp/one.json" --clock model >/dev/null
    timeout -k 5 100 "$mpiexec" -n 2 "$tpsim" demo --trace "$tmp/spread.json" --clock model >/dev/null ||
      fail "mpiexec -n 2 tpsim demo --trace: exit $?"
    cmp "$tmp/one.json" "$tmp/spread.json" || fail "tpsim demo --trace: the trace of 2 processes differs"
    ;;
  memory)
    tpsim=$driver
    # A weight-heavy layer, unverified, a rank a process: a process holds its rank's shards, cut from
    # pieces of the inputs, not the whole inputs and every result.
    args="run --layer column --batch 2 --seq 16 --in-features 4096 --out-features 8192 --tp $p --verify none"
    peaks_against_one $args
    generated_est=$est
    # Each process about 1/P of one process's peak: the program, its shards and its rank's working
    # set. One whole weight (an eighth of one process's peak at P = 8) would put it above a quarter.
    [ $((4 * most)) -le "$one" ] || fail "a process peaked at $most KiB, more than a quarter of one process's $one KiB"
    # The same inputs from --load files: each read and cut a piece at a time, never whole (as
    # doubles, the file would be a process's largest term by far).
    "$tpsim" $args --save "$tmp/inputs" >/dev/null || fail "tpsim $args --save: exit $?"
    spread_peaks run --layer column --tp "$p" --load "$tmp/inputs" --verify none
    [ $((4 * most)) -le "$one" ] ||
      fail "a process peaked at $most KiB with --load, more than a quarter of one process's $one KiB"
    # The weight from a checkpoint, whose files no process holds: each reads a chunk at a time, and
    # stays at or under its estimate, which errs high by at most half, and under a quarter of one
    # process's peak (holding the files whole, each process peaked at 0.4 of it).
    "$tpsim" $args --save-checkpoint "$tmp/checkpoint" >/dev/null || fail "tpsim $args --save-checkpoint: exit $?"
    spread_peaks run --layer column --batch 2 --seq 16 --tp "$p" --load-checkpoint "$tmp/checkpoint" --verify none
    [ $((2 * est)) -le $((3 * most)) ] ||
      fail "checkpoint: estimate $est KiB, more than 1.5 times the largest peak ($most KiB)"
    [ $((4 * most)) -le "$one" ] ||
      fail "a process peaked at $most KiB with --load-checkpoint, more than a quarter of one process's $one KiB"
    # Saved at T = 1, the weight is one chunk, which every process reads whole as its pieces are cut
    # and as its rank loads: the estimate counts it (without, each process would be above it).
    "$tpsim" ${args/--tp $p/--tp 1} --save-checkpoint "$tmp/checkpoint1" >/dev/null ||
      fail "tpsim ${args/--tp $p/--tp 1} --save-checkpoint: exit $?"
    spread_peaks run --layer column --batch 2 --seq 16 --tp "$p" --load-checkpoint "$tmp/checkpoint1" --verify none
    [ $((2 * est)) -le $((3 * most)) ] ||
      fail "checkpoint of one chunk: estimate $est KiB, more than 1.5 times the largest peak ($most KiB)"
    # A row layer's weight is cut along its columns: each piece of rows overlaps every rank's chunk,
    # all of which the cache then holds (without them counted, the estimate is 0.8 of the peak).
    row="run --layer row --batch 2 --seq 16 --in-features 8192 --out-features 4096 --tp $p --verify none"
    "$tpsim" $row --save-checkpoint "$tmp/row-checkpoint" >/dev/null || fail "tpsim $row --save-checkpoint: exit $?"
    spread_peaks run --layer row --batch 2 --seq 16 --tp "$p" --load-checkpoint "$tmp/row-checkpoint" --verify none
    [ $((2 * est)) -le $((3 * most)) ] ||
      fail "row checkpoint: estimate $est KiB, more than 1.5 times the largest peak ($most KiB)"
    # The machine holds its P processes at once: a run each process alone would fit (about a third
    # of what is available: the estimate grows a little slower than the weight) is refused by all
    # of them, the P together being more. Each process may take at most a fifth of it, so that a
    # refusal missed fails here rather than exhausting the machine.
    avail=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo)
    # Or what the cgroup leaves, where that is less (as tpsim reads it: tools/lib/memory.cc).
    for limit_usage in memory.max:memory.current memory/memory.limit_in_bytes:memory/memory.usage_in_bytes; do
      limit=$(cat "/sys/fs/cgroup/${limit_usage%%:*}" 2>/dev/null || true)
      usage=$(cat "/sys/fs/cgroup/${limit_usage##*:}" 2>/dev/null || echo 0)
      [[ "$limit" =~ ^[0-9]+$ ]] && [ "${#limit}" -lt 19 ] || continue
      [ $(((limit - usage) / 1024)) -ge "$avail" ] || avail=$(((limit - usage) / 1024))
      break
    done
    wide=$(( (8192 * avail / 2 / generated_est) / 64 * 64 ))
    args="run --layer column --batch 2 --seq 16 --in-features 4096 --out-features $wide --tp $p --verify none"
    set +e
    (ulimit -v $((avail / 5)); timeout -k 5 100 "$mpiexec" -n "$p" "$tpsim" $args >/dev/null 2>"$tmp/err")
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || { cat "$tmp/err"; fail "tpsim $args over $p processes: exit $rc, expected 2"; }
    n=$(grep -c "^tpsim run: expected a run that fits in memory, got an estimated peak of .* for the largest process of $p (.* for the $p on this machine) .* more than the .* available" "$tmp/err" || true)
    [ "$n" -eq "$p" ] || { cat "$tmp/err"; fail "$n processes refused the run for the machine's memory, expected $p"; }
    read -r mine machine available < <(grep -m1 "^tpsim run: expected a run" "$tmp/err" |
      sed 's/.*estimated peak of \([0-9.]*\) GiB .* (\([0-9.]*\) GiB for the .* than the \([0-9.]*\) GiB available.*/\1 \2 \3/')
    echo "one process $mine GiB, the $p on this machine $machine GiB, available $available GiB"
    awk -v a="$mine" -v b="$available" -v c="$machine" 'BEGIN { exit !(a < b && b < c) }' ||
      fail "expected one process's estimate ($mine GiB) under the $available GiB available, and the $p's ($machine GiB) over it"
    ;;
  verifypart)
    tpsim=$driver
    # An MLP, a column, a row, an embedding and the grouped experts verified in parts
    # (LayerKind::partResults): each process checks its ranks' rows of F, N, K or the vocabulary and
    # process 0 merges the tables, which must be one process's; T = 12 spreads over 2, 3 and 4
    # processes. The injected corruptions land in ranks of other processes than 0: the tables' FAIL
    # rows, counts and first elements come from there (the grouped experts issue no collective: the
    # run completes their partial sums).
    "$tpsim" run --layer mlp --tp 4 --batch 3 --save "$tmp/inputs" >/dev/null || fail "tpsim run --save: exit $?"
    "$tpsim" run --layer mlp --tp 4 --batch 3 --save-checkpoint "$tmp/checkpoint" >/dev/null ||
      fail "tpsim run --save-checkpoint: exit $?"
    mlp="--layer mlp --ffn-hidden 96 --seq 12 --batch 3"
    column="--layer column --out-features 96 --seq 12 --batch 3"
    row="--layer row --input-is-parallel --in-features 96 --seq 12 --batch 3"
    embedding="--layer embedding --vocab 96 --seq 12 --batch 3"
    experts="--tokens 36 --experts 3"
    for case in "12|$mlp" "12|$mlp -S" "12|$mlp --dtype bf16" "12|$mlp --dtype fp16 -S" \
                "12|$mlp --grad-accumulation-fusion" "4|--layer mlp --load $tmp/inputs" \
                "4|--layer mlp --load-checkpoint $tmp/checkpoint" "4|--layer mlp -S --inject 3:4:corrupt:9:29" \
                "4|--layer mlp -S --inject 2:3:corrupt:3:31" "4|--layer mlp -S --inject 1:3:corrupt:50:30" \
                "12|$column --bias" "12|$column -S --dtype bf16 --bias" "12|$column --dtype fp16 -S" \
                "12|$column --grad-accumulation-fusion --bias" "4|--layer column --bias -S --inject 3:1:corrupt:5:30" \
                "4|--layer column -S --inject 2:3:corrupt:7:29" "12|$row --bias" "12|$row -S --dtype bf16" \
                "12|$row --dtype fp16 --bias -S" "4|$row --bias -S --inject 3:2:corrupt:4:30" \
                "4|$row --bias --inject 1:1:corrupt:3:31" "12|$embedding" "12|$embedding --dtype bf16" \
                "12|$embedding --reduce-scatter-embeddings" "4|--layer embedding --reduce-scatter-embeddings \
                --inject 3:2:corrupt:6:30" "4|--layer embedding --inject 2:1:corrupt:1:31" \
                "12|--layer grouped-column --out-features 96 $experts --bias" \
                "12|--layer grouped-column --out-features 96 $experts --dtype bf16 --grad-accumulation-fusion" \
                "12|--layer grouped-row --in-features 96 $experts --bias" \
                "12|--layer grouped-row --in-features 96 $experts --dtype fp16 --bias"; do
      t=${case%%|*} more=${case#*|}
      [ $((t % p)) -eq 0 ] || continue
      args="run --tp $t $more"
      set +e
      "$tpsim" $args >"$tmp/one.txt" 2>&1
      want=$?
      timeout -k 5 100 "$mpiexec" -n "$p" "$tpsim" $args >"$tmp/spread.txt" 2>"$tmp/err"
      rc=$?
      set -e
      [ "$want" -eq $([[ "$more" == *--inject* ]] && echo 1 || echo 0) ] ||
        fail "tpsim $args: exit $want: $(cat "$tmp/one.txt")"
      [ "$rc" -eq "$want" ] || { cat "$tmp/err"; fail "mpiexec -n $p tpsim $args: exit $rc, one process $want"; }
      diff "$tmp/one.txt" "$tmp/spread.txt" || fail "tpsim $args: the report of $p processes differs from one process's"
    done
    ;;
  memorypart)
    tpsim=$driver
    # Layers whose weights (and the MLP's (tokens, F) intermediates) are most of their memory,
    # verified in parts: each process holds its part of them and of the reference, and process 0 no
    # longer every input and result whole. The largest process's peak against one process's, at most
    # (in hundredths): measured 0.31 on the MLP (the ranks' intermediates spread as well), 0.37-0.42,
    # 0.39-0.41 and 0.38-0.40 on the column, the row and the embedding, 0.47 on the grouped experts'
    # column (the activations stay whole; their processes' peaks vary with the timing, the most
    # under a loaded machine).
    # Process 0 holds about what the others hold, at most (in hundredths of the largest of the
    # others): the MLP within 2%; the others' processes vary by up to 20% among themselves (185 or
    # 195-204 MiB each for the experts, from run to run), and process 0 of the row peaked at 1.16
    # times the others beside other tests. Verifying whole, it held the inputs and every result
    # besides (the MLP: 1.16-1.22 times the largest of the others, the column 2.5).
    for case in "40|110|run --layer mlp --tp 4 --seq 1024 --batch 2 --in-features 512 --ffn-hidden 32768" \
                "50|125|run --layer column --tp 4 --seq 64 --batch 2 --in-features 2048 --out-features 16384" \
                "50|125|run --layer row --input-is-parallel --tp 4 --seq 64 --batch 2 --in-features 16384 \
                    --out-features 2048" \
                "50|125|run --layer embedding --tp 4 --vocab 65536 --out-features 512 --seq 64 --batch 2" \
                "55|125|run --layer grouped-column --tp 4 --tokens 64 --experts 8 --in-features 2048 \
                    --out-features 2048"; do
      hundredths=${case%%|*} rest=${case#*|}
      first_most=${rest%%|*} args=${rest#*|}
      peaks_against_one $args
      [ $((100 * most)) -le $((hundredths * one)) ] ||
        fail "tpsim $args: a process peaked at $most KiB, more than 0.$hundredths of one process's $one KiB"
      others=$(for r in $(seq 1 $((p - 1))); do cat "$tmp/spread.peak.$r"; done | sort -n | tail -1)
      first=$(cat "$tmp/spread.peak.0")
      [ $((100 * first)) -le $((first_most * others)) ] ||
        fail "tpsim $args: process 0 peaked at $first KiB, more than $first_most hundredths of the largest of the" \
             "others ($others KiB)"
    done
    ;;
  bench)
    tpsim=$driver
    set +e
    timeout -k 5 100 "$mpiexec" -n "$p" "$tpsim" bench --what mpi -b 16 -e 1K -n 3 >"$tmp/out" 2>"$tmp/err"
    rc=$?
    set -e
    show
    [ "$rc" -eq 0 ] || fail "mpiexec -n $p tpsim bench --what mpi: exit $rc"
    grep -q "^# Cross-process collectives on $p MPI processes" "$tmp/out" || fail "no table header for $p processes"
    # Every collective's section, then its 4 sizes (16, 64, 256, 1K): 10 columns each, the times and
    # bandwidths positive and finite, the ratio their quotient, no wrong element.
    awk -v want="allReduce allGather reduceScatter broadcast" '
      /^# [a-zA-Z]+ vs MPI_/ { sections = sections (sections ? " " : "") $2; rows[$2] = 0; cur = $2; next }
      /^#/ || NF == 0 { next }
      {
        if (NF != 10) { print "row with " NF " columns: " $0; bad = 1; next }
        rows[cur]++
        if ($1 != 16 * 4 ^ (rows[cur] - 1)) { print cur ": size " $1 " at row " rows[cur]; bad = 1 }
        for (i = 5; i <= 8; i++) if (!($i + 0 > 0) || $i ~ /nan|inf/) { print cur ": column " i " not positive: " $0; bad = 1 }
        ratio = $9; sub(/x$/, "", ratio); ratio += 0
        # The times are printed to 0.1 us, the ratio to 0.01.
        if (ratio < ($5 - 0.05) / ($7 + 0.05) - 0.005 || ratio > ($5 + 0.05) / ($7 - 0.05) + 0.005) {
          print cur ": ratio " $9 " is not " $5 " / " $7; bad = 1
        }
        if ($10 != 0) { print cur ": " $10 " wrong elements"; bad = 1 }
      }
      END {
        if (sections != want) { print "sections \"" sections "\", expected \"" want "\""; bad = 1 }
        for (s in rows) if (rows[s] != 4) { print s ": " rows[s] " rows, expected 4"; bad = 1 }
        exit bad
      }' "$tmp/out" || fail "tpsim bench --what mpi: the table is malformed"
    set +e
    "$tpsim" bench --what mpi >"$tmp/out" 2>"$tmp/err"
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || fail "tpsim bench --what mpi in one process: exit $rc, expected 2"
    grep -q "^tpsim bench: --what mpi: expected an MPI job of 2 or more processes.*got 1 process" "$tmp/err" ||
      fail "tpsim bench --what mpi in one process: $(cat "$tmp/err")"
    set +e
    timeout -k 5 100 "$mpiexec" -n "$p" "$tpsim" bench --what mpi -b 4 >"$tmp/out" 2>"$tmp/err"
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || fail "tpsim bench --what mpi -b 4: exit $rc, expected 2"
    grep -q "^tpsim bench: --min-bytes/--max-bytes: with --what mpi expected 4·processes ($((4 * p))) <= min <= max, got 4 and 64M" "$tmp/err" ||
      fail "tpsim bench --what mpi -b 4: $(cat "$tmp/err")"
    ;;
  gpulocal)
    spread local
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    [ "$(grep -c "^process [0-9]* of $p: local [0-9]* of $p$" "$tmp/out")" -eq "$p" ] || fail "expected $p local ranks of $p"
    diff <(sed -n 's/^process [0-9]* of [0-9]*: local \([0-9]*\) of .*/\1/p' "$tmp/out" | sort -n) <(seq 0 $((p - 1))) ||
      fail "the local ranks are not 0 .. $((p - 1)), once each"
    ;;
  gpuid)
    "$driver" id >"$tmp/one"
    grep -q "^id 0d141b" "$tmp/one" || fail "one process: not the made-up id: $(cat "$tmp/one")"
    spread id
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    [ "$(grep -cxF "$(cat "$tmp/one")" "$tmp/out")" -eq "$p" ] || fail "not every process got process 0's id"
    ;;
  gpusplit)
    "$driver" split "$p" >"$tmp/one"
    spread split "$p"
    [ "$rc" -eq 0 ] || fail "exit $rc, expected 0"
    # Three splits of which one leaves the last rank out: a line per member each, NOCOLOR (-1) once.
    [ "$(grep -c '^split ' "$tmp/one")" -eq $((3 * p)) ] || fail "one process recorded $(grep -c '^split ' "$tmp/one") split members"
    [ "$(grep -c "^split w rank $((p - 1)): color -1 key $((p - 1)) -> none" "$tmp/one")" -eq 1 ] || fail "no NOCOLOR member"
    # Keys p - r reverse the even ranks: rank 0 comes last of its ceil(p/2).
    even=$(((p + 1) / 2))
    grep -q "^split w rank 0: color 0 key $p -> w.0.0 rank $((even - 1)) of $even$" "$tmp/one" || fail "rank 0's parity place"
    diff <(grep '^split ' "$tmp/one" | sort) <(grep '^split ' "$tmp/out" | sort) ||
      fail "the splits of $p processes differ from one process's"
    order=" split(world) split(world) split(parity) barrier(world) barrier(parity)"
    [ "$(grep -cxF "order:$order" <(sed 's/^process [0-9]* //' "$tmp/out"))" -eq "$p" ] ||
      fail "not every process saw its collectives in issue order:$order"
    ;;
  gpufault)
    spread split "$p" "$5"
    [ "$rc" -eq 3 ] || fail "exit $rc, expected 3"
    grep "^process [0-9]*: exit 3: " "$tmp/err" | sed 's/^process [0-9]*: exit 3: //' | sort -u >"$tmp/causes"
    [ "$(grep -c "^process [0-9]*: exit 3: " "$tmp/err")" -eq "$p" ] || fail "not every process reported the failure"
    [ "$(wc -l <"$tmp/causes")" -eq 1 ] || fail "the processes reported different failures"
    grep -q "collective mismatch" "$tmp/causes" || fail "not the mismatch"
    ! grep -q "^process .* order:" "$tmp/out" || fail "a process finished its run"
    ;;
  gpufail)
    tpsim=$driver
    args=(run --layer column --tp $((2 * p)) --seq 8 --batch 2 --in-features 16 --out-features 32)
    spread "${args[@]}" --backend gpu
    [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
    n=$(grep -c "^tpsim run: --backend gpu: a GPU world in an MPI job runs one rank per process: expected a world of $p rank(s), one for each of the $p processes, got $((2 * p))" "$tmp/err" || true)
    [ "$n" -eq "$p" ] || fail "$n processes reported the placement error, expected $p"
    if "$tpsim" devices | grep -q '^gpu: usable'; then
      echo "a usable GPU: the refusal without one is not shown here"
    else
      args[4]=$p
      spread "${args[@]}" --backend gpu
      [ "$rc" -eq 2 ] || fail "exit $rc, expected 2"
      n=$(grep -c "^tpsim run: --backend gpu: cannot run here: no CUDA device" "$tmp/err" || true)
      [ "$n" -eq "$p" ] || fail "$n processes reported that there is no GPU, expected $p"
    fi
    ;;
  gpurun)
    tpsim=$driver
    why=$("$tpsim" devices | sed -n 's/^gpu: not usable: //p')
    if [ -n "$why" ]; then
      echo "SKIP: no usable GPU: $why"
      exit 77
    fi
    args=(run --layer column --tp 1 --bias --seq 16 --batch 2 --in-features 64 --out-features 128)
    "$tpsim" "${args[@]}" >"$tmp/one.txt" 2>&1 || fail "tpsim ${args[*]}: exit $?: $(cat "$tmp/one.txt")"
    timeout -k 5 100 "$mpiexec" -n 1 "$tpsim" "${args[@]}" --backend gpu >"$tmp/gpu.txt" 2>&1 ||
      { cat "$tmp/gpu.txt"; fail "mpiexec -n 1 tpsim ${args[*]} --backend gpu: exit $?"; }
    cat "$tmp/gpu.txt"
    grep -q "one GPU each" "$tmp/gpu.txt" || fail "the run did not take the one-process-per-GPU path"
    # Each result checked against the reference: the same rows with OK on both backends.
    diff <(grep -E ' (OK|FAIL|NON-FINITE)( |$)' "$tmp/one.txt" | awk '{print $1, $NF}') \
         <(grep -E ' (OK|FAIL|NON-FINITE)( |$)' "$tmp/gpu.txt" | awk '{print $1, $NF}') || fail "verdicts differ"
    ! grep -qE ' (FAIL|NON-FINITE)( |$)' "$tmp/gpu.txt" || fail "a result failed its check on the GPU"
    ;;
  *) fail "unknown mode $mode" ;;
esac
echo "OK ($mode, $p processes)"
