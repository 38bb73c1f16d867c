#!/usr/bin/python3
"""tpsim against a peer: the same Megatron-style MLP block on PyTorch + gloo, in the same run.

The peer is what one would otherwise use to test tensor-parallel math on a CPU: T processes, one
thread each, torch.distributed over gloo, fc1 column-parallel (F/T rows of W1 per rank), exact
GeLU, fc2 row-parallel with the forward all-reduce, and the column layer's dgrad all-reduce in
the backward, fp32. tpsim runs the same block at the same T through `tpsim bench -W mlp` (sequence
parallel: an all-gather and a reduce-scatter instead of the all-reduces, the same bytes per rank).

Two figures, each a ratio of two measurements taken back to back, repeated --rounds times:
  step     best forward + backward of the large block (default 2048 x 1024 x 4096)
  command  wall time of one whole command at unit-test size (64 x 32 x 128), start-up included:
           `tpsim run --layer mlp` (with its verification) against `python3 tools/peer_bench.py
           --worker-once` (interpreter, torch import, gloo rendezvous, one step)

usage: /usr/bin/python3 tools/peer_bench.py [--tpsim build/tools/tpsim] [--tp 2] [--rounds 3]
Needs python3-torch (Debian 12: apt-get install python3-torch).
"""
import argparse
import os
import queue
import re
import subprocess
import sys
import time


def peer_worker(rank, tp, tokens, hidden, ffn, reps, port, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    f_local = ffn // tp
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(f_local, hidden, generator=g) * 0.02
    w2 = torch.randn(hidden, f_local, generator=g) * 0.02
    dy = torch.randn(tokens, hidden, generator=g)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        h = x @ w1.t()  # fc1 forward (column)
        a = torch.nn.functional.gelu(h)
        y = a @ w2.t()  # fc2 forward (row): partial sums
        dist.all_reduce(y)
        da = dy @ w2  # fc2 backward
        dw2 = dy.t() @ a
        dh = torch.ops.aten.gelu_backward(da, h)
        dw1 = dh.t() @ x  # fc1 backward
        dx = dh @ w1
        dist.all_reduce(dx)  # the column layer's dgrad all-reduce
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw1).all() and torch.isfinite(dw2).all()
    if rank == 0 and out is not None:
        out.put(best)
    dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_step(tp, tokens, hidden, ffn, reps):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=peer_worker, args=(r, tp, tokens, hidden, ffn, reps, port, out)) for r in range(tp)]
    for p in procs:
        p.start()
    # Polled, so that a worker that dies (a failed import, rendezvous or check) ends the wait.
    deadline = time.monotonic() + 600
    while True:
        try:
            best = out.get(timeout=1)
            break
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                sys.exit(f"peer_bench: a PyTorch worker exited with {dead[0]}" if dead
                         else "peer_bench: no result from the PyTorch workers within 600 s")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"peer_bench: a PyTorch worker exited with {p.exitcode}")
    return best


def tpsim_step(tpsim, tp, tokens, hidden, ffn, reps):
    out = subprocess.run([tpsim, "bench", "-W", "mlp", "--threads", str(tp), "--mlp-tp", str(tp), "--tokens",
                          str(tokens), "--hidden", str(hidden), "--ffn", str(ffn), "--mlp-reps", str(reps)],
                         check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 7 and f[:4] == [str(tokens), str(hidden), str(ffn), str(tp)]:
            return float(f[4]) / 1e3
    sys.exit("peer_bench: no MLP row in tpsim's output:\n" + out)


def wall(cmd):
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tpsim", default="build/tools/tpsim")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="steps per measurement (the best is kept)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--worker-once", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker_once:  # the unit-test-size command the start-up figure times
        peer_step(a.tp, a.tokens, a.hidden, a.ffn, 1)
        return
    if a.tp < 1 or a.tokens % a.tp or a.ffn % a.tp:
        sys.exit(f"peer_bench: --tp must divide --tokens and --ffn, got {a.tp}")
    print(f"# MLP {a.tokens} x {a.hidden} x {a.ffn}, fp32, forward + backward, TP={a.tp}, one thread per rank;"
          f" best of {a.reps} steps; cores {os.cpu_count()}")
    print(f"# {'round':>5} {'tpsim(ms)':>10} {'torch(ms)':>10} {'torch/tpsim':>11}   {'tpsim cmd(s)':>12}"
          f" {'torch cmd(s)':>12} {'torch/tpsim':>11}")
    small = ["--tokens", "64", "--hidden", "32", "--ffn", "128", "--tp", str(a.tp)]
    tpsim_cmd = [a.tpsim, "run", "--layer", "mlp", "--tp", str(a.tp), "--sequence-parallel", "--seq", "64",
                 "--batch", "1", "--in-features", "32", "--ffn-hidden", "128", "--threads", str(a.tp)]
    peer_cmd = [sys.executable, os.path.abspath(__file__), "--worker-once"] + small
    for r in range(a.rounds):
        ours = tpsim_step(a.tpsim, a.tp, a.tokens, a.hidden, a.ffn, a.reps)
        theirs = peer_step(a.tp, a.tokens, a.hidden, a.ffn, a.reps)
        ours_cmd, theirs_cmd = wall(tpsim_cmd), wall(peer_cmd)
        print(f"  {r + 1:>5} {ours * 1e3:>10.1f} {theirs * 1e3:>10.1f} {theirs / ours:>10.2f}x   {ours_cmd:>12.3f}"
              f" {theirs_cmd:>12.3f} {theirs_cmd / ours_cmd:>10.1f}x", flush=True)


if __name__ == "__main__":
    main()
