"""A GTP_remat column layer on your own arrays, checked against your own NumPy math.

ColumnParallelLinear at TP = 2 x GTP_remat = 2 with sequence parallelism: y = x·Wᵀ + b. The script
runs it on four simulated ranks, computes the same layer in float64 NumPy, and compares the output
and every gradient; then it shows what rank 3 (t=1, g=1) held. Exits 1 if any result disagrees.

    PYTHONPATH=build/tools/python /usr/bin/python3 docs/examples/gtp_remat_column.py
"""
import sys

import numpy as np

import tpsim

rng = np.random.default_rng(0)
s, b, K, N, G = 8, 4, 32, 48, 2
x = rng.normal(size=(s, b, K)).astype(np.float32)    # input (s, b, K)
w = rng.normal(size=(N, K)).astype(np.float32)       # weight (N, K)
bias = rng.normal(size=(N,)).astype(np.float32)      # bias (N,)
dy = rng.normal(size=(s, b, N)).astype(np.float32)   # grad_output (s, b, N)

r = tpsim.run(layer="column", tp=2, gtp_remat=G, sequence_parallel=True, bias=True,
              inputs={"input": x, "weight": w, "bias": bias, "grad_output": dy})
print(r)

# The same layer in float64. GTP_remat peers are data parallel and reduce their gradients with
# MEAN, so each parameter gradient is 1/G of the full batch's.
x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
mine = {
    "output": np.einsum("sbk,nk->sbn", x64, w64) + bias,
    "input.grad": np.einsum("sbn,nk->sbk", dy64, w64),
    "weight.grad": np.einsum("sbn,sbk->nk", dy64, x64) / G,
    "bias.grad": dy64.sum(axis=(0, 1)) / G,
}
worst = 0.0
for name, want in mine.items():
    rel = np.abs(r.results[name] - want).max() / np.abs(want).max()
    worst = max(worst, rel)
    print(f"{name:12s} max |tpsim - numpy| / max |numpy| = {rel:.1e}")

# N/T = 24 rows per TP rank pad to 32 for the G = 2 split: peer 0 holds 16 real rows, peer 1 the
# other 8 and 8 pad rows.
rank = 3
t, g = r.ranks[rank]
print(f"rank {rank} (t={t}, g={g}) holds weight {r.shards[rank]['weight'].shape}, "
      f"gtp_local_pad_zero_count {r.pad_zero_counts[rank]['weight']}, "
      f"bias {'counted' if r.counted[rank]['bias'] else 'skipped'} by the duplicate filters")
sys.exit(0 if r.ok and worst < 1e-5 else 1)
