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
# Each rank's partial input gradient, stacked (T, s, b, K), checked against the partial products.
check run-disable-grad-reduce 0 "(4, 8, 2, 16)" -- "$tpsim" run --layer column --tp 4 --bias --disable-grad-reduce
check disable-grad-reduce-sp 2 "--disable-grad-reduce: not with --sequence-parallel" -- \
  "$tpsim" run --layer column --tp 2 --sequence-parallel --disable-grad-reduce
check run-help 0 "--disable-grad-reduce" -- "$tpsim" run --help

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
  check gpu-unusable-bench 2 "--backend gpu: cannot run here: " -- "$tpsim" bench --backend gpu
fi
check bench-bad-backend 2 "--backend: expected sim or gpu, got 'tpu'" -- "$tpsim" bench --backend tpu
check bench-gpu-what 2 "--what: with --backend gpu expected layers, fabric or all, got 'latency'" -- \
  "$tpsim" bench --backend gpu -W latency
check bench-gpu-tp 2 "--mlp-tp: every TP size must be <= 64 and divide --tokens and --ffn" -- \
  "$tpsim" bench --backend gpu --mlp-tp 3
check conflicting 2 "--sequence-parallel: needs --tp > 1" -- "$tpsim" run --layer column --tp 1 --sequence-parallel

# Exit codes: only a result outside its bound exits 1; input, configuration and I/O errors exit 2.
check help-exit-codes 0 "3  the simulated world failed" -- "$tpsim" --help
check run-help-exit-codes 0 "2  bad input" -- "$tpsim" run --help
ln -s "$work/loop" "$work/loop"
check load-symlink-loop 2 "tpsim run: '$work/loop': expected a usable path, got 'Too many levels of symbolic links'" -- \
  "$tpsim" run --layer column --load "$work/loop"
touch "$work/plain"
check save-unusable 2 "'$work/plain/out'" -- "$tpsim" run --layer column --save "$work/plain/out"
check out-of-memory 2 "out of memory: the run needs more than this machine has; its size comes from --seq" -- \
  "$tpsim" run --layer column --seq 1000000000000 --batch 1
check gtp-split 2 "the TP-local rows N / --tp = 2 must be divisible by --gtp-remat (with --pad-for-alignment 0) = 4" \
  -- "$tpsim" run --layer column --tp 1 --gtp-remat 4 --batch 4 --out-features 2 --pad-for-alignment 0
# The tools' own messages start with "tpsim run: "; main does not repeat it.
check no-double-prefix 2 "tpsim run: the ffn hidden size F" -- "$tpsim" run --layer mlp --tp 3 --load "$work/a"
if grep -qF "tpsim run: tpsim run:" <<<"$("$tpsim" run --layer mlp --tp 3 --load "$work/a" 2>&1)"; then
  echo "FAIL no-double-prefix: 'tpsim run: tpsim run:'"
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
check stride-too-large 2 "N (weight.npy dim 0) = 16 must be divisible by --tp x --stride = 200000000" -- \
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
npy "$work/inf/input.npy" "(1, 1, 2)" "$big$big"
npy "$work/inf/weight.npy" "(2, 2)" "$big$big$big$big"
npy "$work/inf/grad_output.npy" "(1, 1, 2)" "$one$one"
check inf-result 1 "output: 2 NaN or Inf values, the first at flat index 0" -- \
  "$tpsim" run --layer column --tp 1 --load "$work/inf"
check inf-result-column 1 "NON-FINITE" -- "$tpsim" run --layer column --tp 1 --load "$work/inf"

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
for layer in column row embedding; do
  check "ckpt-$layer" 0 "checkpoint saved" -- "$tpsim" run --layer "$layer" --tp 4 --gtp-remat 2 --batch 4 \
    $([ "$layer" = embedding ] || echo --bias) --save-checkpoint "$work/ck-$layer"
  check "ckpt-$layer-load" 0 "sharded results agree" -- "$tpsim" run --layer "$layer" --tp 2 \
    $([ "$layer" = embedding ] || echo --bias) --load-checkpoint "$work/ck-$layer"
done
check ckpt-inspect 0 "fc1.weight             F32   (64, 16)       (128, 16)           8  0-7" -- \
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
check ckpt-no-dir 2 "checkpoint $work/none: expected a directory, got nothing there" -- \
  "$tpsim" checkpoint inspect "$work/none"
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

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
