"""The user-facing JIT API: ``pitgen.compile(expr, sparse=..., dtype=..., micro_tile=...)``
returns a :class:`SparseKernel`; calling it on device arrays builds the micro-tile index on the
GPU and runs the tile kernel over it, every call, with no host round-trip."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import PlanError, ShapeError
from ..expr import Operator, parse
from ..lower import DTYPES, Schedule, gemm_form
from ..planner import Plan, make_plan
from ..render import render
from ..runtime import GemmCall, Launcher, TorchLaunch, as_operand, signature

if TYPE_CHECKING:
    from ..graph.jit import FormatKernel


def bind_operands(text: str, names: Sequence[str], args: tuple,
                  kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Positional and keyword operands of a call matched to the expression's input names, with
    a ShapeError naming what is missing, unknown or given twice."""
    if len(args) > len(names):
        raise ShapeError(f"{text!r} takes {len(names)} operands ({', '.join(names)}), "
                         f"got {len(args)}")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise ShapeError(f"unknown operand {k!r} (operands: {', '.join(names)})")
        if k in bound:
            raise ShapeError(f"operand {k!r} given twice")
        bound[k] = v
    missing = [n for n in names if n not in bound]
    if missing:
        raise ShapeError(f"missing operand(s) {', '.join(missing)}")
    return bound


