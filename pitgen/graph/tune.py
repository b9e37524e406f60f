"""The formats x schedules tuner for graph operators (SpMM, SDDMM): SparseTIR's search over
composable formats, with conversions on the GPU.

The search is separated from the clock so that it can be tested on the CPU: :class:`Search`
enumerates candidates (format, format parameters, kernel schedule) and decides what to try next
from the times a ``measure`` function reports; :func:`tune` plugs in CUDA-event timing of the
kernels in pitgen.graph.kernels. Results are cached on disk per operator, dtype, feature width,
device and a bucket of the matrix's row-length statistics, so that graphs that look alike share
one entry and a later process skips the search.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .. import cache
from ..errors import FileError, PitgenError, PlanError
from ..runtime import compile_ahead
from . import kernels as graph_ops
from .device import DeviceCSR, to_format
from .formats import BSR_BLOCKS, FORMATS
from .kernels import OPS
HYB_C = (1, 2, 4, 8)
HYB_K = (2, 3, 4, 5, 6)
BSR_DEFAULT = 16
#: ELL pads every row to the longest: tried only while padded slots stay within this many nnz
#: (a power-law graph's longest row makes ELL many times larger than the matrix).
ELL_MAX_PADDING = 4.0
#: BSR's padding is unknown before converting; tried only where the worst case (one non-zero
#: per block) fits in this many stored elements.
BSR_MAX_ELEMENTS = 1 << 28
#: Stored blocks/slots below this never count as too much padding (tiny graphs).
SMALL_ELEMENTS = 1 << 16
CACHE_VERSION = 1
#: GPU spin (cycles, about 0.5 ms at H100 clocks) queued before each timed run.
HIDE_CYCLES = 1_000_000


# -- statistics and cache keys ----------------------------------------------------------------

@dataclass(frozen=True)
class GraphStats:
    """Row-length statistics of a sparse matrix: what format choices depend on."""
    rows: int
    cols: int
    nnz: int
    mean: float
    max: int
    std: float
    empty: float  # fraction of rows without non-zeros

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GraphStats:
        """From ``DeviceCSR.row_stats()`` (several spellings of the keys are accepted)."""
        def get(*names: str) -> Any:
            for n in names:
                if n in d:
                    return d[n]
            raise PlanError(f"row statistics lack {names[0]!r} (have {', '.join(d)})")
        return cls(int(get("rows", "n_rows")), int(get("cols", "n_cols")), int(get("nnz")),
                   float(get("mean", "mean_row", "mean_row_length", "row_mean")),
                   int(get("max", "max_row", "max_row_length", "row_max")),
                   float(get("std", "std_row", "std_row_length", "row_std")),
                   float(get("empty", "empty_rows", "empty_row_fraction", "empty_fraction")))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], cols: int) -> GraphStats:
        """From a host array of row lengths (the CPU twin of ``row_stats``)."""
        import numpy as np
        ln = np.asarray(lengths, dtype=np.float64)
        if ln.size == 0:
            return cls(0, int(cols), 0, 0.0, 0, 0.0, 0.0)
        return cls(int(ln.size), int(cols), int(ln.sum()), float(ln.mean()), int(ln.max()),
                   float(ln.std()), float((ln == 0).mean()))


def _log_bucket(x: float, per_octave: int) -> int:
    """log2(1 + x) rounded to 1/per_octave of an octave: 0 stays 0, doubling moves a step."""
    return round(math.log2(1.0 + max(0.0, x)) * per_octave)


def stats_bucket(s: GraphStats) -> dict[str, int]:
    """Coarse statistics: matrices in one bucket share a cache entry. Sizes are bucketed by half
    octaves, the mean row length by quarter octaves, skew (std / mean) and empty rows linearly."""
    cv = s.std / s.mean if s.mean > 0 else 0.0
    return {"rows": _log_bucket(s.rows, 2), "cols": _log_bucket(s.cols, 2),
            "nnz": _log_bucket(s.nnz, 2), "mean": _log_bucket(s.mean, 4),
            "max": _log_bucket(s.max, 2), "cv": round(min(cv, 20.0) * 2),
            "empty": round(s.empty * 10)}


def tune_key(op: str, feat: int, dtype: str, device: str, stats: GraphStats,
              formats: Sequence[str]) -> dict[str, Any]:
    """What a cached result depends on; :func:`cache_path` hashes it to a file name."""
    return {"version": CACHE_VERSION, "op": op, "feat": int(feat), "dtype": dtype,
            "device": device, "formats": sorted(formats), "bucket": stats_bucket(stats)}


def tune_cache_dir() -> Path:
    """``$PITGEN_TUNE_CACHE`` or ``<pitgen cache>/tune``; :class:`FileError` when it cannot be
    created."""
    if not os.environ.get("PITGEN_TUNE_CACHE"):
        return cache.directory("tune")
    return cache.make_directory(cache.area_path("tune"), "the tune cache", "PITGEN_TUNE_CACHE")


def cache_path(key: Mapping[str, Any], create: bool = True) -> Path:
    """The file of ``key``'s result; its folder is created unless ``create`` is False (a
    lookup needs no folder: a missing one means no result)."""
    digest = cache.key(json.dumps(key, sort_keys=True))[:24]
    folder = tune_cache_dir() if create else cache.area_path("tune")
    return folder / f"{key['op']}-{key['dtype']}-{key['feat']}-{digest}.json"


# -- candidates and the search ----------------------------------------------------------------

def _canon(d: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(d or {}), sort_keys=True)


@dataclass(frozen=True)
class TuneConfig:
    """One point of the search space: a format with its parameters and a kernel schedule."""
    fmt: str
    params: dict[str, Any]
    schedule: dict[str, Any]
    phase: str = "default"

    @property
    def conversion(self) -> tuple[str, str]:
        """Candidates with equal conversions share one converted matrix."""
        return self.fmt, _canon(self.params)

    @property
    def ident(self) -> tuple[str, str, str]:
        return self.fmt, _canon(self.params), _canon(self.schedule)


@dataclass
class Trial:
    """What measuring a candidate gave: kernel time (median ms), conversion time apart, or why
    it was skipped (before converting) or failed (a pitgen error while converting or running)."""
    fmt: str
    params: dict[str, Any]
    schedule: dict[str, Any]
    phase: str
    status: str  # 'ok' | 'skipped' | 'failed'
    ms: float | None = None
    convert_ms: float | None = None
    reason: str = ""

    @classmethod
    def of(cls, c: TuneConfig, status: str, ms: float | None = None,
           convert_ms: float | None = None, reason: str = "") -> Trial:
        return cls(c.fmt, dict(c.params), dict(c.schedule), c.phase, status, ms, convert_ms,
                   reason)

    def to_json(self) -> dict[str, Any]:
        return {"fmt": self.fmt, "params": self.params, "schedule": self.schedule,
                "phase": self.phase, "status": self.status, "ms": self.ms,
                "convert_ms": self.convert_ms, "reason": self.reason}


def default_params(fmt: str, stats: GraphStats | None) -> dict[str, Any]:
    """The parameters a format is tried with first: ELL as wide as the longest row, 16x16
    blocks, and one hyb part with buckets up to about twice the mean row length (``stats`` is
    needed for ELL and hyb only)."""
    if fmt == "csr":
        return {}
    if fmt == "ell":
        return {"width": max(1, stats.max)}
    if fmt == "bsr":
        return {"block": BSR_DEFAULT}
    if fmt == "hyb":
        k = math.ceil(math.log2(max(stats.mean, 1.0))) + 1
        return {"c": 1, "k": min(max(k, HYB_K[0]), HYB_K[-1])}
    raise PlanError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")


def param_space(fmt: str, stats: GraphStats) -> list[dict[str, Any]]:
    """Every parameter setting of a format, the default first, then nearest to it."""
    first = default_params(fmt, stats)
    if fmt == "bsr":
        rest = [{"block": b} for b in BSR_BLOCKS]
    elif fmt == "hyb":
        rest = sorted(({"c": c, "k": k} for c in HYB_C for k in HYB_K),
                      key=lambda p: (abs(p["k"] - first["k"]), p["c"], p["k"]))
    else:
        rest = []
    return [first] + [p for p in rest if p != first]


def infeasible(fmt: str, params: Mapping[str, Any], stats: GraphStats) -> str | None:
    """Why a conversion is not even tried (its padding would be excessive), or None."""
    if fmt == "ell":
        slots = stats.rows * int(params["width"])
        if slots > max(SMALL_ELEMENTS, ELL_MAX_PADDING * stats.nnz):
            return (f"ELL width {params['width']} pads {stats.rows} rows to {slots} slots, "
                    f"> {ELL_MAX_PADDING:g} x nnz ({stats.nnz})")
    if fmt == "bsr":
        b = int(params["block"])
        worst = stats.nnz * b * b
        if worst > BSR_MAX_ELEMENTS:
            return (f"BSR {b}x{b} may store up to {worst} elements (one non-zero per block), "
                    f"> {BSR_MAX_ELEMENTS}")
    return None


@dataclass
class Space:
    """The search space of one operator: formats, their parameters, and the kernels' schedules
    (``schedules(fmt)`` lists them, ``default(fmt)`` is the one tried first)."""
    op: str
    feat: int
    dtype: str
    stats: GraphStats
    formats: Sequence[str]
    schedules: Callable[[str], list[dict[str, Any]]]
    default: Callable[[str], dict[str, Any]]

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise PlanError(f"unknown graph operator {self.op!r} (operators: {', '.join(OPS)})")
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise PlanError(f"unknown format(s) {bad or list(self.formats)!r}; choose from "
                            f"{', '.join(FORMATS)}")
        if int(self.feat) < 1:
            raise PlanError(f"feature width must be >= 1, got {self.feat}")
        # csr first: the baseline every speed-up is over, and the answer of a tiny budget
        self.formats = sorted(dict.fromkeys(self.formats), key=FORMATS.index)

    def size(self) -> int:
        """Number of distinct candidates (for reports)."""
        return sum(len(param_space(f, self.stats)) * max(1, len(self.schedules(f)))
                   for f in self.formats)


class Search:
    """Budgeted search: the default (parameters, schedule) of every format first, then the other
    parameters with the default schedule (formats round-robin, fastest first), then every
    schedule of each format's best parameters (fastest format first). The first trial always
    runs; no trial starts once ``budget_s`` has passed. A ``measure`` with a ``prefetch(cands)``
    method hears of each format's schedule phase before its first trial (to compile ahead)."""

    def __init__(self, space: Space, measure: Callable[[TuneConfig], Trial], budget_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[Trial, float], None] | None = None):
        self.space, self.measure, self.budget_s, self.clock = space, measure, budget_s, clock
        #: called after each measured trial with it and the seconds spent so far
        self.progress = progress
        self.trials: list[Trial] = []
        self._seen: set[tuple[str, str, str]] = set()
        self._t0 = clock()

    def _best(self, fmt: str | None = None) -> Trial | None:
        ok = [t for t in self.trials if _usable(t) and (fmt is None or t.fmt == fmt)]
        return min(ok, key=lambda t: t.ms) if ok else None

    def _ranked_formats(self) -> list[str]:
        def rank(f: str) -> tuple[int, float]:
            b = self._best(f)
            return (0, b.ms) if b else (1, 0.0)
        return sorted(self.space.formats, key=rank)

    def _phases(self):
        """Candidates in order; a generator, so later phases see the earlier phases' times."""
        sp = self.space
        for f in sp.formats:
            yield TuneConfig(f, default_params(f, sp.stats), sp.default(f), "default")
        queues = {f: [TuneConfig(f, p, sp.default(f), "params")
                      for p in param_space(f, sp.stats)[1:]] for f in self._ranked_formats()}
        while any(queues.values()):
            for f in list(queues):
                if queues[f]:
                    yield queues[f].pop(0)
        prefetch = getattr(self.measure, "prefetch", None)
        for f in self._ranked_formats():
            best = self._best(f)
            if best is None:
                continue
            cands = [TuneConfig(f, best.params, s, "schedule") for s in sp.schedules(f)]
            if prefetch is not None and not self._spent():  # compile while the first ones time
                prefetch([c for c in cands if c.ident not in self._seen])
            yield from cands

    def _spent(self) -> bool:
        """The budget is over (never before the first measured trial)."""
        return any(t.status != "skipped" for t in self.trials) \
            and self.clock() - self._t0 >= self.budget_s

    def run(self) -> list[Trial]:
        self._t0 = t0 = self.clock()
        for cand in self._phases():
            if cand.ident in self._seen:
                continue
            self._seen.add(cand.ident)
            if self._spent():
                break
            why = infeasible(cand.fmt, cand.params, self.space.stats)
            if why:
                self.trials.append(Trial.of(cand, "skipped", reason=why))
                continue
            self.trials.append(_finite(self.measure(cand)))
            if self.progress is not None:
                self.progress(self.trials[-1], self.clock() - t0)
        return self.trials

    def best(self) -> Trial | None:
        return self._best()


