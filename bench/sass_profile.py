"""Where a generated kernel's instructions and stalls go, from Nsight Compute's per-instruction (SASS) page.

    ncu --clock-control none --kernel-name regex:pnca_ --launch-skip 2 --launch-count 1 --section SourceCounters \
        -o seed python bench/profile_kernel.py seed
    ncu -i seed.ncu-rep --page source --csv --print-source sass > seed_sass.csv
    python bench/sass_profile.py seed_sass.csv [--per N]

Prints the instruction mix by opcode (executed warp instructions and stall samples), the instructions grouped by
how often each ran (straight-line code runs once per unit of work, so a group is a phase: per head, per
statistics pass, per stage load), and the instructions with the most stall samples. With --per N (e.g. the number
of warp-heads, B * ceil(Lq / 16) * H for the few_keys tile) the counts are also given per unit.
"""
from __future__ import annotations

import argparse
import csv
import io
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    index: int
    text: str        # SASS, predicate included
    executed: int    # warp-level executions
    stalls: int      # warp stall samples (all)

    @property
    def opcode(self) -> str:
        words = self.text.split()
        if words and words[0].startswith("@"):  # predicate guard
            words = words[1:]
        return words[0].split(".")[0] if words else ""


def read_sass_csv(text: str) -> list[Instruction]:
    """Rows of ncu's ``--page source --csv --print-source sass`` output (a kernel-name line, then the header)."""
    rows = list(csv.reader(io.StringIO(text)))
    header_at = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    header = rows[header_at]
    src, ex = header.index("Source"), header.index("Instructions Executed")
    st = header.index("Warp Stall Sampling (All Samples)")
    return [Instruction(i, r[src].strip(), int(r[ex] or 0), int(r[st] or 0))
            for i, r in enumerate(rows[header_at + 1:]) if len(r) > max(src, ex, st)]


def opcode_mix(instrs: list[Instruction]) -> list[tuple[str, int, int]]:
    """(opcode, executed, stall samples), most executed first."""
    executed, stalls = Counter(), Counter()
    for ins in instrs:
        executed[ins.opcode] += ins.executed
        stalls[ins.opcode] += ins.stalls
    return [(op, n, stalls[op]) for op, n in executed.most_common()]


def by_execution_count(instrs: list[Instruction]) -> list[tuple[int, int, int]]:
    """(times run, static instructions, executed) for each distinct count, most executed first."""
    static, executed = Counter(), Counter()
    for ins in instrs:
        static[ins.executed] += 1
        executed[ins.executed] += ins.executed
    return [(count, static[count], n) for count, n in executed.most_common()]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--per", type=int, default=0, help="units of work (e.g. warp-heads) to divide counts by")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    with open(args.csv) as f:
        instrs = read_sass_csv(f.read())
    total = sum(i.executed for i in instrs) or 1
    stall_total = sum(i.stalls for i in instrs) or 1
    per = "  per unit" if args.per else ""
    print(f"{len(instrs)} instructions, {total:,} executed, {stall_total:,} stall samples")
    print(f"\nopcode      executed   share  stalls{per}")
    for op, n, st in opcode_mix(instrs)[:args.top]:
        unit = f"  {n / args.per:8.1f}" if args.per else ""
        print(f"{op:10s} {n:10,d} {100 * n / total:6.1f}% {100 * st / stall_total:6.1f}%{unit}")
    print("\ntimes run   static   executed   share")
    for count, static, n in by_execution_count(instrs)[:args.top]:
        print(f"{count:9,d} {static:8d} {n:10,d} {100 * n / total:6.1f}%")
    print("\nmost stalled")
    for ins in sorted(instrs, key=lambda i: -i.stalls)[:args.top]:
        print(f"{ins.index:5d} {ins.executed:10,d} {100 * ins.stalls / stall_total:5.1f}%  {ins.text}")


if __name__ == "__main__":
    main()
