#!/usr/bin/python3
"""The memory estimate against the measured peak, case by case.

    tools/memory_table.py [--tpsim build/tools/tpsim] [--large] [CASE ...]

Runs `tpsim run` for each case (the README's commands and the shapes of docs/memory.md, or the
CASEs given, each one string of flags) and prints, per case, the peak resident memory of that run
alone (its ru_maxrss, from GNU time), the run's own estimate and their ratio. The estimate is what
`tpsim run` refuses above --max-memory: found to the byte by bisection over --max-memory, on runs
that stop before allocating anything or are stopped right after the check. --large adds the real
model shapes, which need up to 12 GiB and minutes.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

CASES = [
    # The README's commands (without --save; the 70B one is in LARGE).
    "--layer column --tp 4 --sequence-parallel --bias --dtype bf16",
    "--layer mlp --tp 2 --gtp-remat 2 --sequence-parallel --dtype bf16 --batch 4",
    "--layer column --tp 2 --gtp-remat 2 --pad-for-alignment 32 --weight-format mxfp8 --dtype bf16 --batch 4 "
    "--in-features 64 --out-features 96",
    "--layer grouped-row --tp 2 --gtp-remat 2 --experts 3 --tokens 16 --bias --dtype bf16",
    "--layer mlp --tp 8 --seq 512 --batch 4 --in-features 1024 --ffn-hidden 4096",
    "--layer mlp --tp 4 --gtp-remat 2",
    # docs/memory.md: small runs, the test's shape, then one of each kind.
    "--layer column --tp 4 --gtp-remat 2 --batch 2 --seq 8 --in-features 32 --out-features 64",
    "--layer mlp --tp 4 --batch 4 --seq 128 --in-features 256 --ffn-hidden 2048",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 1",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 4",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 16",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 64",
    "--layer row --batch 64 --seq 64 --in-features 1024 --out-features 256 --tp 4",
    "--layer row --batch 64 --seq 64 --in-features 1024 --out-features 256 --tp 1 --verify none",
    "--layer row --batch 4 --seq 256 --in-features 1024 --out-features 1024 --sequence-parallel --input-is-parallel --tp 4",
    "--layer column --batch 4 --seq 256 --in-features 1024 --out-features 1024 --tp 4",
    "--layer column --batch 4 --seq 256 --in-features 1024 --out-features 1024 --tp 4 --gtp-remat 2",
    "--layer column --batch 2 --seq 16 --in-features 2048 --out-features 4096 --tp 2",
    "--layer column --batch 2 --seq 16 --in-features 2048 --out-features 4096 --tp 2 --gtp-remat 2",
    "--layer embedding --vocab 8192 --out-features 512 --batch 4 --seq 256 --tp 4",
    "--layer mlp --batch 4 --seq 128 --in-features 256 --ffn-hidden 2048 --tp 16",
    "--layer mlp --batch 4 --seq 512 --in-features 1024 --ffn-hidden 4096 --sequence-parallel --tp 4",
    "--layer mlp --batch 1 --seq 1024 --in-features 2048 --ffn-hidden 7168 --sequence-parallel --tp 8",
    "--layer mlp --batch 1 --seq 1024 --in-features 2048 --ffn-hidden 7168 --sequence-parallel --tp 8 --verify none",
    "--layer mlp --batch 2 --seq 256 --in-features 512 --ffn-hidden 4096 --sequence-parallel --tp 8",
    "--layer mlp --batch 2 --seq 256 --in-features 512 --ffn-hidden 4096 --sequence-parallel --tp 64",
    "--layer grouped-column --tokens 4096 --experts 4 --in-features 512 --out-features 1024 --tp 4",
    "--layer grouped-row --tokens 4096 --experts 4 --in-features 1024 --out-features 512 --tp 4",
    # bf16 and gradient-accumulation fusion (wgrads added into fp32 or bf16 main_grad).
    "--layer mlp --batch 4 --seq 512 --in-features 1024 --ffn-hidden 4096 --sequence-parallel --tp 4 --dtype bf16",
    "--layer mlp --batch 4 --seq 512 --in-features 1024 --ffn-hidden 4096 --sequence-parallel --tp 4 "
    "--grad-accumulation-fusion",
    "--layer mlp --batch 4 --seq 512 --in-features 1024 --ffn-hidden 4096 --sequence-parallel --tp 4 --dtype bf16 "
    "--grad-accumulation-fusion",
    "--layer mlp --batch 1 --seq 1024 --in-features 2048 --ffn-hidden 7168 --sequence-parallel --tp 8 --dtype bf16",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 4 --dtype bf16",
    "--layer row --batch 16 --seq 64 --in-features 1024 --out-features 256 --tp 4 --dtype bf16 "
    "--grad-accumulation-fusion --main-grad-dtype bf16",
    "--layer column --batch 4 --seq 256 --in-features 1024 --out-features 1024 --tp 4 --dtype bf16 "
    "--grad-accumulation-fusion",
    "--layer column --batch 4 --seq 256 --in-features 1024 --out-features 1024 --tp 4 --gtp-remat 2 --dtype bf16",
    "--layer embedding --vocab 8192 --out-features 512 --batch 4 --seq 256 --tp 4 --dtype bf16",
    "--layer grouped-column --tokens 4096 --experts 4 --in-features 512 --out-features 1024 --tp 4 --dtype bf16",
    "--layer grouped-row --tokens 4096 --experts 4 --in-features 1024 --out-features 512 --tp 4 --dtype bf16 "
    "--grad-accumulation-fusion",
    # GTP_remat with the weight gradients' reduce-scatter as the peak.
    "--layer column --batch 24 --seq 4 --in-features 4096 --out-features 8208 --verify none --pad-for-alignment 0 "
    "--tp 1 --gtp-remat 2",
    "--layer column --batch 24 --seq 4 --in-features 4096 --out-features 8208 --verify none --pad-for-alignment 0 "
    "--tp 2 --gtp-remat 8",
    # A column whose weight is nearly all of the run, on its one rank.
    "--layer column --batch 2 --seq 16 --in-features 4096 --out-features 8192 --verify none --tp 1",
    # GTP_remat on one thread, where the peers reach the reduce-scatter one after another, verified too.
    "--layer column --batch 24 --seq 4 --in-features 4096 --out-features 8208 --verify none --pad-for-alignment 0 "
    "--tp 2 --gtp-remat 4 --threads 1",
    "--layer column --batch 4 --seq 16 --in-features 4096 --out-features 8192 --tp 2 --gtp-remat 4 --threads 1",
    # Weights that are nearly all of a verified run.
    "--layer mlp --batch 2 --seq 16 --in-features 1024 --ffn-hidden 4096 --tp 2",
    "--layer mlp --batch 2 --seq 16 --in-features 1024 --ffn-hidden 4096 --tp 2 --weight-format mxfp8",
    "--layer column --batch 2 --seq 16 --in-features 2048 --out-features 4096 --tp 2 --weight-format mxfp8",
    # A verified row whose weight is most of the run: the reference's packed operands beside |W|.
    "--layer row --input-is-parallel --batch 2 --seq 256 --in-features 16384 --out-features 2048 --tp 4",
    # Embedding tables that are nearly all of a verified run.
    "--layer embedding --vocab 65536 --out-features 512 --batch 4 --seq 256 --tp 1",
    "--layer embedding --vocab 65536 --out-features 512 --batch 4 --seq 256 --tp 8",
    "--layer embedding --vocab 65536 --out-features 512 --batch 4 --seq 256 --tp 2 --gtp-remat 4 --threads 1",
    # Embedding outputs that are nearly all of the run.
    "--layer embedding --vocab 1024 --out-features 4096 --batch 4 --seq 512 --verify none --tp 4 "
    "--reduce-scatter-embeddings --sequence-parallel",
    "--layer embedding --vocab 1024 --out-features 4096 --batch 4 --seq 512 --verify none --tp 2 --dtype bf16",
    # Grouped experts: one expert; weights that are nearly all of the run, alone, under GTP_remat
    # (which gathers every expert's at once) and in bf16 with fusion; an output four times the input.
    "--layer grouped-row --tokens 4096 --experts 1 --in-features 1024 --out-features 512 --tp 4",
    "--layer grouped-column --tokens 64 --experts 8 --in-features 2048 --out-features 2048 --tp 4",
    "--layer grouped-column --tokens 64 --experts 8 --in-features 2048 --out-features 2048 --tp 2 --gtp-remat 2 "
    "--threads 1",
    "--layer grouped-column --tokens 64 --experts 8 --in-features 2048 --out-features 2048 --tp 1 --gtp-remat 2 "
    "--grad-accumulation-fusion --dtype bf16",
    "--layer grouped-row --tokens 1024 --experts 2 --in-features 1024 --out-features 4096 --tp 4",
]
LARGE = [
    # Llama-3-8B's embedding table, then Llama-3-70B's.
    "--layer embedding --vocab 128256 --out-features 4096 --batch 1 --seq 1024 --sequence-parallel "
    "--reduce-scatter-embeddings --tp 8",
    "--layer embedding --vocab 128256 --out-features 8192 --batch 1 --seq 1024 --sequence-parallel "
    "--reduce-scatter-embeddings --tp 8",
    # Llama-3-8B's MLP, then Llama-3-70B's.
    "--layer mlp --batch 1 --seq 1024 --in-features 4096 --ffn-hidden 14336 --sequence-parallel --tp 8",
    "--layer mlp --batch 2 --seq 4096 --in-features 4096 --ffn-hidden 14336 --sequence-parallel --tp 8 --gtp-remat 2",
    "--layer mlp --batch 1 --seq 4096 --in-features 8192 --ffn-hidden 28672 --sequence-parallel --tp 8",
]
# Measures each run's peak (peak() says why not this script itself).
GNU_TIME = "/usr/bin/time"


def refused(tpsim, flags, limit):
    """Whether `tpsim run FLAGS --max-memory LIMIT` refuses the run for its estimate. A run that
    passes the check prints its header line next: it is stopped there."""
    child = subprocess.Popen([tpsim, "run", *flags, "--max-memory", str(limit)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    if child.stdout.readline():
        child.kill()
        child.communicate()
        return False
    _, error = child.communicate()
    if "expected a run that fits in memory" in error:
        return True
    sys.exit(f"memory_table.py: tpsim run {' '.join(flags)} --max-memory {limit}: {error.strip()}")


def estimate(tpsim, flags):
    """The least --max-memory the run passes: its estimate, rounded up to the byte."""
    low, high = 1, 1 << 50
    if not refused(tpsim, flags, low):
        return low
    while high - low > 1:  # refused at low, accepted at high
        mid = (low + high) // 2
        if refused(tpsim, flags, mid):
            low = mid
        else:
            high = mid
    return high


def peak(tpsim, flags):
    """Peak resident bytes and seconds of the run, which must pass.

    GNU time forks the run and reports its ru_maxrss. A child this script forked itself would report
    at least this Python's own resident memory (Linux keeps the high-water mark of the memory a
    process had before exec), about 14 MiB, above the smallest runs' peaks."""
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("r") as report:
        r = subprocess.run([GNU_TIME, "-f", "%M", "-o", report.name, tpsim, "run", *flags, "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit(f"memory_table.py: tpsim run {' '.join(flags)} failed (exit {r.returncode}): {r.stderr.strip()}")
        kib = int(report.read().split()[-1])
    return kib * 1024, time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpsim", default=os.path.join(os.path.dirname(__file__), "..", "build", "tools", "tpsim"))
    parser.add_argument("--large", action="store_true", help="add the real model shapes")
    parser.add_argument("cases", nargs="*", help="flags of tpsim run, one string a case")
    args = parser.parse_args()
    if not os.access(GNU_TIME, os.X_OK):
        sys.exit(f"memory_table.py: expected GNU time at {GNU_TIME}, which measures the peaks; got none "
                 "(Debian: apt-get install time, or tools/install_deps.sh)")
    cases = args.cases or CASES + (LARGE if args.large else [])
    mib = 1 << 20
    print(f"| flags | peak MiB | estimate MiB | estimate / peak | seconds |")
    print(f"|---|---|---|---|---|")
    for case in cases:
        flags = case.split()
        need = estimate(args.tpsim, flags)
        measured, seconds = peak(args.tpsim, flags)
        print(f"| `{case}` | {measured / mib:.0f} | {need / mib:.0f} | {need / measured:.2f} | {seconds:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