def _usable(t: Trial) -> bool:
    """A trial that may win: it ran, and measured a finite, positive time."""
    return t.status == "ok" and isinstance(t.ms, (int, float)) and math.isfinite(t.ms) \
        and t.ms > 0


def _finite(t: Trial) -> Trial:
    """``t``, or a failed trial when it ran but its time is NaN, infinite or not positive (a
    broken clock or kernel must never win the search)."""
    if t.status == "ok" and not _usable(t):
        t.status, t.reason = "failed", f"measured an unusable time ({t.ms!r} ms)"
    return t


# -- results ----------------------------------------------------------------------------------

@dataclass
class TuneResult:
    """The chosen format, its parameters and schedule, its kernel time (median ms), and how the
    search went: every trial, the search's wall time, and the default CSR kernel's time."""
    op: str
    feat: int
    dtype: str
    device: str
    fmt: str
    params: dict[str, Any]
    schedule: dict[str, Any]
    ms: float
    csr_ms: float | None
    search_s: float
    trials: int
    log: list[Trial] = field(default_factory=list)
    from_cache: bool = False

    @property
    def speedup(self) -> float | None:
        """Default CSR kernel time over the chosen kernel's time."""
        return self.csr_ms / self.ms if self.csr_ms and self.ms else None

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "feat": self.feat, "dtype": self.dtype, "device": self.device,
                "fmt": self.fmt, "params": self.params, "schedule": self.schedule,
                "ms": self.ms, "csr_ms": self.csr_ms, "speedup": self.speedup,
                "search_s": self.search_s, "trials": self.trials,
                "from_cache": self.from_cache, "log": [t.to_json() for t in self.log]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TuneResult:
        log = [Trial(t["fmt"], dict(t["params"]), dict(t["schedule"]), t["phase"], t["status"],
                     t["ms"], t["convert_ms"], t["reason"]) for t in d["log"]]
        return cls(d["op"], int(d["feat"]), d["dtype"], d["device"], d["fmt"], dict(d["params"]),
                   dict(d["schedule"]), float(d["ms"]),
                   None if d["csr_ms"] is None else float(d["csr_ms"]), float(d["search_s"]),
                   int(d["trials"]), log, bool(d.get("from_cache", False)))

    def summary(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params.items())
        s = ", ".join(f"{k}={v}" for k, v in self.schedule.items())
        sp = f"{self.speedup:.2f}x the default CSR kernel" if self.speedup else "no CSR baseline"
        src = "cache hit" if self.from_cache else f"search {self.search_s:.1f} s, {self.trials} trials"
        return (f"{self.op} feat={self.feat} {self.dtype} on {self.device}: "
                f"{self.fmt}({p}) schedule({s}) {self.ms:.4f} ms, {sp} ({src})")


