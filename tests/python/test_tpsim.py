"""The Python module against the tpsim CLI it mirrors, and against NumPy's float64 arithmetic and
PyTorch's autograd (where torch imports).

Run by CTest (label python) with the module's folder on PYTHONPATH and TPSIM_CLI naming the tpsim
executable of the same build.
"""
import ast
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tpsim

try:
    import torch
    import torch.nn.functional as F

    NO_TORCH = None
except ImportError as e:  # PyTorch is optional (Debian: python3-torch)
    NO_TORCH = f"PyTorch is not importable ({e}); apt install python3-torch to run this check"

CLI = os.environ["TPSIM_CLI"]

# One configuration per layer kind, and GTP_remat and bf16 runs: the keyword arguments of
# tpsim.run, which mirror the CLI's flags.
CASES = {
    "column": dict(layer="column", tp=2, bias=True),
    "row": dict(layer="row", tp=4, sequence_parallel=True, input_is_parallel=True),
    "embedding": dict(layer="embedding", tp=2),
    "mlp": dict(layer="mlp", tp=2, bias=True),
    "grouped-column": dict(layer="grouped-column", tp=2),
    "grouped-row": dict(layer="grouped-row", tp=2),
    "column-gtp-remat": dict(layer="column", tp=2, gtp_remat=2, sequence_parallel=True, bias=True),
    "mlp-gtp-remat-bf16": dict(layer="mlp", tp=2, gtp_remat=2, dtype="bf16", seed=7),
    "row-bf16": dict(layer="row", tp=2, dtype="bf16", bias=True),
}


def flags(kwargs):
    """tpsim.run's keyword arguments as the CLI's flags."""
    out = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, str(value)]
    return out


def cli(command, *args, check=True):
    return subprocess.run([CLI, command, *args], capture_output=True, text=True, check=check)


def cli_run(kwargs, tmp_path, load=None):
    """The CLI's run of kwargs, saved to tmp_path/out: name -> array of each file it wrote."""
    out = tmp_path / "out"
    extra = ["--load", str(load)] if load else []
    cli("run", *flags(kwargs), *extra, "--save", str(out))
    return {p.name[: -len(".npy")]: np.load(p) for p in out.glob("*.npy")}


def assert_bitwise_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("case", CASES)
def test_generated_run_equals_the_cli(case, tmp_path):
    kwargs = CASES[case]
    saved = cli_run(kwargs, tmp_path)
    r = tpsim.run(**kwargs)
    assert_bitwise_equal({**r.inputs, **r.results}, saved)
    assert r.ok and r.verification and all(v.ok for v in r.verification)
    assert sorted(v.tensor for v in r.verification) == sorted(r.results)


@pytest.mark.parametrize("case", ["column", "embedding", "grouped-row", "column-gtp-remat", "row-bf16"])
def test_run_on_arrays_equals_the_cli_on_the_same_files(case, tmp_path):
    kwargs = {k: v for k, v in CASES[case].items() if k != "seed"}
    inputs_dir = tmp_path / "inputs"
    inputs_dir.mkdir()
    rng = np.random.default_rng(5)
    generated = tpsim.run(**kwargs, verify="none").inputs
    # Other values than the seed's, in float64: both paths round them to the run's dtype alike.
    arrays = {
        name: a if a.dtype == np.int64 else rng.normal(size=a.shape)
        for name, a in generated.items()
    }
    for name, a in arrays.items():
        np.save(inputs_dir / f"{name}.npy", a)
    want = cli_run(kwargs, tmp_path, load=inputs_dir)
    r = tpsim.run(**kwargs, inputs=arrays)
    assert_bitwise_equal(r.results, want)
    assert r.ok


def test_float32_and_float64_arrays_of_the_same_values_give_the_same_bits():
    base = tpsim.run(layer="column", tp=2, bias=True, verify="none")
    as64 = {name: a.astype(np.float64) for name, a in base.inputs.items()}
    r = tpsim.run(layer="column", tp=2, bias=True, inputs=as64, verify="none")
    assert_bitwise_equal(r.results, base.results)


