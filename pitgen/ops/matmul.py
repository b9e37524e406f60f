"""The user-facing JIT API: ``pitgen.compile(expr, sparse=..., dtype=..., micro_tile=...)``
returns a :class:`SparseKernel`; calling it on device arrays builds the micro-tile index on the
GPU and runs the tile kernel over it, every call, with no host round-trip."""
from __future__ import annotations

import sys
import threading
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from ..checks import dtype_name
from ..coverage import plan_on_device
from ..errors import PlanError, ShapeError
from ..expr import Operator, parse
from ..graph.jit import FormatKernel
from ..lower import (DTYPES, PRODUCTS_FINISH_THREADS, PRODUCTS_SLOTS_PER_ROW, GemmForm, Layout,
                     WGMMA_ARCHS, Schedule, fuse, gemm_form, geometry, lower_first,
                     products_fit)
from ..operands import (Operand, Workspace, align, as_operand, bind_operands, contiguous_strides,
                        distinct_strides, on_operand_device, raw_key, signature)
from ..opspec import OpSpec
from ..planner import Plan, make_plan
from ..runtime import (TorchLaunch, capturing, device_arch, device_index, device_sms, memset_d32,
                       tensor_map)
from .library import jit_config, jit_matmul, no_backward, plain_tensors, tracing
from .library import ops as torch_ops

#: The GEMM module (index build, tile kernel, the K = 0 pass). Its permutations depend on the
#: plan: the planner derives them per call from ``analyse`` (micro-tiles only along invariant
#: axes), so none is declared here.
MATMUL = OpSpec("matmul", "module.cu.j2", {
    "pit_gemm": "PPPPPiiiiiiiiii", "pit_gemm_sm90": "MMPPPPPPPiiiiiiiiii",
    "pit_build_index": "PiiiiPPPPiiPP", "pit_gemm_fused": "PiiiiPPPPiiPPii" + "PPP" + "i" * 10,
    "pit_gemm_zero": "Piiii", "pit_gemm_products": "P" * 7 + "i" * 11,
    "pit_gemm_finish": "P" * 6 + "i" * 11}, dtypes=tuple(DTYPES))


#: int32 words after an index's counts: the index pass's done counter (its last CTA orders the
#: m-tiles) and the wgmma kernel's tile counter (its CTAs draw tiles from it); both start at
#: zero and every launch leaves them zero
COUNTS_TAIL = 2


def tile_counter(counts: int, groups: int) -> int:
    """The address of the wgmma kernel's tile counter: the second word of the counts' tail."""
    return counts + 4 * (groups + 1)


#: call signatures (shapes, strides, dtypes, alignment) a SparseKernel keeps launchers for;
#: each keeps its index buffers per stream, so a kernel called with ever new shapes starts over
#: past this many rather than holding all of them
MAX_LAUNCHERS = 64