def result_of(space: Space, trials: list[Trial], search_s: float, device: str) -> TuneResult:
    """The fastest successful trial (a finite time); PlanError when every candidate failed."""
    ok = [t for t in trials if _usable(t)]
    if not ok:
        why = "; ".join(f"{t.fmt}{t.params}: {t.reason}" for t in trials) or "no trial ran"
        raise PlanError(f"no format could run {space.op} (feat {space.feat}, {space.dtype}): {why}")
    best = min(ok, key=lambda t: t.ms)
    csr = next((t for t in ok if t.fmt == "csr" and t.phase == "default"), None)
    return TuneResult(space.op, int(space.feat), space.dtype, device, best.fmt, best.params,
                      best.schedule, best.ms, csr.ms if csr else None, search_s,
                      sum(t.status != "skipped" for t in trials), trials)


def store(key: Mapping[str, Any], result: TuneResult) -> Path | None:
    """Write a result under its key (atomically: readers never see half a file). A result
    whose time is not finite is never stored; an unwritable cache is warned about and skipped
    (the result itself stands): None then."""
    if _result_problem(result) is not None:
        warnings.warn(f"pitgen tune cache: not storing a result that {_result_problem(result)}",
                      RuntimeWarning, stacklevel=2)
        return None
    doc = {"key": dict(key), "result": result.to_json()}
    try:
        path = cache_path(key)
        cache.atomic_write(path, json.dumps(doc, indent=1, allow_nan=False).encode())
    except (OSError, FileError) as e:
        warnings.warn(f"pitgen tune cache: cannot store the result: {e}", RuntimeWarning,
                      stacklevel=2)
        return None
    return path


