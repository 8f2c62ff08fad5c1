#!/usr/bin/env python3
"""Splits a kernel's SASS, as Nsight Compute's source page exports it, into
phases between CTA barriers and prints each phase's share of the executed
instructions and of the warp samples.

Instruction counts are exact, where a short kernel's warp samples are few
(ncu's default sampling interval gives a few hundred for a 10 us kernel):
so this says where the instructions go even when the samples cannot. A
phase ends at a BAR (CTA barrier), an EXIT or PREEXIT (launch_dependents);
phases with fewer than --min executed instructions are not listed (the
percentages are of the whole kernel either way).

usage: scripts/sass_phases.py SASS.csv[.gz] [--min N] [--warps W]
  SASS.csv: ncu -i REPORT --page source --csv --print-source sass
  --warps W: divide the counts by W (the launch's warps: per-warp figures)
"""
import argparse
import csv
import gzip


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    cols = rows[header]
    return cols, rows[header + 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sass")
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--warps", type=int, default=1)
    a = ap.parse_args()
    cols, data = load(a.sass)
    i_src, i_exe = cols.index("Source"), cols.index("Instructions Executed")
    i_smp = cols.index("Warp Stall Sampling (All Samples)")
    total_e = sum(int(r[i_exe] or 0) for r in data)
    total_s = sum(int(r[i_smp] or 0) for r in data)
    print(f"{len(data)} instructions, {total_e} executed (warp level), {total_s} samples")
    print("| first | last | ends with | executed | per warp | % executed | % samples |")
    print("|---|---|---|---|---|---|---|")
    start, e, s = 0, 0, 0
    for i, r in enumerate(data):
        e += int(r[i_exe] or 0)
        s += int(r[i_smp] or 0)
        op = r[i_src].strip()
        if any(t in op for t in ("BAR", "EXIT")) or i == len(data) - 1:
            if e >= a.min:
                print(f"| {start} | {i} | `{op[:32]}` | {e} | {e / a.warps:.0f} | {100 * e / max(total_e, 1):.1f} |"
                      f" {100 * s / max(total_s, 1):.1f} |")
            start, e, s = i + 1, 0, 0


if __name__ == "__main__":
    main()
