"""The cost model behind ``format="auto"``: a format, its parameters and a schedule for a graph
operator (SpMM, SDDMM) from row-length statistics alone, without running anything.

Why a model: the measured search of pitgen.graph.tune costs seconds per graph; a user's first
call must not. The statistics (:meth:`DeviceCSR.row_stats`: rows, nnz, mean / max / std row
length, computed on the GPU and read with one host sync) are enough, because on the graphs of
docs/bench/graphs.md (H100) two effects decide every SpMM result:

* **the longest row's chain.** A CSR, ELL or BSR row is walked by one group of lanes, a batch
  of ``unroll`` dependent gathers at a time; the default CSR times are ``batches x 0.3 us`` of
  the longest row on all five graphs whose CSR time was measured (cora 472 neighbours: 0.082
  ms; ogbn-proteins 132,534: 21.2 ms). hyb cuts rows into pieces of ``2**k`` slots, so its
  chain is one piece plus the summing of a cut row's partial rows.
* **bytes.** Every stored slot moves its index and value and gathers a row of X (F elements),
  at about 4 TB/s on H100 (tuned hyb: 2.5 TB/s at F=32 on ogbn-arxiv, 3.7 at F=512; L2 hits);
  padding (ELL: every row as wide as the longest; BSR: whole blocks, gathered) costs the same.

:func:`spmm_us` / :func:`sddmm_us` turn these into modelled microseconds (coarse: within about
2x of the measured times; ratios between formats are what matter). :func:`decide` takes the
parameters of a format from rules fitted to the tuned choices of docs/bench/graphs.md
(:func:`hyb_params`, docs/tune.md has the table) and the format with the least modelled time
(SpMM) or CSR unless the rows are dense and V outgrows L2 (SDDMM: edge-parallel, no chain, so
CSR's lack of padding wins; the tuned table picks CSR or a hyb within 4 % of it everywhere
else). :func:`warn_if_slow` warns when an explicit format is modelled ``WARN_RATIO`` times
slower than the model's choice. :func:`plan` is what ``format="auto"`` calls: a tuned result
from the tune cache when there is one, else the model; or, with ``tune=True``, the search.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import FormatWarning, PlanError
from . import kernels as graph_ops
from .formats import FORMATS
from .tune import HYB_K, GraphStats, default_params, infeasible, lookup, tune

log = logging.getLogger("pitgen.graph")

#: Fixed cost of a launch with its L2-flushed first loads (the smallest tuned times, us).
LAUNCH_US = 5.0
#: One batch of dependent gathers of a group (an index load, or ``unroll`` rows of X), us:
#: fitted to the default CSR times of docs/bench/graphs.md (0.28-0.34 us on five graphs).
STEP_US = 0.3
#: Gathered bytes per microsecond (4 TB/s: tuned hyb SpMM, mostly L2 hits).
BYTES_PER_US = 4.0e6
#: hyb pads each bucket row to a power of two: 4/3 of the non-zeros on average.
HYB_PADDING = 4.0 / 3.0
#: Mean row length from which hyb splits columns (c > 1: dense rows, many pieces per row).
DENSE_ROWS = 64.0
#: Bytes of the gathered dense operand up to which c = 4 column parts serve; beyond, 8.
SPLIT_BYTES = 128 << 20
#: SDDMM leaves CSR for hyb(c > 1) only on dense rows whose V is at least this large (its
#: column parts then fit L2: ogbn-proteins F >= 256 fp32, 12-23 % faster).
SDDMM_SPLIT_BYTES = 96 << 20
#: From this many rows hyb takes one more doubling of its widest bucket (ogbn-arxiv: k = 5 on
#: all ten tuned cases, where the mean row alone gives 4).
MANY_ROWS = 1 << 16
#: hyb SpMM gathers HYB_SMALL_UNROLL neighbours at once per lane (``unroll``) on unsplit rows
#: (c == 1) where its bucket rows have at most HYB_SMALL_GROUP lanes, or at most
#: HYB_FEW_ROWS_GROUP on graphs of fewer than MANY_ROWS rows: there too few warps hide the
#: gathers' latency, so each lane keeps more in flight (H200, session 36, ms from unroll 2 to
#: 4: F = 16 fp32 ppi 0.0278 -> 0.0206, pubmed 0.0216 -> 0.0188, ogbn-arxiv 0.0433 -> 0.0387;
#: F = 64 fp32 (16 lanes) cora 0.0127 -> 0.0111, ppi 0.0249 -> 0.0223 but ogbn-arxiv 0.0818 ->
#: 0.0898; with c = 4, ogbn-proteins and reddit at F = 16, 3-4 % slower; 32 lanes mixed).
HYB_SMALL_UNROLL = graph_ops.HYB_SMALL_UNROLL
HYB_SMALL_GROUP = 4
HYB_FEW_ROWS_GROUP = graph_ops.HYB_SMALL_UNROLL_GROUP
#: An explicit format modelled this many times slower than the model's choice is warned about.
WARN_RATIO = 10.0

#: An edge list multiplied as it comes (``DeviceCOO``, kernels.spmm_coo): GPU ns per (edge,
#: feature) of its atomic adds (H100, F = 64: 0.0037 on ogbn-arxiv, 0.0042 ppi, 0.0049 pubmed;
#: 0.0097 on ogbn-proteins, whose hub rows contend), and a bound on the host time per call that
#: converting it instead costs (``DeviceCSR.from_coo``, hyb sized by bounds, a new SpMM launch
#: closure: 0.7-0.9 ms of Python and driver calls per small graph on that H100's host,
#: docs/formats.md).
COO_NS_PER_EDGE_FEATURE = 0.004
CONVERT_HOST_US = 300.0


def coo_pays(nnz: int, feat: int) -> bool:
    """Whether ``format="auto"`` multiplies an edge list directly: while its atomic adds take
    less GPU time than converting takes on the host, a call that converted would wait for its
    host work anyway (eager), and the direct launch also skips the conversion's GPU passes."""
    return LAUNCH_US + nnz * feat * COO_NS_PER_EDGE_FEATURE * 1e-3 <= CONVERT_HOST_US


