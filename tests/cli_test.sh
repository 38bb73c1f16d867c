#!/usr/bin/env bash
# The tpsim command line as outside harnesses drive it: exit codes (0 ok, 1 a result outside its
# bound, 2 bad flags, input files, sizes or paths, 3 the world failed), the --save/--load round trip
# (a replay reproduces every result bit for bit), and the errors for bad files and flags.
# usage: cli_test.sh path/to/tpsim
set -uo pipefail
tpsim="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
passed=0
check() {  # check NAME EXPECTED_EXIT EXPECTED_TEXT -- command...
  local name="$1" want="$2" text="$3"
  shift 4
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$want" ] || ! grep -qF -- "$text" <<<"$out"; then
    echo "FAIL $name: exit $rc (want $want), output lacks '$text':"
    echo "$out" | tail -n 20
    failures=$((failures + 1))
  else
    echo "ok   $name"
    passed=$((passed + 1))
  fi
}

check demo 0 "every output and gradient agrees with the unsharded MLP" -- "$tpsim" demo
check demo-bf16 0 "every output and gradient agrees" -- "$tpsim" demo --dtype bf16 --tp 2
for layer in column row embedding mlp grouped-column grouped-row; do
  check "run-$layer" 0 "sharded results agree" -- "$tpsim" run --layer "$layer" --tp 4
done
check run-options 0 "sharded results agree" -- "$tpsim" run --layer column --tp 2 --bias --gather-output \
  --dtype bf16 --output-dtype fp32 --grad-accumulation-fusion
check run-gtp 0 "sharded results agree" -- "$tpsim" run --layer row --tp 2 --gtp-remat 2 --bias --gtp-reduce sum \
  --batch 4
check run-gtp-fp32 0 "sharded results agree" -- "$tpsim" run --layer column --tp 1 --gtp-remat 4 --batch 4 \
  --fp32-accum-reduce-scatter --dtype bf16
check gtp-batch 2 "must be divisible by --gtp-remat" -- "$tpsim" run --layer column --gtp-remat 3
check run-mxfp8 0 "sharded results agree" -- "$tpsim" run --layer mlp --tp 2 --gtp-remat 2 --batch 4 \
  --pad-for-alignment 32 --weight-format mxfp8 --dtype bf16
check mxfp8-pad 2 "--pad-for-alignment: expected a positive multiple of 32 for --weight-format mxfp8" -- \
  "$tpsim" run --layer column --gtp-remat 2 --weight-format mxfp8
check mxfp8-embedding 2 "--weight-format mxfp8: applies to --layer column, row or mlp" -- \
  "$tpsim" run --layer embedding --weight-format mxfp8
# A size flag the kind has no size for would be ignored unsaid.
check size-flag-unused 2 "--vocab: applies to --layer embedding, got --layer column" -- \
  "$tpsim" run --layer column --vocab 100
check size-flag-unused-layout 2 "--experts: applies to --layer grouped-column or grouped-row, got --layer mlp" -- \
  "$tpsim" layout --layer mlp --experts 2
check run-rs-embeddings 0 "sharded results agree" -- "$tpsim" run --layer embedding --tp 2 --reduce-scatter-embeddings
# Each rank's partial input gradient, stacked (T, s, b, K), checked against the partial products.
check run-disable-grad-reduce 0 "(4, 8, 2, 16)" -- "$tpsim" run --layer column --tp 4 --bias --disable-grad-reduce
check disable-grad-reduce-sp 2 "--disable-grad-reduce: not with --sequence-parallel" -- \
  "$tpsim" run --layer column --tp 2 --sequence-parallel --disable-grad-reduce
check run-help 0 "--disable-grad-reduce" -- "$tpsim" run --help

# tpsim layout: the blocks each rank holds, drawn as text and as an SVG page whose panels the XML
# checker finds tiled exactly once per copy.
check layout-text 0 "r3 (t=1, g=1) (16, 16): pad rows [0, 16) of its 16; gtp_local_pad_zero_count 256" -- \
  "$tpsim" layout --layer column --tp 2 --gtp-remat 2 --bias
check layout-pad-marks 0 "0-0000000000000000" -- "$tpsim" layout --layer column --tp 2 --gtp-remat 2
check layout-hatch 0 "/0/0/0/0/0/0/0/0" -- "$tpsim" layout --layer column --tp 2 --gtp-remat 2
check layout-duplicates 0 "r2 (t=0, g=1) (8,): [0, 8); gtp_local_pad_zero_count 0; duplicate filters: skipped" -- \
  "$tpsim" layout --layer column --tp 2 --gtp-remat 2 --bias
check layout-partial 0 "fc2.output.partial (8, 2, 16) output: TP: partial sums, reduce-scatter over TP" -- \
  "$tpsim" layout --layer mlp --tp 2 --sequence-parallel
if grep -qF $'\033[' <<<"$("$tpsim" layout --layer row --tp 2)"; then
  echo "FAIL layout-plain: ANSI colour written to a pipe"; failures=$((failures + 1))
fi
# On a terminal (script(1) gives it one, where the system has pseudo-terminals) the grid is
# coloured, unless NO_COLOR is set.
if ! command -v script >/dev/null || ! script -qc true /dev/null >/dev/null 2>&1; then
  echo "skip layout-colour, layout-no-colour: script(1) cannot open a pseudo-terminal here"
else
  if ! grep -qF $'\033[30;48;5;' <<<"$(script -qc "'$tpsim' layout --layer row --tp 2" /dev/null)"; then
    echo "FAIL layout-colour: no ANSI colour on a terminal"; failures=$((failures + 1))
  fi
  if grep -qF $'\033[' <<<"$(script -qc "NO_COLOR=1 '$tpsim' layout --layer row --tp 2" /dev/null)"; then
    echo "FAIL layout-no-colour: ANSI colour with NO_COLOR set"; failures=$((failures + 1))
  fi
fi
# A run's progress on a terminal (script(1) gives stderr one; stdout goes to /dev/null): the phase
# line, then each phase's time; none with --quiet, before TPSIM_PROGRESS_AFTER_MS (2 s), or where
# stderr is not a terminal; a failed run's error on a clean line with no times above it.
fail_progress() { echo "FAIL $1:"; cat -v <<<"$2" | tail -n 5; failures=$((failures + 1)); }
if ! command -v script >/dev/null || ! script -qc true /dev/null >/dev/null 2>&1; then
  echo "skip progress-*: script(1) cannot open a pseudo-terminal here"
else
  shown=$(script -qec "TPSIM_PROGRESS_AFTER_MS=0 '$tpsim' run --layer mlp --tp 4 --sequence-parallel --save '$work/progress' >/dev/null" /dev/null)
  phases='tpsim run: [0-9.]+ s: generate [0-9.]+ s, forward [0-9.]+ s, backward [0-9.]+ s, assemble [0-9.]+ s, verify [0-9.]+ s, save [0-9.]+ s'
  if ! grep -qF $'\r\033[Ktpsim run: ' <<<"$shown" || ! grep -qE "$phases" <<<"$shown"; then
    fail_progress progress-terminal "$shown"
  else
    echo "ok   progress-terminal"; passed=$((passed + 1))
  fi
  for args in "TPSIM_PROGRESS_AFTER_MS=0 '$tpsim' run --layer row --tp 2 --quiet" "'$tpsim' run --layer row --tp 2"; do
    shown=$(script -qec "$args >/dev/null" /dev/null)
    if [ -n "$shown" ]; then fail_progress "progress-silent ($args)" "$shown"; else echo "ok   progress-silent"; passed=$((passed + 1)); fi
  done
  shown=$(script -qec "TPSIM_PROGRESS_AFTER_MS=0 '$tpsim' run --layer mlp --tp 2 --sequence-parallel --inject 1:1:op >/dev/null" /dev/null)
  if grep -qE 'tpsim run: [0-9.]+ s:' <<<"$shown" || ! grep -qF $'\r\033[Ktpsim run: the simulated world failed' <<<"$shown"; then
    fail_progress progress-failed "$shown"
  else
    echo "ok   progress-failed"; passed=$((passed + 1))
  fi
fi
check progress-not-terminal 0 "" -- bash -c "TPSIM_PROGRESS_AFTER_MS=0 '$tpsim' run --layer row --tp 2 2>&1 >/dev/null | grep -c . && exit 1; exit 0"
check progress-delay-bad 2 "TPSIM_PROGRESS_AFTER_MS: expected whole milliseconds from 0 to 999999999, got '2s'" -- \
  env TPSIM_PROGRESS_AFTER_MS=2s "$tpsim" run --layer row
check layout-svg 0 "wrote $work/col.svg" -- "$tpsim" layout --layer column --tp 2 --gtp-remat 2 --bias --svg "$work/col.svg"
check layout-svg-tiles 0 "panels tile exactly" -- /usr/bin/python3 "$(dirname "$0")/layout_svg_check.py" "$work/col.svg" \
  weight bias output input.grad.partial weight.grad
for args in "--layer mlp --tp 4 --gtp-remat 2 --sequence-parallel" "--layer row --tp 4 --stride 2 --input-is-parallel --bias" \
  "--layer embedding --tp 2 --gtp-remat 2 --reduce-scatter-embeddings --vocab 40" \
  "--layer column --tp 4 --gtp-remat 2 --stride 2 --out-features 4096 --in-features 1000 --pad-for-alignment 64" \
  "--layer grouped-column --tp 2 --gtp-remat 2 --experts 3 --bias" "--layer grouped-row --tp 4 --experts 2 --tokens 8"; do
  # shellcheck disable=SC2086
  "$tpsim" layout $args --svg "$work/l.svg" >/dev/null 2>&1
  check "layout-svg-tiles $args" 0 "panels tile exactly" -- /usr/bin/python3 "$(dirname "$0")/layout_svg_check.py" "$work/l.svg"
done
# The experts: a --save/--load replay, token ids out of range named by file, a checkpoint loaded at
# another topology and mode, and one of another expert count refused before the run.
check grouped-save 0 "saved to $work/g" -- "$tpsim" run --layer grouped-row --tp 2 --gtp-remat 2 --experts 3 --bias \
  --save "$work/g" --save-checkpoint "$work/g-ck"
check grouped-load 0 "sharded results agree" -- "$tpsim" run --layer grouped-row --tp 4 --experts 3 --bias --load "$work/g"
/usr/bin/python3 - "$work/g/expert_ids.npy" <<'PY'
import sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
data[-8:] = (7).to_bytes(8, "little", signed=True)  # the last token's expert: 7 of 3
open(path, "wb").write(bytes(data))
PY
check grouped-bad-id 2 "expert_ids.npy holds id 7 at flat position 15, outside [0, E=3)" -- \
  "$tpsim" run --layer grouped-row --tp 2 --experts 3 --bias --load "$work/g"
check grouped-ckpt 0 "parameters from checkpoint $work/g-ck" -- "$tpsim" run --layer grouped-column --tp 4 --experts 3 \
  --bias --load-checkpoint "$work/g-ck"
check grouped-many-experts 2 "--experts: expected 1..4096 (one weight file and one GEMM per expert), got 99999999999" -- \
  "$tpsim" run --layer grouped-column --experts 99999999999
check grouped-no-experts 2 "--experts: expected >= 1, got 0" -- "$tpsim" layout --layer grouped-row --experts 0
check grouped-ckpt-experts 2 "key 'weight' in $work/g-ck: expected 2 entries along its leading axis" -- \
  "$tpsim" run --layer grouped-column --experts 2 --bias --load-checkpoint "$work/g-ck"
check layout-no-layer 2 "--layer is required" -- "$tpsim" layout --tp 2
check layout-bad-layer 2 "--layer: expected column, row, embedding, mlp, grouped-column or grouped-row, got 'conv'" -- \
  "$tpsim" layout --layer conv
check layout-bad-flag 2 "unrecognised option '--frob'" -- "$tpsim" layout --layer column --frob
check layout-bad-tp 2 "--tp: expected 1..64, got 0" -- "$tpsim" layout --layer column --tp 0
# Past 36 ranks or 26 sets of copies a cell takes two characters, so that no two share a code.
"$tpsim" layout --layer column --tp 2 --gtp-remat 32 --batch 32 >"$work/wide.txt" 2>&1
check layout-wide-legend 0 "every code stands for one rank or set" -- /usr/bin/python3 - "$work/wide.txt" <<'PY'
import re, sys
section = open(sys.argv[1]).read().split("\n\n")[1]  # the input: replicated over TP, 32 GTP_remat blocks
sets = re.findall(r"^  ([A-Z]+) = the same elements on (.*)$", section, re.M)
rows = [l for l in section.splitlines() if re.match(r"^ *[0-9]*[-|]", l)]
codes = [code for code, _ in sets]
if len(sets) < 27 or len(set(codes)) != len(codes) or len(set(w for _, w in sets)) != len(sets):
    sys.exit("a code stands for two sets: %s" % sets)
if any("*" in r or "?" in r for r in rows):
    sys.exit("a cell has no code of its own")