def _result_problem(r: TuneResult) -> str | None:
    """Why a (cached) result cannot be trusted, or None."""
    def finite(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and v > 0
    if r.fmt not in FORMATS:
        return f"names an unknown format {r.fmt!r}"
    if not finite(r.ms):
        return f"has time {r.ms!r} ms"
    if r.csr_ms is not None and not finite(r.csr_ms):
        return f"has a CSR time of {r.csr_ms!r} ms"
    if not isinstance(r.params, dict) or not isinstance(r.schedule, dict):
        return "lacks its parameters or schedule"
    return None


#: Results read from disk, by file, with the (mtime, size) they were read at: a graph that
#: changes every call looks its result up every call, and a stat is all that costs.
_LOADED: dict[Path, tuple[tuple[int, int], TuneResult]] = {}


def load(key: Mapping[str, Any]) -> TuneResult | None:
    """The cached result for ``key``; None when absent. A broken or foreign file is ignored
    with a warning (it is overwritten by the next search)."""
    try:
        path = cache_path(key, create=False)
    except FileError as e:
        warnings.warn(f"pitgen tune cache: {e}; searching without it", RuntimeWarning,
                      stacklevel=2)
        return None
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        hit = _LOADED.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"pitgen tune cache: cannot read {path}: {e}; searching without it",
                      RuntimeWarning, stacklevel=2)
        return None
    try:
        doc = json.loads(raw.decode())
        if doc["key"] != json.loads(json.dumps(dict(key))):
            raise ValueError("its key does not match")
        res = TuneResult.from_json(doc["result"])
        problem = _result_problem(res)
        if problem is not None:
            raise ValueError(f"its result {problem}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"pitgen tune cache: ignoring broken entry {path}: {e}", stacklevel=2)
        return None
    res.from_cache = True
    _LOADED[path] = (stamp, res)
    return res


# -- GPU side ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _device_name_of(index: int) -> str:
    import torch
    return torch.cuda.get_device_name(index)


def _device_name() -> str:
    """The current device's name (read once per device: it keys every tune-cache lookup)."""
    import torch
    return _device_name_of(torch.cuda.current_device())


def _stats_of(a: Any) -> GraphStats:
    return a if isinstance(a, GraphStats) else GraphStats.from_dict(a.row_stats())


class _GpuMeasure:
    """Times candidates on the GPU: conversion (host-synchronised wall time, kept apart) and
    kernel (CUDA events, L2 flushed, warm-up, median; a spin kernel ahead of the start event
    hides the host's launch overhead, which would otherwise swamp microsecond kernels and
    pick formats at random). Keeps the last two conversions."""

    def __init__(self, a: Any, op: str, feat: int, dtype: str, repeats: int):
        import torch

        self.torch, self.a, self.op, self.repeats = torch, a, op, repeats
        rows, cols = a.shape
        g = torch.Generator(device="cuda").manual_seed(0)
        tdt = getattr(torch, dtype)
        rnd = lambda n: torch.randn(n, feat, device="cuda", generator=g).to(tdt)  # noqa: E731
        self.args = (rnd(cols),) if op == "spmm" else (rnd(rows), rnd(cols))
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        self.flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
        self._converted: dict[tuple[str, str], Any] = {}
        #: conversion ms of a layout converted by prefetch, owed to its first trial
        self._owed_ms: dict[tuple[str, str], float] = {}

    def prefetch(self, cands: Sequence[TuneConfig]) -> None:
        """Start nvcc on the SpMM kernels of ``cands`` (schedules of one format's parameters,
        hence one layout) in background threads, so that the phase's trials time kernels while
        the later ones compile. Any failure here is left to the trials, which log it."""
        if self.op != "spmm" or not cands:
            return
        try:
            m, ms = self._convert(cands[0])   # the phase's one layout, timed for its first trial
            if ms is not None:
                self._owed_ms[cands[0].conversion] = ms
            compile_ahead(graph_ops.spmm_source(m, self.args[0], c.schedule) for c in cands)
        except (PitgenError, RuntimeError):  # RuntimeError: torch's out of memory
            return

    def _convert(self, c: TuneConfig) -> tuple[Any, float | None]:
        """Converts on a private DeviceCSR over the same buffers: to_format's cache on the
        caller's matrix is not filled with every candidate, and conversions are really timed."""

        if c.conversion in self._converted:
            return self._converted[c.conversion], None
        torch, a = self.torch, self.a
        if len(self._converted) >= 2:
            self._converted.pop(next(iter(self._converted)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        m = to_format(DeviceCSR(a.shape, a.indptr, a.indices, a.values), c.fmt, **c.params)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        self._converted[c.conversion] = m
        return m, ms

    def _run(self, m: Any, schedule: dict[str, Any]) -> Any:

        fn = graph_ops.spmm if self.op == "spmm" else graph_ops.sddmm
        return fn(m, *self.args, schedule=schedule)

    def __call__(self, c: TuneConfig) -> Trial:
        torch = self.torch
        try:
            m, conv_ms = self._convert(c)
            if conv_ms is None:
                conv_ms = self._owed_ms.pop(c.conversion, None)
            self._run(m, c.schedule)  # compiles (cached on disk) and warms up
            torch.cuda.synchronize()
        except PitgenError as e:
            return Trial.of(c, "failed", reason=f"{type(e).__name__}: {e}")
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            return Trial.of(c, "failed", reason=f"out of GPU memory: {str(e).splitlines()[0]}")
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            # the GPU spins while the host enqueues the launch: events time the kernel alone
            torch.cuda._sleep(HIDE_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._run(m, c.schedule)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if times[0] > 100.0:  # a very slow candidate: one run says enough
                break
        times.sort()
        return Trial.of(c, "ok", ms=times[len(times) // 2], convert_ms=conv_ms)


def make_space(stats: GraphStats, op: str, feat: int, dtype: str,
               formats: Sequence[str] = FORMATS) -> Space:
    """The search space with graph_ops' schedules (imports the GPU module, compiles nothing).
    Schedules keep the default's vector width: a narrower one only adds loads (the kernels
    already narrow it where F or a pointer's alignment needs), and each schedule is a kernel
    to compile, so this cuts the space by up to 4x."""

    def schedules(f: str) -> list[dict[str, Any]]:
        vec = graph_ops.default_schedule(op, f, feat, dtype)["vec"]
        return [s for s in graph_ops.schedule_space(op, f, feat, dtype) if s["vec"] == vec]

    return Space(op, feat, dtype, stats, list(formats), schedules,
                 lambda f: graph_ops.default_schedule(op, f, feat, dtype))


def tune(a: Any, op: str, feat: int, dtype: str, budget_s: float = 60,
         formats: Sequence[str] = FORMATS, cache: bool = True, repeats: int = 5,
         progress: Callable[[Trial, float], None] | None = None) -> TuneResult:
    """Search formats x parameters x schedules for ``op`` ('spmm' or 'sddmm') on the DeviceCSR
    ``a`` with ``feat`` features of ``dtype``; returns the fastest. Synchronises with the host
    (timing). Candidates whose conversion or launch raises a pitgen error are logged as failed.
    With ``cache`` the result is stored on disk (:func:`lookup` and :func:`best` read it).
    ``progress(trial, elapsed_s)`` hears of every measured trial as the search goes."""
    stats = _stats_of(a)
    space = make_space(stats, op, feat, dtype, formats)
    if not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise PlanError(f"budget_s must be a positive finite number of seconds, got {budget_s!r}")
    t0 = time.perf_counter()
    trials = Search(space, _GpuMeasure(a, op, feat, dtype, repeats), budget_s,
                    progress=progress).run()
    device = _device_name()
    result = result_of(space, trials, time.perf_counter() - t0, device)
    if cache:
        store(tune_key(op, feat, dtype, device, stats, formats), result)
    return result


def lookup(a: Any, op: str, feat: int, dtype: str, formats: Sequence[str] = FORMATS,
           device: str | None = None) -> TuneResult | None:
    """The cached result for a matrix like ``a`` (a DeviceCSR or its :class:`GraphStats`) on
    this device (or ``device``), or None. No timing, no kernel launch."""
    stats = _stats_of(a)
    key = tune_key(op, feat, dtype, device or _device_name(), stats, formats)
    return load(key)