def _elem(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _steps(length: float, group: int, unroll: int) -> float:
    """Dependent batches of a group walking ``length`` entries: per chunk of ``group`` entries,
    one index load, then the chunk's gathers ``unroll`` at a time (templates/spmm.cu.j2)."""
    if length <= 0:
        return 0.0
    chunk = min(group, length)
    return math.ceil(length / group) * (1 + math.ceil(chunk / unroll))


def hyb_params(s: GraphStats, op: str, feat: int, dtype: str) -> dict[str, int]:
    """hyb's (c, k) by rule: k = ceil(log2 mean row) + 1, one more from MANY_ROWS rows, within
    HYB_K (the widest bucket a little above the typical row: short rows are not padded far, long
    ones are cut into few pieces); c = 1 unless rows are dense (mean >= DENSE_ROWS), then 4, or 8
    when the dense operand exceeds SPLIT_BYTES (column parts that fit L2)."""
    k = math.ceil(math.log2(max(s.mean, 1.0))) + 1 + (s.rows >= MANY_ROWS)
    k = min(max(k, HYB_K[0]), HYB_K[-1])
    c = 1
    if s.mean >= DENSE_ROWS:
        c = 4 if s.cols * feat * _elem(dtype) <= SPLIT_BYTES else 8
    return {"c": c, "k": k}


def hyb_schedule(params: Mapping[str, Any], schedule: Mapping[str, Any],
                 s: GraphStats) -> dict[str, Any]:
    """hyb SpMM's schedule with the model's unroll (HYB_SMALL_UNROLL where the groups are
    small for the graph's rows and rows are not split), the schedule's own otherwise."""
    out = dict(schedule)
    small = HYB_FEW_ROWS_GROUP if s.rows < MANY_ROWS else HYB_SMALL_GROUP
    if int(params["c"]) == 1 and max(out["groups"]) <= small:
        out["unroll"] = HYB_SMALL_UNROLL
    return out


def _bsr_blocks(s: GraphStats, b: int) -> tuple[float, float]:
    """Expected stored blocks and blocks of the longest block row, with the non-zeros of a block
    row placed at random among its block columns (a graph with locality does better; the
    pattern is not known before converting)."""
    brows, bcols = max(1, math.ceil(s.rows / b)), max(1, math.ceil(s.cols / b))
    per = s.nnz / brows
    blocks = brows * bcols * -math.expm1(-per / bcols)
    return blocks, min(bcols, max(s.max, 1))


def spmm_us(fmt: str, params: Mapping[str, Any], schedule: Mapping[str, Any], s: GraphStats,
            feat: int, dtype: str) -> float:
    """Modelled SpMM time (us): launch + the longest chain + bytes (see the module docstring)."""
    e = _elem(dtype)
    row = feat * e
    out = s.rows * row
    if fmt == "hyb":
        g = max(schedule["groups"])
        u = schedule["unroll"]
        width, c = 1 << int(params["k"]), int(params["c"])
        pieces = math.ceil(s.max / (c * width))   # of the longest row's column part
        if c == 1:  # the last piece sums the partial rows, four at a time
            chain = _steps(width, g, u) + math.ceil(pieces / 4)
            extra = (s.nnz / width) * feat * 4 * 2   # partial rows written and read back
        else:       # pieces add into an fp32 workspace row, then a finish pass copies it
            chain = _steps(width, g, u) + pieces * c / 32
            extra = s.rows * feat * 4 * 3
        moved = HYB_PADDING * s.nnz * (4 + e) + s.nnz * row + out + extra
    elif fmt == "bsr":
        b = int(params["block"])
        blocks, longest = _bsr_blocks(s, b)
        chain = _steps(longest * b, schedule["group"], schedule["unroll"])
        # every row of a block row walks all its blocks' columns: X gathered b times per block
        moved = blocks * b * b * (e + row) + blocks * 4 + out
    else:
        width = s.max if fmt == "csr" else int(params["width"])
        slots = s.nnz if fmt == "csr" else s.rows * width
        chain = _steps(width, schedule["group"], schedule["unroll"])
        moved = slots * (4 + e) + s.nnz * row + out + (8 * s.rows if fmt == "csr" else 0)
    return LAUNCH_US + chain * STEP_US + moved / BYTES_PER_US


def sddmm_us(fmt: str, params: Mapping[str, Any], s: GraphStats, feat: int, dtype: str) -> float:
    """Modelled SDDMM time (us): edge-parallel (no chain), so bytes of the stored slots, each
    gathering a row of U and one of V, plus its index, position and value."""
    e = _elem(dtype)
    if fmt == "ell":
        slots = s.rows * int(params["width"])
    elif fmt == "bsr":
        slots = _bsr_blocks(s, int(params["block"]))[0] * int(params["block"]) ** 2
    elif fmt == "hyb":
        slots = HYB_PADDING * s.nnz
    else:
        slots = s.nnz
    return LAUNCH_US + (slots * (2 * feat * e + 8 + e)) / BYTES_PER_US


def _params(fmt: str, s: GraphStats, op: str, feat: int, dtype: str) -> dict[str, Any]:
    return hyb_params(s, op, feat, dtype) if fmt == "hyb" else default_params(fmt, s)


def modelled_us(op: str, fmt: str, params: Mapping[str, Any], schedule: Mapping[str, Any],
                s: GraphStats, feat: int, dtype: str) -> float:
    """Modelled time (us) of ``op`` on a matrix with statistics ``s`` in ``fmt``."""
    if op == "spmm":
        return spmm_us(fmt, params, schedule, s, feat, dtype)
    return sddmm_us(fmt, params, s, feat, dtype)


@dataclass
class Decision:
    """The model's choice for one operator, feature width and dtype on one graph: format,
    parameters, schedule and modelled time (us), with every feasible format's modelled time
    at its own rule parameters (``modelled``) and why the others were left out."""
    op: str
    feat: int
    dtype: str
    fmt: str
    params: dict[str, Any]
    schedule: dict[str, Any]
    us: float
    modelled: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params.items())
        others = ", ".join(f"{f} {us:.1f}" for f, us in sorted(self.modelled.items(),
                                                              key=lambda kv: kv[1]))
        return (f"{self.op} feat={self.feat} {self.dtype}: {self.fmt}({p}), modelled "
                f"{self.us:.1f} us (modelled us: {others})")