print("every code stands for one rank or set")
PY
# --threads is bounded, and threads the system refuses are an error (exit 2), never std::terminate.
for cmd in "run --layer column" demo "bench -W latency --ranks 2"; do
  # shellcheck disable=SC2086
  check "threads-bound $cmd" 2 "--threads: expected 0..1024 (0 = every core), got 100000" -- "$tpsim" $cmd --threads 100000
done
if grep -qa __asan_init "$tpsim"; then
  echo "skip threads-refused: ASan's shadow memory does not start under ulimit -v"
else
  check threads-refused 2 "; ask for fewer" -- bash -c "ulimit -v 600000; exec \"\$0\" bench -W latency --ranks 1024 --iters 10" "$tpsim"
fi
check bench-empty-mlp 2 "--mlp-tp: expected TP sizes in 1..64 that divide --tokens and --ffn, got 3" -- \
  "$tpsim" bench -W mlp --mlp-tp 3
check layout-indivisible 2 "--out-features = 10 must be divisible by --tp x --stride = 4" -- \
  "$tpsim" layout --layer column --tp 4 --out-features 10
check layout-svg-dir 2 "--svg: " -- "$tpsim" layout --layer column --svg "$work/no/such/dir/x.svg"
check layout-svg-empty 2 "--svg: expected a file name" -- "$tpsim" layout --layer column --svg ""
mkdir -p "$work/svgdir"
check layout-svg-is-dir 2 "--svg: expected $work/svgdir to be absent or a regular file" -- \
  "$tpsim" layout --layer column --svg "$work/svgdir"
echo keep >"$work/svg-outside"
ln -s "$work/svg-outside" "$work/svg-link"
check layout-svg-symlink 0 "wrote $work/svg-link" -- "$tpsim" layout --layer row --svg "$work/svg-link"
if [ "$(cat "$work/svg-outside")" != keep ] || [ -L "$work/svg-link" ]; then
  echo "FAIL layout-svg-symlink: the SVG was written through the symlink"; failures=$((failures + 1))
fi
check layout-help 0 "--svg" -- "$tpsim" layout --help

# Save generated inputs and results, replay from the files: identical results, byte for byte.
check save 0 "saved to $work/a" -- "$tpsim" run --layer mlp --tp 4 --sequence-parallel --dtype bf16 --save "$work/a"
check load 0 "sharded results agree" -- "$tpsim" run --layer mlp --tp 2 --sequence-parallel --dtype bf16 \
  --load "$work/a" --save "$work/b"
for f in output input.grad fc1.weight.grad fc1.bias.grad fc2.weight.grad fc2.bias.grad; do
  [ -f "$work/a/$f.npy" ] || { echo "FAIL save: $f.npy not written"; failures=$((failures + 1)); }
done
# A different TP size sums in a different order; the same TP size must replay exactly.
check load-same-tp 0 "sharded results agree" -- "$tpsim" run --layer mlp --tp 4 --sequence-parallel --dtype bf16 \
  --load "$work/a" --save "$work/c"
for f in output input.grad fc1.weight.grad fc2.weight.grad; do
  cmp -s "$work/a/$f.npy" "$work/c/$f.npy" || { echo "FAIL replay: $f.npy differs"; failures=$((failures + 1)); }
done
# The files size the run: a size flag given beside them must agree, or it would be overruled unsaid.
check load-size-flag 2 "--ffn-hidden: expected 64 (as the ffn hidden size F (fc1.weight.npy dim 0) gives it)" -- \
  "$tpsim" run --layer mlp --tp 2 --sequence-parallel --dtype bf16 --load "$work/a" --ffn-hidden 128
check load-size-flag-seq 2 "--seq: expected 8 (as the sequence length s (input.npy dim 0) gives it) or no --seq" -- \
  "$tpsim" run --layer mlp --tp 2 --sequence-parallel --dtype bf16 --load "$work/a" --seq 16
check load-size-flag-agrees 0 "sharded results agree" -- \
  "$tpsim" run --layer mlp --tp 2 --sequence-parallel --dtype bf16 --load "$work/a" --ffn-hidden 64 --seq 8

# Bad files and flags.
mkdir -p "$work/bad"
cp "$work/a/"*.npy "$work/bad/"
rm "$work/bad/fc2.bias.npy"
check missing-file 2 "fc2.bias.npy is missing" -- "$tpsim" run --layer mlp --tp 2 --load "$work/bad"
printf 'not a numpy file' >"$work/bad/fc2.bias.npy"
check corrupt-file 2 "expected the .npy magic string" -- "$tpsim" run --layer mlp --tp 2 --load "$work/bad"
check wrong-shape 2 "must be divisible by --tp" -- "$tpsim" run --layer mlp --tp 3 --load "$work/a"
check bad-flag 2 "unrecognised option '--frob'" -- "$tpsim" run --layer column --frob
check no-layer 2 "--layer is required" -- "$tpsim" run --tp 2
check bad-backend 2 "--backend: expected sim or gpu, got 'tpu'" -- "$tpsim" run --layer row --backend tpu
# Without a usable GPU (not built, no driver, no device) --backend gpu is refused with the reason.
if ! "$tpsim" run --layer row --backend gpu >/dev/null 2>&1; then
  check gpu-unusable 2 "--backend gpu: cannot run here: " -- "$tpsim" run --layer row --backend gpu
  check gpu-unusable-demo 2 "--backend gpu: cannot run here: " -- "$tpsim" demo --backend gpu
  check gpu-unusable-bench 2 "--backend gpu: cannot run here: " -- "$tpsim" bench --backend gpu
fi
# One process (no launcher): nothing to cross.
check bench-mpi-one-process 2 "--what mpi: expected an MPI job of 2 or more processes (mpirun -np 2 tpsim bench --what mpi, in a build with MPI), got 1 process" -- \
  "$tpsim" bench --what mpi
check bench-bad-backend 2 "--backend: expected sim or gpu, got 'tpu'" -- "$tpsim" bench --backend tpu
check bench-size-overflow 2 "--min-bytes: expected a size like 128, 64K, 16M or 1G (at most 2^63 - 1 bytes)" -- \
  "$tpsim" bench --min-bytes 4611686018427387904k
check bench-empty-range 2 "--ranks: expected positive integers like 1,2,4 or 2..64 (a range from low to high)" -- \
  "$tpsim" bench --ranks 64..2
check bench-gpu-empty-range 2 "--fabric-ranks: expected positive integers" -- "$tpsim" bench --backend gpu -R 8..2
check bench-gpu-what 2 "--what: with --backend gpu expected layers, fabric or all, got 'latency'" -- \
  "$tpsim" bench --backend gpu -W latency
check bench-gpu-tp 2 "--mlp-tp: every TP size must be <= 64 and divide --tokens and --ffn" -- \
  "$tpsim" bench --backend gpu --mlp-tp 3
check conflicting 2 "--sequence-parallel: needs --tp > 1" -- "$tpsim" run --layer column --tp 1 --sequence-parallel

# --verify: exact holds on small-integer data, where every step is exact; generated data misses it.
# int_npy FILE SHAPE VALUES...: a float32 .npy of integers in [-2, 2].
int_npy() {
  local file="$1" shape="$2" header v
  shift 2
  header="{'descr': '<f4', 'fortran_order': False, 'shape': ($shape), }"
  while [ $(((10 + ${#header} + 1) % 64)) -ne 0 ]; do header+=" "; done
  {
    printf '\x93NUMPY\x01\x00'
    printf "\\x$(printf %02x $(((${#header} + 1) % 256)))\\x$(printf %02x $(((${#header} + 1) / 256)))"
    printf '%s\n' "$header"
    for v in "$@"; do
      case "$v" in
        -2) printf '\x00\x00\x00\xc0' ;; -1) printf '\x00\x00\x80\xbf' ;; 0) printf '\x00\x00\x00\x00' ;;
        1) printf '\x00\x00\x80\x3f' ;; 2) printf '\x00\x00\x00\x40' ;;
      esac
    done
  } >"$file"
}
ints() { for ((i = 0; i < $1; i++)); do echo $(((i * 7 + $2) % 5 - 2)); done; }  # COUNT SEED
mkdir -p "$work/ints"
int_npy "$work/ints/input.npy" "8, 2, 16" $(ints 256 1)
int_npy "$work/ints/weight.npy" "32, 16" $(ints 512 2)
int_npy "$work/ints/bias.npy" "32," $(ints 32 3)
int_npy "$work/ints/grad_output.npy" "8, 2, 32" $(ints 512 4)
check verify-exact 0 "sharded results equal the unsharded computation" -- "$tpsim" run --layer column --tp 4 \
  --sequence-parallel --bias --load "$work/ints" --verify exact
check verify-exact-real 1 "MISMATCH" -- "$tpsim" run --layer mlp --tp 4 --verify exact
check verify-none 0 "verification skipped (--verify none)" -- "$tpsim" run --layer mlp --tp 2 --verify none \
  --save "$work/none"
[ -f "$work/none/output.npy" ] || { echo "FAIL verify-none: output.npy not saved"; failures=$((failures + 1)); }
check verify-bad 2 "--verify: expected bound, exact or none, got 'often'" -- "$tpsim" run --layer row --verify often

# --version: what a bug report or a benchmark figure needs to know about the binary.
check version 0 "isa: " -- "$tpsim" --version
check version-gpu 0 "gpu backend: " -- "$tpsim" --version

# Exit codes: only a result outside its bound exits 1; input, configuration and I/O errors exit 2.
check help-exit-codes 0 "3  the simulated world failed" -- "$tpsim" --help
check run-help-exit-codes 0 "2  bad input" -- "$tpsim" run --help
ln -s "$work/loop" "$work/loop"
check load-symlink-loop 2 "tpsim run: '$work/loop': expected a usable path, got 'Too many levels of symbolic links'" -- \
  "$tpsim" run --layer column --load "$work/loop"
touch "$work/plain"
check save-unusable 2 "'$work/plain/out'" -- "$tpsim" run --layer column --save "$work/plain/out"
# Memory: a run estimated above the memory available, or --max-memory, is refused before anything
# is allocated (so at once); an allocation that fails anyway is an error naming the size flags.
check memory-estimate 2 "expected a run that fits in memory, got an estimated peak of" -- \
  timeout 10 "$tpsim" run --layer column --seq 4000000000 --batch 2
check max-memory 2 "more than --max-memory 1.0 MiB" -- "$tpsim" run --layer mlp --max-memory 1M
check max-memory-bad 2 "--max-memory: expected a size like 128, 64K, 16M or 1G" -- \
  "$tpsim" run --layer mlp --max-memory 12Q
check max-memory-zero 2 "--max-memory: expected a positive size" -- "$tpsim" run --layer mlp --max-memory 0
check max-memory-fits 0 "sharded results agree" -- "$tpsim" run --layer mlp --max-memory 512M
# ASan reserves terabytes of address space, which a limit on it would refuse.
# The limit is what the binary needs to start (a GPU build maps the CUDA libraries) plus 300 MB,
# far less than the run needs, though the memory estimate (against MemAvailable) lets it start.
if ! grep -qa __asan_init "$tpsim"; then
  start_kib=200000
  while [ "$start_kib" -lt 6400000 ] && ! bash -c 'ulimit -v "$1" && exec "$2" --version' _ "$start_kib" "$tpsim" \
      >/dev/null 2>&1; do
    start_kib=$((start_kib * 2))
  done
  check out-of-memory 2 "out of memory: the run needs more than this machine has; its size comes from --seq" -- \
    bash -c 'ulimit -v "$1" && exec "$2" run --layer column --seq 1000000 --batch 1' _ $((start_kib + 300000)) "$tpsim"
  # The same for a bench rank's buffers (512 MiB, within what the machine has, beyond the limit).
  check bench-out-of-memory 2 "out of memory: the benchmark needs more than this machine has; its sizes come from --ranks, --bw-ranks, --max-bytes" -- \
    bash -c 'ulimit -v "$1" && exec "$2" bench -W bandwidth -p 1 -b 256M -e 256M --bw-iters 1' _ $((start_kib + 300000)) "$tpsim"
fi
check gtp-split 2 "weight's TP-local rows, --out-features / --tp = 2 must be divisible by --gtp-remat (with --pad-for-alignment 0) = 4" \
  -- "$tpsim" run --layer column --tp 1 --gtp-remat 4 --batch 4 --out-features 2 --pad-for-alignment 0
# The tools' own messages start with "tpsim run: "; main does not repeat it.
check no-double-prefix 2 "tpsim run: the ffn hidden size F" -- "$tpsim" run --layer mlp --tp 3 --load "$work/a"
if grep -qF "tpsim run: tpsim run:" <<<"$("$tpsim" run --layer mlp --tp 3 --load "$work/a" 2>&1)"; then
  echo "FAIL no-double-prefix: 'tpsim run: tpsim run:'"
  failures=$((failures + 1))
fi

# A size is named by where it comes from: its flag, the --load file or the checkpoint's key; the
# demo checks its flags before it prints anything.
check size-from-flag 2 "tpsim run: --in-features = 16 must be divisible by --tp x --stride = 3" -- \
  "$tpsim" run --layer row --tp 3