def test_the_collectives_are_the_cli_demo_trace():
    r = tpsim.run(layer="mlp", tp=4, gtp_remat=2, sequence_parallel=True, bias=True)
    demo = cli("demo").stdout.splitlines()
    start = demo.index(next(line for line in demo if line.startswith("# collectives each rank issued")))
    for rank, line in enumerate(demo[start + 1 : start + 9]):
        assert line == f"rank {rank}:" + "".join(f"  {e.op} {e.group} {e.bytes}B" for e in r.collectives[rank])
    assert len(r.collectives) == 8
    assert "fc1.weight (64, 16): TP: shard dim 0; GTP_remat: shard dim 0 of the TP-local tensor" in r.placements


def tokens(x):
    """(s, b, features) -> (s*b, features): the GEMMs' M rows."""
    return x.reshape(-1, x.shape[-1]).astype(np.float64)


def assert_close_in_float64(got, want):
    # fp32 GEMMs of K <= 64 terms of unit size: errors well under 1e-5 of the largest magnitude.
    scale = np.abs(want).max()
    assert np.abs(got.astype(np.float64) - want).max() <= 1e-5 * scale


@pytest.mark.parametrize("gtp_remat", [1, 2])
def test_column_forward_and_weight_gradient_match_numpy_float64(gtp_remat):
    r = tpsim.run(layer="column", tp=2, gtp_remat=gtp_remat, bias=True, seq=8, batch=4, in_features=32,
                  out_features=64)
    x, w, b, dy = (r.inputs[n] for n in ("input", "weight", "bias", "grad_output"))
    y = (tokens(x) @ w.astype(np.float64).T + b).reshape(8, 4, 64)
    assert_close_in_float64(r.results["output"], y)
    # GTP_remat's MEAN reduction leaves each parameter gradient 1/G of the full batch's.
    dw = tokens(dy).T @ tokens(x) / gtp_remat
    assert_close_in_float64(r.results["weight.grad"], dw)
    assert_close_in_float64(r.results["bias.grad"], tokens(dy).sum(axis=0) / gtp_remat)
    assert_close_in_float64(r.results["input.grad"], (tokens(dy) @ w.astype(np.float64)).reshape(x.shape))


def test_row_forward_and_weight_gradient_match_numpy_float64():
    r = tpsim.run(layer="row", tp=4, bias=True, seq=4, batch=2, in_features=64, out_features=16, seed=3)
    x, w, b, dy = (r.inputs[n] for n in ("input", "weight", "bias", "grad_output"))
    assert_close_in_float64(r.results["output"], (tokens(x) @ w.astype(np.float64).T + b).reshape(4, 2, 16))
    assert_close_in_float64(r.results["weight.grad"], tokens(dy).T @ tokens(x))
    assert_close_in_float64(r.results["input.grad"], (tokens(dy) @ w.astype(np.float64)).reshape(x.shape))


def cli_error(*args):
    """The message `tpsim run ARGS` fails with (exit 2), without its 'tpsim run: ' prefix."""
    done = cli("run", *args, check=False)
    assert done.returncode == 2, done
    first = done.stderr.splitlines()[0]
    assert first.startswith("tpsim run: ")
    return first[len("tpsim run: "):]


def test_a_bad_tp_raises_the_cli_message():
    with pytest.raises(ValueError) as e:
        tpsim.run(layer="column", tp=3)
    assert str(e.value) == cli_error("--layer", "column", "--tp", "3")
    assert "--tp" in str(e.value)


def test_an_unknown_layer_raises_the_cli_message():
    with pytest.raises(ValueError) as e:
        tpsim.run(layer="attention", tp=2)
    assert str(e.value) == cli_error("--layer", "attention", "--tp", "2")


