"""GNN SpMM and SDDMM on the GPU formats of pitgen.graph.device.

SpMM ``Y[i,f] += A[i,j] * X[j,f]``: the rule engine says i is spatial (rows are computed in any
order and written back to their own places: hyb's bucket rows are out of order, SWrite) and j
is the reduction axis (a row's neighbours are gathered, SRead). SDDMM
``E[i,j] += U[i,f] * V[j,f]``: i and j are spatial (edges in any order, each written to its CSR
position), f is reduced by a shuffle tree in any order. Each kernel family declares these as an
:class:`~pitgen.opspec.OpSpec` whose permutations the rule engine must confirm.

Every launch runs on torch's current stream with no host synchronisation; buffer sizes and grids
come from host numbers recorded at conversion time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from ..errors import PlanError, ShapeError
from ..operands import check_tensor, on_operand_device, raw_key, validated
from ..opspec import OpSpec, Permutation
from ..runtime import TorchLaunch, stream_counters
from .device import MAX_GRID, VALUE_DTYPES, DeviceCOO, DeviceCSR, DeviceMatrix, to_format
from .formats import FORMATS, SDDMM_EXPR, SPMM_EXPR

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["spmm", "spmm_coo", "sddmm", "schedule_space", "default_schedule", "resolve_schedule",
           "SPMM_EXPR", "SDDMM_EXPR"]

GROUPS = (4, 8, 16, 32)
THREADS = (128, 256)
HYB_WIDTHS = 7  # hyb "groups": one lane count per bucket width 1, 2, 4, ..., 64
#: SpMM neighbours gathered at once per lane (loads in flight); SPMM_UNROLL is the default.
UNROLLS = (1, 2, 4, 8)
SPMM_UNROLL = 2
#: hyb SpMM's other unroll, searched for groups of up to HYB_SMALL_UNROLL_GROUP lanes
#: (pitgen.graph.model's rule runs it where there are few warps to hide latency)
HYB_SMALL_UNROLL = 4
HYB_SMALL_UNROLL_GROUP = 16
#: SpMM vectors per lane per pass, at most (``packs``): a row's features in fewer passes.
PACKS = (1, 2, 4)
SPMM_PACKS = 4
#: hyb SpMM with c == 1, rows cut into pieces (``cut``): "atomic" adds the pieces into a
#: workspace (zeroed, then a finish pass), "pieces" stores partial rows that the last piece
#: sums (one launch).
CUTS = ("atomic", "pieces")
SPMM_CUT = "pieces"
#: Rows in any order, each written back to its own place (hyb's buckets; SWrite), and a row's
#: neighbours gathered in any order (SRead).
_SPMM_PERMUTES = (Permutation("rows", SPMM_EXPR, "spatial", "A"),
                  Permutation("neighbours", SPMM_EXPR, "reduction", "A"))
SPMM = OpSpec("spmm", "spmm.cu.j2", {"pit_spmm": "PPPPPPiiiii"}, _SPMM_PERMUTES, VALUE_DTYPES)
#: hyb's SpMM: the same template with bucket tables, cut rows and a finish pass.
HYB_SPMM = OpSpec("hyb spmm", "spmm.cu.j2",
                  {"pit_spmm": "PPPPPPPPPPPPPiiiiiiiii", "pit_spmm_finish": "PiPiPPiiP"},
                  _SPMM_PERMUTES, VALUE_DTYPES)
#: An edge list's SpMM: edges in any order, each one's products added into its row (atomics).
COO_SPMM = OpSpec("coo spmm", "spmm.cu.j2", {"pit_spmm": "PPPPPqiii"}, _SPMM_PERMUTES,
                  VALUE_DTYPES)
#: Edges in any order, each to its CSR position; features reduced by a shuffle tree.
GRAPH_SDDMM = OpSpec(
    "graph sddmm", "graph_sddmm.cu.j2", {"pit_sddmm": "PPPiiPPPiiii"},
    (Permutation("edge rows", SDDMM_EXPR, "spatial", "U"),
     Permutation("edge columns", SDDMM_EXPR, "spatial", "V"),
     Permutation("features", SDDMM_EXPR, "reduction", "U")),
    VALUE_DTYPES)


def _elem_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _vecs(feat: int, dtype: str) -> list[int]:
    """Vector widths (elements per lane per load) that F allows: at most 16 bytes."""
    return [v for v in (1, 2, 4, 8) if v * _elem_bytes(dtype) <= 16 and feat % v == 0]


#: The graph operators by name: the OpSpecs whose rules a schedule of each relies on.
OPS = {"spmm": (SPMM, HYB_SPMM), "sddmm": (GRAPH_SDDMM,)}


def _check(op: str, fmt: str, feat: int, dtype: str) -> None:
    if op not in OPS:
        raise PlanError(f"unknown graph operator {op!r}; choose from {tuple(OPS)}")
    if fmt not in FORMATS:
        raise PlanError(f"unknown sparse format {fmt!r}; choose from {FORMATS}")
    if dtype not in VALUE_DTYPES:
        raise ShapeError(f"dtype {dtype!r} is not supported; use one of {VALUE_DTYPES}")
    if not isinstance(feat, int) or feat < 1:
        raise ShapeError(f"feature size must be a positive integer, got {feat!r}")
    for spec in OPS[op]:
        spec.derive()


def _useful_groups(feat: int, vec: int) -> list[int]:
    """Group sizes whose lanes all have features (or the smallest group): no idle lanes."""
    return [g for g in GROUPS if g == GROUPS[0] or g * vec <= max(feat, GROUPS[0])]


def schedule_space(op: str, fmt: str, feat: int, dtype: str) -> list[dict]:
    """Tunable schedules: ``group`` lanes per row (SpMM) or per edge (SDDMM), ``vec`` features
    per lane per load, ``threads`` per block; hyb SpMM has ``groups`` (lanes per bucket row,
    by log2 of the bucket width) instead of ``group``: uniform, or growing with the width, and
    with groups of up to 16 lanes two unrolls. CSR SpMM's unroll follows its group
    (``csr_unroll``)."""
    _check(op, fmt, feat, dtype)
    out = []
    for vec in _vecs(feat, dtype):
        groups = _useful_groups(feat, vec)
        for threads in THREADS:
            if op == "spmm" and fmt == "hyb":
                choices = [[g] * HYB_WIDTHS for g in groups]
                ramp = [max(groups[0], min(groups[-1], 1 << e)) for e in range(HYB_WIDTHS)]
                if ramp not in choices:
                    choices.append(ramp)
                out += [{"groups": g, "vec": vec, "threads": threads, "unroll": u,
                         "packs": SPMM_PACKS, "cut": SPMM_CUT} for g in choices
                        for u in ((SPMM_UNROLL, HYB_SMALL_UNROLL)
                                  if max(g) <= HYB_SMALL_UNROLL_GROUP else (SPMM_UNROLL,))]
            elif op == "spmm":
                out += [{"group": g, "vec": vec, "threads": threads,
                         "unroll": _unroll(fmt, g, vec, feat), "packs": SPMM_PACKS}
                        for g in groups]
            else:
                out += [{"group": g, "vec": vec, "threads": threads} for g in groups]
    return out


def csr_unroll(group: int, packs: int) -> int:
    """The CSR SpMM's neighbours in flight per lane: as many as the group fetches per chunk
    (``group`` entries) while ``unroll * packs`` vectors stay at most 8 per lane (registers).
    A CSR row is walked by one group, so the longest row's chain of dependent gathers bounds the
    kernel: on H100 the default CSR times of docs/bench/graphs.md are 0.3 us per batch of
    ``unroll`` gathers of the longest row on all five graphs measured (pitgen.graph.model),
    so four times as many loads in flight cut that chain by up to 2.5x."""
    return max(SPMM_UNROLL, min(8 // packs, group, UNROLLS[-1]))


def _unroll(fmt: str, group: int, vec: int, feat: int) -> int:
    """SpMM's unroll for a group of ``group`` lanes: ``csr_unroll`` for CSR, else SPMM_UNROLL."""
    if fmt != "csr":
        return SPMM_UNROLL
    return csr_unroll(group, max(1, min(SPMM_PACKS, -(-feat // (group * vec)))))


def default_schedule(op: str, fmt: str, feat: int, dtype: str) -> dict:
    """The widest vector F allows, and the smallest group that covers F in one pass (SpMM) or
    in about four loads per lane (SDDMM); 256 threads; CSR SpMM gathers ``csr_unroll``
    neighbours at once (its time is its longest row's chain). A member of ``schedule_space``."""
    _check(op, fmt, feat, dtype)
    vec = _vecs(feat, dtype)[-1]
    loads = -(-feat // vec) if op == "spmm" else -(-feat // (4 * vec))
    group = next((g for g in GROUPS if g >= loads), GROUPS[-1])
    group = max(g for g in _useful_groups(feat, vec) if g <= group)
    if op == "spmm" and fmt == "hyb":
        return {"groups": [group] * HYB_WIDTHS, "vec": vec, "threads": 256, "unroll": SPMM_UNROLL,
                "packs": SPMM_PACKS, "cut": SPMM_CUT}
    if op == "spmm":
        return {"group": group, "vec": vec, "threads": 256,
                "unroll": _unroll(fmt, group, vec, feat), "packs": SPMM_PACKS}
    return {"group": group, "vec": vec, "threads": 256}


def resolve_schedule(schedule: Mapping | None, op: str, fmt: str, feat: int,
                     dtype: str) -> dict:
    """Validate a user schedule (unknown keys or values: PlanError); fill in defaults."""
    base = default_schedule(op, fmt, feat, dtype)
    if schedule is None:
        return base
    extra = sorted(set(schedule) - set(base))
    if extra:
        raise PlanError(f"{op} on {fmt} takes schedule keys {sorted(base)}, got unknown {extra}")
    s = {**base, **schedule}
    if s["threads"] not in THREADS:
        raise PlanError(f"threads must be one of {THREADS}, got {s['threads']!r}")
    if s["vec"] not in (1, 2, 4, 8) or s["vec"] * _elem_bytes(dtype) > 16:
        raise PlanError(f"vec {s['vec']!r} is not 1, 2, 4 (or 8 for float16)")
    gs = s.get("groups", [s.get("group")])
    if "groups" in s and (not isinstance(gs, (list, tuple)) or len(gs) != HYB_WIDTHS):
        raise PlanError(f"hyb groups must list {HYB_WIDTHS} lane counts, got {gs!r}")
    if any(g not in GROUPS for g in gs):
        raise PlanError(f"group sizes must be in {GROUPS}, got {gs!r}")
    if "unroll" in s and s["unroll"] not in UNROLLS:
        raise PlanError(f"unroll must be one of {UNROLLS}, got {s['unroll']!r}")
    if "packs" in s and s["packs"] not in PACKS:
        raise PlanError(f"packs must be one of {PACKS}, got {s['packs']!r}")
    if "cut" in s and s["cut"] not in CUTS:
        raise PlanError(f"cut must be one of {CUTS}, got {s['cut']!r}")
    return s


def _vec_for(vec: int, feat: int, dtype: str, *tensors: Any) -> int:
    """The widest vector <= vec that F and every pointer's alignment allow."""
    size = _elem_bytes(dtype)
    while vec > 1 and (feat % vec or any(t.data_ptr() % (vec * size) for t in tensors)):
        vec //= 2
    return vec


def _matrix(a: DeviceMatrix | DeviceCSR) -> DeviceMatrix:
    if isinstance(a, DeviceCSR):
        return to_format(a, "csr")
    if not isinstance(a, DeviceMatrix):
        raise ShapeError(f"expected a DeviceMatrix or DeviceCSR, got {type(a).__name__}")
    return a


class SpMMBucket(NamedTuple):
    """One hyb bucket of the SpMM template context: its width, the lanes of a bucket row
    (group), the vectors per lane per pass (packs) and how its rows are written. A tuple, so
    that the whole context hashes and its module is found with one lookup (a list of dicts
    made every lookup repr the context: ~20 µs of each new matrix's first launch)."""

    width: int
    group: int
    packs: int
    mode: str


def spmm_context(m: DeviceMatrix, sched: Mapping, vec: int, feat: int) -> dict:
    """Template context of the SpMM kernel for this matrix, schedule, vector width and feature
    size (a body of g lanes takes min(packs, ceil(F / (g * vec))) vectors per lane per pass)."""
    def packs(group: int) -> int:
        return max(1, min(sched["packs"], -(-feat // (group * vec))))

    ctx = {"dtype": m.dtype, "fmt": m.fmt, "vec": vec, "threads": sched["threads"],
           "unroll": sched["unroll"]}
    if m.fmt == "hyb":
        k = m.params["k"]
        buckets = []
        for b, (w, at) in enumerate(zip(m.info["widths"], m.info["atomic"])):
            g = sched["groups"][b % (k + 1)]
            # a layout sized by bounds has no host word on cut rows: its widest bucket (c == 1)
            # runs as pieces, which also stores the uncut rows there directly
            mode = "direct" if not at else "atomic" if m.params["c"] > 1 else \
                sched["cut"] if m.info.get("exact", True) else "pieces"
            buckets.append(SpMMBucket(int(w), g, packs(g), mode))
        ctx["buckets"] = tuple(buckets)
    else:
        ctx["group"] = sched["group"]
        ctx["packs"] = packs(sched["group"])
    if m.fmt == "bsr":
        ctx["block"] = m.params["block"]
    return ctx


def spmm_source(a: DeviceMatrix | DeviceCSR, x: Tensor, schedule: Mapping | None = None) -> str:
    """The CUDA source that ``spmm(a, x, schedule)`` loads (``out`` left to the call): what a
    caller that knows its next launches compiles ahead (``runtime.compile_ahead``)."""
    m = _matrix(a)
    check_tensor("x", x, (m.dtype,), 2, (m.shape[1], None))
    feat = int(x.shape[1])
    sched = resolve_schedule(schedule, "spmm", m.fmt, feat, m.dtype)
    ctx = spmm_context(m, sched, _vec_for(sched["vec"], feat, m.dtype, x), feat)
    return (HYB_SPMM if m.fmt == "hyb" else SPMM).source(ctx)


def spmm(a: DeviceMatrix | DeviceCSR, x: Tensor, schedule: Mapping | None = None,
         out: Any = None, spec: OpSpec | None = None) -> Any:
    """Y = A @ X for a sparse A (any format; a DeviceCSR runs as "csr") and dense X [cols, F]
    of A's dtype; fp32 accumulation. ``out`` [rows, F] is overwritten. No host sync.
    ``spec``: the operator whose rules the launch relies on, when not SpMM's (RGCN runs its
    composed relations through the CSR, ELL or BSR body); its kernels must be SpMM's."""
    # a call signature seen before: its launch closure, found without building the csr view
    # or the device guard (the key holds the current device, which was the operands' then)
    launches = a._csr_launches if type(a) is DeviceCSR else \
        a.launches if type(a) is DeviceMatrix else None
    if launches:
        key = _launch_key(x, out, schedule, spec)
        launch = launches.get(key) if key is not None else None
        if launch is not None:
            return launch(x, out)
    return _spmm(a, x, schedule, out, spec)


@on_operand_device
def _spmm(a: DeviceMatrix | DeviceCSR, x: Tensor, schedule: Mapping | None, out: Any,
          spec: OpSpec | None) -> Any:
    """``spmm`` past its fast path, on the operands' device."""
    m = _matrix(a)
    launch = validated(m.launches, _launch_key(x, out, schedule, spec),
                       lambda: _spmm_launch(m, x, schedule, out, spec))
    return launch(x, out)


def _spmm_launch(m: DeviceMatrix, x: Tensor, schedule: Mapping | None, out: Any,
                 spec: OpSpec | None) -> _SpMMLaunch:
    """The checked launch closure of ``spmm`` for this call signature."""
    if spec is not None and (m.fmt == "hyb" or dict(spec.kernels) != dict(SPMM.kernels)):
        raise PlanError(f"{spec.name} cannot launch SpMM's {m.fmt} kernels")
    n_rows, n_cols = m.shape
    check_tensor("x", x, (m.dtype,), 2, (n_cols, None))
    feat = int(x.shape[1])
    if out is not None:
        check_tensor("out", out, (m.dtype,), 2, (n_rows, feat))
    launch = _SpMMLaunch((n_rows, feat))
    if n_rows == 0 or feat == 0:
        return launch   # nothing to launch: out, or an empty one
    if n_rows * feat > 2**31 - 1 or n_cols * feat > 2**31 - 1:
        raise ShapeError(f"SpMM operands of {max(n_rows, n_cols)} x {feat} exceed int32 indexing")
    sched = resolve_schedule(schedule, "spmm", m.fmt, feat, m.dtype)
    # the vector width the operands' alignment allows (out is allocated 16-byte aligned)
    vec = _vec_for(sched["vec"], feat, m.dtype, x, *(() if out is None else (out,)))
    ctx = spmm_context(m, sched, vec, feat)
    b, threads = m.buffers, sched["threads"]
    if m.fmt == "hyb":
        info = m.info
        kern = HYB_SPMM.module(ctx)
        pieces = any(bk.mode == "pieces" for bk in ctx["buckets"])
        n_ws = 0 if pieces else info["ws_rows"]
        n_cut, n_partials = (info["cut_rows"], info["partial_rows"]) if pieces else (0, 0)
        # buffers a launch does not use are passed as `out` (never dereferenced: n_ws /
        # n_partials are 0 then), so the direct and atomic paths allocate nothing extra
        launch.ws_rows, launch.partial_rows = n_ws, n_partials
        launch.cut_rows, launch.counters = (info["cut_rows"] if pieces else 0), m.counters
        # pieces: the launch zeroes the empty rows; otherwise the finish pass writes them
        # with the workspace rows
        zero, n_zero = (b["empty_rows"], info["empty_rows"]) if pieces else (_OUT, 0)
        if info.get("exact", True):
            grid = sum(-(-rows // (threads // ctx_b.group))
                       for rows, ctx_b in zip(info["bucket_rows"], ctx["buckets"]))
        else:   # a bound: CTAs past the live buckets' (table) and empty rows' ranges exit
            grid = -(-info["brows"] // min(threads // bk.group for bk in ctx["buckets"])) \
                + len(ctx["buckets"])
        grid += -(-n_zero * feat // threads)
        launch.add(kern.bind("pit_spmm", (grid, 1, 1), (threads, 1, 1)),
                   (b["brow_row"], b["cols"], b["vals"], b["table"], _X, _OUT, _WS,
                    b["ws_index"], b["cut_index"], b["cut_info"], _PARTIALS, _COUNTERS, zero,
                    n_rows, n_cols, info["slots"], info["brows"], n_ws, n_cut, n_partials,
                    n_zero, feat))
        n_fix = 0 if pieces else info["fix_rows"]
        if n_fix:
            launch.add(kern.bind("pit_spmm_finish", (min(-(-n_fix * feat // threads), 65535), 1, 1),
                                 (threads, 1, 1)),
                       (b["fix_rows"], n_fix, b["ws_index"], n_ws, _WS, _OUT, n_rows, feat,
                        b["table"]))
    else:
        kern = (spec or SPMM).module(ctx)
        grid = -(-n_rows // (threads // sched["group"]))
        if m.fmt == "csr":
            args = (b["indptr"], b["indices"], b["values"], 0, n_rows, n_cols, m.nnz, 0)
        elif m.fmt == "ell":
            args = (0, b["cols"], b["vals"], 0, n_rows, n_cols, m.info["slots"],
                    m.info["width"])
        else:
            args = (b["indptr"], b["bcols"], b["blocks"], 0, n_rows, n_cols, m.info["slots"],
                    m.info["blocks"])
        launch.add(kern.bind("pit_spmm", (grid, 1, 1), (threads, 1, 1)),
                   (*args[:4], _X, _OUT, *args[4:], feat))
    return launch


def _launch_key(x: Any, out: Any, schedule: Mapping | None, spec: OpSpec | None) -> tuple | None:
    """What an SpMM launch closure depends on besides the layout: x's and out's raw attributes,
    the schedule's items and the operator; None when one of them is not hashable."""
    key = raw_key(x, out)
    if key is None:
        return None
    try:
        # in the dict's order: equal schedules in another order only get a closure of their own
        sched = None if schedule is None else tuple(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in schedule.items())
        hash(sched)
    except TypeError:
        return None
    return key, sched, spec.name if spec is not None else None


#: the per-call tensors of an SpMM launch's arguments (``_SpMMLaunch``), by position in the
#: tuple of their addresses each call makes
PER_CALL = _X, _OUT, _WS, _PARTIALS, _COUNTERS = tuple(object() for _ in range(5))


class _SpMMLaunch:
    """An SpMM's launches for one call signature, decided once (the layout's buffers, the
    schedule's kernels, grids and vector width for X's and out's shape, dtype and alignment):
    a steady-state call allocates out (unless given) and hyb's fp32 workspace or partial rows
    where its plan has them, and makes one or two driver launches."""

    __slots__ = ("out_shape", "launches", "ws_rows", "partial_rows", "cut_rows", "counters")

    def __init__(self, out_shape: tuple[int, int]) -> None:
        self.out_shape, self.launches = out_shape, []
        self.ws_rows = self.partial_rows = self.cut_rows = 0
        self.counters: dict = {}

    def add(self, bound: Any, args: tuple) -> None:
        """A launch of ``bound`` with ``args``: layout buffers (read as addresses now), numbers,
        and the per-call markers of PER_CALL."""
        fixed = [t.data_ptr() if hasattr(t, "data_ptr") else t for t in args]
        slots = tuple((i, w) for i, t in enumerate(args) for w, p in enumerate(PER_CALL)
                      if t is p)
        self.launches.append((bound, fixed, slots))

    def __call__(self, x: Any, out: Any) -> Any:
        import torch
        if out is None:   # sizes as arguments, not a tuple: 1.2 us less (H200 host)
            out = torch.empty(*self.out_shape, dtype=x.dtype, device=x.device)
        if not self.launches:
            return out
        feat = self.out_shape[1]
        ws = torch.zeros((self.ws_rows, feat), dtype=torch.float32, device=x.device) \
            if self.ws_rows else out
        partials = torch.empty((self.partial_rows, feat), dtype=torch.float32,
                               device=x.device) if self.partial_rows else out
        with TorchLaunch() as tl:
            # cut-row counters, reset by each row's last piece
            counters = stream_counters(self.counters, tl.stream, self.cut_rows, x.device) \
                if self.cut_rows else out
            now = (x.data_ptr(), out.data_ptr(), ws.data_ptr(), partials.data_ptr(),
                   counters.data_ptr())
            for bound, fixed, slots in self.launches:
                args = fixed.copy()
                for i, w in slots:
                    args[i] = now[w]
                bound(tl.stream, *args)
        return out


#: spmm_coo's launch plans by call signature (operands' raw keys, the edge list's kind)
_COO_PLANS: dict = {}
COO_THREADS = 256


@on_operand_device
def spmm_coo(a: DeviceCOO, x: Tensor, out: Any = None) -> Any:
    """Y = A @ X for an edge list A and dense X [cols, F] of A's dtype, with no CSR built: one
    launch adds each edge's products into its row of an fp32 Y by atomics (float16: into a
    float32 buffer, converted into ``out`` after), so the sums' order, and their last bits,
    vary from run to run. ``out`` [rows, F] is overwritten. No host sync."""
    if not isinstance(a, DeviceCOO):
        raise ShapeError(f"spmm_coo needs a DeviceCOO, got {type(a).__name__}")
    key = raw_key(x, out)
    plan = validated(_COO_PLANS, None if key is None else
                     (key, a.shape, a.dtype, a.rows.dtype, a.values is None),
                     lambda: _coo_plan(a, x, out))
    return plan(a, x, out)


def _coo_plan(a: DeviceCOO, x: Any, out: Any) -> Any:
    """The checked launch of ``spmm_coo`` for this call signature."""
    import torch
    n_rows, n_cols = a.shape
    check_tensor("x", x, (a.dtype,), 2, (n_cols, None))
    feat = int(x.shape[1])
    if out is not None:
        check_tensor("out", out, (a.dtype,), 2, (n_rows, feat))
    if n_rows * feat > 2**31 - 1 or n_cols * feat > 2**31 - 1:
        raise ShapeError(f"SpMM operands of {max(n_rows, n_cols)} x {feat} exceed int32 indexing")
    direct = a.dtype == "float32"   # atomics straight into out
    # the widest vector F and the pointers allow (Y: a fresh fp32 buffer, or out when direct)
    vec = _vec_for(4, feat, "float32" if direct else a.dtype, x,
                   *(() if out is None or not direct else (out,)))
    kern = COO_SPMM.module({"dtype": a.dtype, "fmt": "coo", "vec": vec, "threads": COO_THREADS,
                            "idx64": a.rows.dtype == torch.int64})
    per_edge = feat // vec

    def run(a: DeviceCOO, x: Any, out: Any) -> Any:
        if direct:
            y = torch.zeros((n_rows, feat), dtype=torch.float32, device=x.device) \
                if out is None else out.zero_()
        else:
            y = torch.zeros((n_rows, feat), dtype=torch.float32, device=x.device)
        items = a.nnz * per_edge
        if items:
            with TorchLaunch() as tl:
                kern.launch("pit_spmm", (min(-(-items // COO_THREADS), MAX_GRID), 1, 1),
                            (COO_THREADS, 1, 1), tl.stream, a.rows.data_ptr(), a.cols.data_ptr(),
                            0 if a.values is None else a.values.data_ptr(), x.data_ptr(),
                            y.data_ptr(), a.nnz, n_rows, n_cols, feat)
        if direct:
            return y
        return y.to(x.dtype) if out is None else out.copy_(y)
    return run


@on_operand_device
def sddmm(a: DeviceMatrix | DeviceCSR, u: Tensor, v: Tensor,
          schedule: Mapping | None = None) -> Tensor:
    """E[p] = U[row(p)] . V[col(p)] at every non-zero p of A, in A's CSR order whatever the
    format (A's values are not used); U [rows, F], V [cols, F], one dtype, fp32 accumulation.
    No host sync."""
    import torch
    m = _matrix(a)
    n_rows, n_cols = m.shape
    check_tensor("u", u, VALUE_DTYPES, 2, (n_rows, None))
    dtype = str(u.dtype).replace("torch.", "")
    check_tensor("v", v, (dtype,), 2, (n_cols, u.shape[1]))
    feat = int(u.shape[1])
    e = torch.empty(m.nnz, dtype=u.dtype, device=u.device)
    if m.nnz == 0:
        return e
    if feat == 0:
        return e.zero_()
    if max(n_rows, n_cols) * feat > 2**31 - 1:
        raise ShapeError(f"SDDMM operands of {max(n_rows, n_cols)} x {feat} exceed int32 indexing")
    sched = resolve_schedule(schedule, "sddmm", m.fmt, feat, dtype)
    vec = _vec_for(sched["vec"], feat, dtype, u, v)
    threads, group = sched["threads"], sched["group"]
    ctx = {"dtype": dtype, "fmt": m.fmt, "vec": vec, "threads": threads, "group": group}
    b = m.buffers
    if m.fmt == "csr":
        slots, args = m.nnz, (b["rows"], b["indices"], 0, m.nnz, 0)
    elif m.fmt == "ell":
        slots, args = m.info["slots"], (0, b["cols"], b["perm"], m.info["slots"],
                                        max(m.info["width"], 1))
    elif m.fmt == "hyb":
        slots, args = m.info["slots"], (b["slot_row"], b["cols"], b["perm"], m.info["slots"], 0)
    else:
        ctx["block"] = m.params["block"]
        slots, args = m.info["slots"], (b["brows"], b["bcols"], b["perm"], m.info["slots"], 0)
    kern = GRAPH_SDDMM.module(ctx)
    args = (*args, u, v, e, n_rows, n_cols, m.nnz, feat)
    with TorchLaunch() as tl:
        kern.launch("pit_sddmm", (-(-slots // (threads // group)), 1, 1), (threads, 1, 1),
                    tl.stream, *(t.data_ptr() if hasattr(t, "data_ptr") else t for t in args))
    return e