"$tpsim" run --layer row --tp 2 --save "$work/row-files" --save-checkpoint "$work/row-ck" >/dev/null
check size-from-file 2 "tpsim run: K (weight.npy dim 1) = 16 must be divisible by --tp x --stride = 3" -- \
  "$tpsim" run --layer row --tp 3 --load "$work/row-files"
check size-from-checkpoint 2 "K (checkpoint $work/row-ck: key 'weight' dim 1) = 16 must be divisible by --tp x --stride = 3" \
  -- "$tpsim" run --layer row --tp 3 --load-checkpoint "$work/row-ck"
check size-from-checkpoint-with-files 2 "K (checkpoint $work/row-ck: key 'weight' dim 1) = 16 must be divisible" -- \
  "$tpsim" run --layer row --tp 3 --load "$work/row-files" --load-checkpoint "$work/row-ck"
check size-from-flag-grouped 2 "tpsim run: --out-features = 16 must be divisible by --tp = 3" -- \
  "$tpsim" run --layer grouped-column --tp 3 --experts 4
check size-from-flag-demo 2 "tpsim demo: --seq = 8 must be divisible by --tp = 3" -- "$tpsim" demo --tp 3
if "$tpsim" demo --tp 3 2>/dev/null | grep -q .; then
  echo "FAIL size-from-flag-demo: the demo printed before refusing its flags"
  failures=$((failures + 1))
fi

# Flags mean what they say: a stray word is not silently dropped, a seed is not wrapped, an empty
# path is not "no path".
check bias-false 2 "got the stray argument 'false'" -- "$tpsim" run --layer column --bias false
check stray-demo 2 "tpsim demo: expected only options" -- "$tpsim" demo extra
check stray-bench 2 "got the stray argument 'extra'" -- "$tpsim" bench extra
check negative-seed 2 "--seed: expected an integer in 0..2^64-1, got '-1'" -- "$tpsim" run --layer column --seed -1
check negative-seed-demo 2 "--seed: expected an integer in 0..2^64-1, got '-5'" -- "$tpsim" demo --seed -5
check empty-load 2 "--load: expected a directory, got an empty path" -- "$tpsim" run --layer column --load ""
check empty-save 2 "--save: expected a directory, got an empty path" -- "$tpsim" run --layer column --save ""