def _check(op: str, feat: int, dtype: str, formats: Sequence[str]) -> None:
    if op not in graph_ops.OPS:
        raise PlanError(f"unknown graph operator {op!r} (operators: {', '.join(graph_ops.OPS)})")
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PlanError(f"unknown format(s) {bad or list(formats)!r}; choose from "
                        f"{', '.join(FORMATS)}")
    if not isinstance(feat, int) or isinstance(feat, bool) or feat < 1:
        raise PlanError(f"feature width must be a positive integer, got {feat!r}")


def decide(s: GraphStats, op: str, feat: int, dtype: str,
           formats: Sequence[str] = FORMATS) -> Decision:
    """The model's format, parameters and default schedule for ``op`` at ``feat`` features of
    ``dtype`` on a matrix with statistics ``s``; never a format that :func:`infeasible`
    refuses (CSR, always feasible, is the answer when nothing else is allowed)."""
    _check(op, feat, dtype, formats)
    modelled: dict[str, float] = {}
    chosen: dict[str, tuple[dict, dict]] = {}
    excluded: dict[str, str] = {}
    for f in dict.fromkeys(formats):
        params = _params(f, s, op, feat, dtype)
        why = infeasible(f, params, s)
        if why:
            excluded[f] = why
            continue
        sched = graph_ops.default_schedule(op, f, feat, dtype)
        # modelled at the default schedule (the fitted one); hyb then runs with its unroll rule
        modelled[f] = modelled_us(op, f, params, sched, s, feat, dtype)
        chosen[f] = (params, hyb_schedule(params, sched, s) if op == "spmm" and f == "hyb"
                     else sched)
    if not chosen:
        raise PlanError(f"no allowed format can hold this matrix: {'; '.join(excluded.values())}")
    if s.nnz == 0:
        best = "csr" if "csr" in chosen else min(chosen, key=modelled.__getitem__)
    elif op == "sddmm":
        split = s.mean >= DENSE_ROWS and s.cols * feat * _elem(dtype) >= SDDMM_SPLIT_BYTES
        if split and "hyb" in chosen:
            c = 4 if s.cols * feat * _elem(dtype) <= 2 * SPLIT_BYTES else 8
            chosen["hyb"] = ({"c": c, "k": HYB_K[-1]}, chosen["hyb"][1])
            best = "hyb"
        else:
            best = "csr" if "csr" in chosen else min(chosen, key=modelled.__getitem__)
    else:
        best = min(chosen, key=modelled.__getitem__)
    params, sched = chosen[best]
    return Decision(op, feat, dtype, best, dict(params), dict(sched), modelled[best], modelled,
                    excluded)


