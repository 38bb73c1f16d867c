#!/usr/bin/env python3
"""Checks a tpsim --trace file against the Chrome Trace Event format's rules and tpsim's own.

usage: trace_check.py FILE.json [model]
Format: required fields (name, ph, ts, pid, tid; dur for complete events), every flow start has
exactly one finish with its id, name and category, each bound inside a span of its track, and
spans on one track are disjoint or properly nested. tpsim: a named process per rank and a named
thread per track, GEMMs carry M, N, K and FLOPs = 2MNK, collectives their op, group, seq, dtype
and bytes, the summary's compute is the sum of the compute spans, and on the model clock each
rank's total is the sum of its parts (compute + exposed communication).
"""
import collections
import json
import re
import sys

EPS = 1e-6


def fail(message):
    print(f"trace_check: {message}")
    sys.exit(1)


def main():
    path = sys.argv[1]
    model = len(sys.argv) > 2 and sys.argv[2] == "model"
    with open(path) as f:
        trace = json.load(f)
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        fail("expected a non-empty traceEvents list")
    names, threads, spans, flows = {}, set(), collections.defaultdict(list), collections.defaultdict(list)
    for e in events:
        for field in ("name", "ph", "ts", "pid", "tid"):
            if field not in e:
                fail(f"event lacks '{field}': {e}")
        if e["ph"] == "M":
            if e["name"] == "process_name":
                names[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                threads.add((e["pid"], e["tid"]))
        elif e["ph"] == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                fail(f"complete event without a duration >= 0: {e}")
            spans[(e["pid"], e["tid"])].append(e)
            args = e.get("args", {})
            if e["name"] == "gemm" and args["flops"] != 2 * args["M"] * args["N"] * args["K"]:
                fail(f"gemm FLOPs are not 2·M·N·K: {e}")
            if e.get("cat") == "collective" and not {"op", "group", "seq", "dtype", "bytes"} <= set(args):
                fail(f"collective without op, group, seq, dtype and bytes: {e}")
        elif e["ph"] in ("s", "f"):
            flows[e["id"]].append(e)
        else:
            fail(f"unexpected phase {e['ph']}")
    pids = {pid for pid, _ in spans}
    for pid in pids:
        if not re.fullmatch(r"rank \d+ \(t=\d+, g=\d+\)", names.get(pid, "")):
            fail(f"process {pid} is not named 'rank R (t=.., g=..)': {names.get(pid)}")
    for track, track_spans in spans.items():
        if track not in threads:
            fail(f"track {track} has no thread_name")
        track_spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in track_spans:
            while stack and stack[-1] <= e["ts"] + EPS:
                stack.pop()
            end = e["ts"] + e["dur"]
            if stack and end > stack[-1] + EPS:
                fail(f"spans overlap without nesting on track {track}: {e}")
            stack.append(end)

    def enclosed(e):
        return any(s["ts"] - EPS <= e["ts"] <= s["ts"] + s["dur"] + EPS for s in spans[(e["pid"], e["tid"])])

    for fid, pair in flows.items():
        phases = sorted(p["ph"] for p in pair)
        if phases != ["f", "s"]:
            fail(f"flow {fid} is not one start and one finish: {pair}")
        if len({(p["name"], p.get("cat")) for p in pair}) != 1:
            fail(f"flow {fid}'s start and finish differ in name or category: {pair}")
        finish = next(p for p in pair if p["ph"] == "f")
        if finish.get("bp") != "e":
            fail(f"flow {fid}'s finish does not bind to its enclosing slice: {finish}")
        if not all(enclosed(p) for p in pair):
            fail(f"flow {fid} has an end outside every span of its track: {pair}")
    summary = trace["otherData"]["ranks"]
    for s in summary:
        compute = sum(e["dur"] for e in spans[(s["rank"], 0)])
        if abs(compute - s["compute_us"]) > 1e-3 * (1 + len(spans[(s["rank"], 0)])):
            fail(f"rank {s['rank']}: summary compute {s['compute_us']} != sum of compute spans {compute}")
        parts = s["compute_us"] + s["exposed_us"] + s["other_us"]
        if abs(s["total_us"] - parts) > 0.01:
            fail(f"rank {s['rank']}: total {s['total_us']} != compute + exposed + other {parts}")
        if model and abs(s["other_us"]) > 0.01:
            fail(f"rank {s['rank']}: the model clock left {s['other_us']} µs outside compute and exposed communication")
    collectives = sum(len(v) for k, v in spans.items() if k[1] > 0)
    print(f"trace_check: ok, {len(pids)} ranks, {sum(len(v) for v in spans.values())} spans "
          f"({collectives} collective), {len(flows)} flows")


if __name__ == "__main__":
    main()