# Zero and overflowing sizes: a clear error naming the file or the flags, not SIGFPE or SIGSEGV.
empty_npy() {  # empty_npy FILE SHAPE: a float32 .npy with no elements, SHAPE a Python tuple
  local dict="{'descr': '<f4', 'fortran_order': False, 'shape': $2, }"
  local len=$(((${#dict} + 11 + 63) / 64 * 64 - 10))
  printf '\x93NUMPY\x01\x00\x'"$(printf %02x $((len % 256)))"'\x'"$(printf %02x $((len / 256)))"'%-*s\n' \
    $((len - 1)) "$dict" >"$1"
}
"$tpsim" run --layer column --save "$work/col" >/dev/null
mkdir -p "$work/zero"
cp "$work/col/input.npy" "$work/col/grad_output.npy" "$work/zero/"
empty_npy "$work/zero/weight.npy" "(0, 16)"
check zero-rows 2 "tpsim run: weight.npy: expected every dim >= 1, got shape (0, 16)" -- \
  "$tpsim" run --layer column --load "$work/zero"
# Shapes consistent with N = 0 (the dense reference divided by it).
empty_npy "$work/zero/grad_output.npy" "(8, 2, 0)"
check zero-output 2 "grad_output.npy: expected every dim >= 1, got shape (8, 2, 0)" -- \
  "$tpsim" run --layer column --load "$work/zero"
"$tpsim" run --layer embedding --save "$work/emb" >/dev/null
mkdir -p "$work/zero-vocab"
cp "$work/emb/"*.npy "$work/zero-vocab/"
empty_npy "$work/zero-vocab/weight.npy" "(0, 16)"
check zero-vocab 2 "tpsim run: weight.npy: expected every dim >= 1, got shape (0, 16)" -- \
  "$tpsim" run --layer embedding --load "$work/zero-vocab"
check seq-overflow 2 "--seq x --batch x --in-features: expected sizes whose product fits in 64 bits" -- \
  "$tpsim" run --layer column --seq 4611686018427387904 --batch 4
check gtp-overflow 2 "--gtp-remat: expected G >= 1 with --tp x --gtp-remat <= 64, got 1073741824 with --tp 4" -- \
  "$tpsim" run --layer column --tp 4 --gtp-remat 1073741824

# No hang: --load reads regular files only (opening a FIFO waits for a writer), and --stride
# cannot exceed the rows it splits.
mkdir -p "$work/fifo" "$work/fifo-link"
cp "$work/col/"*.npy "$work/fifo/"
cp "$work/col/"*.npy "$work/fifo-link/"
rm "$work/fifo/input.npy" "$work/fifo-link/input.npy"
mkfifo "$work/fifo/input.npy"
ln -s "$work/fifo/input.npy" "$work/fifo-link/input.npy"
check load-fifo 2 "input.npy': expected a regular file, got a FIFO" -- \
  timeout 20 "$tpsim" run --layer column --load "$work/fifo"
check load-link-to-fifo 2 "input.npy': expected a regular file, got a FIFO" -- \
  timeout 20 "$tpsim" run --layer column --load "$work/fifo-link"
check load-link-to-device 2 "weight.npy': expected a regular file, got a device or other special file" -- \
  bash -c 'cp -r "$1/col" "$1/dev" && ln -sf /dev/null "$1/dev/weight.npy" && exec "$2" run --layer column --load "$1/dev"' \
  _ "$work" "$tpsim"
# A weight of 0 rows divides by any --stride: it used to run for minutes.
check stride-zero-rows 2 "expected every dim >= 1" -- \
  timeout 20 "$tpsim" run --layer column --stride 100000000 --load "$work/zero"
# layout and bench: too large a size is exit 2 naming their own flags, not a failed world.
check layout-overflow 2 "--out-features x --in-features: expected sizes whose product fits in 64 bits" -- \
  "$tpsim" layout --layer column --out-features 4611686018427387904
if ! grep -qa __asan_init "$tpsim"; then  # ASan reports an allocation this large itself
  check layout-out-of-memory 2 "out of memory: the layout's layers need more than this machine has" -- \
    "$tpsim" layout --layer column --tp 2 --out-features 20000000000 --in-features 100
fi
# The estimate counts GTP_remat's pad rows, which every rank holds, gathers and reduces: 1.1 GiB for
# a run that peaks at 840 MiB (with the gpu backend's 1.75 MiB more as well); without them, 9.7 MiB.
check estimate-pad-rows 2 "got an estimated peak of 1.1 GiB for --layer column --tp 2 --gtp-remat 2" -- \
  "$tpsim" run --layer column --gtp-remat 2 --pad-for-alignment 524288 --max-memory 256M
check stride-too-large 2 "--out-features = 16 must be divisible by --tp x --stride = 200000000" -- \
  "$tpsim" run --layer column --stride 100000000

# --save: checked before the run, all outputs or none, symlinks at output names replaced, not followed.
check save-is-file 2 "--save: expected a directory or a path where one can be created, got '$work/plain'" -- \
  "$tpsim" run --layer column --save "$work/plain"
if grep -qF "collectives" <<<"$("$tpsim" run --layer column --save "$work/plain" 2>&1)"; then
  echo "FAIL save-is-file: the run started"
  failures=$((failures + 1))
fi
mkdir -p "$work/blocked/output.npy"
check save-none 2 "--save: expected $work/blocked/output.npy to be absent or a regular file" -- \
  "$tpsim" run --layer column --save "$work/blocked"
if [ "$(ls -A "$work/blocked")" != "output.npy" ]; then
  echo "FAIL save-none: a failed --save left $(ls -A "$work/blocked")"
  failures=$((failures + 1))
fi
mkdir -p "$work/linked"
echo keep >"$work/outside"
ln -s "$work/outside" "$work/linked/output.npy"
check save-symlink 0 "saved to $work/linked" -- "$tpsim" run --layer column --save "$work/linked"
if [ "$(cat "$work/outside")" != keep ] || [ -L "$work/linked/output.npy" ] || [ -n "$(ls -A "$work/linked" | grep partial)" ]; then
  echo "FAIL save-symlink: wrote through the symlink, kept it, or left a temporary file"
  failures=$((failures + 1))
fi

# NaN and Inf: refused in the inputs, reported with their count and place in the results.
npy() {  # npy FILE SHAPE BYTES: a float32 .npy, BYTES its data as printf escapes
  local dict="{'descr': '<f4', 'fortran_order': False, 'shape': $2, }"
  local len=$(((${#dict} + 11 + 63) / 64 * 64 - 10))
  printf '\x93NUMPY\x01\x00\x'"$(printf %02x $((len % 256)))"'\x'"$(printf %02x $((len / 256)))"'%-*s\n'"$3" \
    $((len - 1)) "$dict" >"$1"
}
one='\x00\x00\x80\x3f' big='\xe6\xb1\x61\x7f' nan='\x00\x00\xc0\x7f'  # 1, 3e38, NaN
mkdir -p "$work/nan" "$work/inf"
npy "$work/nan/input.npy" "(1, 1, 2)" "$one$nan"
npy "$work/nan/weight.npy" "(2, 2)" "$one$one$one$one"
npy "$work/nan/grad_output.npy" "(1, 1, 2)" "$one$one"
check nan-input 2 "tpsim run: input.npy: expected finite values, got 1 NaN or Inf, the first at flat index 1" -- \
  "$tpsim" run --layer column --tp 1 --load "$work/nan"
# A refused run leaves nothing behind: --save's directory is made once the inputs are checked.
check nan-input-save 2 "tpsim run: input.npy: expected finite values" -- \
  "$tpsim" run --layer column --tp 1 --load "$work/nan" --save "$work/nan-saved" --save-checkpoint "$work/nan-ck"
if [ -e "$work/nan-saved" ] || [ -e "$work/nan-ck" ]; then
  echo "FAIL nan-input-save: the refused run made its --save or --save-checkpoint directory"
  failures=$((failures + 1))
fi
npy "$work/inf/input.npy" "(1, 1, 2)" "$big$big"
npy "$work/inf/weight.npy" "(2, 2)" "$big$big$big$big"
npy "$work/inf/grad_output.npy" "(1, 1, 2)" "$one$one"
check inf-result 1 "output: 2 NaN or Inf values, the first at flat index 0" -- \
  "$tpsim" run --layer column --tp 1 --load "$work/inf"
check inf-result-column 1 "NON-FINITE" -- "$tpsim" run --layer column --tp 1 --load "$work/inf"

# Injected faults: every rank's diagnostic and exit 3, within 1 s for all but a stall, which
# --timeout ends.
within() {  # within NAME MILLISECONDS -- command...: check ... that also ends in time once started
  local name="$1" limit="$2" start elapsed startup
  shift 3
  # Process start-up (loading the libraries) is not the fault's to pay: measured by --version, the
  # cheapest run of the same binary, right before; a loaded machine slows both alike.
  start=$(date +%s%N)
  "$tpsim" --version >/dev/null
  startup=$((($(date +%s%N) - start) / 1000000))
  start=$(date +%s%N)
  check "$name" "$@"
  elapsed=$((($(date +%s%N) - start) / 1000000 - startup))
  if [ "$elapsed" -ge "$limit" ]; then
    echo "FAIL $name: took $elapsed ms after a start-up of $startup ms, expected < $limit ms"
    failures=$((failures + 1))
  fi
}
within inject-skip 1000 -- 3 "rank 1 1:3:skip: its collective 3, allGather(fp32 x256 -> x512) on gtp_remat[1,5]" \
  -- "$tpsim" demo --inject 1:3:skip
within inject-op 1000 -- 3 "rank 1 issued allReduce(sum, fp32 x256)" -- "$tpsim" demo --inject 1:3:op
within inject-count 1000 -- 3 "rank 1 issued allGather(fp32 x257 -> x514)" -- "$tpsim" demo --inject 1:3:count
within inject-dtype 1000 -- 3 "rank 1 issued allGather(bf16 x256 -> x512)" -- "$tpsim" demo --inject 1:3:dtype
within inject-group 1000 -- 3 "rank 1 has not issued it: it waits on allGather(fp32 x256 -> x512) on world[0-7]" \
  -- "$tpsim" demo --inject 1:3:group
# Repeatable: the second fault would come later; the first one fails the world.
within inject-throw 1000 -- 3 "rank 1 failed: injected fault: rank 1 throws at its collective 3" \
  -- "$tpsim" run --layer mlp --tp 4 --gtp-remat 2 --batch 4 --inject 1:3:throw --inject 2:9:skip
# Either clock may run out first: rank 0's wait, or rank 1's stall; both name the collective held back.
within inject-stall 3000 -- 3 "before issuing its collective 1" \
  -- "$tpsim" run --layer row --tp 2 --inject 1:1:stall --timeout 1
for kind in skip op count dtype group throw; do
  if ! grep -qF "what each rank ended with:" <<<"$("$tpsim" demo --inject 2:5:$kind 2>&1)"; then
    echo "FAIL inject-$kind-every-rank: no per-rank diagnostics"
    failures=$((failures + 1))
  fi
done
check inject-rank 2 "--inject: expected RANK in [0, 8) (the world's --tp x --gtp-remat ranks), got 8 in '8:1:skip'" \
  -- "$tpsim" demo --inject 8:1:skip
check inject-k 2 "--inject: expected K >= 1 (the rank's K-th collective, counted from 1), got '0'" \
  -- "$tpsim" run --layer row --inject 1:0:skip
# corrupt: a silent flip of one bit of one element of a collective's result on one rank. No peer
# notices; the check against the unsharded computation must, for an all-gather, a reduce-scatter
# and an all-reduce of every layer kind, whichever rank's copy is wrong.
while read -r name args; do
  # shellcheck disable=SC2086
  check "corrupt-$name" 1 "outside the bound, the first at flat index" -- "$tpsim" run $args
done <<'CASES'
column-allgather --layer column --tp 2 --sequence-parallel --inject 1:1:corrupt
column-reducescatter --layer column --tp 2 --sequence-parallel --inject 1:3:corrupt
column-allreduce --layer column --tp 2 --inject 1:1:corrupt
row-reducescatter --layer row --tp 2 --input-is-parallel --sequence-parallel --inject 1:1:corrupt
row-allgather --layer row --tp 2 --input-is-parallel --sequence-parallel --inject 1:2:corrupt
row-allreduce --layer row --tp 2 --inject 1:1:corrupt
embedding-allreduce --layer embedding --tp 2 --inject 1:1:corrupt
embedding-reducescatter --layer embedding --tp 2 --sequence-parallel --inject 1:1:corrupt
embedding-allgather --layer embedding --tp 2 --sequence-parallel --inject 1:2:corrupt
mlp-allgather --layer mlp --tp 2 --sequence-parallel --inject 1:1:corrupt
mlp-reducescatter --layer mlp --tp 2 --sequence-parallel --inject 1:2:corrupt
mlp-allreduce --layer mlp --tp 2 --inject 1:1:corrupt
grouped-allgather --layer grouped-column --tp 1 --gtp-remat 2 --inject 1:1:corrupt
grouped-reducescatter --layer grouped-row --tp 1 --gtp-remat 2 --inject 1:2:corrupt
rank0-allreduce --layer row --tp 2 --inject 0:1:corrupt
CASES
# The lowest mantissa bit of a bf16 result is within its bound: not a mismatch (docs/simulator.md).
check corrupt-hidden 0 "sharded results agree" -- "$tpsim" run --layer column --tp 2 --dtype bf16 --inject 1:1:corrupt:0:0
check corrupt-bit-range 2 "sim: injected fault 1:1:corrupt:0:20: expected an element below 256 and a bit below 16 of the result" -- \
  "$tpsim" run --layer column --tp 2 --dtype bf16 --inject 1:1:corrupt:0:20
check inject-kind 2 "--inject: expected FAULT to be skip, op, count, dtype, group, throw, stall or corrupt, got 'crash'" \
  -- "$tpsim" run --layer row --inject 1:1:crash
check inject-form 2 "--inject: expected RANK:K:FAULT (three fields separated by ':'), got '1-1-skip'" \
  -- "$tpsim" demo --inject 1-1-skip
check inject-never 2 "injected fault 1:99:skip never fired: rank 1 issued 2 collectives" \
  -- "$tpsim" run --layer row --tp 2 --inject 1:99:skip
check timeout-zero 2 "--timeout: expected a positive number of seconds" -- "$tpsim" demo --timeout 0
check timeout-word 2 "--timeout: expected a positive number of seconds from 0.001 to 1000000 (like 1 or 0.5), got '1s'" \
  -- "$tpsim" run --layer row --timeout 1s
check inject-help 0 "RANK:K:FAULT" -- "$tpsim" demo --help

# --trace: a Chrome Trace Event file that follows the format's rules (tests/trace_check.py), on
# both clocks; run's normal output is unchanged but for one line.
trace_check="$(dirname "$0")/trace_check.py"
check trace-demo-model 0 "overlap = collectives under compute" -- \
  "$tpsim" demo --trace "$work/demo.json" --clock model --device-model h100-nvlink
check trace-demo-model-json 0 "trace_check: ok, 8 ranks" -- python3 "$trace_check" "$work/demo.json" model
check trace-run-measured 0 "trace (clock measured) written to $work/run.json" -- \
  "$tpsim" run --layer column --tp 4 --sequence-parallel --bias --trace "$work/run.json"
check trace-run-measured-json 0 "trace_check: ok, 4 ranks" -- python3 "$trace_check" "$work/run.json"
printf 'tflops.fp32 = 20\ntflops.bf16 = 300\ntflops.fp16 = 300\ntflops.fp64 = 10\nmemory_gbps = 2000\nlink_latency_us = 8\nlink_gbps = 25\n' \
  >"$work/device.txt"
check trace-run-file 0 "trace (clock model ($work/device.txt)) written" -- "$tpsim" run --layer row --tp 2 \
  --input-is-parallel --gtp-remat 2 --batch 4 --trace "$work/file.json" --clock model --device-model "$work/device.txt"
check trace-run-file-json 0 "trace_check: ok, 4 ranks" -- python3 "$trace_check" "$work/file.json" model
# A device model that would make a time infinite is refused; a path that is not UTF-8 still gives JSON.
sed 's/tflops.fp32 = 20/tflops.fp32 = 1e-300/' "$work/device.txt" >"$work/slow.txt"
check trace-device-infinite 2 "--device-model $work/slow.txt:1: expected tflops.fp32 in [1e-06, 1e+09], got '1e-300'" -- \
  "$tpsim" run --layer row --trace "$work/slow.json" --clock model --device-model "$work/slow.txt"
printf 'tflops.fp32 = 20\ntflops.fp32 = 21\n' >"$work/twice.txt"
check trace-device-twice 2 "--device-model $work/twice.txt:2: expected each key once, got tflops.fp32 again" -- \
  "$tpsim" run --layer row --trace "$work/twice.json" --clock model --device-model "$work/twice.txt"
odd="$work/$(printf 'dev\xff.txt')"
cp "$work/device.txt" "$odd"
"$tpsim" run --layer row --trace "$work/odd.json" --clock model --device-model "$odd" >/dev/null 2>&1
check trace-path-not-utf8 0 "trace_check: ok, 2 ranks" -- python3 "$trace_check" "$work/odd.json" model
if diff <("$tpsim" run --layer row --tp 2) <("$tpsim" run --layer row --tp 2 --trace "$work/same.json") | grep '^[<>]' \
  | grep -qv "^> trace (clock measured) written to $work/same.json\|^> \$"; then
  echo "FAIL trace-output: --trace changed run's output beyond its one line"
  failures=$((failures + 1))
fi
# The checker itself refuses what the format forbids.
meta='{"name":"process_name","ph":"M","ts":0,"pid":0,"tid":0,"args":{"name":"rank 0 (t=0, g=0)"}},
{"name":"thread_name","ph":"M","ts":0,"pid":0,"tid":0,"args":{"name":"compute"}}'
summary='"otherData":{"ranks":[]}'
printf '{"traceEvents":[%s,{"name":"a","ph":"X","ts":0,"dur":2,"pid":0,"tid":0},{"name":"b","ph":"X","ts":1,"dur":2,"pid":0,"tid":0}],%s}' \
  "$meta" "$summary" >"$work/overlap.json"
check trace-check-overlap 1 "spans overlap without nesting on track (0, 0)" -- python3 "$trace_check" "$work/overlap.json"
printf '{"traceEvents":[%s,{"name":"a","ph":"X","ts":0,"dur":2,"pid":0,"tid":0},{"name":"f","ph":"s","id":1,"ts":1,"pid":0,"tid":0}],%s}' \
  "$meta" "$summary" >"$work/flow.json"
check trace-check-flow 1 "flow 1 is not one start and one finish" -- python3 "$trace_check" "$work/flow.json"
printf '{"traceEvents":[%s,{"name":"a","ph":"X","ts":0,"pid":0,"tid":0}],%s}' "$meta" "$summary" >"$work/dur.json"
check trace-check-dur 1 "complete event without a duration" -- python3 "$trace_check" "$work/dur.json"
check trace-clock 2 "--clock: expected measured or model, got 'wall'" -- "$tpsim" demo --trace "$work/x.json" --clock wall
check trace-clock-alone 2 "--clock: applies with --trace FILE, got no --trace" -- "$tpsim" run --layer row --clock model
check trace-device-measured 2 "--device-model: applies to --clock model, got --clock measured" -- \
  "$tpsim" demo --trace "$work/x.json" --device-model pcie
check trace-device-unknown 2 "--device-model: expected h100-nvlink, h200-nvlink, a100-nvlink, pcie or a readable key=value file, got 'b200'" \
  -- "$tpsim" demo --trace "$work/x.json" --clock model --device-model b200
# No hang, no unbounded read: a --device-model file is a regular file (opening a FIFO waits for a
# writer) of at most 1 MiB and lines of at most 4096 bytes; the 10 GiB file is sparse.
mkfifo "$work/device.fifo"
check trace-device-fifo 2 "--device-model $work/device.fifo: expected a regular file, got a FIFO" -- \
  timeout 10 "$tpsim" demo --trace "$work/x.json" --clock model --device-model "$work/device.fifo"
check trace-device-zero 2 "--device-model /dev/zero: expected a regular file, got a device or other special file" -- \
  timeout 10 "$tpsim" demo --trace "$work/x.json" --clock model --device-model /dev/zero
check trace-device-dir 2 "--device-model $work: expected a key=value file, got a directory" -- \
  timeout 10 "$tpsim" demo --trace "$work/x.json" --clock model --device-model "$work"
truncate -s 10G "$work/device.huge"
check trace-device-huge 2 "--device-model $work/device.huge: expected a file of at most 1048576 bytes, got 10737418240" -- \
  timeout 10 "$tpsim" demo --trace "$work/x.json" --clock model --device-model "$work/device.huge"
printf 'tflops.fp32 = 1%*s\n' 5000 '' >"$work/device.long"
check trace-device-long-line 2 "--device-model $work/device.long:1: expected lines of at most 4096 bytes, got a longer one" -- \
  timeout 10 "$tpsim" demo --trace "$work/x.json" --clock model --device-model "$work/device.long"
check trace-dir 2 "--trace: expected a file path in an existing directory, got '$work/nowhere/t.json'" -- \
  "$tpsim" run --layer row --trace "$work/nowhere/t.json"
check trace-empty 2 "--trace: expected a file path, got an empty path" -- "$tpsim" demo --trace ""

# Checkpoints: save at TP=4 x GTP_remat=2 (padded), load at TP=2: the results equal, byte for byte,
# those of the same run reading the weights from .npy; inspect and consolidate; bad input exits 2.
ck="$work/ck"
check ckpt-save 0 "checkpoint saved to $ck" -- "$tpsim" run --layer mlp --tp 4 --gtp-remat 2 --pad-for-alignment 16 \
  --save "$work/ck-npy" --save-checkpoint "$ck"
check ckpt-npy 0 "sharded results agree" -- "$tpsim" run --layer mlp --tp 2 --load "$work/ck-npy" --save "$work/ck-a"
check ckpt-load 0 "parameters from checkpoint $ck" -- "$tpsim" run --layer mlp --tp 2 --load "$work/ck-npy" \
  --load-checkpoint "$ck" --save "$work/ck-b"
for f in output input.grad fc1.weight.grad fc1.bias.grad fc2.weight.grad fc2.bias.grad; do
  cmp -s "$work/ck-a/$f.npy" "$work/ck-b/$f.npy" || { echo "FAIL ckpt-load: $f.npy differs"; failures=$((failures + 1)); }
done
check ckpt-load-bf16-gtp 0 "sharded results agree" -- "$tpsim" run --layer mlp --tp 2 --gtp-remat 4 \
  --pad-for-alignment 8 --batch 4 --dtype bf16 --load-checkpoint "$ck"
# The checkpoint's keys size the parameters: a flag for one of their sizes must agree; the input's
# other sizes are still the flags'.
check ckpt-size-flag 2 "(checkpoint $ck: key 'fc1.weight' dim 1) gives it) or no --in-features, got 32" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$ck" --in-features 32
check ckpt-size-flag-seq 0 "input (4, 2, 16)" -- "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$ck" --seq 4
for layer in column row embedding; do
  check "ckpt-$layer" 0 "checkpoint saved" -- "$tpsim" run --layer "$layer" --tp 4 --gtp-remat 2 --batch 4 \
    $([ "$layer" = embedding ] || echo --bias) --save-checkpoint "$work/ck-$layer"
  check "ckpt-$layer-load" 0 "sharded results agree" -- "$tpsim" run --layer "$layer" --tp 2 \
    $([ "$layer" = embedding ] || echo --bias) --load-checkpoint "$work/ck-$layer"
done
# Parameters of more than a piece (2^20 elements), read a box of rows at a time and verified against
# what the ranks read of their chunks: a column's weight of three pieces, over GTP_remat's pad rows,
# and the experts' weights, which share one key, of two each.
check ckpt-pieces-save 0 "checkpoint saved" -- "$tpsim" run --layer column --tp 4 --gtp-remat 2 \
  --pad-for-alignment 16 --batch 2 --seq 8 --in-features 1024 --out-features 2304 --verify none \
  --save-checkpoint "$work/ck-pieces"
check ckpt-pieces-load 0 "sharded results agree" -- "$tpsim" run --layer column --tp 2 --batch 2 --seq 8 \
  --load-checkpoint "$work/ck-pieces"
check ckpt-expert-pieces-save 0 "checkpoint saved" -- "$tpsim" run --layer grouped-row --tp 2 --experts 2 \
  --tokens 16 --in-features 1152 --out-features 1024 --verify none --save-checkpoint "$work/ck-expert-pieces"
check ckpt-expert-pieces-load 0 "sharded results agree" -- "$tpsim" run --layer grouped-row --tp 4 --experts 2 \
  --tokens 16 --load-checkpoint "$work/ck-expert-pieces"
check ckpt-inspect 0 "fc1.weight             F32   (64, 16)       (128, 16)           8  0-7" -- \
  "$tpsim" checkpoint inspect "$ck"
check ckpt-inspect-placement 0 "fc2.weight             TP: shard dim 1; GTP_remat: shard dim 0 of the TP-local tensor, 16 pad rows per TP slice" -- \
  "$tpsim" checkpoint inspect "$ck"
check ckpt-consolidate 0 "fc2.weight             F32   (16, 64)" -- \
  "$tpsim" checkpoint consolidate "$ck" "$work/all.safetensors"
if command -v python3 >/dev/null; then
  # The safetensors layout read with Python's standard library: each tensor equals its .npy.
  if ! python3 - "$work/all.safetensors" "$work/ck-npy" <<'PY'; then
import json, math, struct, sys
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
    t = header[name]
    b, e = t["data_offsets"]
    npy = open(f"{sys.argv[2]}/{name}.npy", "rb").read()
    assert t["dtype"] == "F32" and npy.endswith(data[8 + n + b:8 + n + e]) and e - b == 4 * math.prod(t["shape"]), name
PY
    echo "FAIL ckpt-consolidate-python: the consolidated tensors differ from the .npy files"
    failures=$((failures + 1))
  else
    echo "ok   ckpt-consolidate-python"
    passed=$((passed + 1))
  fi
fi
check ckpt-consolidate-dtype 2 "--dtype: expected saved, fp32, bf16 or fp16, got 'fp8'" -- \
  "$tpsim" checkpoint consolidate "$ck" "$work/x.safetensors" --dtype fp8
check ckpt-consolidate-name 2 "FILE: expected a name ending in .safetensors, got '$work/x.bin'" -- \
  "$tpsim" checkpoint consolidate "$ck" "$work/x.bin"
check ckpt-action 2 "expected an action, inspect or consolidate, got 'show'" -- "$tpsim" checkpoint show "$ck"
check ckpt-layer 2 "--load-checkpoint: expected key 'weight' in $ck (--layer column reads weight), got only fc1.bias" -- \
  "$tpsim" run --layer column --load-checkpoint "$ck"
check ckpt-stride 2 "--stride: checkpoints need stride 1" -- \
  "$tpsim" run --layer column --tp 2 --stride 2 --save-checkpoint "$work/ck-stride"
check ckpt-no-dir 2 "checkpoint $work/no-checkpoint: expected a directory, got nothing there" -- \
  "$tpsim" checkpoint inspect "$work/no-checkpoint"
check ckpt-empty 2 "--save-checkpoint: expected a directory, got an empty path" -- \
  "$tpsim" run --layer column --save-checkpoint ""
cp -r "$ck" "$work/ck-bad"
# The last byte is data (rank 2 holds real rows); it is changed, whatever it was.
bad="$work/ck-bad/rank-00002.safetensors"
last=$(tail -c 1 "$bad" | od -An -tu1 | tr -d ' ')
printf "\\x$(printf %02x $(((last + 1) % 256)))" | dd of="$bad" bs=1 seek=$(($(stat -c %s "$bad") - 1)) \
  conv=notrunc status=none
check ckpt-corrupt 2 "in rank-00002.safetensors: expected data checksum" -- \
  "$tpsim" checkpoint inspect "$work/ck-bad"
truncate -s -1 "$work/ck-bad/rank-00002.safetensors"
check ckpt-truncated 2 "the file is truncated or was replaced" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$work/ck-bad"
rm "$work/ck-bad/rank-00002.safetensors"
check ckpt-missing 2 "rank-00002.safetensors: expected a readable safetensors file named in the index, got no such file" -- \
  "$tpsim" checkpoint consolidate "$work/ck-bad" "$work/y.safetensors"
[ -e "$work/y.safetensors" ] && { echo "FAIL ckpt-missing: wrote a file"; failures=$((failures + 1)); }
# No hang, no unbounded read: a checkpoint's files are read only if regular (opening a FIFO waits for
# a writer), the index up to 64 MiB, and a file only once its size is the index's. The 1 TiB files
# are sparse: read before that check, they would not fit in memory.
check ckpt-small 0 "checkpoint saved" -- "$tpsim" run --layer column --save-checkpoint "$work/ck-small"
# A load waits for a save of another process into the checkpoint's directory (it holds the
# directory's lock), with a note, then reads the checkpoint whole.
python3 - "$work/ck-small" <<'PY' &
import fcntl, os, sys, time
held = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(held, fcntl.LOCK_EX)
open(sys.argv[1] + ".held", "w").close()
time.sleep(2)
PY
lock_pid=$!
until [ -e "$work/ck-small.held" ] || ! kill -0 $lock_pid 2>/dev/null; do sleep 0.01; done
check ckpt-load-waits 0 "checkpoint $work/ck-small: waiting for another process writing into it" -- \
  "$tpsim" checkpoint inspect "$work/ck-small"
wait $lock_pid
rm -f "$work/ck-small.held"
mkdir -p "$work/ck-odd"
odd_checkpoint() {  # odd_checkpoint NAME FILE: a copy of ck-small without FILE, for a test to put one there
  rm -rf "${work:?}/ck-odd/$1"
  cp -r "$work/ck-small" "$work/ck-odd/$1"
  rm "$work/ck-odd/$1/$2"
}
odd_checkpoint index-fifo index.json
mkfifo "$work/ck-odd/index-fifo/index.json"
check ckpt-index-fifo 2 "ck-odd/index-fifo/index.json: expected a regular file, got a FIFO" -- \
  timeout 10 "$tpsim" checkpoint inspect "$work/ck-odd/index-fifo"
odd_checkpoint index-dir index.json
mkdir "$work/ck-odd/index-dir/index.json"
check ckpt-index-dir 2 "ck-odd/index-dir/index.json: expected an index, got a directory" -- \
  timeout 10 "$tpsim" checkpoint inspect "$work/ck-odd/index-dir"
odd_checkpoint index-huge index.json
truncate -s 1T "$work/ck-odd/index-huge/index.json"
check ckpt-index-huge 2 "index.json: expected a file of at most 67108864 bytes, got 1099511627776" -- \
  timeout 10 "$tpsim" checkpoint inspect "$work/ck-odd/index-huge"
odd_checkpoint shard-fifo rank-00001.safetensors
mkfifo "$work/ck-odd/shard-fifo/rank-00001.safetensors"
check ckpt-shard-fifo 2 "rank-00001.safetensors: expected a regular file, got a FIFO" -- \
  timeout 10 "$tpsim" run --layer column --load-checkpoint "$work/ck-odd/shard-fifo"
odd_checkpoint shard-link-to-fifo rank-00001.safetensors
ln -s "$work/ck-odd/shard-fifo/rank-00001.safetensors" "$work/ck-odd/shard-link-to-fifo/rank-00001.safetensors"
check ckpt-shard-link-to-fifo 2 "rank-00001.safetensors: expected a regular file, got a FIFO" -- \
  timeout 10 "$tpsim" checkpoint consolidate "$work/ck-odd/shard-link-to-fifo" "$work/z.safetensors"
odd_checkpoint shard-dir rank-00001.safetensors
mkdir "$work/ck-odd/shard-dir/rank-00001.safetensors"
check ckpt-shard-dir 2 "rank-00001.safetensors: expected a safetensors file, got a directory" -- \
  timeout 10 "$tpsim" checkpoint inspect "$work/ck-odd/shard-dir"
odd_checkpoint shard-huge rank-00001.safetensors
shard_size=$(stat -c %s "$work/ck-small/rank-00001.safetensors")
truncate -s 1T "$work/ck-odd/shard-huge/rank-00001.safetensors"
check ckpt-shard-huge 2 "rank-00001.safetensors: expected $shard_size bytes (the index's size), got 1099511627776; the file is truncated or was replaced" -- \
  timeout 10 "$tpsim" run --layer column --load-checkpoint "$work/ck-odd/shard-huge"
# --max-memory is checked on the sizes the checkpoint's index gives, before any of its files is read:
# a shard replaced by garbage of its size, refused as corrupt when read, is never read.
odd_checkpoint garbage rank-00000.safetensors
head -c "$(stat -c %s "$work/ck-small/rank-00000.safetensors")" /dev/zero >"$work/ck-odd/garbage/rank-00000.safetensors"
check ckpt-garbage 2 "rank-00000.safetensors: expected header checksum" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/ck-odd/garbage"
check ckpt-memory-first 2 "tpsim run: expected a run that fits in memory, got an estimated peak of" -- \
  "$tpsim" run --layer column --max-memory 1M --load-checkpoint "$work/ck-odd/garbage"

# The writer's rules (tools/lib/output_files.h): no output over one of the command's inputs or
# other outputs, short temporaries, none left after a failure or a signal, one writer of a directory
# at a time, lost stdout reported, and a checkpoint save cut short leaving the old checkpoint.
w="$work/w"
mkdir -p "$w/save" "$w/in"
cp -r "$work/ck-small" "$w/ck"
"$tpsim" run --layer column --save "$w/in" >/dev/null
before=$(cat "$w/ck/"* "$w/in/"* "$work/device.txt" | cksum)
check same-trace-save 2 "--trace: expected a file other than --save's output.npy, got the same file $w/save/output.npy" -- \
  "$tpsim" run --layer column --save "$w/save" --trace "$w/save/output.npy"
ln -s "$w/save" "$w/save-link"
check same-trace-save-link 2 "--trace: expected a file other than --save's output.npy, got the same file $w/save-link/output.npy" -- \
  "$tpsim" run --layer column --save "$w/save" --trace "$w/save-link/output.npy"
[ -z "$(ls -A "$w/save")" ] || { echo "FAIL same-trace-save: wrote $(ls -A "$w/save")"; failures=$((failures + 1)); }
check same-trace-index 2 "--trace: expected a file other than --save-checkpoint's index.json, got the same file $w/ck/index.json" -- \
  "$tpsim" run --layer column --save-checkpoint "$w/ck" --trace "$w/ck/index.json"
check same-trace-shard 2 "--trace: expected a file other than --load-checkpoint's rank-00000.safetensors, got the same file $w/ck/rank-00000.safetensors" -- \
  "$tpsim" run --layer column --load-checkpoint "$w/ck" --trace "$w/ck/rank-00000.safetensors"
check same-trace-load 2 "--trace: expected a file other than --load's input.npy, got the same file $w/in/input.npy" -- \
  "$tpsim" run --layer column --load "$w/in" --trace "$w/in/input.npy"
check same-trace-device 2 "--trace: expected a file other than --device-model, got the same file $work/device.txt" -- \
  "$tpsim" run --layer column --trace "$work/device.txt" --clock model --device-model "$work/device.txt"
check same-demo-device 2 "--trace: expected a file other than --device-model, got the same file $work/./device.txt" -- \
  "$tpsim" demo --trace "$work/./device.txt" --clock model --device-model "$work/device.txt"
check same-checkpoint 2 "--save-checkpoint: expected a file other than --load-checkpoint's index.json, got the same file $w/ck/index.json" -- \
  "$tpsim" run --layer column --load-checkpoint "$w/ck" --save-checkpoint "$w/ck"
check same-consolidate 2 "consolidate: FILE: expected a file other than DIR's rank-00000.safetensors, got the same file $w/ck/rank-00000.safetensors" -- \
  "$tpsim" checkpoint consolidate "$w/ck" "$w/ck/rank-00000.safetensors"
if [ "$(cat "$w/ck/"* "$w/in/"* "$work/device.txt" | cksum)" != "$before" ]; then
  echo "FAIL same-*: an input changed"; failures=$((failures + 1))
fi
# A 255-byte name (NAME_MAX) is an output like any other: its temporary's name does not grow with it.
long_name=$(printf 'n%.0s' {1..240})
check name-max-trace 0 "trace (clock measured) written to $w/${long_name}nnnnnnnnnn.json" -- \
  "$tpsim" run --layer column --trace "$w/${long_name}nnnnnnnnnn.json"
check name-max-svg 0 "wrote $w/${long_name}nnnnnnnnnnn.svg" -- "$tpsim" layout --layer row --svg "$w/${long_name}nnnnnnnnnnn.svg"
check name-max-consolidate 0 "into $w/${long_name}n.safetensors" -- \
  "$tpsim" checkpoint consolidate "$w/ck" "$w/${long_name}n.safetensors"

# Interrupted by SIGINT or SIGTERM while it writes a large save (some 270 MB), a run leaves no
# temporary, and the directory holds all the old outputs or all the new ones. A script's background
# job starts with SIGINT ignored, and SIGXFSZ may be ignored by whatever started the script:
# default_signals (which execs: run it in the background or a subshell) runs a command with both at
# their default action, as a terminal's job has them.
default_signals() {
  exec python3 -c 'import os, signal, sys
for s in (signal.SIGINT, signal.SIGXFSZ): signal.signal(s, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}
big=(run --layer column --seq 2048 --batch 8 --in-features 1024 --out-features 1024 --verify none)
"$tpsim" run --layer column --save "$w/old" >/dev/null  # the same names, small
until_writing() {  # until_writing PID DIR: waits until PID has a temporary in DIR (or has ended)
  for _ in $(seq 12000); do
    compgen -G "$2/.*.partial" >/dev/null && return
    kill -0 "$1" 2>/dev/null || return
    sleep 0.01
  done
}
for sig in INT TERM; do
  rm -rf "$w/sig"
  cp -r "$w/old" "$w/sig"
  default_signals "$tpsim" "${big[@]}" --save "$w/sig" >/dev/null 2>&1 &
  pid=$!
  until_writing $pid "$w/sig"
  kill -s $sig $pid
  wait $pid
  rc=$?
  old_files=0 new_files=0
  for f in "$w/old/"*; do
    if cmp -s "$f" "$w/sig/$(basename "$f")"; then old_files=$((old_files + 1)); else new_files=$((new_files + 1)); fi
  done
  if [ "$rc" -ne $((128 + $(kill -l $sig))) ] || [ "$(ls -A "$w/sig")" != "$(ls -A "$w/old")" ] ||
    { [ "$old_files" -ne 0 ] && [ "$new_files" -ne 0 ]; }; then
    echo "FAIL save-sig$sig: exit $rc, left $(ls -A "$w/sig" | tr '\n' ' ')($old_files old, $new_files new)"
    failures=$((failures + 1))
  else
    echo "ok   save-sig$sig"
    passed=$((passed + 1))
  fi
done
# SIGKILL cannot be caught: the temporaries it leaves go at the next save into the directory.
"$tpsim" "${big[@]}" --save "$w/sig" >/dev/null 2>&1 &
pid=$!
until_writing $pid "$w/sig"
kill -s KILL $pid
{ wait $pid; } 2>/dev/null
check save-after-kill 0 "saved to $w/sig" -- "$tpsim" run --layer column --save "$w/sig"
if [ -n "$(ls -A "$w/sig" | grep partial)" ]; then
  echo "FAIL save-after-kill: left $(ls -A "$w/sig" | grep partial)"; failures=$((failures + 1))
fi

# One writer of a directory at a time: a save into a directory another process has locked waits
# for it (with a note), and two runs saving into one directory leave one run's files, all of them.
mkdir -p "$w/locked"
python3 - "$w/locked" >"$w/lock-verdict" <<'PY' &
import fcntl, os, sys, time
held = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(held, fcntl.LOCK_EX)
open(sys.argv[1] + ".held", "w").close()
time.sleep(2)
print(" ".join(os.listdir(sys.argv[1])), end="")  # what was written while the lock was held
PY
lock_pid=$!
until [ -e "$w/locked.held" ] || ! kill -0 $lock_pid 2>/dev/null; do sleep 0.01; done
check save-lock 0 "waiting for another process reading or writing the same directory" -- \
  "$tpsim" run --layer column --save "$w/locked"
wait $lock_pid
if [ -s "$w/lock-verdict" ] || [ ! -f "$w/locked/output.npy" ]; then
  echo "FAIL save-lock: wrote '$(cat "$w/lock-verdict")' while the lock was held, or nothing"; failures=$((failures + 1))
fi
mid=(run --layer column --seq 512 --batch 8 --in-features 512 --out-features 512 --verify none)
"$tpsim" "${mid[@]}" --seed 1 --save "$w/seed1" >/dev/null
"$tpsim" "${mid[@]}" --seed 2 --save "$w/seed2" >/dev/null
mkdir -p "$w/both"
"$tpsim" "${mid[@]}" --seed 1 --save "$w/both" >/dev/null 2>&1 &
pid1=$!
"$tpsim" "${mid[@]}" --seed 2 --save "$w/both" >/dev/null 2>&1 &
pid2=$!
wait $pid1
rc1=$?
wait $pid2
rc2=$?
from1=0 from2=0
for f in "$w/seed1/"*; do
  cmp -s "$f" "$w/both/$(basename "$f")" && from1=$((from1 + 1))
  cmp -s "$w/seed2/$(basename "$f")" "$w/both/$(basename "$f")" && from2=$((from2 + 1))
done
total=$(ls "$w/seed1" | wc -l)
if [ "$rc1$rc2" != 00 ] || [ "$(ls -A "$w/both")" != "$(ls -A "$w/seed1")" ] || { [ $from1 -ne "$total" ] && [ $from2 -ne "$total" ]; }; then
  echo "FAIL save-concurrent: exits $rc1 $rc2, $from1 files of seed 1 and $from2 of seed 2 of $total: $(ls -A "$w/both" | tr '\n' ' ')"
  failures=$((failures + 1))
else
  echo "ok   save-concurrent"
  passed=$((passed + 1))
fi

# What a command prints is part of its result: stdout that cannot be written fails it.
if [ -w /dev/full ]; then
  check stdout-full 2 "tpsim run: standard output: expected every line written, got 'No space left on device'" -- \
    bash -c '"$0" run --layer column >/dev/full' "$tpsim"
  check stdout-full-help 2 "tpsim: standard output: expected every line written" -- bash -c '"$0" --help >/dev/full' "$tpsim"
fi

# A checkpoint save stopped by a file-size limit at its first file (2528 bytes) or at its index
# (12126 bytes, more than any rank file): with SIGXFSZ ignored the write fails (exit 2, naming the
# file); with its default action the signal ends the run (exit 153) once the temporaries are
# removed. Either way the directory still loads as the previous checkpoint, bitwise.
ck_run=(run --layer mlp --tp 4 --gtp-remat 2 --pad-for-alignment 16)
"$tpsim" "${ck_run[@]}" --save-checkpoint "$w/ck-old" >/dev/null
"$tpsim" checkpoint consolidate "$w/ck-old" "$w/ck-old.safetensors" >/dev/null
for limit in 1:rank-00000.safetensors 4:index.json; do
  for xfsz in ignored default; do
    rm -rf "$w/ck-cut"
    cp -r "$w/ck-old" "$w/ck-cut"
    limited=(bash -c 'ulimit -f "$0" && exec "$@"' "${limit%%:*}" "$tpsim" "${ck_run[@]}" --seed 7 --save-checkpoint "$w/ck-cut")
    out=$(if [ $xfsz = default ]; then default_signals "${limited[@]}"; else trap '' XFSZ; exec "${limited[@]}"; fi 2>&1)
    rc=$?
    want=$([ $xfsz = default ] && echo 153 || echo 2)
    "$tpsim" checkpoint consolidate "$w/ck-cut" "$w/ck-cut.safetensors" >/dev/null 2>&1
    name="ckpt-cut-at-${limit#*:}-xfsz-$xfsz"
    if [ "$rc" -ne "$want" ] || { [ $xfsz = ignored ] && ! grep -qF "${limit#*:} (File too large)" <<<"$out"; } ||
      ! cmp -s "$w/ck-old.safetensors" "$w/ck-cut.safetensors" || [ -n "$(ls -A "$w/ck-cut" | grep partial)" ]; then
      echo "FAIL $name: exit $rc (want $want), left $(ls -A "$w/ck-cut" | tr '\n' ' ')"
      tail -n 3 <<<"$out"
      failures=$((failures + 1))
    else
      echo "ok   $name"
      passed=$((passed + 1))
    fi
  done
done

# A checkpoint's files lie in its directory: a shard that resolves elsewhere, here through a symlink
# to an identical copy outside, is refused; a symlink to a file beside it is followed.
odd_checkpoint shard-outside rank-00001.safetensors
cp "$work/ck-small/rank-00001.safetensors" "$work/outside.safetensors"
ln -s "$work/outside.safetensors" "$work/ck-odd/shard-outside/rank-00001.safetensors"
check ckpt-shard-outside 2 "shard-outside/rank-00001.safetensors: expected a file in $work/ck-odd/shard-outside, got one resolving to $work/outside.safetensors" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/ck-odd/shard-outside"
odd_checkpoint shard-beside rank-00001.safetensors
cp "$work/ck-small/rank-00001.safetensors" "$work/ck-odd/shard-beside/copy.bin"
ln -s copy.bin "$work/ck-odd/shard-beside/rank-00001.safetensors"
check ckpt-shard-beside 0 "sharded results agree" -- "$tpsim" run --layer column --load-checkpoint "$work/ck-odd/shard-beside"

# A symlink at an output name that leads to something other than a regular file stands for what
# the user still needs (/dev/stdout, a FIFO, a directory): refused before anything is written, the
# link kept. A dangling one is replaced.
ln -s /proc/self/fd/1 "$work/to-stdout.svg"
check svg-symlink-to-stdout 2 "--svg: expected $work/to-stdout.svg to be absent, a regular file or a symlink to one, got a symlink to " -- \
  "$tpsim" layout --layer row --svg "$work/to-stdout.svg"
mkfifo "$work/fifo-target"
mkdir -p "$work/linked-fifo"
ln -s "$work/fifo-target" "$work/linked-fifo/output.npy"
check save-symlink-to-fifo 2 "to be absent, a regular file or a symlink to one, got a symlink to a FIFO" -- \
  timeout 10 "$tpsim" run --layer column --save "$work/linked-fifo"
ln -s "$work" "$work/to-dir.json"
check trace-symlink-to-dir 2 "to be absent, a regular file or a symlink to one, got a symlink to a directory" -- \
  "$tpsim" run --layer row --trace "$work/to-dir.json"
if [ ! -L "$work/to-stdout.svg" ] || [ ! -L "$work/linked-fifo/output.npy" ] || [ ! -L "$work/to-dir.json" ] ||
  [ -n "$(ls -A "$work/linked-fifo" | grep -v '^output.npy$')" ]; then
  echo "FAIL symlink-kept: a refused output's symlink was replaced, or files were written beside it"
  failures=$((failures + 1))
fi
ln -s "$work/no-such-target" "$work/dangling.svg"
check svg-symlink-dangling 0 "wrote $work/dangling.svg" -- "$tpsim" layout --layer row --svg "$work/dangling.svg"
[ -f "$work/dangling.svg" ] && [ ! -L "$work/dangling.svg" ] && [ ! -e "$work/no-such-target" ] ||
  { echo "FAIL svg-symlink-dangling: not replaced by the file"; failures=$((failures + 1)); }
# A trace onto the directory --save or --save-checkpoint writes into: refused before either exists.
check trace-onto-save-dir 2 "--trace: expected a file other than --save's directory, got the same file $work/clash-dir" -- \
  "$tpsim" run --layer column --save "$work/clash-dir" --trace "$work/clash-dir"
check trace-onto-checkpoint-dir 2 "--trace: expected a file other than --save-checkpoint's directory, got the same file $work/clash-ck" -- \
  "$tpsim" run --layer column --save-checkpoint "$work/clash-ck/" --trace "$work/clash-ck"
if [ -e "$work/clash-dir" ] || [ -e "$work/clash-ck" ]; then
  echo "FAIL trace-onto-dir: a refused run created its directory"; failures=$((failures + 1))
fi
# Paths in what a command prints show control bytes as \xNN, as its error messages do.
check path-escaped 0 'written to '"$work"'/tr\x1b[31m.json' -- "$tpsim" run --layer row --trace "$work/tr"$'\e'"[31m.json"
if "$tpsim" run --layer row --trace "$work/tr"$'\e'"[31m.json" | grep -q $'\x1b'; then
  echo "FAIL path-escaped: an escape byte of a path reached stdout"; failures=$((failures + 1))
fi

# Hostile checkpoints, edited as a user who knows the format would: hostile NAME FROM sealed|unsealed
# CODE copies checkpoint FROM to $work/hostile/NAME and runs Python CODE on its index (`index`), its
# shards (shard, hole) and the index's text (`post`); `sealed` then recomputes the index's checksum
# (docs/checkpoints.md), `unsealed` leaves it as a hand edit does.
cat >"$work/ckpt_edit.py" <<'PY'
import json, struct, sys
directory, mode, code = sys.argv[1:4]
def fnv(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
    return "%016x" % h
def chunks(key):
    return index["tensors"][key]["chunks"]
def shard(name, edit):
    """Rewrites the file NAME as edit(header, data) returns it: (a header dict or JSON text, data)."""
    raw = open(f"{directory}/{name}", "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    raw = struct.pack("<Q", len(text)) + text + data
    open(f"{directory}/{name}", "wb").write(raw)
    index["files"][name].update(size=len(raw), header_fnv1a64=fnv(raw[:8 + len(text)]))
def hole(name, where):
    """Leaves 8 bytes no tensor indexes in file NAME: before its first tensor, after its first, or after its last."""
    def edit(header, data):
        tensors = sorted((t["data_offsets"], n) for n, t in header.items() if n != "__metadata__")
        at = {"before": 0, "between": tensors[0][0][1], "after": len(data)}[where]
        for n, t in header.items():
            if n != "__metadata__" and t["data_offsets"][0] >= at and where != "after":
                t["data_offsets"] = [o + 8 for o in t["data_offsets"]]
        for t in index["tensors"].values():
            for c in t["chunks"]:
                if c["file"] == name: c["data_offsets"] = header[c["tensor"]]["data_offsets"]
        return header, data[:at] + bytes(8) + data[at:]
    shard(name, edit)
index = json.load(open(f"{directory}/index.json"))
post = lambda text: text
exec(code)
if mode == "sealed":
    index.pop("index_fnv1a64", None)
    index["index_fnv1a64"] = fnv(json.dumps(index, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
open(f"{directory}/index.json", "w").write(post(json.dumps(index, indent=1)))
PY
hostile() {
  rm -rf "${work:?}/hostile/$1"
  mkdir -p "$work/hostile"
  cp -r "$2" "$work/hostile/$1"
  python3 "$work/ckpt_edit.py" "$work/hostile/$1" "$3" "$4"
}
swap_offsets='a, b = chunks("weight")[:2]; a["global_offset"], b["global_offset"] = b["global_offset"], a["global_offset"]'
# fc1.weight's chunk at rows [32, 48) (TP slice 1) described as one padded block: the same stored rows
# land on the logical rows of another slice, and rows [16, 32) come out zero.
other_padding='[c for c in chunks("fc1.weight") if c["global_offset"] == [32, 0]][0]["gtp_padding"] = {"tp_axis": 0, "tp_size": 1, "pad_length": 64}'
# The index checksums itself: an edited index is corrupt, before any field of it is believed.
hostile edited-offsets "$work/ck-small" unsealed "$swap_offsets"
check ckpt-edited-offsets 2 "hostile/edited-offsets/index.json: expected index checksum" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/edited-offsets"
hostile edited-padding "$ck" unsealed "$other_padding"
check ckpt-edited-padding 2 "; the index is corrupt or was edited" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$work/hostile/edited-padding"
# Resealed, the same edits still contradict the files and the rest of the index.
hostile sealed-offsets "$work/ck-small" sealed "$swap_offsets"
check ckpt-sealed-offsets 2 "chunk 'weight@0,0' in rank-00000.safetensors: expected tensor name 'weight@8,0' (its key and global offset), got 'weight@0,0'" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/sealed-offsets"
hostile sealed-padding "$ck" sealed "$other_padding"
check ckpt-sealed-padding 2 "key 'fc1.weight': expected every chunk to share one padding record" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$work/hostile/sealed-padding"
# Every chunk as its file's header has it: the data_offsets too.
hostile sealed-data-offsets "$work/ck-small" sealed 'chunks("weight")[0]["data_offsets"] = [0, 256]'
check ckpt-sealed-data-offsets 2 "expected F32 (8, 16) at data_offsets [0, 256) (the index's), got F32 (8, 16) at [0, 512) in the file" -- \
  "$tpsim" checkpoint inspect "$work/hostile/sealed-data-offsets"
# A field of the wrong JSON type is named, not reported as the JSON library's exception.
hostile dtype-object "$work/ck-small" sealed 'index["tensors"]["weight"]["dtype"] = {"F32": 1}'
check ckpt-dtype-object 2 "key 'weight': dtype: expected a string, got an object of 1 fields" -- \
  "$tpsim" checkpoint inspect "$work/hostile/dtype-object"
# A shard named like a save's temporary would be removed by the next save into the directory.
hostile temporary-name "$work/ck-small" sealed 'import os
os.rename(f"{directory}/rank-00000.safetensors", f"{directory}/.tpsim-1-1.partial")
index["files"][".tpsim-1-1.partial"] = index["files"].pop("rank-00000.safetensors")
for t in index["tensors"].values():
    for c in t["chunks"]:
        if c["file"] == "rank-00000.safetensors": c["file"] = ".tpsim-1-1.partial"'
check ckpt-temporary-name 2 "expected file names other than a save's temporaries (.tpsim-*.partial), which the next save into the directory removes, got '.tpsim-1-1.partial'" -- \
  "$tpsim" checkpoint inspect "$work/hostile/temporary-name"
# Integers only, in range: a fraction is not truncated, 2^32 not wrapped to 0 in an int.
hostile fraction-size "$work/ck-small" sealed 'index["files"]["rank-00000.safetensors"]["size"] += 0.9'
check ckpt-fraction-size 2 "size: expected an integer in [0, 9223372036854775807], got " -- \
  "$tpsim" checkpoint inspect "$work/hostile/fraction-size"
hostile fraction-offset "$work/ck-small" sealed 'chunks("weight")[0]["global_offset"] = [0.5, 0]'
check ckpt-fraction-offset 2 "global_offset: expected an integer in [0, 281474976710655], got 0.5" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/fraction-offset"
hostile huge-axis "$work/ck-small" sealed 'chunks("weight")[0]["padded_axis"] = 2**32'
check ckpt-huge-axis 2 "padded_axis: expected an integer in [0, 1], got 4294967296" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/huge-axis"
# A key twice in one object: refused, not read as its last copy.
hostile duplicate-key "$work/ck-small" sealed 'post = lambda text: text.replace("\"fnv1a64\":", "\"fnv1a64\": \"broken\", \"fnv1a64\":", 1)'
check ckpt-duplicate-key 2 "index.json: expected a well-formed tpsim checkpoint index with each key once in an object, got 'fnv1a64' twice" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/duplicate-key"
# Nesting a million deep, in the index or in a header: refused before parsing, no message dumps it.
hostile deep-index "$work/ck-small" unsealed 'post = lambda text: "{\"format\": " + "[" * 10**6 + "]" * 10**6 + ", \"version\": 2}"'
check ckpt-deep-index 2 "index.json: expected a well-formed tpsim checkpoint index nested at most 16 deep, got deeper" -- \
  "$tpsim" checkpoint inspect "$work/hostile/deep-index"
hostile deep-header "$work/ck-small" sealed 'shard("rank-00001.safetensors", lambda header, data: ("{\"x\": " + "[" * 10**6 + "]" * 10**6 + "}", data))'
check ckpt-deep-header 2 "rank-00001.safetensors: expected a JSON header nested at most 16 deep, got deeper" -- \
  "$tpsim" checkpoint inspect "$work/hostile/deep-header"
# A key without chunks covers nothing, even of a tensor with no elements.
hostile no-chunks "$work/ck-small" sealed 'index["tensors"]["empty"] = {"dtype": "F32", "global_shape": [0], "saved_global_shape": [0], "chunks": []}'
check ckpt-no-chunks 2 "key 'empty': chunks: expected at least one chunk, got none" -- \
  "$tpsim" checkpoint inspect "$work/hostile/no-chunks"
# A shard larger than the memory there is (sparse here, so the disk need not hold it), its size in
# the index: consolidate, which holds every tensor whole, refuses it from the index's sizes before
# any file is read; inspect reads its header alone, which indexes none of the bytes added.
hostile huge-shard "$work/ck-small" sealed 'import os
size = int([l for l in open("/proc/meminfo") if l.startswith("MemAvailable:")][0].split()[1]) * 1024 + 2**30
os.truncate(f"{directory}/rank-00000.safetensors", size)
index["files"]["rank-00000.safetensors"]["size"] = size'
check ckpt-huge-shard 2 "huge-shard: expected a checkpoint whose files fit in memory (consolidate holds" -- \
  timeout 60 "$tpsim" checkpoint consolidate "$work/hostile/huge-shard" "$work/huge.safetensors"
check ckpt-huge-shard-inspect 2 "tensor 'weight@0,0' [0, 512): expected the last tensor to end at the data's end" -- \
  timeout 60 "$tpsim" checkpoint inspect "$work/hostile/huge-shard"
rm -rf "$work/hostile/huge-shard"
# A load keeps every file of the checkpoint open: a soft limit on open files too low for them is
# raised; a hard one is named.
"$tpsim" run --layer column --tp 16 --out-features 32 --save-checkpoint "$work/ck-16" >/dev/null
check ckpt-open-files 0 "sharded results agree" -- \
  bash -c 'ulimit -Sn 40 && exec "$0" run --layer column --tp 2 --load-checkpoint "$1"' "$tpsim" "$work/ck-16"
check ckpt-open-files-hard 2 "index.json: expected at most 8 files, which a load keeps open (the hard limit" -- \
  bash -c 'ulimit -n 40 && exec "$0" run --layer column --tp 2 --load-checkpoint "$1"' "$tpsim" "$work/ck-16"
# A chunk larger than the memory there is, with the header and the index grown to agree: a reader
# holds one chunk at a time, whole, so it refuses this one from its data_offsets before reading it.
hostile huge-chunk "$work/ck-small" sealed 'import os
rows = (int([l for l in open("/proc/meminfo") if l.startswith("MemAvailable:")][0].split()[1]) * 1024 + 2**30) // 64
t = index["tensors"]["weight"]
t["global_shape"] = t["saved_global_shape"] = [8 + rows, 16]
c = [c for c in chunks("weight") if c["tensor"] == "weight@8,0"][0]
c["local_shape"] = c["stored_shape"] = [rows, 16]
c["data_offsets"] = [0, 64 * rows]
def grow(header, data):
    header["weight@8,0"].update(shape=[rows, 16], data_offsets=[0, 64 * rows])
    return header, b""
file = c["file"]
shard(file, grow)
os.truncate(f"{directory}/{file}", os.path.getsize(f"{directory}/{file}") + 64 * rows)
index["files"][file]["size"] = os.path.getsize(f"{directory}/{file}")'
check ckpt-huge-chunk 2 "rank-00001.safetensors: expected a chunk that fits in memory (each is read whole)" -- \
  timeout 60 "$tpsim" checkpoint inspect "$work/hostile/huge-chunk"
rm -rf "$work/hostile/huge-chunk"
# One that fits, sparse (4 GiB, or half the memory there is), its index resealed to agree: refused
# from its header, which indexes none of the bytes added, before the data is read; reading the data
# first would hold the whole file.
hostile sparse-shard "$work/ck-small" sealed 'import os
size = min(4 * 2**30, int([l for l in open("/proc/meminfo") if l.startswith("MemAvailable:")][0].split()[1]) * 512)
os.truncate(f"{directory}/rank-00000.safetensors", size)
index["files"]["rank-00000.safetensors"]["size"] = size'
peak_kib() {  # peak_kib FILE COMMAND...: runs COMMAND, then writes its peak resident memory (KiB) to FILE
  python3 -c 'import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)' "$@"
}
check ckpt-sparse-shard 2 "rank-00000.safetensors: tensor 'weight@0,0' [0, 512): expected the last tensor to end at the data's end, byte " -- \
  peak_kib "$work/sparse.kib" timeout 60 "$tpsim" checkpoint inspect "$work/hostile/sparse-shard"
if [ "$(cat "$work/sparse.kib")" -lt 262144 ]; then
  echo "ok   ckpt-sparse-shard-memory"
  passed=$((passed + 1))
else
  echo "FAIL ckpt-sparse-shard-memory: a peak of $(cat "$work/sparse.kib") KiB, want under 256 MiB: the data was read before the header was checked"
  failures=$((failures + 1))
fi
rm -rf "$work/hostile/sparse-shard"
# Safetensors data bytes are all indexed: a hole before the first tensor, between two, after the last.
check ckpt-bias 0 "checkpoint saved" -- "$tpsim" run --layer column --tp 2 --bias --save-checkpoint "$work/ck-bias"
hostile hole-before "$work/ck-bias" sealed 'hole("rank-00000.safetensors", "before")'
check ckpt-hole-before 2 "rank-00000.safetensors: tensor 'bias@0': expected data_offsets from byte 0 (the first data byte), got [8, 40): a hole of 8 bytes" -- \
  "$tpsim" run --layer column --tp 2 --bias --load-checkpoint "$work/hostile/hole-before"
hostile hole-between "$work/ck-bias" sealed 'hole("rank-00000.safetensors", "between")'
check ckpt-hole-between 2 "rank-00000.safetensors: tensor 'weight@0,0': expected data_offsets from byte 32 (where tensor 'bias@0' ends), got [40, 552): a hole of 8 bytes" -- \
  "$tpsim" checkpoint inspect "$work/hostile/hole-between"
hostile hole-after "$work/ck-bias" sealed 'hole("rank-00000.safetensors", "after")'
check ckpt-hole-after 2 "rank-00000.safetensors: tensor 'weight@0,0' [32, 544): expected the last tensor to end at the data's end, byte 552, got a hole of 8 bytes after it" -- \
  "$tpsim" checkpoint consolidate "$work/hostile/hole-after" "$work/hole.safetensors"
# A checkpoint of another kind of layer is refused before the world starts, naming both kinds, even
# where the shapes agree (a column weight is no row weight); the grouped modes are one module.
check ckpt-column-as-row 2 "--load-checkpoint: expected a checkpoint saved by --layer row, got one saved by --layer column in $work/ck-column" -- \
  "$tpsim" run --layer row --tp 2 --bias --load-checkpoint "$work/ck-column"
check ckpt-embedding-as-column 2 "--load-checkpoint: expected a checkpoint saved by --layer column, got one saved by --layer embedding in $work/ck-embedding" -- \
  "$tpsim" run --layer column --tp 2 --load-checkpoint "$work/ck-embedding"
check ckpt-grouped-as-column 2 "--load-checkpoint: expected a checkpoint saved by --layer column, got one saved by --layer grouped-row" -- \
  "$tpsim" run --layer column --bias --load-checkpoint "$work/g-ck"
hostile no-layer "$work/ck-small" sealed 'del index["layer"]'
check ckpt-no-layer 2 "got one saved by no layer kind (its index names none)" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/no-layer"
# One key of another logical shape than the others give: the bias halved, file and index alike.
check ckpt-bias-tp1 0 "checkpoint saved" -- "$tpsim" run --layer column --tp 1 --bias --save-checkpoint "$work/ck-bias1"
hostile short-bias "$work/ck-bias1" sealed '
def halve(header, data):
    b, w = header["bias@0"], header["weight@0,0"]
    half = b["data_offsets"][1] // 2
    b["shape"], b["data_offsets"] = [b["shape"][0] // 2], [0, half]
    w["data_offsets"] = [o - half for o in w["data_offsets"]]
    return header, data[:half] + data[2 * half:]
shard("rank-00000.safetensors", halve)
bias, weight = index["tensors"]["bias"], chunks("weight")[0]
n = bias["global_shape"][0] // 2
bias.update(global_shape=[n], saved_global_shape=[n])
bias["chunks"][0].update(local_shape=[n], stored_shape=[n], data_offsets=[0, 4 * n])
weight["data_offsets"] = [o - 4 * n for o in weight["data_offsets"]]
raw = open(directory + "/rank-00000.safetensors", "rb").read()
start = 8 + struct.unpack("<Q", raw[:8])[0]
bias["chunks"][0]["fnv1a64"] = fnv(raw[start:start + 4 * n])'
check ckpt-shape-mismatch 2 "--load-checkpoint: key 'bias' in $work/hostile/short-bias: expected shape (16,) (--layer column bias with K = 16, N = 16, as the checkpoint's keys give them), got (8,)" -- \
  "$tpsim" run --layer column --bias --load-checkpoint "$work/hostile/short-bias"
# The layer's `_extra_state` entries are compared with the checkpoint's before the world starts: one
# absent, renamed or of another grid is bad input (exit 2), not a rank's failure.
hostile no-extra-state "$work/ck-small" sealed 'del index["objects"]["_extra_state"]'
check ckpt-no-extra-state 2 "checkpoint $work/hostile/no-extra-state/index.json: expected object '_extra_state', got no objects" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/no-extra-state"
hostile renamed-extra-state "$work/ck-small" sealed 'index["objects"]["_extra_statf"] = index["objects"].pop("_extra_state")'
check ckpt-renamed-extra-state 2 "expected object '_extra_state', got only '_extra_statf'" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/renamed-extra-state"
hostile extra-state-grid "$work/ck-small" sealed 'index["objects"]["_extra_state"]["global_shape"] = [2]'
check ckpt-extra-state-grid 2 "checkpoint $work/hostile/extra-state-grid/index.json: object '_extra_state': expected grid (1,), got (2,)" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/extra-state-grid"
hostile no-fc1-extra-state "$ck" sealed 'del index["objects"]["fc1._extra_state"]'
check ckpt-no-fc1-extra-state 2 "expected object 'fc1._extra_state', got only 'fc2._extra_state'" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$work/hostile/no-fc1-extra-state"
hostile extra-state-value "$work/ck-small" sealed 'index["objects"]["_extra_state"]["value"] = 5'
check ckpt-extra-state-value 2 "object '_extra_state': expected an object whose value is null (the layers' extra state is None), got value 5" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/extra-state-value"
# A NaN in a checkpoint's tensor (the first float of rank-00000.safetensors, its chunk resealed) is
# named by the checkpoint and key it is read from, not by a .npy file.
first_nan='shard("rank-00000.safetensors", lambda header, data: (header, struct.pack("<f", float("nan")) + data[4:]))
raw = open(directory + "/rank-00000.safetensors", "rb").read()
start = 8 + struct.unpack("<Q", raw[:8])[0]
for c in [c for t in index["tensors"].values() for c in t["chunks"] if c["file"] == "rank-00000.safetensors"]:
    c["fnv1a64"] = fnv(raw[start + c["data_offsets"][0]:start + c["data_offsets"][1]])'
hostile nan-column "$work/ck-small" sealed "$first_nan"
check ckpt-nan-column 2 "tpsim run: checkpoint $work/hostile/nan-column: key 'weight': expected finite values, got 1 NaN or Inf, the first at flat index 0" -- \
  "$tpsim" run --layer column --load-checkpoint "$work/hostile/nan-column"
hostile nan-mlp "$ck" sealed "$first_nan"
check ckpt-nan-mlp 2 "tpsim run: checkpoint $work/hostile/nan-mlp: key 'fc1.bias': expected finite values, got 1 NaN or Inf" -- \
  "$tpsim" run --layer mlp --tp 2 --load-checkpoint "$work/hostile/nan-mlp"
# Names from a checkpoint are printed escaped: a key holding an escape sequence never reaches the terminal.
hostile escaped-key "$work/ck-small" sealed '
escaped = "w\x1b[31m"
for name in index["files"]:
    shard(name, lambda header, data: ({k.replace("weight@", escaped + "@"): v for k, v in header.items()}, data))
index["tensors"][escaped] = index["tensors"].pop("weight")
for c in chunks(escaped): c["tensor"] = c["tensor"].replace("weight@", escaped + "@")'
check ckpt-escaped-key 0 'w\x1b[31m' -- "$tpsim" checkpoint inspect "$work/hostile/escaped-key"
if "$tpsim" checkpoint inspect "$work/hostile/escaped-key" 2>&1 | grep -q $'\x1b'; then
  echo "FAIL ckpt-escaped-key: an escape byte reached the terminal"
  failures=$((failures + 1))
fi
# The largest checkpoint tpsim writes, 4096 experts x TP 32 = 131,072 chunks (its index near the 64
# MiB a load reads): its tiling is checked in O(n log n), not pair by pair.
check ckpt-many-chunks-save 0 "checkpoint saved" -- "$tpsim" run --layer grouped-column --experts 4096 --tp 32 \
  --tokens 32 --in-features 4 --out-features 32 --verify none --save-checkpoint "$work/ck-many"
# AddressSanitizer builds run it several times slower, and longer still on a loaded machine.
inspect_limit=30
if grep -qa __asan_init "$tpsim"; then inspect_limit=150; fi
check ckpt-many-chunks 0 "weight                 F32   (4096, 32, 4)  (4096, 32, 4)  131072  0-31" -- \
  timeout "$inspect_limit" "$tpsim" checkpoint inspect "$work/ck-many"
rm -rf "${work:?}/ck-many"

# Resharding GTP_remat's interleaved pad rows: a checkpoint whose TP slices each carry pad rows
# loads into a world of another T, G and --pad-for-alignment (each slice's pad rows dropped, the
# new ones added), and saves again to the same logical tensors, bitwise.
reshard() {  # reshard NAME LAYER SIZE_FLAG "FLAGS OF THE SAVE" "FLAGS OF THE LOAD" "PAD TEXT OF THE LOAD"
  local name="$1" layer="$2" size="$3" from="$4" to="$5" pad="$6" dir="$work/reshard-$1"
  # shellcheck disable=SC2086
  "$tpsim" run --layer "$layer" $size --batch 4 $from --save-checkpoint "$dir-a" >/dev/null &&
    check "reshard-$name" 0 "sharded results agree" -- \
      "$tpsim" run --layer "$layer" $size --batch 4 $to --load-checkpoint "$dir-a" --save-checkpoint "$dir-b" &&
    check "reshard-$name-layout" 0 "$pad" -- "$tpsim" checkpoint inspect "$dir-b" &&
    "$tpsim" checkpoint consolidate "$dir-a" "$dir-a.safetensors" >/dev/null &&
    "$tpsim" checkpoint consolidate "$dir-b" "$dir-b.safetensors" >/dev/null
  if cmp -s "$dir-a.safetensors" "$dir-b.safetensors"; then
    echo "ok   reshard-$name-bitwise"
    passed=$((passed + 1))
  else
    echo "FAIL reshard-$name-bitwise: $dir-b consolidates to other tensors than $dir-a"
    failures=$((failures + 1))
  fi
}
reshard column-2-to-4 column "--out-features 36" "--tp 2 --gtp-remat 2 --pad-for-alignment 8" \
  "--tp 4 --gtp-remat 4 --pad-for-alignment 16" "weight                 F32   (36, 16)       (256, 16)          16  0-15       55 rows per TP slice (T=4)"
reshard column-4-to-2 column "--out-features 36" "--tp 4 --gtp-remat 4 --pad-for-alignment 16" \
  "--tp 2 --gtp-remat 2 --pad-for-alignment 8" "weight                 F32   (36, 16)       (64, 16)            4  0-3        14 rows per TP slice (T=2)"
reshard mlp-2-to-4 mlp "--ffn-hidden 36" "--tp 2 --gtp-remat 2 --pad-for-alignment 8" \
  "--tp 4 --gtp-remat 4 --pad-for-alignment 4" "fc1.weight             F32   (36, 16)       (64, 16)           16  0-15       7 rows per TP slice (T=4)"
reshard mlp-4-to-2 mlp "--ffn-hidden 36" "--tp 4 --gtp-remat 4 --pad-for-alignment 4" \
  "--tp 2 --gtp-remat 4 --pad-for-alignment 16" "fc1.weight             F32   (36, 16)       (128, 16)           8  0-7        46 rows per TP slice (T=2)"
# Where the new world cannot hold the tensors (T does not divide F), the load is refused, naming the
# checkpoint's key.
check reshard-refused 2 "the ffn hidden size F (checkpoint $work/reshard-mlp-2-to-4-a: key 'fc1.weight' dim 0) = 36 must be divisible by --tp = 8" -- \
  "$tpsim" run --layer mlp --tp 8 --load-checkpoint "$work/reshard-mlp-2-to-4-a"

# Megatron's usual embedding setup: sequence parallelism is reduce_scatter_embeddings.
check embedding-sp 0 "reduce-scatter-embeddings" -- "$tpsim" run --layer embedding --tp 2 --sequence-parallel
# A header's bytes are shown, never sent to the terminal: control bytes come out as \xNN.
mkdir -p "$work/esc"
cp "$work/emb/"*.npy "$work/esc/"
esc_dict=$'{"descr": "\e[31m<f9", "fortran_order": False, "shape": (2,), }'
esc_len=$(((${#esc_dict} + 11 + 63) / 64 * 64 - 10))
printf '\x93NUMPY\x01\x00\x'"$(printf %02x $((esc_len % 256)))"'\x'"$(printf %02x $((esc_len / 256)))"'%-*s\n' \
  $((esc_len - 1)) "$esc_dict" >"$work/esc/weight.npy"
check header-escaped 2 'got "\x1b[31m<f9"' -- "$tpsim" run --layer embedding --load "$work/esc"
if "$tpsim" run --layer embedding --load "$work/esc" 2>&1 | grep -q $'\x1b'; then
  echo "FAIL header-escaped: an escape byte reached the terminal"
  failures=$((failures + 1))
fi

check bench-bw-ranks 2 "--bw-ranks: expected 1..1024, got 701063466" -- "$tpsim" bench -W bandwidth -p 701063466
# Buffers no machine has (an input and an output of 64 GiB on each of 1024 ranks) are refused before
# any is allocated.
check bench-bw-memory 2 "--bw-ranks (-p) 1024 and --max-bytes (-e) 64G: expected collective buffers that fit in memory, got 128.0 TiB" -- \
  "$tpsim" bench -W bandwidth -p 1024 -b 64G -e 64G --bw-iters 1

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
