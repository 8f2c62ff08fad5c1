#!/usr/bin/env python3
"""Reads a kernel timeline of one decode step (step_bench --trace CSV[.gz])
and prints where a layer's time goes, per layer type.

Layers are cut where the next one's input is ready: the end of wo_b (the
first FP8 linear after wo_a's FP8 x bf16 one), or of the residual_norm_kernel
that follows it on its stream where wo_b does not run the norm itself; the
first cut is the step's first residual_norm_kernel. Where wo_a and wo_b
run on cuBLASLt (64 rows and more), every layer ends with its own
residual_norm_kernel, and those ends are the cuts. A layer with the
indexer's score_kernel (or short_kernel) is C4A, one with a compressor (COMPRESSOR_KERNELS)
but no scorer is C128A, the rest are SWA-only. For
the median layer of each type it lists every kernel in start order with its
end measured from the layer's start: with programmatic dependent launch a
kernel starts before the one it waits for has ended, so the ends, not the
durations, show the chain.

usage: scripts/trace_chain.py TRACE.csv[.gz]
"""
import csv
import gzip
import re
import statistics
import sys


def base_name(name):
    name = name.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    return re.split(r"[<(]", name)[0].split("::")[-1]


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [
            {"s": int(r["start_ns"]), "e": int(r["end_ns"]), "stream": r["stream"], "ctas": int(r["ctas"]),
             "k": base_name(r["kernel"]), "full": r["kernel"]}
            for r in csv.DictReader(f)
        ]
    return sorted(rows, key=lambda r: r["s"])


def linear_kind(r):
    """0: FP8 x FP8, 1: FP8 x bf16 (wo_a), None: not a linear's own kernel."""
    if r["k"] not in ("gemm_kernel", "gemv_kernel"):
        return None
    m = re.search(r"GemvWeight\)(\d)|GemvWeight::(k\w+)", r["full"])
    if not m:
        return None
    return int(m.group(1)) if m.group(1) else {"kFp8": 0, "kW8A16": 1, "kBf16": 2}.get(m.group(2))


def cuts(rows):
    norms = [r["e"] for r in rows if r["k"] == "residual_norm_kernel"]
    out = norms[:1]
    after_wo_a = False
    for i, r in enumerate(rows):
        kind = linear_kind(r)
        if kind == 1:
            after_wo_a = True
        elif kind == 0 and after_wo_a:  # wo_b
            after_wo_a = False
            nxt = next((q for q in rows[i + 1:] if q["stream"] == r["stream"]), None)
            out.append(nxt["e"] if nxt and nxt["k"] == "residual_norm_kernel" else r["e"])
    return out if len(out) > 1 else norms  # no own-kernel wo_b: the layers' own norms


# The compressor's kernels: the state rows alone, rows and entries in one
# CTA a token, and C128A's decode entries on a cluster (rows_entries_wide).
COMPRESSOR_KERNELS = {"state_rows_kernel", "rows_entries_kernel", "rows_entries_wide_kernel"}
# The indexer's scorers: the unit kernel, and run_short's one kernel.
SCORER_KERNELS = {"score_kernel", "short_kernel"}


def layers(rows):
    cut = cuts(rows)
    out = []
    for a, b in zip(cut, cut[1:]):
        ks = [r for r in rows if a < r["e"] <= b]  # a kernel belongs to the layer it ends in
        names = {r["k"] for r in ks}
        kind = "C4A" if names & SCORER_KERNELS else ("C128A" if names & COMPRESSOR_KERNELS else "SWA")
        out.append((kind, a, b, ks))
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = load(sys.argv[1])
    span = max(r["e"] for r in rows) - min(r["s"] for r in rows)
    print(f"{len(rows)} kernels, step span {span / 1e3:.1f} us")
    ls = layers(rows)
    for kind in ("SWA", "C128A", "C4A"):
        mine = [l for l in ls if l[0] == kind]
        if not mine:
            continue
        times = [b - a for _, a, b, _ in mine]
        med = statistics.median(times)
        _, a, b, ks = min(mine, key=lambda l: abs((l[2] - l[1]) - med))
        print(f"\n{kind}: {len(mine)} layers, median {med / 1e3:.1f} us (min {min(times) / 1e3:.1f}, "
              f"max {max(times) / 1e3:.1f}); the median layer:")
        print("| kernel | stream | CTAs | starts at us | ends at us | duration us |\n|---|---|---|---|---|---|")
        for r in ks:
            print(f"| {r['k']} | {r['stream']} | {r['ctas']} | {(r['s'] - a) / 1e3:.1f} | {(r['e'] - a) / 1e3:.1f} | "
                  f"{(r['e'] - r['s']) / 1e3:.1f} |")


if __name__ == "__main__":
    main()
