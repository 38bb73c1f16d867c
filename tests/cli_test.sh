#!/usr/bin/env bash
# The tpsim command line as outside harnesses drive it: exit codes (0 ok, 1 check failed, 2 bad
# flags or input files), the --save/--load round trip
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
for layer in column row embedding mlp; do
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
check run-rs-embeddings 0 "sharded results agree" -- "$tpsim" run --layer embedding --tp 2 --reduce-scatter-embeddings

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
fi
check conflicting 2 "--sequence-parallel: needs --tp > 1" -- "$tpsim" run --layer column --tp 1 --sequence-parallel

# --verify: exact holds on small-integer data, where every step is exact; generated data misses it.
# npy FILE SHAPE VALUES...: a float32 .npy of integers in [-2, 2].
npy() {
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
npy "$work/ints/input.npy" "8, 2, 16" $(ints 256 1)
npy "$work/ints/weight.npy" "32, 16" $(ints 512 2)
npy "$work/ints/bias.npy" "32," $(ints 32 3)
npy "$work/ints/grad_output.npy" "8, 2, 32" $(ints 512 4)
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

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
