"""Where a profiled kernel's warps wait and its shared-memory wavefronts go, per SASS line,
from Nsight Compute's source page (what docs/performance.md quotes as "the profile"):

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats \\
        --import-source yes -o prof python3 scripts/profile_cases.py rows1x64-90
    ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python3 scripts/ncu_summary.py sass.csv.gz [--top 25] [--window 100]

For each kernel of the file: the totals (stall samples, shared wavefronts and their excess, L2
sectors in excess), the same per opcode, the lines holding most samples with their two largest
stall reasons, and the samples per window of consecutive instructions with the landmark
opcodes each holds (wgmma, barriers, copies, adds), which is how a warp-specialized kernel's
roles show apart. Reads a plain or gzipped CSV; writes text to stdout.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import defaultdict
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
WAVEFRONTS, EXCESS = "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive"
SECTORS_EXCESS = "L2 Theoretical Sectors Global Excessive"
#: opcodes that mark a region of the kernel in the window view
LANDMARKS = ("HGMMA", "LDGSTS", "UTMALDG", "SYNCS.ARRIVE", "SYNCS.PHASECHK", "BAR.SYNC",
             "BAR.ARV", "DEPBAR", "FADD", "STS", "LDS", "LDG", "SHFL", "EXIT")


@dataclass
class Line:
    """One SASS instruction of the source page and its counters."""
    address: int
    source: str
    counters: dict[str, float]

    @property
    def mnemonic(self) -> str:
        """The instruction with its modifiers, without its predicate (``@!P0 LDGSTS.E.128``)."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0] if words else ""

    @property
    def opcode(self) -> str:
        """The mnemonic without its modifiers (``LDGSTS.E.128`` -> LDGSTS)."""
        return self.mnemonic.split(".")[0]

    def marks(self, landmark: str) -> bool:
        """Whether this is a ``landmark`` instruction: its opcode, or with modifiers
        (``BAR.SYNC``) the start of its mnemonic."""
        if "." in landmark:
            return self.mnemonic.startswith(landmark)
        return self.opcode == landmark

    def get(self, name: str) -> float:
        return self.counters.get(name, 0.0)


@dataclass
class Kernel:
    name: str
    lines: list[Line] = field(default_factory=list)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse(text: str) -> list[Kernel]:
    """The kernels of a ``--page source --csv`` export: each a ``"Kernel Name",NAME`` row, a
    header row, then one row per instruction."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1] if len(row) > 1 else "?"))
            header = None
        elif header is None:
            header = row
        elif kernels and len(row) == len(header):
            values = dict(zip(header, row))
            counters = {k: v for k, v in ((k, _number(v)) for k, v in values.items())
                        if v is not None}
            address = int(values.get("Address", "0"), 16) if values.get("Address") else 0
            kernels[-1].lines.append(Line(address, values.get("Source", "").strip(), counters))
    return kernels


def _stalls(line: Line, header_names: list[str], n: int = 2) -> str:
    reasons = sorted(((line.get(h), h[len("stall_"):]) for h in header_names), reverse=True)
    return ", ".join(f"{r} {int(v)}" for v, r in reasons[:n] if v > 0)


def summary(kernel: Kernel, top: int = 25, window: int = 100) -> str:
    """The text report of one kernel."""
    lines = kernel.lines
    stall_names = sorted({k for ln in lines for k in ln.counters
                          if k.startswith("stall_") and "Not Issued" not in k})
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for ln in lines:
        acc = by_op[ln.opcode]
        for i, name in enumerate((SAMPLES, WAVEFRONTS, EXCESS, SECTORS_EXCESS)):
            acc[i] += ln.get(name)
    samples, wavefronts, excess, sectors = (sum(col) for col in zip(*by_op.values())) \
        if by_op else (0.0,) * 4
    total = samples or 1.0
    out = [f"== {kernel.name}: {len(lines)} instructions, {int(samples)} stall samples, "
           f"{int(wavefronts):,} shared wavefronts ({int(excess):,} excess), "
           f"{int(sectors):,} L2 sectors in excess"]
    out.append("-- per opcode: samples % | shared wavefronts | excess | L2 sectors in excess")
    for op, (s, w, e, x) in sorted(by_op.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        out.append(f"{op:<12} {100 * s / total:5.1f}% {int(w):>12,} {int(e):>12,} {int(x):>12,}")
    out.append("-- lines with most samples: index, address, samples %, source, stall reasons")
    ranked = sorted(range(len(lines)), key=lambda i: -lines[i].get(SAMPLES))[:top]
    for i in ranked:
        ln = lines[i]
        out.append(f"{i:>5} {ln.address & 0xfffff:05x} {100 * ln.get(SAMPLES) / total:5.1f}% "
                   f"{ln.source[:56]:<56} {_stalls(ln, stall_names)}")
    out.append(f"-- samples per window of {window} instructions, with its landmark opcodes")
    for a in range(0, len(lines), window):
        part = lines[a:a + window]
        share = 100 * sum(ln.get(SAMPLES) for ln in part) / total
        marks = [m for m in LANDMARKS if any(ln.marks(m) for ln in part)]
        out.append(f"{a:>5} {part[0].address & 0xfffff:05x} {share:5.1f}% {' '.join(marks)}")
    return "\n".join(out)


def read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz too)")
    ap.add_argument("--top", type=int, default=25, help="opcodes and lines listed")
    ap.add_argument("--window", type=int, default=100, help="instructions per window")
    args = ap.parse_args(argv)
    kernels = parse(read(args.csv))
    if not kernels:
        print(f"{args.csv}: no kernel in it (expected ncu's source page as CSV)")
        return 1
    print("\n\n".join(summary(k, args.top, args.window) for k in kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
