"""The user-facing JIT API: ``pitgen.compile(expr, sparse=..., dtype=..., micro_tile=...)``
returns a :class:`SparseKernel`; calling it on device arrays builds the micro-tile index on the
GPU and runs the tile kernel over it, every call, with no host round-trip."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from ..checks import dtype_name
from ..coverage import plan_on_device
from ..errors import PlanError, ShapeError
from ..expr import Operator, parse
from ..graph.jit import FormatKernel
from ..lower import DTYPES, GemmForm, Layout, Schedule, gemm_form, geometry, lower_first
from ..operands import (Operand, Workspace, align, as_operand, bind_operands, contiguous_strides,
                        distinct_strides, signature)
from ..opspec import OpSpec
from ..planner import Plan, make_plan
from ..runtime import TorchLaunch, device_arch, device_sms, memset_d32, tensor_map
from .library import jit_config, jit_matmul, no_backward

#: The GEMM module (index build, tile kernel, SWrite passes). Its permutations depend on the
#: plan: the planner derives them per call from ``analyse`` (micro-tiles only along invariant
#: axes), so none is declared here.
MATMUL = OpSpec("matmul", "module.cu.j2", {
    "pit_gemm": "PPPPPPiiiiiiiiii", "pit_gemm_sm90": "MMPPPPPPPiiiiiiiiii",
    "pit_gemm_sm90_order": "PPi",
    "pit_build_index": "PiiiiPPPPii",
    "pit_gemm_zero": "Piiii", "pit_gemm_finish": "PPiiiii"}, dtypes=tuple(DTYPES))


class Launcher:
    """The validated, compiled launch plan of one call signature: problem sizes, module, grids.

    Built once per signature (validation, sympy extents, lowering and the module load are
    all here), so that a call itself only allocates buffers and enqueues launches.
    """

    def __init__(self, op: Operator, form: GemmForm,
                 choices: list[tuple[str, str | None, tuple[int, ...]]], dtype: str,
                 ops: dict[str, Operand],
                 out: Operand | None, accumulate: bool, schedule: Schedule = Schedule(),
                 vendor_dense: bool = True, mask: Operand | None = None):
        A, B = ops[form.sparse], ops[form.dense]
        if mask is not None:
            if mask.dtype not in ("bool", "uint8"):
                raise ShapeError(f"mask has dtype {mask.dtype}; expected bool or uint8")
            if mask.is_torch != A.is_torch:
                raise ShapeError("mask must be the same kind of array as the operands")
            if any(st < 0 for st in mask.strides):
                raise ShapeError(f"mask has a negative stride {mask.strides}")
        for o in (A, B):
            if o.dtype != dtype:
                raise ShapeError(f"{o.name} has dtype {o.dtype}, the kernel was compiled for {dtype}")
            if any(s < 0 for s in o.strides):
                raise ShapeError(f"{o.name} has a negative stride {o.strides}")
        if A.is_torch != B.is_torch:
            raise ShapeError("mixing torch tensors and GPUArrays in one call is not supported")
        ext = op.extents({o.name: o.shape for o in ops.values()})
        self.M, self.N, self.K = M, N, K = ext[form.m_axis], ext[form.n_axis], ext[form.k_axis]
        self.out_shape = tuple(ext[a] for a in op.output.axes)
        self.form, self.dtype, self.accumulate, self.is_torch = form, dtype, accumulate, A.is_torch
        if out is None:
            if accumulate:
                raise ShapeError("accumulate=True needs out= (the array to add to)")
            sc_out = contiguous_strides(self.out_shape)
            align_c = 16
        else:
            if out.shape != self.out_shape or out.dtype != dtype:
                raise ShapeError(f"out has shape {out.shape} and dtype {out.dtype}; expected "
                                 f"{self.out_shape} {dtype}")
            if out.is_torch != A.is_torch:
                raise ShapeError("out must be the same kind of array as the operands")
            if not distinct_strides(out.shape, out.strides):
                raise ShapeError(f"out has overlapping strides {out.strides}: every element "
                                 f"needs its own place")
            sc_out, align_c = out.strides, align(out.ptr)
        sc = (sc_out[form.c_dims[0]], sc_out[form.c_dims[1]])
        self.layout = Layout(M, N, K, (A.strides[form.a_dims[0]], A.strides[form.a_dims[1]]),
                             (B.strides[form.b_dims[0]], B.strides[form.b_dims[1]]), sc,
                             align(A.ptr), align(B.ptr), align_c)
        arch = device_arch() if M * N else "sm_80"
        #: which of ``choices`` runs: the first that lowering accepts on this layout
        self.choice, self.spec = lower_first(op, form.sparse, choices, dtype, self.layout,
                                             accumulate=accumulate, schedule=schedule, arch=arch)
        kind, _, shape = choices[self.choice]
        #: a dense plan on torch tensors runs the vendor GEMM (cuBLAS through torch)
        self.vendor = kind == "dense" and A.is_torch and vendor_dense
        sms = device_sms() if self.spec.gemm.mainloop == "wgmma" else 0
        self.geo = geometry(self.spec, self.layout, shape[form.a_dims[1]], sms)
        self.mod = MATMUL.module(self.spec.context()) if M * N and not self.vendor else None
        self.smem = self.spec.gemm.smem_bytes(dtype)
        self.mask_strides = (0, 0)
        if mask is not None:  # the mask's strides along the index's (long, id) dims
            md = (mask.strides[form.a_dims[0]], mask.strides[form.a_dims[1]])
            self.mask_strides = md[::-1] if self.spec.gemm.a_mode == "rows" else md


    def tensor_maps(self, a_ptr: int, b_ptr: int) -> tuple[bytes, bytes]:
        """The wgmma kernel's TMA descriptors of A' and B' at these addresses, box for box as
        its shared-memory tiles."""
        g, lay = self.spec.gemm, self.layout
        ta = (tensor_map(a_ptr, self.dtype, (lay.K, lay.M), lay.sa[0], (g.bk, g.bm))
              if g.a_smem_kcontig else
              tensor_map(a_ptr, self.dtype, (lay.M, lay.K), lay.sa[1], (64, g.bk)))
        tb = (tensor_map(b_ptr, self.dtype, (lay.N, lay.K), lay.sb[0], (64, g.bk))
              if g.b_smem_ncontig else
              tensor_map(b_ptr, self.dtype, (lay.K, lay.N), lay.sb[1], (g.bk, g.bn)))
        return ta, tb


class GemmCall:
    """One call: the launcher's plan applied to this call's arrays and fresh buffers.

    ``build_index()`` then ``compute()``: both only enqueue work on the stream; nothing waits.
    """

    def __init__(self, launcher: Launcher, ops: dict[str, Operand], out: Any | None,
                 mask: Operand | None = None):
        self.L = L = launcher
        self.mask_ptr = mask.ptr if mask is not None else 0
        self.A, self.B = ops[L.form.sparse], ops[L.form.dense]
        self.ws = Workspace(self.A)
        self.out = out if out is not None else self.ws.alloc(L.out_shape, L.dtype)
        self.c_ptr = Workspace.ptr(self.out)
        self.counts = self.ids = self.pack = self.order = None

    def build_index(self, stream) -> None:
        """Zero the counts, then one pass over A' appends every non-zero micro-tile (or block)."""
        L = self.L
        ix = L.spec.index
        if ix is None or L.vendor or L.M * L.N * L.K == 0:
            return
        geo = L.geo
        self.counts = self.ws.alloc((geo.groups,), "int32")
        self.ids = self.ws.alloc((geo.groups, geo.cap), "int32")
        if ix.pack:
            self.pack = self.ws.alloc((geo.groups * geo.cap * ix.long_extent,), L.dtype)
        memset_d32(Workspace.ptr(self.counts), 0, geo.groups, stream)
        L.mod.launch(
            "pit_build_index", geo.index_grid, (256, 1, 1), stream, self.A.ptr, *geo.index_args,
            Workspace.ptr(self.counts), Workspace.ptr(self.ids),
            Workspace.ptr(self.pack) if self.pack is not None else 0,
            self.mask_ptr, *L.mask_strides)
        if L.spec.gemm.mainloop == "wgmma":  # the m-tiles longest first, for the persistent CTAs
            self.order = self.ws.alloc((geo.groups,), "int32")
            L.mod.launch("pit_gemm_sm90_order", (1, 1), (1024, 1, 1), stream,
                         Workspace.ptr(self.counts), Workspace.ptr(self.order), geo.groups)

    def compute(self, stream) -> None:
        """The tile kernel over the index (upper-bound grid; empty tiles exit), then SWrite passes."""
        L = self.L
        M, N, K, g, mod, sc = L.M, L.N, L.K, L.spec.gemm, L.mod, L.layout.sc
        if M * N == 0:
            return
        if L.vendor:
            return self._vendor()
        if K == 0:
            if not L.accumulate:
                mod.launch("pit_gemm_zero", L.geo.flat, (256, 1, 1), stream, self.c_ptr, M, N, *sc)
            return
        f32 = None
        if g.a_mode == "rows":
            if g.c_mode == "atomic":
                f32 = self.ws.alloc((M * N,), "float32")
                memset_d32(Workspace.ptr(f32), 0, M * N, stream)
            elif not L.accumulate:
                mod.launch("pit_gemm_zero", L.geo.flat, (256, 1, 1), stream, self.c_ptr, M, N, *sc)
        ptr = lambda x: Workspace.ptr(x) if x is not None else 0  # noqa: E731
        lay = L.layout
        buffers = (ptr(self.pack) if self.pack is not None else self.A.ptr, self.B.ptr,
                   self.c_ptr, ptr(f32), ptr(self.counts), ptr(self.ids))
        sizes = (M, N, K, lay.sa[0], lay.sa[1], lay.sb[0], lay.sb[1], sc[0], sc[1], L.geo.tk)
        if g.mainloop == "wgmma":
            mod.launch("pit_gemm_sm90", L.geo.grid, (g.threads, 1, 1), stream,
                       *L.tensor_maps(self.A.ptr, self.B.ptr), *buffers, ptr(self.order),
                       *sizes, smem=L.smem)
        else:
            mod.launch("pit_gemm", L.geo.grid, (g.threads, 1, 1), stream, *buffers, *sizes,
                       smem=L.smem)
        if f32 is not None:
            mod.launch("pit_gemm_finish", L.geo.flat, (256, 1, 1), stream, self.c_ptr,
                       Workspace.ptr(f32), M, N, *sc, int(L.accumulate))

    def _vendor(self) -> None:
        """Dense plan on torch tensors: cuBLAS through torch, on torch's current stream."""
        f = self.L.form
        a = self.A.obj.permute(*f.a_dims)
        b = self.B.obj.permute(*f.b_dims)
        c = self.out.permute(*f.c_dims)
        if self.L.accumulate:
            c.addmm_(a, b)
        elif c.is_contiguous():
            import torch
            torch.mm(a, b, out=c)
        else:
            c.copy_(a @ b)

    def run(self) -> Any:
        """build_index + compute on the caller's stream; returns the output array."""
        if self.L.vendor:
            self.compute(None)
            return self.out
        with TorchLaunch(self.A.is_torch) as launch:
            try:
                self.build_index(launch.stream)
                self.compute(launch.stream)
            finally:
                launch.keep(*self.ws.keep)
        return self.out


