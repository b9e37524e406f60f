"""Graph operators through SparseTIR-style formats: ``pitgen.compile(expr, sparse=..., format=...)``.

Two forms are recognised, each derived through the rule engine:

* SpMM ``Y[i,f] += A[i,j] * X[j,f]`` (``sparse="A"``): the reduction axis j must be invariant
  (the non-zeros of a row are gathered in any order: SRead) and so must i (format kernels
  compute rows, or hyb's bucket rows, in any order and write each to its own place: SWrite).
* SDDMM ``E[i,j] += U[i,f] * V[j,f]`` (``sparse="E"``, the sampled output): i and j must be
  invariant (edges are computed in any order and written to their CSR slot). The edge pattern
  is passed at call time as ``sample=``.

``format`` is "csr", "ell", "bsr", "hyb" or "auto" (:func:`pitgen.graph.model.plan`: a tuned result
of the on-disk tune cache for a graph like this one, else the cost model, in well under 50 ms;
the measured search runs only when asked: ``tune=True`` or ``budget_s``). An explicit format
that the model expects to be WARN_RATIO times slower than its choice is warned about
(:class:`pitgen.errors.FormatWarning`). SpMM also takes an edge list (``DeviceCOO``): "coo"
multiplies it as it comes (one launch of atomic adds), "auto" does so while
:func:`pitgen.graph.model.coo_pays`, and any other format converts it to a CSR first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import sympy

from ..errors import PlanError, ShapeError
from ..expr import Operator, parse
from ..rules import analyse
from ..operands import bind_operands, check_tensor, on_operand_device
from . import kernels as graph_ops
from .device import VALUE_DTYPES, DeviceCOO, DeviceCSR, to_format
from .formats import CSR, FORMATS
from .kernels import default_schedule
from .model import coo_pays, plan, warn_if_slow
from .tune import GraphStats, default_params

#: Matrices (by identity) whose conversions a kernel object keeps alive.
MAX_MATRICES = 4
#: The formats a dynamic kernel converts to without a host sync.
SYNC_FREE = ("csr", "hyb")
#: SpMM of an edge list (DeviceCOO) as it comes, no conversion (kernels.spmm_coo).
COO = "coo"
#: Seconds of a measured search asked for by ``tune=True`` alone.
DEFAULT_BUDGET_S = 10.0


@dataclass(frozen=True)
class GraphForm:
    """Which graph operator an expression is, and where its operands go."""
    op: str                      # 'spmm' | 'sddmm'
    sparse: str                  # sparse operand (SpMM: an input; SDDMM: the output)
    inputs: tuple[str, ...]      # positional call order (the expression's inputs)
    dense: tuple[str, ...]       # SpMM: (X,); SDDMM: (U, V) with U indexed by rows


def _bare(acc: Any) -> tuple[str, ...] | None:
    if all(isinstance(e, sympy.Symbol) for e in acc.indices):
        return tuple(e.name for e in acc.indices)
    return None


def graph_form(op: Operator, sparse: str) -> GraphForm:
    """Recognise SpMM or SDDMM with ``sparse`` as the sparse operand; PlanError says why not,
    RuleError if an axis the kernels permute is not invariant."""
    spmm_shape = "Y[i,f] += A[i,j] * X[j,f] with sparse='A'"
    sddmm_shape = "E[i,j] += U[i,f] * V[j,f] with sparse='E'"
    if op.reducer != "sum" or op.epilogue or len(op.inputs) != 2 or \
            len({a.tensor for a in op.inputs}) != 2:
        raise PlanError(f"format kernels run {spmm_shape} or {sddmm_shape}; {op.text!r} is not a "
                        f"sum of products of two distinct tensors")
    dims = {a.tensor: _bare(a) for a in (op.output, *op.inputs)}
    if any(d is None or len(d) != 2 or len(set(d)) != 2 for d in dims.values()):
        raise PlanError(f"format kernels need 2-D operands indexed by two distinct bare axes; "
                        f"{op.text!r} is not one ({spmm_shape}, or {sddmm_shape})")
    rules = analyse(op)
    names = tuple(a.tensor for a in op.inputs)
    if sparse == op.output.tensor:
        i, j = dims[sparse]
        fs = op.reduction_axes
        rows = next((n for n in names if len(fs) == 1 and dims[n] == (i, fs[0])), None)
        cols = next((n for n in names if len(fs) == 1 and dims[n] == (j, fs[0])), None)
        if rows is None or cols is None:
            raise PlanError(f"SDDMM must read {sddmm_shape} (U[rows, f], V[cols, f]); got "
                            f"{op.text!r}")
        rules.require_invariant(i)
        rules.require_invariant(j)
        return GraphForm("sddmm", sparse, names, (rows, cols))
    if sparse not in names:
        raise PlanError(f"sparse operand {sparse!r} is neither an input nor the output of "
                        f"{op.text!r}")
    dense = next(n for n in names if n != sparse)
    i, f = dims[op.output.tensor]
    s, d = dims[sparse], dims[dense]
    if len(op.reduction_axes) != 1 or s != (i, op.reduction_axes[0]) or \
            d != (op.reduction_axes[0], f):
        raise PlanError(f"SpMM must read {spmm_shape} (the sparse operand [rows, j], the dense "
                        f"one [j, features], output [rows, features]); got {op.text!r}")
    rules.require_invariant(s[1])
    rules.require_invariant(i)
    return GraphForm("spmm", sparse, names, (dense,))


def as_device_csr(name: str, a: Any, dtype: str) -> Any:
    """A DeviceCSR from what callers hold: a DeviceCSR (its values must have ``dtype``), a torch
    sparse CSR tensor or a dense CUDA tensor (converted on the GPU; a dense one costs a host
    sync for its nnz), a scipy sparse matrix or a pitgen.graph.formats.CSR (uploaded)."""

    if isinstance(a, DeviceCOO):
        raise ShapeError(f"{name} is a DeviceCOO: SDDMM writes its values in CSR order, so pass "
                         f"{name}.to_csr(sort=True)")
    if isinstance(a, DeviceCSR):
        got = str(a.values.dtype).replace("torch.", "")
        if got != dtype:
            raise ShapeError(f"{name} holds {got} values but the kernel is {dtype}; build it with "
                             f"dtype={dtype!r}")
        return a
    if isinstance(a, CSR):
        return DeviceCSR.from_host(a, dtype)
    if type(a).__module__.startswith("scipy.sparse"):
        return DeviceCSR.from_scipy(a, dtype)
    if type(a).__module__.startswith("torch"):
        import torch
        if not isinstance(a, torch.Tensor) or a.dim() != 2:
            raise ShapeError(f"{name} must be a 2-D tensor, got {getattr(a, 'shape', type(a))}")
        check_tensor(name, a.values() if a.layout == torch.sparse_csr else a,
                     ("float16", "bfloat16", "float32", "float64", "bool"), contiguous=False)
        tdt = getattr(torch, dtype)
        if a.layout == torch.sparse_csr:
            return DeviceCSR(tuple(a.shape), a.crow_indices().to(torch.int32).contiguous(),
                             a.col_indices().to(torch.int32).contiguous(),
                             a.values().to(tdt).contiguous())
        if a.layout != torch.strided:
            raise ShapeError(f"{name} has layout {a.layout}; pass a sparse CSR or dense tensor")
        return DeviceCSR.from_dense(a, dtype=dtype)
    raise ShapeError(f"{name}: expected a DeviceCSR, torch sparse CSR or dense CUDA tensor, scipy "
                     f"sparse matrix or pitgen.graph.formats.CSR; got {type(a).__name__}")


def search_settings(tune: bool, budget_s: float | None) -> tuple[bool, float]:
    """(search?, budget) from a caller's ``tune`` and ``budget_s``: the measured search is
    opt-in, by ``tune=True`` (budget 10 s unless given) or by an explicit positive
    ``budget_s``; PlanError for a budget that is not a positive finite number."""
    if not isinstance(tune, bool):
        raise PlanError(f"tune must be True or False, got {tune!r}")
    if budget_s is None:
        return tune, DEFAULT_BUDGET_S
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or \
            not 0 < budget_s < float("inf"):
        raise PlanError(f"budget_s must be a positive finite number of seconds, got {budget_s!r}")
    return True, float(budget_s)


def _identity(a: Any) -> tuple:
    """Identity of a caller's matrix: the object, and for torch tensors its in-place version
    counter, so an edited tensor is converted again."""
    return id(a), getattr(a, "_version", None)


class FormatKernel:
    """A graph operator run by one of SparseTIR's formats on the GPU (see the module docstring).

    ``k(a, x)`` runs SpMM (operands in the expression's input order, or by name) and returns
    Y [rows, F]; ``k(u, v, sample=a)`` runs SDDMM and returns the values [nnz] in the CSR order
    of ``a``. The converted matrix and the format choice are kept per (matrix, feature width), so
    repeated calls with the same graph convert once (the matrix is treated as immutable; torch
    tensors edited in place are noticed; :meth:`forget` drops everything).
    The first call per matrix synchronises with the host once, to read its row statistics
    (computed on the GPU): ``format='auto'`` decides from them (a tuned result of the tune
    cache, else the cost model; with ``tune=True`` or a ``budget_s``, a measured search of
    ``budget_s`` seconds, default 10, when the cache has none), and an explicit format is
    checked against the model (a FormatWarning when it is WARN_RATIO times slower). Hyb and ELL
    conversions sync once more to size their layouts; later calls do not sync.

    ``dynamic=True`` is for a graph that changes every call (new edges, sampled neighbours):
    the choice is made once per (shape, feature width), from the first matrix of that shape,
    among the formats that need no host sync (CSR, and hyb sized by bounds: ``to_format(...,
    sync=False)``), so every later matrix is converted and multiplied without waiting for the
    GPU."""

    def __init__(self, expr: str | Operator, sparse: str, format: str = "auto",
                 dtype: str = "float16", budget_s: float | None = None,
                 params: Mapping[str, Any] | None = None,
                 schedule: Mapping[str, Any] | None = None, tune: bool = False,
                 dynamic: bool = False):
        self.operator = parse(expr) if isinstance(expr, str) else expr
        if format not in ("auto", *FORMATS, COO):
            raise PlanError(f"unknown format {format!r} (choose auto, {', '.join(FORMATS)}, "
                            f"{COO})")
        if dtype not in VALUE_DTYPES:
            raise PlanError(f"format kernels run {' or '.join(VALUE_DTYPES)}, not {dtype!r}")
        if format == "auto" and (params or schedule):
            raise PlanError("params= and schedule= need an explicit format, not 'auto'")
        self.tune, self.budget_s = search_settings(tune, budget_s)
        if self.tune and format != "auto":
            raise PlanError(f"tune=/budget_s= search formats: they need format='auto', not "
                            f"{format!r}")
        if not isinstance(dynamic, bool):
            raise PlanError(f"dynamic must be True or False, got {dynamic!r}")
        if dynamic and format not in ("auto", *SYNC_FREE, COO):
            raise PlanError(f"dynamic=True converts without a host sync: format 'auto', "
                            f"{' or '.join(repr(f) for f in (*SYNC_FREE, COO))}, not {format!r}")
        self.form = graph_form(self.operator, sparse)
        if format == COO and self.form.op != "spmm":
            raise PlanError(f"format {COO!r} multiplies an edge list: it is for SpMM, not "
                            f"{self.form.op}")
        self.format, self.dtype, self.dynamic = format, dtype, dynamic
        self._by_shape: dict[tuple, tuple[str, dict, dict]] = {}
        self.params = dict(params) if params is not None else None
        self.schedule = dict(schedule) if schedule is not None else None
        self._mats: OrderedDict[tuple, tuple[Any, Any, dict]] = OrderedDict()

    @property
    def op(self) -> str:
        return self.form.op

    def forget(self) -> None:
        """Drop every kept matrix, conversion and choice (their GPU memory is freed now)."""
        while self._mats:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest kept matrix. A DeviceCSR built here also releases its transpose
        (which references it back), so its memory goes now, not at the next garbage
        collection; a caller's own DeviceCSR keeps its caches."""
        _, (a, csr, _) = self._mats.popitem(last=False)
        if csr is not a:
            csr.release()

    def _entry(self, name: str, a: Any) -> tuple[Any, dict]:
        key = _identity(a)
        hit = self._mats.get(key)
        if hit is not None and hit[0] is a:
            self._mats.move_to_end(key)
            return hit[1], hit[2]
        csr = as_device_csr(name, a, self.dtype)
        self._mats[key] = (a, csr, {})
        if len(self._mats) > MAX_MATRICES:
            self._evict()
        return csr, self._mats[key][2]

    def choice(self, csr: Any, feat: int) -> tuple[str, dict, dict, GraphStats | None]:
        """(format, params, schedule, statistics) for this DeviceCSR and feature width: one
        host sync for the row statistics; with ``tune``, a search when the tune cache has no
        result. The statistics come back for an explicit format (``prepare`` checks it against
        the model once its parameters are known to be valid), None with 'auto'."""

        if self.format == "auto":
            c = plan(csr, self.op, feat, self.dtype, self.tune, self.budget_s,
                     SYNC_FREE if self.dynamic else FORMATS)
            return c.fmt, c.params, c.schedule, None
        stats = GraphStats.from_dict(csr.row_stats())
        params = self.params if self.params is not None else default_params(self.format, stats)
        sched = self.schedule if self.schedule is not None else \
            default_schedule(self.op, self.format, feat, self.dtype)
        return self.format, dict(params), dict(sched), stats

    def prepare(self, name: str, a: Any, feat: int) -> tuple[Any, tuple[str, dict, dict]]:
        """The converted matrix and the choice for ``a`` at feature width ``feat`` (cached)."""

        if feat < 1:
            raise ShapeError(f"feature width must be >= 1, got {feat}")
        csr, per_feat = self._entry(name, a)
        if feat not in per_feat and self.dynamic:   # once per shape: no statistics, no sync
            key = (csr.shape, feat)
            if key not in self._by_shape:
                self._by_shape[key] = self.choice(csr, feat)[:3]
            fmt, params, sched = self._by_shape[key]
            if fmt == "hyb" and params.get("c", 1) > 1 and not csr.sorted_columns:
                params = {**params, "c": 1}   # column parts need ordered columns
            mat = csr if fmt == "csr" else to_format(csr, fmt, sync=False, **params)
            per_feat[feat] = (mat, (fmt, params, sched))
        if feat not in per_feat:
            fmt, params, sched, stats = self.choice(csr, feat)
            mat = csr if fmt == "csr" else to_format(csr, fmt, **params)
            if stats is not None:  # an explicit format, its parameters valid (converted)
                warn_if_slow(stats, self.op, feat, self.dtype, fmt, params,
                             graph_ops.resolve_schedule(sched, self.op, fmt, feat, self.dtype),
                             stacklevel=4)
            per_feat[feat] = (mat, (fmt, params, sched))
        return per_feat[feat]

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return bind_operands(self.operator.text, self.form.inputs, args, kwargs)

    @on_operand_device
    def __call__(self, *args: Any, sample: Any = None, out: Any = None, **kwargs: Any) -> Any:

        ops = self._bind(args, kwargs)
        if self.op == "spmm":
            if sample is not None:
                raise ShapeError("sample= is for SDDMM; SpMM takes the sparse operand "
                                 f"{self.form.sparse!r} as an operand")
            (xn,) = self.form.dense
            a = ops[self.form.sparse]
            x = check_tensor(xn, ops[xn], (self.dtype,), ndim=2)
            if isinstance(a, DeviceCOO):
                if a.dtype != self.dtype:
                    raise ShapeError(f"{self.form.sparse} holds {a.dtype} values but the kernel "
                                     f"is {self.dtype}")
                if self.format == COO or (self.format == "auto"
                                          and coo_pays(a.nnz, int(x.shape[1]))):
                    return graph_ops.spmm_coo(a, x, out=out)
                # a CSR to convert; a dynamic kernel keeps its columns unsorted (hyb, c = 1)
                a = a.to_csr(sort=not self.dynamic)
            elif self.format == COO:
                raise ShapeError(f"format {COO!r} multiplies an edge list: pass "
                                 f"{self.form.sparse} as a pitgen.graph.device.DeviceCOO, not "
                                 f"{type(a).__name__}")
            mat, (_, _, sched) = self.prepare(self.form.sparse, a, int(x.shape[1]))
            if x.shape[0] != mat.shape[1]:
                raise ShapeError(f"{xn} has {x.shape[0]} rows but {self.form.sparse} has "
                                 f"{mat.shape[1]} columns")
            return graph_ops.spmm(mat, x, schedule=sched, out=out)
        if out is not None:
            raise ShapeError("out= is for SpMM; SDDMM returns a new values tensor")
        if sample is None:
            raise ShapeError(f"SDDMM needs the edge pattern of {self.form.sparse!r}: "
                             f"k({', '.join(self.form.inputs)}, sample=A)")
        un, vn = self.form.dense
        u = check_tensor(un, ops[un], (self.dtype,), ndim=2)
        v = check_tensor(vn, ops[vn], (self.dtype,), ndim=2)
        if u.shape[1] != v.shape[1]:
            raise ShapeError(f"{un} and {vn} need the same feature width, got {u.shape[1]} and "
                             f"{v.shape[1]}")
        mat, (_, _, sched) = self.prepare("sample", sample, int(u.shape[1]))
        for n, t, want in ((un, u, mat.shape[0]), (vn, v, mat.shape[1])):
            if t.shape[0] != want:
                raise ShapeError(f"{n} has {t.shape[0]} rows; the sample is {mat.shape[0]} x "
                                 f"{mat.shape[1]} so it needs {want}")
        return graph_ops.sddmm(mat, u, v, schedule=sched)