class Launcher:
    """The validated, compiled launch plan of one call signature: problem sizes, module, grids.

    Built once per signature (validation, sympy extents, lowering and the module load are
    all here), so that a call itself only allocates buffers and enqueues launches.
    """

    def __init__(self, op: Operator, form: GemmForm,
                 choices: list[tuple], dtype: str,
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
        kind = choices[self.choice][0]
        #: kernels after the index pass are programmatic dependent launches (sm_90: each
        #: starts while the kernel before it completes, and waits for its writes first)
        self.early = arch in WGMMA_ARCHS
        #: a dense plan on torch tensors runs the vendor GEMM (cuBLAS through torch)
        self.vendor = kind == "dense" and A.is_torch and vendor_dense
        g = self.spec.gemm
        sms = device_sms() if g.mainloop == "wgmma" or g.a_mode == "products" else 0
        self.geo = geometry(self.spec, self.layout, sms)
        #: a small problem's one-launch plan and its module (only pit_gemm_fused), else None
        fused = fuse(self.spec, self.geo) if not self.vendor and M * N * K else self.spec
        self.fused_spec = fused if fused.fused else None
        self.fused_mod = MATMUL.module(fused.context()) if fused.fused else None
        self._mod = None
        self.smem = g.smem_bytes(dtype)
        self.mask_strides = (0, 0)
        if mask is not None:  # the mask's strides along the index's (long, id) dims
            md = (mask.strides[form.a_dims[0]], mask.strides[form.a_dims[1]])
            self.mask_strides = md[::-1] if g.a_mode in ("rows", "products") else md
        lay = self.layout
        #: the tile kernel's size arguments
        self.sizes = (M, N, K, *lay.sa, *lay.sb, *lay.sc, self.geo.tk)
        #: int32 words of the index: counts and their tail (COUNTS_TAIL), ids, and the wgmma
        #: kernel's m-tile order
        n = self.geo.groups
        self.index_words = n + COUNTS_TAIL + n * self.geo.cap + (n if g.mainloop == "wgmma" else 0)
        #: products: the row table's int32 words (per row a count and a bit per k-tile, zero
        #: between launches; each row's places in the k-tile lists; the lists' bases) and the
        #: fp32 slots' rows (one per product up to PRODUCTS_SLOTS_PER_ROW * M; the finishing pass
        #: forms products past them)
        kts = n if g.a_mode == "products" else 0
        self.table_bits = M * (1 + (kts + 31) // 32) if kts else 0
        self.table_words = self.table_bits + M * kts + (kts + 1 if kts else 0)
        self.slot_rows = M * PRODUCTS_SLOTS_PER_ROW if kts else 0
        #: per stream handle: index buffers that calls on that stream reuse (stream order
        #: keeps one call's index build behind the previous call's tile kernel)
        self._scratch: dict[tuple[int, str], Any] = {}
        #: held while a reusing call enqueues its index build and tile kernel, so that two
        #: threads on one stream cannot interleave their launches over one index buffer
        self.lock = threading.Lock()
        self._torch_call: Callable[[Any, Any, Any, int], Any] | None = None

    @property
    def mod(self) -> Any:
        """The module of the index pass, the tile kernel and the K = 0 pass (None for a vendor
        or empty plan), loaded on first use: a fused launcher needs it only for an index alone,
        a captured call or prepare()."""
        if self._mod is None and self.M * self.N and not self.vendor:
            self._mod = MATMUL.module(self.spec.context())
        return self._mod

    def scratch(self, stream: int | None, words: int, dtype: str) -> Any:
        """This launcher's reusable buffer of ``words`` elements for launches on ``stream``."""
        key = (stream or 0, dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = Workspace(self.is_torch).alloc((words,), dtype)
        return buf

    def counts_pair(self, stream: int | None) -> tuple[Any, int, int, int]:
        """(buffer, half, its address, the other half's address) of the index counts for this
        launch on ``stream``: the two halves of one [2, groups + COUNTS_TAIL] buffer zeroed once,
        taken in turn (each half's counters after its counts stay zero between launches). Each
        index launch zeroes the other half's counts for the launch after it (stream order
        keeps the two apart), so calls that reuse their index buffers enqueue no memset (one
        driver call fewer per call; addresses, not tensor views, to keep the call lean)."""
        key = (stream or 0, "counts")
        entry = self._scratch.get(key)
        if entry is None:
            n = self.geo.groups + COUNTS_TAIL
            buf = Workspace(self.is_torch).alloc((2, n), "int32")
            base = Workspace.ptr(buf)
            memset_d32(base, 0, 2 * n, stream or 0)
            entry = (buf, 0, base, base + 4 * n)
        buf, half, this, other = entry
        self._scratch[key] = (buf, 1 - half, other, this)
        return buf, half, this, other

    def fused_sync(self, stream: int | None) -> int:
        """The address of the fused kernel's ticket, finish and per-m-tile done counters for
        launches on ``stream``: zeroed once, and every launch leaves them zero."""
        key = (stream or 0, "sync")
        entry = self._scratch.get(key)
        if entry is None:
            words = 2 + self.geo.groups
            buf = Workspace(self.is_torch).alloc((words,), "int32")
            memset_d32(Workspace.ptr(buf), 0, words, stream or 0)
            entry = self._scratch[key] = (buf, Workspace.ptr(buf))
        return entry[1]

    def products_buffers(self, stream: int | None, fresh: bool = False) -> tuple[Any, Any]:
        """(row table, slots) of the products kernel: the launcher's for ``stream`` (the table's
        bits zeroed once; every finishing pass leaves them zero), or with ``fresh`` new ones."""
        key = (stream or 0, "products")
        entry = None if fresh else self._scratch.get(key)
        if entry is None:
            ws = Workspace(self.is_torch)
            entry = (ws.alloc((self.table_words,), "int32"),
                     ws.alloc((self.slot_rows * self.N,), "float32"))
            memset_d32(Workspace.ptr(entry[0]), 0, self.table_bits, stream or 0)
            if not fresh:
                self._scratch[key] = entry
        return entry

    def fused_grid(self) -> tuple[int, int, int]:
        """The fused kernel's grid: the index CTAs, then the output tiles."""
        (ix, iy), (tx, ty) = self.geo.index_grid, self.geo.grid
        return (ix * iy + tx * ty, 1, 1)

    def torch_call(self) -> Callable[[Any, Any, Any, int], Any]:
        """``call(a, b, out, mask_ptr) -> out``: a steady-state call on plain torch tensors
        (SparseKernel.__call__ once this launcher is known for their raw attributes), the same
        launches as ``GemmCall(..., reuse=True).run()`` with everything but the pointers and
        the stream decided here, once: kernels bound to their grids, argument tuples built, the
        index buffers and counts pair per stream. A call allocates its output and makes its
        driver calls (index pass, tile kernel), nothing else."""
        if self._torch_call is None:
            self._torch_call = self._make_torch_call()
        return self._torch_call

    def _make_torch_call(self) -> Callable[[Any, Any, Any, int], Any]:
        g, geo, ix = self.spec.gemm, self.geo, self.spec.index
        if self.vendor or ix is None or self.M * self.N * self.K == 0 or g.a_mode == "products":
            def general(a: Any, b: Any, out: Any, mask_ptr: int) -> Any:
                return GemmCall(self, a, b, out, mask_ptr, reuse=True).run()
            return general
        import torch
        shape, dtype, lock, n = self.out_shape, getattr(torch, self.dtype), self.lock, geo.groups
        index_args, mask_strides, sizes = geo.index_args, self.mask_strides, self.sizes
        wgmma = g.mainloop == "wgmma"
        if self.fused_mod is not None:
            fused = self.fused_mod.bind("pit_gemm_fused", self.fused_grid(), (256, 1, 1),
                                        self.smem)
        else:
            fused = None
            index = self.mod.bind("pit_build_index", geo.index_grid, (256, 1, 1))
            tile = self.mod.bind("pit_gemm_sm90" if wgmma else "pit_gemm", geo.grid,
                                 (g.threads, 1, 1), self.smem, early=wgmma or g.early)
        empty, by_stream = torch.empty, {}

        def buffers(stream: int) -> tuple[int, int]:
            """(ids, packed A') addresses of this stream's index buffers (build_index's)."""
            ids = self.scratch(stream, self.index_words, "int32").data_ptr() + 4 * (n + COUNTS_TAIL)
            pack = self.scratch(stream, n * geo.cap * ix.long_extent, self.dtype).data_ptr() \
                if ix.pack else 0
            by_stream[stream] = ids, pack
            return ids, pack

        def call(a: Any, b: Any, out: Any, mask_ptr: int) -> Any:
            if capturing():   # fresh index buffers: nothing shared between graphs
                return GemmCall(self, a, b, out, mask_ptr).run()
            if out is None:   # sizes as arguments, not a tuple: 1.2 us less (H200 host)
                out = empty(*shape, dtype=dtype, device=a.device)
            a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
            with TorchLaunch() as launch, lock:
                stream = launch.stream
                ids, pack = by_stream.get(stream) or buffers(stream)
                _, _, counts, zero = self.counts_pair(stream)
                if fused is not None:
                    fused(stream, a_ptr, *index_args, counts, ids, pack, mask_ptr, *mask_strides,
                          zero, self.fused_sync(stream), *geo.index_grid, pack or a_ptr, b_ptr,
                          out.data_ptr(), *sizes)
                    return out
                order_ptr = ids + 4 * n * geo.cap if wgmma else 0
                index(stream, a_ptr, *index_args, counts, ids, pack, mask_ptr, *mask_strides,
                      zero, order_ptr)
                if wgmma:
                    tile(stream, *self.tensor_maps(a_ptr, b_ptr), pack or a_ptr, b_ptr,
                         out.data_ptr(), counts, ids, order_ptr, tile_counter(counts, n), *sizes)
                else:
                    tile(stream, pack or a_ptr, b_ptr, out.data_ptr(), counts, ids, *sizes)
            return out
        return call

    def tensor_maps(self, a_ptr: int, b_ptr: int) -> tuple[bytes, bytes]:
        """The wgmma kernel's TMA descriptors of A' and B' at these addresses, box for box as
        its shared-memory tiles."""
        g, lay = self.spec.gemm, self.layout
        tb = (tensor_map(b_ptr, self.dtype, (lay.N, lay.K), lay.sb[0], (64, g.bk))
              if g.b_smem_ncontig else
              tensor_map(b_ptr, self.dtype, (lay.K, lay.N), lay.sb[1], (g.bk, g.bn)))
        if g.a_mode == "rows":   # A' rows are gathered (cp.async): the kernel reads no map of A'
            return tb, tb
        ta = (tensor_map(a_ptr, self.dtype, (lay.K, lay.M), lay.sa[0], (g.bk, g.bm))
              if g.a_smem_kcontig else
              tensor_map(a_ptr, self.dtype, (lay.M, lay.K), lay.sa[1], (64, g.bk)))
        return ta, tb


class GemmCall:
    """One call: the launcher's plan applied to this call's arrays.

    ``build_index()`` then ``compute()``: both only enqueue work on the stream (a CUstream
    handle; None or 0: the legacy default stream); nothing waits. ``a`` and ``b`` are the
    sparse and the dense operand (torch tensors or GPUArrays, as the launcher was built for).
    The index goes to fresh buffers (``counts``/``ids`` stay the caller's), or with
    ``reuse=True`` to the launcher's per-stream buffers (``__call__``: nothing allocated for it;
    not while the stream captures a CUDA graph).
    """

    def __init__(self, launcher: Launcher, a: Any, b: Any, out: Any | None, mask_ptr: int = 0,
                 reuse: bool = False):
        self.L = L = launcher
        self.a, self.b, self.mask_ptr = a, b, mask_ptr
        self.reuse = reuse and not (L.is_torch and capturing())   # see runtime.capturing
        self.a_ptr, self.b_ptr = Workspace.ptr(a), Workspace.ptr(b)
        self.out = out if out is not None else Workspace(L.is_torch).alloc(L.out_shape, L.dtype)
        self.c_ptr = Workspace.ptr(self.out)
        self._ints = self.pack = None
        self._counts: tuple[Any, Any] | None = None  # (buffer, index): the counts are buffer[index]
        self.counts_ptr = self.ids_ptr = self.order_ptr = self.next_ptr = 0
        self.products: tuple[Any, Any] | None = None  # products: (row table, slots)

    @property
    def device(self) -> Any:
        """The torch device of its operands (None for GPUArrays): its launches run there, also
        when another device is current by the time they are made (on_operand_device)."""
        return self.a.device if self.L.is_torch else None

    @property
    def counts(self) -> Any:
        """The index's per-group counts (None before build_index, or without an index)."""
        return None if self._counts is None else self._counts[0][self._counts[1]]

    @property
    def ids(self) -> Any:
        """The index's [groups, cap] id lists (rows padded past ``counts``). Rows mode: group
        kt * (row blocks) + rb lists the active rows of row block rb (BM rows) in k-tile kt."""
        if self._ints is None:
            return None
        n, cap = self.L.geo.groups, self.L.geo.cap
        return self._ints[n + COUNTS_TAIL:n + COUNTS_TAIL + n * cap].reshape(n, cap)

    def use_index(self, counts: Any, ids: Any) -> None:
        """Compute over an index built elsewhere (device arrays shaped as ``counts``/``ids``;
        the wgmma kernel then takes its tiles in a static order). Not for the products kernel,
        which reads its own index's row table."""
        if self.L.spec.gemm.a_mode == "products":
            raise PlanError("the products kernel computes only over the index it builds (its row "
                            "table is not part of counts and ids)")
        self.counts_ptr, self.ids_ptr = Workspace.ptr(counts), Workspace.ptr(ids)
        self.order_ptr = self.next_ptr = 0

    def _buffer(self, stream: int | None, size: int, dtype: str) -> Any:
        """An index buffer: the launcher's for ``stream`` when reusing, else a fresh one."""
        if self.reuse:
            return self.L.scratch(stream, size, dtype)
        return Workspace(self.L.is_torch).alloc((size,), dtype)

    @on_operand_device
    def build_index(self, stream: int | None) -> None:
        """Zero the counts, then one pass over A' appends every non-zero micro-tile (or block)
        (wgmma: and its last CTA sorts the m-tiles longest first). Fresh counts and their done
        counter, ids and the m-tile order share one int32 buffer; a reusing call takes the
        launcher's counts pair instead, zeroed by the launch before."""
        args = self._index_args(stream)
        if args is not None:
            self.L.mod.launch("pit_build_index", self.L.geo.index_grid, (256, 1, 1), stream,
                              *args, self.order_ptr)

    def _index_args(self, stream: int | None) -> tuple | None:
        """The index buffers of this call (fresh, or the launcher's for ``stream``), and the
        index pass's arguments over them but the last (the m-tile order); None: no index."""
        L = self.L
        ix = L.spec.index
        if ix is None or L.vendor or L.M * L.N * L.K == 0:
            return None
        geo = L.geo
        n, cap = geo.groups, geo.groups * geo.cap
        words = L.index_words
        self._ints = ints = self._buffer(stream, words, "int32")
        base = Workspace.ptr(ints)
        self.ids_ptr = base + 4 * (n + COUNTS_TAIL)
        pack = 0
        if ix.pack:
            self.pack = self._buffer(stream, cap * ix.long_extent, L.dtype)
            pack = Workspace.ptr(self.pack)
        if self.reuse:
            buf, half, self.counts_ptr, zero_ptr = L.counts_pair(stream)
            self._counts = (buf, (half, slice(0, n)))
        else:
            self._counts, self.counts_ptr, zero_ptr = (ints, slice(0, n)), base, 0
            memset_d32(base, 0, n + COUNTS_TAIL, stream)
        if L.spec.gemm.mainloop == "wgmma":  # the m-tiles longest first, for persistent CTAs
            self.order_ptr = base + 4 * (n + COUNTS_TAIL + cap)
            self.next_ptr = tile_counter(self.counts_ptr, n)
        if L.spec.gemm.a_mode == "products":   # the index's last argument: the row table
            self.products = L.products_buffers(stream, fresh=not self.reuse)
            self.order_ptr = Workspace.ptr(self.products[0])
        return (self.a_ptr, *geo.index_args, self.counts_ptr, self.ids_ptr, pack, self.mask_ptr,
                *L.mask_strides, zero_ptr)

    @on_operand_device
    def compute(self, stream: int | None) -> None:
        """The tile kernel over the index (box and packed: an upper-bound grid whose empty tiles
        exit; rows: a CTA per output tile, which writes all of it)."""
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
        a = Workspace.ptr(self.pack) if self.pack is not None else self.a_ptr
        if g.a_mode == "products":   # the row table and slots of this call's build_index
            table, slots = map(Workspace.ptr, self.products)
            args = (a, self.b_ptr, self.c_ptr, self.counts_ptr, self.ids_ptr, table, slots,
                    *L.sizes, L.slot_rows)
            mod.launch("pit_gemm_products", L.geo.grid, (g.threads, 1, 1), stream, *args,
                       smem=L.smem, early=L.early)
            mod.launch("pit_gemm_finish", L.geo.finish, (PRODUCTS_FINISH_THREADS, 1, 1), stream,
                       *args[:4], *args[5:], early=L.early)
        elif g.mainloop == "wgmma":
            mod.launch("pit_gemm_sm90", L.geo.grid, (g.threads, 1, 1), stream,
                       *L.tensor_maps(self.a_ptr, self.b_ptr), a, self.b_ptr, self.c_ptr,
                       self.counts_ptr, self.ids_ptr, self.order_ptr, self.next_ptr, *L.sizes,
                       smem=L.smem, early=True)
        else:
            mod.launch("pit_gemm", L.geo.grid, (g.threads, 1, 1), stream, a, self.b_ptr,
                       self.c_ptr, self.counts_ptr, self.ids_ptr, *L.sizes, smem=L.smem,
                       early=g.early)

    def _vendor(self) -> None:
        """Dense plan on torch tensors: cuBLAS through torch, on torch's current stream."""
        f = self.L.form
        a = self.a.permute(*f.a_dims)
        b = self.b.permute(*f.b_dims)
        c = self.out.permute(*f.c_dims)
        if self.L.accumulate:
            c.addmm_(a, b)
        elif c.is_contiguous():
            import torch
            torch.mm(a, b, out=c)
        else:
            c.copy_(a @ b)

    @on_operand_device
    def run(self) -> Any:
        """build_index + compute on the caller's stream; returns the output array."""
        if self.L.vendor:
            self.compute(None)
            return self.out
        L = self.L
        with TorchLaunch(L.is_torch) as launch, L.lock:
            s = launch.stream
            if L.fused_mod is not None and self.reuse:   # one launch (gemm_fused.cu.j2)
                args = self._index_args(s)
                a = Workspace.ptr(self.pack) if self.pack is not None else self.a_ptr
                L.fused_mod.launch("pit_gemm_fused", L.fused_grid(), (256, 1, 1), s, *args,
                             L.fused_sync(s), *L.geo.index_grid, a, self.b_ptr, self.c_ptr,
                             *L.sizes, smem=L.smem)
            else:
                self.build_index(s)
                self.compute(s)
        return self.out


def _is_tensor(x: Any) -> bool:
    """A torch tensor (checked by its type's module, like :func:`as_operand`: no torch import)."""
    return type(x).__module__.startswith("torch")


def _torch_key(args: tuple, out: Any, mask: Any, accumulate: bool) -> tuple | None:
    """What a launcher depends on, read straight off torch tensors (:func:`raw_key` of the
    operands, out and mask, and accumulate), or None when an operand is not a plain tensor. A
    key seen before maps to a launcher the full path validated for exactly these attributes."""
    key = raw_key(*args, out, mask)
    return None if key is None else (accumulate, *key)


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
        #: the same launchers keyed by a torch call's raw tensor attributes (see _torch_key)
        self._fast: dict[tuple, Launcher] = {}
        names = self.operator.input_names
        self._ab = names.index(self.form.sparse), names.index(self.form.dense)
        if not (isinstance(micro_tile, str) and micro_tile == "auto"):
            self._plan = make_plan(self.operator, sparse, micro_tile=micro_tile, tile=tile)
        #: the ``pitgen::matmul`` argument that rebuilds this kernel
        self.config = jit_config(self)
        if sys.modules.get("torch") is not None and not tracing():
            torch_ops()   # registered now, so that a function calling this kernel traces whole

    @property
    def plan(self) -> Plan | None:
        """The plan in use (None for 'auto' before the first call)."""
        return self._plan

    def replan(self) -> None:
        """Forget an 'auto' choice; the next call plans again from its operand."""
        if isinstance(self.micro_tile, str) and self.micro_tile == "auto":
            self._plan = None
            self._launchers.clear()
            self._fast.clear()

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self.operator.input_names
        bound = bind_operands(self.operator.text, names, args, kwargs)
        return {n: as_operand(n, bound[n]) for n in names}

    def _schedule(self, plan: Plan) -> Schedule:
        """The tile kernel's BN' and BK from the plan's compute tile where the user gave a tile;
        the products kernel for micro-tiles along m that fit it (``products_fit``, as the
        planner priced them: planner._costed)."""
        c, rows = plan.choice, None
        if plan.masked and c.kind == "micro" and c.axis == self.form.m_axis \
                and products_fit(c.nonzero, plan.shape[self.form.a_dims[0]]):
            rows = "products"
        if self.tile is None:
            return Schedule(rows=rows)
        ct = plan.compute_tile
        return Schedule(bn=ct[self.form.n_axis], bk=ct[self.form.k_axis], rows=rows)

    @on_operand_device
    def prepare(self, *args: Any, out: Any = None, accumulate: bool = False, mask: Any = None,
                **kwargs: Any) -> GemmCall:
        """Validate the operands and compile (or load) the module for them; launches nothing.
        Everything but buffer allocation is cached per call signature (shapes, strides, dtypes,
        alignment), so repeated calls cost only their launches: a call on torch tensors given
        positionally finds its launcher from the tensors' raw attributes, before any Operand is
        built. The call builds its index into fresh buffers, which stay the caller's."""
        return self._prepare(args, kwargs, out, accumulate, mask, reuse=False)

    def _call(self, launcher: Launcher, args: tuple, out: Any, mask: Any,
              reuse: bool) -> GemmCall:
        """A call of a launcher found by _torch_key (positional plain tensors)."""
        ia, ib = self._ab
        return GemmCall(launcher, args[ia], args[ib], out,
                        mask.data_ptr() if mask is not None else 0, reuse)

    def _prepare(self, args: tuple, kwargs: dict, out: Any, accumulate: bool, mask: Any,
                 reuse: bool) -> GemmCall:
        fast = _torch_key(args, out, mask, accumulate) if not kwargs else None
        launcher = self._fast.get(fast) if fast is not None else None
        if launcher is not None:
            return self._call(launcher, args, out, mask, reuse)
        ops = self._bind(args, kwargs)
        m_op = as_operand("mask", mask) if mask is not None else None
        if m_op is not None and m_op.shape != ops[self.sparse].shape:
            raise ShapeError(f"mask has shape {m_op.shape} but {self.sparse} has shape "
                             f"{ops[self.sparse].shape}")
        if self._plan is None:
            width = ops[self.form.dense].shape[self.form.b_dims[1]]
            self._plan = plan_on_device(self.operator, self.sparse, m_op or ops[self.sparse],
                                        self.tile, width)
        c_op = as_operand("out", out) if out is not None else None
        key = signature(ops, c_op, accumulate, m_op), device_index()   # its modules' device
        launcher = self._launchers.get(key)
        if launcher is None:
            if len(self._launchers) >= MAX_LAUNCHERS:   # their index buffers: memory bounded
                self._launchers.clear()
                self._fast.clear()
            plan = self._plan
            order = [plan.choice]
            if isinstance(self.micro_tile, str) and self.micro_tile == "auto":
                order += [c for c in plan.candidates if c != plan.choice]  # dense is among them
            launcher = Launcher(self.operator, self.form,
                                [(c.kind, c.axis, c.shape) for c in order],
                                self.dtype, ops,
                                c_op, accumulate, self._schedule(plan),
                                vendor_dense=self.vendor_dense, mask=m_op)
            if launcher.choice:
                self._plan = replace(plan, choice=order[launcher.choice])
            self._launchers[key] = launcher
        if fast is not None:
            self._fast[fast] = launcher
        return GemmCall(launcher, ops[self.sparse].obj, ops[self.form.dense].obj, out,
                        m_op.ptr if m_op is not None else 0, reuse)

    def __call__(self, *args: Any, out: Any = None, accumulate: bool = False, mask: Any = None,
                 **kwargs: Any) -> Any:
        """Compute the operator; ``out`` receives the result (``accumulate=True`` adds to it).

        ``mask`` (bool or uint8, the sparse operand's shape) says where that operand may be
        non-zero: the index is built from it instead of from the values. Values outside the mask
        must be zero (they are computed only where they share a micro-tile with a masked one).

        Eager calls on plain torch tensors launch directly; under torch.compile or
        torch.export (or on tensor subclasses such as fake tensors) the call is the
        ``torch.library`` op ``pitgen::matmul``, which the graph holds as one op. There is no
        backward: operands that require grad (grad mode on) raise
        :class:`pitgen.errors.BackwardError`."""
        if not kwargs:  # plain tensors seen before (none while tracing): straight to the launch
            fast = _torch_key(args, out, mask, accumulate)
            launcher = self._fast.get(fast) if fast is not None else None
            if launcher is not None:   # the key holds the current device: theirs (no guard)
                for x in args:
                    if x.requires_grad:
                        no_backward("pitgen::matmul (a compiled SparseKernel)", *args)
                ia, ib = self._ab
                return launcher.torch_call()(args[ia], args[ib], out,
                                             0 if mask is None else mask.data_ptr())
        return self._guarded_call(*args, out=out, accumulate=accumulate, mask=mask, **kwargs)

    @on_operand_device
    def _guarded_call(self, *args: Any, out: Any = None, accumulate: bool = False,
                      mask: Any = None, **kwargs: Any) -> Any:
        """``__call__`` past its fast path, on the operands' device."""
        tensors = self._torch_operands(args, kwargs)
        if tensors is not None:
            no_backward("pitgen::matmul (a compiled SparseKernel)", *tensors)
            if (out is None and not accumulate and (mask is None or _is_tensor(mask))
                    and (tracing() or not plain_tensors(*tensors))):
                return jit_matmul(self, *tensors, mask)
        return self._prepare(args, kwargs, out, accumulate, mask, reuse=True).run()

    def _torch_operands(self, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
        """The two operands in the expression's input order when both are torch tensors, else
        None (GPUArrays, other arities: the direct launch path)."""
        names = self.operator.input_names
        if len(names) != 2:
            return None
        bound = bind_operands(self.operator.text, names, args, kwargs)
        ops = tuple(bound[n] for n in names)
        return ops if all(_is_tensor(t) for t in ops) else None

    @on_operand_device
    def index(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Build only the micro-tile index of the sparse operand; returns device arrays
        ``(counts, ids)`` (``ids`` rows padded past ``counts``; order within a row is free),
        or ``(None, None)`` for a dense plan. Micro-tiles along m list each k-tile's rows per
        row block of the kernel (``ids.shape[1]`` rows): group ``kt * blocks + rb``."""
        call = self.prepare(*args, **kwargs)
        if call.L.vendor:
            return None, None
        with TorchLaunch(call.L.is_torch) as launch:
            call.build_index(launch.stream)
        return call.counts, call.ids

    def source(self, *args: Any, **kwargs: Any) -> str:
        """The CUDA source this kernel runs for these operands (a small problem's: the
        one-launch kernel's)."""
        launcher = self.prepare(*args, **kwargs).L
        return MATMUL.source((launcher.fused_spec or launcher.spec).context())


def compile(expr: str | Operator, sparse: str, dtype: str = "float16",
            micro_tile: str | Sequence[int] = "auto",
            tile: str | Sequence[int] | Mapping[str, int] | None = None,
            vendor_dense: bool = True, format: str | None = None,
            budget_s: float | None = None, tune: bool = False,
            dynamic: bool = False) -> SparseKernel | FormatKernel:
    """JIT kernel for ``expr`` with operand ``sparse`` dynamically sparse.

    ``micro_tile``: 'auto', 'dense', or a shape in the operand's dimension order ('32x1' is
    32 rows by 1 column of ``A[m,k]``: a micro-tile along k). A micro-tile along an axis that is
    not permutation invariant is refused with the rule's reason. A dense plan on torch tensors
    runs cuBLAS (through torch) unless ``vendor_dense=False`` asks for pitgen's own tile kernel.

    ``format`` ('auto', 'csr', 'ell', 'bsr', 'hyb') asks for a graph operator instead (SpMM
    ``Y[i,f] += A[i,j] * X[j,f]``, or SDDMM ``E[i,j] += U[i,f] * V[j,f]`` with ``sparse='E'``)
    run by a sparse-format kernel: a :class:`pitgen.graph.jit.FormatKernel`; 'auto' takes a
    tuned result of the tune cache, else the cost model's choice (pitgen.graph.model; no
    search), and with ``tune=True`` or a ``budget_s`` a measured search of ``budget_s``
    seconds (default 10) when the cache has none; ``dynamic=True`` for a graph that changes
    every call (chosen once per shape, converted without a host sync); SpMM also takes an edge
    list (``pitgen.graph.device.DeviceCOO``), which 'coo' multiplies as it comes and 'auto'
    does while that is cheaper than converting it. ``dtype`` is a name or a torch/NumPy dtype
    (``torch.bfloat16``).
    """
    dtype = dtype_name(dtype)
    if format is not None:
        if not (isinstance(micro_tile, str) and micro_tile == "auto") or tile is not None \
                or not vendor_dense:
            raise PlanError("micro_tile=, tile= and vendor_dense= are for micro-tile kernels; "
                            "a format kernel takes format= (and budget_s=, tune=, dynamic=) "
                            "only")
        return FormatKernel(expr, sparse, format, dtype, budget_s, tune=tune, dynamic=dynamic)
    if tune or budget_s is not None or dynamic:
        raise PlanError("tune=, budget_s= and dynamic= are for sparse formats: they need "
                        "format=")
    return SparseKernel(expr, sparse, dtype, micro_tile, tile, vendor_dense)