def _is_tensor(x: Any) -> bool:
    """A torch tensor (checked by its type's module, like :func:`as_operand`: no torch import)."""
    return type(x).__module__.startswith("torch")


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
        dtype = dtype_name(dtype)
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
        #: the ``pitgen::matmul`` argument that rebuilds this kernel
        self.config = jit_config(self)

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
            self._plan = plan_on_device(self.operator, self.sparse, m_op or ops[self.sparse], self.tile)
        c_op = as_operand("out", out) if out is not None else None
        key = signature(ops, c_op, accumulate, m_op)
        launcher = self._launchers.get(key)
        if launcher is None:
            plan = self._plan
            order = [plan.choice]
            if isinstance(self.micro_tile, str) and self.micro_tile == "auto":
                order += [c for c in plan.candidates if c != plan.choice]  # dense is among them
            launcher = Launcher(self.operator, self.form,
                                [(c.kind, c.axis, c.shape) for c in order], self.dtype, ops,
                                c_op, accumulate, self._schedule(plan),
                                vendor_dense=self.vendor_dense, mask=m_op)
            if launcher.choice:
                self._plan = replace(plan, choice=order[launcher.choice])
            self._launchers[key] = launcher
        return GemmCall(launcher, ops, out, m_op)

    def __call__(self, *args: Any, out: Any = None, accumulate: bool = False, mask: Any = None,
                 **kwargs: Any) -> Any:
        """Compute the operator; ``out`` receives the result (``accumulate=True`` adds to it).

        ``mask`` (bool or uint8, the sparse operand's shape) says where that operand may be
        non-zero: the index is built from it instead of from the values. Values outside the mask
        must be zero (they are computed only where they share a micro-tile with a masked one).

        On torch tensors without ``out`` the call runs as the ``torch.library`` op
        ``pitgen::matmul`` (torch.compile and CUDA graphs see one op). It has no backward:
        operands that require grad (grad mode on) raise :class:`pitgen.errors.BackwardError`."""
        tensors = self._torch_operands(args, kwargs)
        if tensors is not None:
            if out is None and not accumulate and (mask is None or _is_tensor(mask)):
                return jit_matmul(self, *tensors, mask)
            no_backward("a compiled SparseKernel called with out=", *tensors)
        return self.prepare(*args, out=out, accumulate=accumulate, mask=mask, **kwargs).run()

    def _torch_operands(self, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
        """The two operands in the expression's input order when both are torch tensors, else
        None (GPUArrays, other arities: the direct launch path)."""
        names = self.operator.input_names
        if len(names) != 2:
            return None
        bound = bind_operands(self.operator.text, names, args, kwargs)
        ops = tuple(bound[n] for n in names)
        return ops if all(_is_tensor(t) for t in ops) else None

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
        return MATMUL.source(launcher.spec.context())


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
    tuned choice (``budget_s`` bounds a search when the tune cache has none). ``dtype`` is a
    name or a torch/NumPy dtype (``torch.bfloat16``).
    """
    dtype = dtype_name(dtype)
    if format is not None:
        if not (isinstance(micro_tile, str) and micro_tile == "auto") or tile is not None \
                or not vendor_dense:
            raise PlanError("micro_tile=, tile= and vendor_dense= are for micro-tile kernels; "
                            "a format kernel takes format= (and budget_s=) only")
        return FormatKernel(expr, sparse, format, dtype, budget_s)
    return SparseKernel(expr, sparse, dtype, micro_tile, tile, vendor_dense)