def test_a_wrong_shaped_input_raises_the_cli_message(tmp_path):
    arrays = dict(tpsim.run(layer="column", tp=2, verify="none").inputs)
    arrays["input"] = arrays["input"][:, :, :8]
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    with pytest.raises(ValueError) as e:
        tpsim.run(layer="column", tp=2, inputs=arrays)
    assert str(e.value) == cli_error("--layer", "column", "--tp", "2", "--load", str(tmp_path))
    assert str(e.value) == "input.npy must have shape (8, 2, 16), got (8, 2, 8)"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(weight=m["weight"].astype(np.int32)),
         "inputs['weight']: expected a float32, float64, float16 or int64 array, got int32"),
        (lambda m: m.update(weight=m["weight"].astype(np.int64)),
         "inputs['weight']: expected float32, float64 or float16 values, got int64"),
        (lambda m: m.pop("grad_output"),
         "inputs: expected 'grad_output'; --layer column reads input, weight, grad_output"),
        (lambda m: m.update(wieght=m["weight"]),
         "inputs: unexpected 'wieght'; --layer column reads input, weight, grad_output"),
    ],
    ids=["int32", "ids-for-values", "missing", "unknown-name"],
)
def test_bad_arrays_raise_value_errors_naming_the_input(change, message):
    arrays = dict(tpsim.run(layer="column", tp=2, verify="none").inputs)
    change(arrays)
    with pytest.raises(ValueError, match=f"^{message.replace('[', '.').replace(']', '.')}$"):
        tpsim.run(layer="column", tp=2, inputs=arrays)


def test_non_contiguous_arrays_are_read_in_their_logical_order():
    base = tpsim.run(layer="column", tp=2, verify="none")
    arrays = dict(base.inputs)
    arrays["weight"] = np.asfortranarray(arrays["weight"])
    assert not arrays["weight"].flags.c_contiguous
    assert_bitwise_equal(tpsim.run(layer="column", tp=2, inputs=arrays, verify="none").results, base.results)


def test_file_flags_are_refused():
    with pytest.raises(ValueError, match=r"^tpsim.run: save is the command line's only: here tensors are numpy arrays"):
        tpsim.run(layer="column", save="/tmp/x")
    with pytest.raises(ValueError, match=r"^tpsim.layout: svg is the command line's only"):
        tpsim.layout(layer="column", svg="x.svg")


def test_a_failed_rank_raises_rank_failure_with_every_ranks_diagnostic():
    args = dict(layer="column", tp=2, bias=True, inject="1:1:throw")
    with pytest.raises(tpsim.RankFailure) as e:
        tpsim.run(**args)
    assert isinstance(e.value, RuntimeError)
    assert len(e.value.rank_errors) == 2
    assert e.value.rank_errors[1].startswith("injected fault: rank 1 throws at its collective 1")
    assert e.value.rank_errors[0].startswith("peer rank 1 failed")
    done = cli("run", *flags(args), check=False)
    assert done.returncode == 3
    assert done.stderr == "tpsim run: " + str(e.value) + "\n"


def test_the_gil_is_released_during_a_run():
    ticks = []
    done = threading.Event()

    def work():
        tpsim.run(layer="mlp", tp=4, seq=256, batch=4, in_features=256, ffn_hidden=1024)
        done.set()

    worker = threading.Thread(target=work)
    start = time.monotonic()
    worker.start()
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.002)
    worker.join()
    elapsed = time.monotonic() - start
    assert elapsed > 0.1, "the run was too short to tell"
    # Holding the GIL, the run would stop this loop for most of its time (one gap of ~3/4 of it).
    longest_gap = np.diff([start, *ticks, start + elapsed]).max()
    assert longest_gap < elapsed / 4, (longest_gap, elapsed)


def test_layout_is_the_cli_drawing(tmp_path):
    args = dict(layer="column", tp=2, gtp_remat=2, bias=True)
    layout = tpsim.layout(**args)
    svg = tmp_path / "layout.svg"
    done = cli("layout", *flags(args), "--svg", str(svg))
    assert done.stdout == layout.text + f"\nwrote {svg}\n"
    assert layout._repr_svg_() == svg.read_text()
    assert str(layout) == layout.text
    with pytest.raises(ValueError, match="^--layer: expected column"):
        tpsim.layout(layer="attention")


