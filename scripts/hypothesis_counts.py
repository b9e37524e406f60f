"""Examples each Hypothesis test ran, from a pytest log made with --hypothesis-show-statistics:
one line per test function (its parametrized items summed), the items, and whether the function
reached pitgen.testing.THOROUGH_EXAMPLES. Counts the generate, reuse and explicit phases (the
shrink phase replays variants of a failure, not new examples).

    python3 scripts/hypothesis_counts.py LOG [--min N] [--expect COLLECTED]

Exit status 1 when a function ran fewer than ``--min`` examples (default: none required), or
when a function listed in COLLECTED (``pytest --collect-only -q`` output: the run's selection)
never reported statistics (the run was stopped before it finished)."""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

HEADER = re.compile(r"^(\S+::[^\s\[]+)(\[.*\])?:$")
PHASE = re.compile(r"^\s*- during (\w+) phase")
COUNTS = re.compile(r"^\s*- (\d+) passing, (\d+) failing, and (\d+) invalid")
NEW_EXAMPLES = ("generate", "reuse", "explicit")


def count(lines: list[str]) -> dict[str, tuple[int, int, int]]:
    """test function -> (items, passing examples, failing examples) over its items."""
    items: dict[str, set[str]] = defaultdict(set)
    passing: dict[str, int] = defaultdict(int)
    failing: dict[str, int] = defaultdict(int)
    test = phase = None
    for line in lines:
        if (m := HEADER.match(line.rstrip())):
            test, phase = m.group(1), None
            items[test].add(m.group(2) or "")
        elif (m := PHASE.match(line)):
            phase = m.group(1)
        elif (m := COUNTS.match(line)) and test and phase in NEW_EXAMPLES:
            passing[test] += int(m.group(1))
            failing[test] += int(m.group(2))
    return {t: (len(items[t]), passing[t], failing[t]) for t in items}


def collected(lines: list[str]) -> set[str]:
    """The test functions (parameters dropped) in ``pytest --collect-only -q`` output."""
    return {line.strip().split("[")[0] for line in lines if "::" in line}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--min", type=int, default=0, help="examples each function must reach")
    ap.add_argument("--expect", help="pytest --collect-only -q output of the run's selection")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        counts = count(f.readlines())
    if args.expect:
        with open(args.expect, errors="replace") as f:
            for test in collected(f.readlines()) - set(counts):
                counts[test] = (0, 0, 0)     # selected but never finished: short of any --min
    if not counts:
        print(f"no Hypothesis statistics in {args.log} (pytest ran without "
              f"--hypothesis-show-statistics, or was killed before its summary)")
        return 1
    short = 0
    print(f"{'test function':<78} {'items':>5} {'examples':>8} {'failing':>7}")
    for test, (n_items, n_pass, n_fail) in sorted(counts.items()):
        total = n_pass + n_fail
        mark = "  never ran" if n_items == 0 else "  < min" if total < args.min else ""
        short += total < args.min or n_items == 0
        print(f"{test:<78} {n_items:>5} {total:>8} {n_fail:>7}{mark}")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
