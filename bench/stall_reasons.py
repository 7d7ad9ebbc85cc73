"""Why a kernel's warps wait, from Nsight Compute's raw page: the warp-state samples by stall reason.

    ncu -i seed.ncu-rep --page raw --csv | python bench/stall_reasons.py

Prints each reason's share of the sampled warp states (the WarpStateStats section collects them), largest first.
"""
from __future__ import annotations

import csv
import sys


def stall_shares(text: str) -> list[tuple[str, float]]:
    rows = [r for r in csv.reader(text.splitlines()) if r]
    header = next(r for r in rows if "ID" in r and any("issue_stalled" in c for c in r))
    values = rows[rows.index(header) + 2]  # a units row sits between the names and the first kernel's values
    samples = {}
    for name, value in zip(header, values):
        if name.startswith("smsp__pcsamp_warps_issue_stalled_") and not name.endswith("_not_issued"):
            try:
                samples[name.removeprefix("smsp__pcsamp_warps_issue_stalled_")] = float(value.replace(",", ""))
            except ValueError:
                pass
    if not samples:
        raise SystemExit("no smsp__pcsamp_warps_issue_stalled_* metrics on this page (was WarpStateStats collected?); "
                         "stall-like names: " + ", ".join(c for c in header if "stall" in c)[:2000])
    total = sum(samples.values()) or 1.0
    return sorted(((k, v / total) for k, v in samples.items()), key=lambda kv: -kv[1])


def main():
    for reason, share in stall_shares(sys.stdin.read()):
        if share >= 0.001:
            print(f"{reason:28s} {100 * share:5.1f}%")


if __name__ == "__main__":
    main()