def test_runs_from_several_threads_at_once_give_the_same_bits():
    kwargs = dict(layer="mlp", tp=4, gtp_remat=2, seed=3)
    want = tpsim.run(**kwargs)
    got = []

    def work():
        for _ in range(3):
            got.append(tpsim.run(**kwargs))

    workers = [threading.Thread(target=work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == 9
    for r in got:
        assert r.ok
        assert_bitwise_equal(r.results, want.results)


def test_a_corrupted_collective_fails_verification_as_in_the_cli():
    args = dict(layer="column", tp=2, bias=True, inject="1:1:corrupt")
    r = tpsim.run(**args)
    assert not r.ok
    failed = [v for v in r.verification if not v.ok]
    assert failed and all(v.result == "FAIL" and v.outside > 0 and v.note for v in failed)
    done = cli("run", *flags(args), check=False)
    assert done.returncode == 1
    # The configuration line, the table and the notes under it, as the CLI prints them.
    for line in str(r).splitlines():
        assert line in done.stdout.splitlines(), line


# A child interpreter: a short run, then one of tens of seconds that SIGINT interrupts, then the
# short run again. It reports, as JSON, when KeyboardInterrupt reached it, its thread count before
# and after, and whether the second short run gave the first's bits.
INTERRUPTED_CHILD = r"""
import json, os, signal, sys, time
import numpy as np
import tpsim
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job ignores SIGINT
small = dict(layer="mlp", tp=4, gtp_remat=2, seed=3)
before = tpsim.run(**small)
threads = len(os.listdir("/proc/self/task"))
print("running", flush=True)
report = {"threads_before": threads}
try:
    tpsim.run(layer="mlp", tp=4, seq=512, batch=4, in_features=2048, ffn_hidden=8192)
    report["interrupted"] = None
except KeyboardInterrupt as e:
    report["interrupted"] = time.time()
    report["trace"] = repr(e)
report["threads_after"] = len(os.listdir("/proc/self/task"))
after = tpsim.run(**small)
report["same_bits"] = all(np.array_equal(after.results[n], before.results[n]) for n in before.results)
print(json.dumps(report), flush=True)
"""


@pytest.mark.parametrize("delay", [0.5, 3.0], ids=["after-0.5s", "after-3s"])
def test_ctrl_c_stops_a_long_run_at_once_and_leaves_the_interpreter_working(delay):
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "running\n"
        time.sleep(delay)
        sent = time.time()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, out
    report = json.loads(out)
    assert report["interrupted"] is not None, "the run ended before the signal"
    # The uninterrupted run takes tens of seconds; stopped, it returns within a fraction of one.
    assert report["interrupted"] - sent < 1.5, report
    assert report["trace"] == "KeyboardInterrupt()"
    assert report["threads_after"] == report["threads_before"], report
    assert report["same_bits"]


def layout_rank_lines(args):
    """`tpsim layout`'s per-rank lines of parameters and their gradients: {(tensor, rank): (pad zero
    count, counted by the duplicate filters)}."""
    import re

    out, tensor = {}, None
    for line in cli("layout", *flags(args)).stdout.splitlines():
        if m := re.match(r"^(\S+) \(", line):
            tensor = m.group(1)
        elif m := re.match(r"^  r(\d+) \(t=.*; gtp_local_pad_zero_count (\d+); duplicate filters: (counted|skipped)$", line):
            out[tensor, int(m.group(1))] = (int(m.group(2)), m.group(3) == "counted")
    return out


@pytest.mark.parametrize("args", [dict(layer="column", tp=2, gtp_remat=2, bias=True),
                                  dict(layer="mlp", tp=2, gtp_remat=2, bias=True),
                                  dict(layer="row", tp=4, bias=True)], ids=["column", "mlp", "row"])
def test_pad_counts_and_duplicate_filters_are_the_cli_layouts(args):
    r = tpsim.run(**args, verify="none")
    want = layout_rank_lines(args)
    params = sorted({tensor for tensor, _ in want if not tensor.endswith(".grad")})
    assert params == sorted(r.pad_zero_counts[0]) and params
    for rank in range(len(r.ranks)):
        for p in params:
            got = (r.pad_zero_counts[rank][p], r.counted[rank][p])
            assert got == want[p, rank] == want[p + ".grad", rank], (p, rank)
    if args.get("gtp_remat"):  # the G = 2 split pads: some rank holds padding, some copy is skipped
        assert any(c > 0 for counts in r.pad_zero_counts for c in counts.values())
        assert not all(c for counted in r.counted for c in counted.values())


def test_shards_are_the_blocks_each_rank_holds():
    s, b, K, N = 8, 4, 32, 64
    r = tpsim.run(layer="column", tp=2, gtp_remat=2, sequence_parallel=True, seq=s, batch=b, in_features=K,
                  out_features=N)
    assert r.ranks == [(0, 0), (1, 0), (0, 1), (1, 1)]
    x, w = r.inputs["input"], r.inputs["weight"]
    for rank, (t, g) in enumerate(r.ranks):
        shard = r.shards[rank]
        assert sorted(shard) == sorted([*r.inputs, *r.results])
        # Sequence parallel: TP rank t holds rows t of the sequence; GTP_remat peer g its batch block.
        assert np.array_equal(shard["input"], x[t * 4:(t + 1) * 4, g * 2:(g + 1) * 2])
        # TP cuts the weight's rows; GTP_remat cuts the TP-local 32 rows again (no pad: 32 = 16 x G).
        assert np.array_equal(shard["weight"], w[t * 32 + g * 16:t * 32 + g * 16 + 16])
        # Gathered over the sequence, the output holds every token of its batch block and N/T columns.
        assert np.array_equal(shard["output"], r.results["output"][:, g * 2:(g + 1) * 2, t * 32:(t + 1) * 32])
        assert np.array_equal(shard["weight.grad"], r.results["weight.grad"][t * 32 + g * 16:t * 32 + g * 16 + 16])
        assert r.pad_zero_counts[rank]["weight"] == 0


def test_result_shards_are_what_each_rank_held_before_the_reductions_the_run_completes():
    # The experts' output is left partial over expert TP for the token dispatcher: the ranks' sum.
    r = tpsim.run(layer="grouped-row", tp=2)
    partials = [r.shards[rank]["output"].astype(np.float64) for rank in range(2)]
    assert not np.array_equal(partials[0], r.results["output"])
    assert np.array_equal((partials[0] + partials[1]).astype(np.float32), r.results["output"])
    # The GTP_remat peers' bias gradients are data-parallel halves of the batch, reduced by MEAN.
    r = tpsim.run(layer="column", tp=2, gtp_remat=2, bias=True)
    for t in range(2):
        peers = [r.shards[rank]["bias.grad"].astype(np.float64) for rank, tg in enumerate(r.ranks) if tg[0] == t]
        assert not np.array_equal(peers[0], peers[1])
        np.testing.assert_allclose((peers[0] + peers[1]) / 2, r.results["bias.grad"][t * 8:(t + 1) * 8], rtol=1e-6)


def test_pad_rows_of_a_shard_are_zero_and_counted():
    r = tpsim.run(layer="column", tp=2, gtp_remat=2, verify="none")
    w = r.inputs["weight"]
    for rank, (t, g) in enumerate(r.ranks):
        shard = r.shards[rank]["weight"]
        zero_rows = int((shard == 0).all(axis=1).sum())
        assert zero_rows * shard.shape[1] == r.pad_zero_counts[rank]["weight"] > 0
        # TP rank t's 8 rows pad to 32 for G = 2: peer 0 holds them and 8 pad rows, peer 1 only pad.
        if g == 0:
            assert np.array_equal(shard[:8], w[t * 8:(t + 1) * 8])
        assert zero_rows == (8 if g == 0 else 16)


@pytest.fixture
def saved_checkpoint(tmp_path):
    """A checkpoint of a GTP_remat column layer as `tpsim run --save-checkpoint` writes it, and the
    arrays that run read."""
    args = dict(layer="column", tp=2, gtp_remat=2, bias=True, seed=11)
    cli("run", *flags(args), "--save-checkpoint", str(tmp_path / "ckpt"), "--save", str(tmp_path / "saved"))
    return tmp_path / "ckpt", {p.stem: np.load(p) for p in (tmp_path / "saved").glob("*.npy")}


def test_checkpoint_inspect_is_the_cli_report(saved_checkpoint):
    ckpt, _ = saved_checkpoint
    info = tpsim.checkpoint.inspect(ckpt)  # a pathlib.Path works as a str does
    assert info.text == cli("checkpoint", "inspect", str(ckpt)).stdout
    assert str(info) == info.text and info.layer == "column"
    assert info.keys["weight"] == dict(
        dtype="fp32", global_shape=(16, 16), saved_shape=(64, 16), chunks=4, writers=[0, 1, 2, 3],
        padding="24 rows per TP slice (T=2)",
        placement="TP: shard dim 0; GTP_remat: shard dim 0 of the TP-local tensor, 24 pad rows per TP slice")
    assert info.keys["bias"]["writers"] == [0, 1]  # the GTP_remat peers' copies are not written twice
    assert list(info.objects) == ["_extra_state"]


def test_checkpoint_load_gives_the_saved_arrays_and_feeds_a_run_at_another_topology(saved_checkpoint, tmp_path):
    ckpt, saved = saved_checkpoint
    loaded = tpsim.checkpoint.load(str(ckpt))
    assert sorted(loaded) == ["bias", "weight"]
    for name in loaded:
        assert loaded[name].dtype == np.float32
        assert np.array_equal(loaded[name], saved[name]), name
    # The keys are the run's input names: the same as `tpsim run --load-checkpoint` at TP = 4.
    args = dict(layer="column", tp=4, bias=True, seed=11)
    out = tmp_path / "resharded"
    cli("run", *flags(args), "--load-checkpoint", str(ckpt), "--save", str(out))
    want = {p.stem: np.load(p) for p in out.glob("*.npy")}
    generated = tpsim.run(**args, verify="none").inputs
    r = tpsim.run(**args, inputs={**generated, **loaded})
    assert r.ok
    assert_bitwise_equal({**r.inputs, **r.results}, want)


def test_checkpoint_consolidate_writes_the_cli_file(saved_checkpoint, tmp_path):
    ckpt, _ = saved_checkpoint
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    report = tpsim.checkpoint.consolidate(ckpt, ours, dtype="bf16")
    done = cli("checkpoint", "consolidate", str(ckpt), str(theirs), "--dtype", "bf16")
    assert report == done.stdout.replace(str(theirs), str(ours))
    assert ours.read_bytes() == theirs.read_bytes()
    assert "weight                 BF16  (16, 16)" in report


def cli_checkpoint_error(*args):
    done = cli("checkpoint", *args, check=False)
    assert done.returncode == 2, done
    first = done.stderr.splitlines()[0]
    assert first.startswith("tpsim checkpoint: ")
    return first[len("tpsim checkpoint: "):]


def test_checkpoint_errors_raise_the_cli_messages(saved_checkpoint, tmp_path):
    ckpt, _ = saved_checkpoint
    missing = tmp_path / "nothing"
    with pytest.raises(ValueError) as e:
        tpsim.checkpoint.inspect(missing)
    assert str(e.value) == cli_checkpoint_error("inspect", str(missing)) == f"checkpoint {missing}: expected a directory, got nothing there"
    # One flipped byte of a chunk: its checksum names the file and key, for every function.
    rank1 = ckpt / "rank-00001.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-1] ^= 0x40
    rank1.write_bytes(bytes(data))
    message = cli_checkpoint_error("inspect", str(ckpt))
    assert "rank-00001.safetensors" in message
    for call in (lambda: tpsim.checkpoint.inspect(ckpt), lambda: tpsim.checkpoint.load(ckpt)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message
    out = tmp_path / "never.safetensors"
    with pytest.raises(ValueError) as e:
        tpsim.checkpoint.consolidate(ckpt, out)
    assert str(e.value) == message
    assert not out.exists(), "a failed consolidate writes nothing"
    with pytest.raises(ValueError, match="^--dtype: expected saved, fp32, bf16 or fp16, got 'int8'$"):
        tpsim.checkpoint.consolidate(ckpt, out, dtype="int8")
    with pytest.raises(ValueError, match="^consolidate: FILE: expected a name ending in .safetensors, got 'x.npy'$"):
        tpsim.checkpoint.consolidate(ckpt, "x.npy")
    with pytest.raises(ValueError, match="^tpsim.checkpoint.load: path: expected a str or os.PathLike, got int$"):
        tpsim.checkpoint.load(3)
    with pytest.raises(ValueError, match="^tpsim.checkpoint.consolidate: dtype: expected 'saved', 'fp32', 'bf16' or "
                                         "'fp16', got <class 'numpy.float32'>$"):
        tpsim.checkpoint.consolidate(ckpt, out, dtype=np.float32)


def torch_forward(layer, t):
    """The layer's forward in PyTorch on t (name -> tensor), as Megatron's unsharded module computes it."""
    if layer in ("column", "row"):
        return F.linear(t["input"], t["weight"], t.get("bias"))
    if layer == "embedding":
        return F.embedding(t["input"], t["weight"])
    if layer == "mlp":
        hidden = F.gelu(F.linear(t["input"], t["fc1.weight"], t.get("fc1.bias")))  # erf GeLU, as Megatron's
        return F.linear(hidden, t["fc2.weight"], t.get("fc2.bias"))
    # Grouped experts: token m through expert expert_ids[m]'s weight.
    experts = torch.stack([t[f"weight{i}"] for i in range(len([n for n in t if n.startswith("weight")]))])
    return torch.einsum("mk,mnk->mn", t["input"], experts[t["expert_ids"]])


@pytest.mark.parametrize("case", CASES)
def test_results_match_pytorch_autograd(case):
    if NO_TORCH:
        pytest.skip(NO_TORCH)
    kwargs = CASES[case]
    r = tpsim.run(**kwargs)
    tensors = {}
    for name, a in r.inputs.items():
        if a.dtype == np.int64:
            tensors[name] = torch.from_numpy(a)
        elif name != "grad_output":
            tensors[name] = torch.from_numpy(a.astype(np.float64)).requires_grad_()
    y = torch_forward(kwargs["layer"], tensors)
    y.backward(torch.from_numpy(r.inputs["grad_output"].astype(np.float64)))
    # GTP_remat's MEAN reduction leaves each parameter gradient 1/G of the full batch's.
    g = kwargs.get("gtp_remat", 1)
    want = {"output": y.detach().numpy()}
    for name, t in tensors.items():
        if t.requires_grad:
            want[f"{name}.grad"] = t.grad.numpy() / (1 if name == "input" else g)
    assert sorted(want) == sorted(r.results)
    # fp32 sums of a few dozen unit-sized terms; bf16 rounds every GEMM's operands to 8 bits.
    tolerance = 2e-2 if kwargs.get("dtype") == "bf16" else 1e-5
    for name, value in want.items():
        err = np.abs(r.results[name].astype(np.float64) - value).max()
        assert err <= tolerance * np.abs(value).max(), (name, err)


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_the_example_script_runs_and_agrees_with_numpy():
    done = subprocess.run([sys.executable, str(EXAMPLES / "gtp_remat_column.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# tpsim run: layer=column tp=2 dtype=fp32 sequence-parallel bias gtp-remat=2")
    assert sum(line.endswith("  OK") for line in lines) == 4
    assert lines[-1] == ("rank 3 (t=1, g=1) holds weight (16, 32), gtp_local_pad_zero_count 256, "
                         "bias skipped by the duplicate filters")


def run_cells(sources):
    """Runs code cells in one namespace as Jupyter does: per cell, what it printed and the value of
    its last line when that is an expression."""
    namespace = {"__name__": "__main__"}
    out = []
    for source in sources:
        tree = ast.parse(source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(tree, "<cell>", "exec"), namespace)
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace) if last else None
        out.append((printed.getvalue(), value))
    return out


def test_the_notebook_runs_and_shows_what_it_stored():
    notebook = json.loads((EXAMPLES / "tpsim.ipynb").read_text())
    assert (notebook["nbformat"], notebook["nbformat_minor"]) == (4, 4)
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert cells
    for cell, (printed, value) in zip(cells, run_cells(["".join(c["source"]) for c in cells])):
        stored = {o["output_type"]: o for o in cell["outputs"]}
        assert ("".join(stored["stream"]["text"]) if "stream" in stored else "") == printed
        if value is None:
            assert "execute_result" not in stored
            continue
        data = stored["execute_result"]["data"]
        assert "".join(data["text/plain"]) == repr(value)
        if hasattr(value, "_repr_svg_"):
            assert "".join(data["image/svg+xml"]) == value._repr_svg_()