def warn_if_slow(s: GraphStats, op: str, feat: int, dtype: str, fmt: str,
                 params: Mapping[str, Any], schedule: Mapping[str, Any],
                 stacklevel: int = 3) -> float | None:
    """Warn (:class:`FormatWarning`) when ``fmt`` with ``params`` is modelled at least
    WARN_RATIO times slower than the model's choice on this graph; returns that ratio, or None
    when the graph is empty. A format whose padding :func:`infeasible` refuses is warned about
    with that reason and the better format."""
    if s.nnz == 0:
        return None
    d = decide(s, op, feat, dtype)
    if fmt == d.fmt:
        return 1.0
    mine = modelled_us(op, fmt, params, schedule, s, feat, dtype)
    ratio = mine / d.us
    why = infeasible(fmt, params, s)
    if ratio >= WARN_RATIO or why:
        p = ", ".join(f"{k}={v}" for k, v in d.params.items())
        warnings.warn(
            f"format {fmt!r} is modelled {ratio:.0f}x slower than {d.fmt}({p}) on this graph "
            f"({s.rows} rows, mean row {s.mean:.1f}, longest {s.max}"
            f"{'; ' + why if why else ''}): use format={d.fmt!r} or format='auto'",
            FormatWarning, stacklevel=stacklevel)
    return ratio


@dataclass
class AutoChoice:
    """What ``format="auto"`` runs: format, parameters, schedule, where the choice came from
    ('model', 'cache': a stored tuned result, 'search': a search just now), the statistics, and
    the planning time (ms: statistics, cache lookup, model or search; no conversion)."""
    fmt: str
    params: dict[str, Any]
    schedule: dict[str, Any]
    source: str
    stats: GraphStats
    plan_ms: float


def plan(a: Any, op: str, feat: int, dtype: str, tune_search: bool = False,
         budget_s: float = 10.0, formats: Sequence[str] = FORMATS) -> AutoChoice:
    """``format="auto"`` for the DeviceCSR ``a``: its row statistics (on the GPU, one host
    sync), then a tuned result of the tune cache for matrices like it (preferred: measured),
    else the model's :func:`decide` (microseconds of Python). With ``tune_search`` a search of
    ``budget_s`` runs when the cache has no result (each trial and the choice are logged to the
    ``pitgen.graph`` logger at INFO, and the result is stored)."""
    t0 = time.perf_counter()
    s = GraphStats.from_dict(a.row_stats())
    hit = lookup(s, op, feat, dtype, formats)
    if hit is not None:
        fmt, params, sched, source = hit.fmt, hit.params, hit.schedule, "cache"
    elif tune_search:
        log.info("tuning %s (feat %d, %s) on a %d x %d graph, %d non-zeros, for up to %g s",
                 op, feat, dtype, s.rows, s.cols, s.nnz, budget_s)

        def progress(t: Any, elapsed: float) -> None:
            took = f"{t.ms:.4f} ms" if t.ms is not None else f"{t.status}: {t.reason}"
            log.info("tune %5.1f/%g s  %s %s %s -> %s", elapsed, budget_s, t.fmt, t.params,
                     t.schedule, took)

        r = tune(a, op, feat, dtype, budget_s, formats, progress=progress)
        fmt, params, sched, source = r.fmt, r.params, r.schedule, "search"
    else:
        d = decide(s, op, feat, dtype, formats)
        fmt, params, sched, source = d.fmt, d.params, d.schedule, "model"
    ms = (time.perf_counter() - t0) * 1e3
    log.info("format auto (%s, %.1f ms): %s feat=%d %s -> %s %s %s", source, ms, op, feat, dtype,
             fmt, params, sched)
    return AutoChoice(fmt, dict(params), dict(sched), source, s, ms)