class SparseKernel:
    """A compiled dynamic-sparse operator. ``micro_tile='auto'`` plans on the first call from
    coverage counts computed on the GPU (one small device-to-host copy) and keeps that choice;
    :meth:`replan` forgets it so the next call plans again (e.g. when the sparsity *kind* of the
    data changes; the index itself is rebuilt on every call regardless)."""

    def __init__(self, expr: str | Operator, sparse: str, dtype: str = "float16",
                 micro_tile: str | Sequence[int] = "auto",
                 tile: str | Sequence[int] | Mapping[str, int] | None = None,
                 vendor_dense: bool = True):
        self.vendor_dense = vendor_dense
        self.operator = parse(expr) if isinstance(expr, str) else expr
        if dtype not in DTYPES:
            raise PlanError(f"dtype {dtype!r} has no GPU kernel (supported: {', '.join(DTYPES)})")
        self.dtype = dtype
        self.sparse = sparse
        self.form = gemm_form(self.operator, sparse)
        self.tile = tile
        self.micro_tile = micro_tile
        self._plan: Plan | None = None
        self._launchers: dict[tuple, Launcher] = {}
        if not (isinstance(micro_tile, str) and micro_tile == "auto"):
            self._plan = make_plan(self.operator, sparse, micro_tile=micro_tile, tile=tile)

    @property
    def plan(self) -> Plan | None:
        """The plan in use (None for 'auto' before the first call)."""
        return self._plan

    def replan(self) -> None:
        """Forget an 'auto' choice; the next call plans again from its operand."""
        if isinstance(self.micro_tile, str) and self.micro_tile == "auto":
            self._plan = None
            self._launchers.clear()

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self.operator.input_names
        bound = bind_operands(self.operator.text, names, args, kwargs)
        return {n: as_operand(n, bound[n]) for n in names}

    def _schedule(self, plan: Plan) -> Schedule:
        """The tile kernel's BN' and BK from the plan's compute tile where the user gave a tile."""
        if self.tile is None:
            return Schedule()
        ct = plan.compute_tile
        return Schedule(bn=ct[self.form.n_axis], bk=ct[self.form.k_axis])

    def prepare(self, *args: Any, out: Any = None, accumulate: bool = False, mask: Any = None,
                **kwargs: Any) -> GemmCall:
        """Validate the operands and compile (or load) the module for them; launches nothing.
        Everything but buffer allocation is cached per call signature (shapes, strides, dtypes,
        alignment), so repeated calls cost only their launches."""
        ops = self._bind(args, kwargs)
        m_op = as_operand("mask", mask) if mask is not None else None
        if m_op is not None and m_op.shape != ops[self.sparse].shape:
            raise ShapeError(f"mask has shape {m_op.shape} but {self.sparse} has shape "
                             f"{ops[self.sparse].shape}")
        if self._plan is None:
            from ..coverage import plan_on_device
            self._plan = plan_on_device(self.operator, self.sparse, m_op or ops[self.sparse], self.tile)
        c_op = as_operand("out", out) if out is not None else None
        key = signature(ops, c_op, accumulate, m_op)
        launcher = self._launchers.get(key)
        if launcher is None:
            c = self._plan.choice
            launcher = Launcher(self.operator, self.form, c.kind, c.axis, c.shape, self.dtype,
                                ops, c_op, accumulate, self._schedule(self._plan),
                                vendor_dense=self.vendor_dense, mask=m_op)
            self._launchers[key] = launcher
        return GemmCall(launcher, ops, out, m_op)

    def __call__(self, *args: Any, out: Any = None, accumulate: bool = False, mask: Any = None,
                 **kwargs: Any) -> Any:
        """Compute the operator; ``out`` receives the result (``accumulate=True`` adds to it).

        ``mask`` (bool or uint8, the sparse operand's shape) says where that operand may be
        non-zero: the index is built from it instead of from the values. Values outside the mask
        must be zero (they are computed only where they share a micro-tile with a masked one)."""
        return self.prepare(*args, out=out, accumulate=accumulate, mask=mask, **kwargs).run()

    def index(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Build only the micro-tile index of the sparse operand; returns device arrays
        ``(counts, ids)`` (``ids`` rows padded past ``counts``; order within a row is free),
        or ``(None, None)`` for a dense plan."""
        call = self.prepare(*args, **kwargs)
        if call.L.vendor:
            return None, None
        with TorchLaunch(call.A.is_torch) as launch:
            try:
                call.build_index(launch.stream)
            finally:
                launch.keep(*call.ws.keep)
        return call.counts, call.ids

    def source(self, *args: Any, **kwargs: Any) -> str:
        """The CUDA source this kernel runs for these operands."""
        launcher = self.prepare(*args, **kwargs).L
        return render(launcher.spec)


def compile(expr: str | Operator, sparse: str, dtype: str = "float16",
            micro_tile: str | Sequence[int] = "auto",
            tile: str | Sequence[int] | Mapping[str, int] | None = None,
            vendor_dense: bool = True, format: str | None = None,
            budget_s: float = 10.0) -> SparseKernel | FormatKernel:
    """JIT kernel for ``expr`` with operand ``sparse`` dynamically sparse.

    ``micro_tile``: 'auto', 'dense', or a shape in the operand's dimension order ('32x1' is
    32 rows by 1 column of ``A[m,k]``: a micro-tile along k). A micro-tile along an axis that is
    not permutation invariant is refused with the rule's reason. A dense plan on torch tensors
    runs cuBLAS (through torch) unless ``vendor_dense=False`` asks for pitgen's own tile kernel.

    ``format`` ('auto', 'csr', 'ell', 'bsr', 'hyb') asks for a graph operator instead (SpMM
    ``Y[i,f] += A[i,j] * X[j,f]``, or SDDMM ``E[i,j] += U[i,f] * V[j,f]`` with ``sparse='E'``)
    run by a sparse-format kernel: a :class:`pitgen.graph.jit.FormatKernel`; 'auto' takes the
    tuned choice (``budget_s`` bounds a search when the tune cache has none).
    """
    if format is not None:
        if not (isinstance(micro_tile, str) and micro_tile == "auto") or tile is not None \
                or not vendor_dense:
            raise PlanError("micro_tile=, tile= and vendor_dense= are for micro-tile kernels; "
                            "a format kernel takes format= (and budget_s=) only")
        from ..graph.jit import FormatKernel
        return FormatKernel(expr, sparse, format, dtype, budget_s)
    return SparseKernel(expr, sparse, dtype, micro_tile, tile, vendor_dense)
