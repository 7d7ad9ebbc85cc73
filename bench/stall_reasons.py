"""Why a kernel's warps wait, from Nsight Compute's raw page: the warp-state samples by stall reason.

    ncu -i seed.ncu-rep --page raw --csv | python bench/stall_reasons.py

Prints each reason's share of the stalls, largest first: from the sampled warp states (SourceCounters), else from
the per-issue averages (WarpStateStats).
"""
from __future__ import annotations

import csv
import sys


PREFIXES = (  # sampled warp states (SourceCounters), else the per-issue averages (WarpStateStats)
    ("smsp__pcsamp_warps_issue_stalled_", ""),
    ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"),
)


def stall_shares(text: str) -> list[tuple[str, float]]:
    """(reason, share of all stalls), largest first, from the raw page's CSV: a row of metric names, a row of
    units, then one row per profiled kernel (the first is read)."""
    rows = [r for r in csv.reader(text.splitlines()) if r]
    header_at = next(i for i, r in enumerate(rows) if any("issue_stalled" in c for c in r))
    header, values = rows[header_at], rows[header_at + 2]
    for prefix, suffix in PREFIXES:
        samples = {}
        for name, value in zip(header, values):
            if name.startswith(prefix) and name.endswith(suffix) and "not_issued" not in name:
                try:
                    samples[name[len(prefix):len(name) - len(suffix)]] = float(value.replace(",", ""))
                except ValueError:
                    pass
        if samples:
            total = sum(samples.values()) or 1.0
            return sorted(((k, v / total) for k, v in samples.items()), key=lambda kv: -kv[1])
    raise SystemExit("no warp-stall metrics on this page (were WarpStateStats / SourceCounters collected?)")


def main():
    for reason, share in stall_shares(sys.stdin.read()):
        if share >= 0.001:
            print(f"{reason:28s} {100 * share:5.1f}%")


if __name__ == "__main__":
    main()
