"""Turning result rows (plain dicts) into what people read: Markdown tables, CSV, JSON,
geometric means and ratios, plots, and progress lines. Pure Python; matplotlib is imported only
to draw, and a missing matplotlib costs the plot, never the run."""
from __future__ import annotations

import csv
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


def fmt(x: Any, nd: int = 3) -> str:
    """A number for a table: ``nd`` decimals, scientific when that would print 0, '-' for None."""
    if x is None:
        return "-"
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return str(x)
    if math.isnan(x):
        return "NaN"
    return f"{x:.1e}" if 0 < abs(x) < 10 ** -nd else f"{x:.{nd}f}"


def fmt_x(x: float | None) -> str:
    """A speed-up or ratio: '1.23x'."""
    return "-" if x is None else f"{x:.2f}x"


def fmt_e(x: float | None) -> str:
    """An error: '1.2e-03'."""
    return fmt(x) if x is None or math.isnan(x) else f"{x:.1e}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0 (a table shows '-', never inf)."""
    return None if a is None or not b else a / b


def geomean(xs: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive finite values (speed-ups); None without any."""
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def speedup_summary(rows: Sequence[dict], dtypes: Sequence[str], target: float) -> list[dict]:
    """Per dtype: the geometric means of the rows' ``speedup`` and ``wall_speedup`` (pitgen
    against its best peer, GPU and eager wall time) and whether the GPU one meets ``target``."""
    out = []
    for dt in dtypes:
        rs = [x for x in rows if x["dtype"] == dt]
        if rs:
            gm = geomean([x["speedup"] for x in rs])
            out.append({"dtype": dt, "cases": len(rs), "geomean_speedup": gm,
                        "geomean_wall_speedup": geomean([x["wall_speedup"] for x in rs]),
                        "target": target, "met": None if gm is None else gm >= target,
                        "all_correct": all(x["ok"] for x in rs)})
    return out


def speedup_table(summ: Sequence[dict]) -> list[str]:
    """The markdown table of :func:`speedup_summary`'s rows."""
    return md_table(["dtype", "cases", "GPU speed-up", "wall speed-up", "target", "met",
                     "all correct"],
                    [[s["dtype"], s["cases"], f"{fmt(s['geomean_speedup'], 2)}x",
                      f"{fmt(s['geomean_wall_speedup'], 2)}x", f">= {s['target']}x",
                      "-" if s["met"] is None else ("**met**" if s["met"] else "**missed**"),
                      "yes" if s["all_correct"] else "NO"] for s in summ])


def md_table(head: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table as lines; cells are str()-ed and pipes escaped."""
    def cell(c: Any) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cell(c) for c in row) + " |" for row in body])


def write_csv(rows: Sequence[dict], path: Path, lead: Sequence[str] = ()) -> None:
    """Rows as CSV: the ``lead`` columns first (those present), then the rest sorted."""
    keys = [k for k in lead if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r} - set(keys))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_json(path: Path, doc: Any) -> None:
    """Indented JSON; what JSON cannot hold (a Path, a dtype) is written as its str()."""
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def rel_err(got: Any, ref: Any) -> float:
    """Relative Frobenius error of two torch tensors, in float64 (the absolute one if ref is 0)."""
    d = (got.double() - ref.double()).norm().item()
    n = ref.double().norm().item()
    return d / n if n else d


def describe(e: BaseException) -> str:
    """One line for a failure: type, first line of the message, where it was raised."""
    msg = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    tb = traceback.extract_tb(e.__traceback__)
    where = f" [{tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}]" if tb else ""
    return f"{type(e).__name__}: {msg}"[:300] + where


class Progress:
    """One line per step on stderr (stdout stays the results): a bar, the step, elapsed time
    and a naive estimate of the time left."""

    def __init__(self, total: int, width: int = 24):
        self.total, self.width, self.done, self.t0 = total, width, 0, time.monotonic()

    def step(self, what: str) -> None:
        el = time.monotonic() - self.t0
        fill = self.width * min(self.done, self.total) // max(self.total, 1)
        eta = f", ~{el / self.done * (self.total - self.done):.0f}s left" if self.done else ""
        self.done += 1
        print(f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {what} "
              f"| {el:.0f}s{eta}", file=sys.stderr, flush=True)


def plot(path: Path, draw: Callable[[Any], Any]) -> str | None:
    """Draw a figure with ``draw(pyplot) -> figure`` and save it to ``path``; returns a note
    instead when matplotlib is missing (the data files are written anyway)."""
    try:
        import matplotlib
    except ImportError:
        return (f"{Path(path).name} not drawn: matplotlib is not installed "
                "(pip install matplotlib, then --replot DIR)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def legend(fig: Any, axes: Iterable[Any], loc: str) -> None:
    """One legend for a figure of several axes, each label once."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc=loc, ncol=min(len(seen), 4),
                   fontsize=8)
