"""pitgen's operators as PyTorch custom ops (``torch.library``, namespace ``pitgen``), so that
``torch.compile`` (``fullgraph=True``), ``torch.export`` and CUDA graphs see them as single ops:

==================================  ==========================================================
``pitgen::matmul``                  the JIT GEMM (:class:`pitgen.ops.matmul.SparseKernel`)
``pitgen::gemm``                    one cached GEMM of the training linear (``linear._gemm``)
``pitgen::sparse_weight_linear``    ``x (W ⊙ M)ᵀ + b``, with backward
``pitgen::sparse_input_linear``     ``x Wᵀ + b`` skipping x's zeros, with backward
``pitgen::sddmm``                   dense ``scale · (Q Kᵀ) ⊙ M``, with backward
``pitgen::sddmm_tiles``             the compact :class:`pitgen.ops.sddmm.SparseTiles` tensors
``pitgen::sddmm_out``               SDDMM into a caller's dense ``out`` (mutates it)
``pitgen::moe_ffn``                 the fused MoE FFN, with backward (:mod:`pitgen.ops.moe`)
``pitgen::moe_route``               its routing index (expert-sorted rows, tile list)
``pitgen::moe_rows``                its backward's products: tile rows x their expert's weight
``pitgen::moe_rows_act``            the same with the activation's backward in its epilogue
``pitgen::moe_wgrad``               its backward's weight gradients, one GEMM per expert's rows
``pitgen::moe_gather``              its backward's rows of a chunk of tiles: gathers and bookkeeping
``pitgen::sparse_conv2d``           conv2d skipping all-zero input channels, with backward
``pitgen::conv_channels``           its channel index alone (:mod:`pitgen.ops.conv`)
==================================  ==========================================================

Every op has a fake (meta) implementation that propagates shapes and dtypes without touching
the GPU. Configuration travels as op arguments (strings, ints, floats, lists). Host
synchronisation (``moe_ffn(check=True)``) stays in the Python wrappers, outside the ops, and is
skipped while torch traces. The ops are registered on first use (:func:`ops`): importing
pitgen never imports torch. Ops without a backward refuse inputs that require grad while grad
mode is on (:func:`no_backward`), rather than returning a result with no grad path.
"""
from __future__ import annotations

import ast
import functools
import importlib
import sys
from typing import Any, Mapping, Sequence

from ..errors import BackwardError, PitgenError
from ..operands import on_operand_device

NAMESPACE = "pitgen"

#: config string (see :func:`jit_config`) -> the SparseKernel that last ran with it
_JIT: dict[str, Any] = {}


def tracing() -> bool:
    """Whether torch is tracing (torch.compile, torch.export): host reads must be skipped. Not
    while torch is not even imported (GPUArray callers)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())


def needs_grad(*tensors: Any) -> bool:
    """Whether autograd would record an op on ``tensors`` (None entries skipped): grad mode is
    on and one of them requires grad (False while torch is not even imported)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def plain_tensors(*tensors: Any) -> bool:
    """Whether every one of ``tensors`` is a plain ``torch.Tensor`` (not a fake, functional or
    other subclass, which only the ops' fake implementations can take)."""
    import torch
    return all(type(t) is torch.Tensor for t in tensors)


def no_backward(op: str, *tensors: Any, hint: str = "") -> None:
    """BackwardError naming ``op`` when grad mode is on and one of ``tensors`` requires grad:
    ``op`` has no backward, so its result would silently have no grad path."""
    if needs_grad(*tensors):
        raise BackwardError(f"{op} has no backward, but an input requires grad; run it under "
                            f"torch.no_grad() or pass detached tensors" + (f" ({hint})" if hint else ""))


@functools.lru_cache(maxsize=256)
def _axes(expr: str) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """((axes of each input, in input order), output axes) of ``expr``."""
    from ..expr import parse
    op = parse(expr)
    return tuple(tuple(op.access(n).axes) for n in op.input_names), tuple(op.output.axes)


def out_shape(expr: str, *shapes: Sequence[int]) -> list[int]:
    """The output shape of ``expr`` for inputs of ``shapes`` (in the expression's input order)."""
    ins, out = _axes(expr)
    sizes: dict[str, int] = {}
    for axes, shape in zip(ins, shapes):
        sizes.update(zip(axes, shape))
    return [sizes[a] for a in out]


def jit_config(kernel: Any) -> str:
    """The literal that rebuilds ``kernel`` (a SparseKernel): the ``pitgen::matmul`` argument."""
    def plain(v: Any) -> Any:  # ints, strs, tuples and dicts of them: literal_eval reads them
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, Mapping):
            return {str(a): int(n) for a, n in sorted(v.items())}
        return tuple(int(n) for n in v)

    return repr((kernel.operator.text, kernel.sparse, kernel.dtype, plain(kernel.micro_tile),
                 plain(kernel.tile), bool(kernel.vendor_dense)))


def _jit_kernel(config: str) -> Any:
    """The SparseKernel of ``config``: the one that last called with it (its 'auto' plan),
    else a new one (a graph loaded in another process)."""
    k = _JIT.get(config)
    if k is None:
        SparseKernel = importlib.import_module(f"{__package__}.matmul").SparseKernel
        expr, sparse, dtype, micro_tile, tile, vendor = ast.literal_eval(config)
        k = _JIT[config] = SparseKernel(expr, sparse, dtype, micro_tile, tile, vendor)
    return k


def jit_matmul(kernel: Any, a: Any, b: Any, mask: Any) -> Any:
    """``kernel(a, b, mask=mask)`` on torch tensors through ``pitgen::matmul``."""
    _JIT[kernel.config] = kernel
    return ops().matmul(a, b, mask, kernel.config)


_REGISTERED: list[bool] = []


def ops() -> Any:
    """``torch.ops.pitgen``, every op registered (once, on first call; the torch modules
    ``pitgen.nn.*`` register when their class is built and a ``SparseKernel`` when it is made
    with torch imported, so a model or function traces with them in place)."""
    import torch
    if not _REGISTERED:
        if tracing():
            raise PitgenError(
                "pitgen's torch ops are registered on first use, which cannot happen while "
                "torch traces: call pitgen.ops.library.ops() once before torch.compile")
        _register(torch)
        importlib.import_module(f"{__package__}.attention")._ops()   # pitgen::sparse_attention
        _REGISTERED.append(True)
    return torch.ops.pitgen


def _register(torch: Any) -> None:  # noqa: C901 - one place declares every op
    from torch.library import custom_op

    # by name, not ``from . import``: those modules import this one
    linear, moe, sd, conv = (importlib.import_module(f"{__package__}.{m}")
                             for m in ("linear", "moe", "sddmm", "conv"))

    def op(name: str, schema: str, mutates: tuple[str, ...] = ()) -> Any:
        # explicit schemas: this module's annotations are strings (postponed evaluation); the
        # body runs on its operands' device (a compiled graph calls it with the device as it is)
        define = custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates, schema=schema)
        return lambda fn: define(on_operand_device(fn))

    # -- the JIT GEMM and the training linear's GEMMs ----------------------------------------

    @op("matmul",
        "(Tensor a, Tensor b, Tensor? mask, str config) -> Tensor")
    def matmul(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None,
               config: str) -> torch.Tensor:
        return _jit_kernel(config).prepare(a, b, mask=mask).run()

    @matmul.register_fake
    def _(a, b, mask, config):
        expr, _sparse, dtype, *_ = ast.literal_eval(config)
        return a.new_empty(out_shape(expr, a.shape, b.shape), dtype=getattr(torch, dtype))

    @op("gemm",
        "(Tensor a, Tensor b, Tensor? mask, str expr, str sparse, str micro_tile) -> Tensor")
    def gemm(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None, expr: str, sparse: str,
             micro_tile: str) -> torch.Tensor:
        return linear.gemm_body(a, b, mask, expr, sparse, micro_tile)

    @gemm.register_fake
    def _(a, b, mask, expr, sparse, micro_tile):
        return a.new_empty(out_shape(expr, a.shape, b.shape))

    # -- SDDMM ---------------------------------------------------------------------------------

    @op("sddmm",
        "(Tensor q, Tensor k, Tensor mask, int[] tile, float scale) -> Tensor")
    def sddmm_dense(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, tile: list[int],
                    scale: float) -> torch.Tensor:
        return sd.dense(q, k, mask, tile, scale)

    @sddmm_dense.register_fake
    def _(q, k, mask, tile, scale):
        return q.new_empty(q.shape[0], k.shape[0])

    def sddmm_setup(ctx, inputs, output):
        q, k, mask, tile, scale = inputs
        ctx.save_for_backward(q, k, mask)
        ctx.scale = scale

    def sddmm_backward(ctx, ds):
        q, k, mask = ctx.saved_tensors
        dsm = torch.where(mask != 0, ds * ctx.scale, torch.zeros((), dtype=ds.dtype,
                                                                  device=ds.device))
        dq = dk = None
        if ctx.needs_input_grad[0]:
            dq = torch.ops.pitgen.gemm(dsm, k, mask, sd.GRAD_EXPR, "A", "auto")
        if ctx.needs_input_grad[1]:
            dk = torch.ops.pitgen.gemm(dsm.t(), q, mask.t(), sd.GRAD_EXPR, "A", "auto")
        return dq, dk, None, None, None

    sddmm_dense.register_autograd(sddmm_backward, setup_context=sddmm_setup)

    @op("sddmm_tiles",
        "(Tensor q, Tensor k, Tensor mask, int[] tile, float scale)"
        " -> (Tensor, Tensor, Tensor, Tensor)")
    def sddmm_tiles(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, tile: list[int],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = sd.launch(q, k, mask, tuple(tile), None, scale)
        return t.values, t.tile_rows, t.tile_cols, t.count

    @sddmm_tiles.register_fake
    def _(q, k, mask, tile, scale):
        th, tw = tile
        cap = -(-q.shape[0] // th) * -(-k.shape[0] // tw)
        i32 = torch.int32
        return (q.new_empty(cap, th, tw), q.new_empty(cap, dtype=i32), q.new_empty(cap, dtype=i32),
                q.new_empty(1, dtype=i32))

    @op("sddmm_out",
        "(Tensor q, Tensor k, Tensor mask, int[] tile, float scale, Tensor(a!) out) -> ()",
        mutates=("out",))
    def sddmm_out(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, tile: list[int],
                  scale: float, out: torch.Tensor) -> None:
        sd.launch(q, k, mask, tuple(tile), out, scale)

    @sddmm_out.register_fake
    def _(q, k, mask, tile, scale, out):
        return None

    # -- training linear -------------------------------------------------------------------------

    @op("sparse_weight_linear",
        "(Tensor x, Tensor weight, Tensor mask, Tensor? bias, str micro_tile, str dx_micro_tile,"
        " int[] sddmm_tile) -> Tensor")
    def weight_linear(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                      bias: torch.Tensor | None, micro_tile: str, dx_micro_tile: str,
                      sddmm_tile: list[int]) -> torch.Tensor:
        return linear.weight_forward(x, weight, mask, bias, micro_tile)

    @weight_linear.register_fake
    def _(x, weight, mask, bias, micro_tile, dx_micro_tile, sddmm_tile):
        return x.new_empty(weight.shape[0], x.shape[0]).t()  # the kernel writes yᵀ

    def weight_setup(ctx, inputs, output):
        x, weight, mask, bias, _mt, dx_micro_tile, sddmm_tile = inputs
        ctx.save_for_backward(x, weight, mask)
        ctx.cfg = (dx_micro_tile, list(sddmm_tile), bias is not None)

    def weight_backward(ctx, dy):
        x, weight, mask = ctx.saved_tensors
        dx, dw, db = linear.weight_grads(x, weight, mask, dy, ctx.needs_input_grad, *ctx.cfg,
                                         gemm=torch.ops.pitgen.gemm, sddmm=torch.ops.pitgen.sddmm)
        return dx, dw, None, db, None, None, None

    weight_linear.register_autograd(weight_backward, setup_context=weight_setup)

    @op("sparse_input_linear",
        "(Tensor x, Tensor weight, Tensor? bias, str micro_tile) -> Tensor")
    def input_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     micro_tile: str) -> torch.Tensor:
        return linear.input_forward(x, weight, bias, micro_tile)

    @input_linear.register_fake
    def _(x, weight, bias, micro_tile):
        return x.new_empty(x.shape[0], weight.shape[0])

    def input_setup(ctx, inputs, output):
        x, weight, bias, micro_tile = inputs
        ctx.save_for_backward(x, weight)
        ctx.cfg = (micro_tile, bias is not None)

    def input_backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw, db = linear.input_grads(x, weight, dy, ctx.needs_input_grad, *ctx.cfg,
                                        gemm=torch.ops.pitgen.gemm)
        return dx, dw, db, None

    input_linear.register_autograd(input_backward, setup_context=input_setup)

    # -- MoE -------------------------------------------------------------------------------------

    @op("moe_ffn",
        "(Tensor x, Tensor expert_ids, Tensor gates, Tensor w1, Tensor w2, Tensor? b1, Tensor? b2,"
        " str activation) -> Tensor")
    def moe_ffn(x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor,
                w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None,
                b2: torch.Tensor | None, activation: str) -> torch.Tensor:
        return moe.launch(x, expert_ids, gates, w1, w2, b1, b2, activation)

    @moe_ffn.register_fake
    def _(x, expert_ids, gates, w1, w2, b1, b2, activation):
        return torch.empty_like(x)

    moe.register_backward(moe_ffn)

    @op("moe_route",
        "(Tensor expert_ids, int num_experts, int block_m) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    def moe_route(expert_ids: torch.Tensor, num_experts: int,
                  block_m: int) -> tuple[torch.Tensor, ...]:
        # views of one buffer: an op's outputs must not alias each other
        return tuple(t.clone() for t in moe.route_tensors(expert_ids, num_experts, block_m))

    @moe_route.register_fake
    def _(expert_ids, num_experts, block_m):
        pairs = expert_ids.shape[0] * expert_ids.shape[1]
        tiles = -(-pairs // block_m) + num_experts
        i32 = torch.int32
        return (expert_ids.new_empty(max(pairs, 1), dtype=i32),
                expert_ids.new_empty(tiles, dtype=i32), expert_ids.new_empty(tiles, dtype=i32),
                expert_ids.new_empty(num_experts + 1, dtype=i32), expert_ids.new_empty(1, dtype=i32))

    @op("moe_rows", "(Tensor a, Tensor w, Tensor tile_e, Tensor ntiles, int row0,"
                    " int tile_rows, bool trans, Tensor? bias) -> Tensor")
    def moe_rows(a: torch.Tensor, w: torch.Tensor, tile_e: torch.Tensor, ntiles: torch.Tensor,
                 row0: int, tile_rows: int, trans: bool,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return moe.expert_rows(a, w, tile_e, ntiles, row0, tile_rows, trans, bias)

    @moe_rows.register_fake
    def _(a, w, tile_e, ntiles, row0, tile_rows, trans, bias):
        return a.new_empty(a.shape[0], w.shape[1] if trans else w.shape[2], dtype=torch.float32)

    # dg and db1 (db2 below) are the backward's float32 sums, added into across the chunks
    @op("moe_rows_act", "(Tensor dy, Tensor w, Tensor h, Tensor gate, Tensor tile_e,"
                        " Tensor ntiles, int row0, int tile_rows, str activation, Tensor pair,"
                        " Tensor(a!) dg, Tensor(b!) db1) -> (Tensor, Tensor)",
        mutates=("dg", "db1"))
    def moe_rows_act(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor, gate: torch.Tensor,
                     tile_e: torch.Tensor, ntiles: torch.Tensor, row0: int, tile_rows: int,
                     activation: str, pair: torch.Tensor, dg: torch.Tensor,
                     db1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.expert_rows_act(dy, w, h, gate, tile_e, ntiles, row0, tile_rows, activation,
                                   pair, dg, db1)

    @moe_rows_act.register_fake
    def _(dy, w, h, gate, tile_e, ntiles, row0, tile_rows, activation, pair, dg, db1):
        return dy.new_empty(h.shape), dy.new_empty(h.shape)

    @op("moe_gather", "(Tensor x, Tensor dy, Tensor gates, Tensor? b2, Tensor row_pair,"
                      " Tensor tile_e, Tensor tile_r, Tensor offsets, Tensor ntiles, int row0,"
                      " int rows, int tile_rows, int topk, Tensor(a!) dg, Tensor(b!) db2)"
                      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        mutates=("dg", "db2"))
    def moe_gather(x: torch.Tensor, dy: torch.Tensor, gates: torch.Tensor,
                   b2: torch.Tensor | None, row_pair: torch.Tensor, tile_e: torch.Tensor,
                   tile_r: torch.Tensor, offsets: torch.Tensor, ntiles: torch.Tensor, row0: int,
                   rows: int, tile_rows: int, topk: int, dg: torch.Tensor,
                   db2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return moe.gather_rows(x, dy, gates, b2, row_pair, tile_e, tile_r, offsets, ntiles,
                               row0, rows, tile_rows, topk, dg, db2)

    @moe_gather.register_fake
    def _(x, dy, gates, b2, row_pair, tile_e, tile_r, offsets, ntiles, row0, rows, tile_rows,
          topk, dg, db2):
        H, f32, i32 = x.shape[1], torch.float32, torch.int32
        return (x.new_empty(rows, H), x.new_empty(rows, H), x.new_empty(rows, H),
                x.new_empty(rows, dtype=f32), x.new_empty(rows, dtype=i32),
                x.new_empty(rows, dtype=i32))

    @op("moe_wgrad", "(Tensor a, Tensor b, Tensor rows, int experts, int tile_rows) -> Tensor")
    def moe_wgrad(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, experts: int,
                  tile_rows: int) -> torch.Tensor:
        return moe.wgrad(a, b, rows, experts, tile_rows)

    @moe_wgrad.register_fake
    def _(a, b, rows, experts, tile_rows):
        return a.new_empty(experts, a.shape[1], b.shape[1])

    # -- sparse-channel convolution ----------------------------------------------------------------

    @op("sparse_conv2d",
        "(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding) -> (Tensor, Tensor)")
    def sparse_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      stride: list[int], padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return conv.launch(x, weight, bias, tuple(stride), tuple(padding))

    @sparse_conv2d.register_fake
    def _(x, weight, bias, stride, padding):
        N, _, H, W = x.shape
        F, _, R, S = weight.shape
        P = (H + 2 * padding[0] - R) // stride[0] + 1
        Q = (W + 2 * padding[1] - S) // stride[1] + 1
        fmt = torch.contiguous_format if x.is_contiguous() else torch.channels_last
        return (torch.empty((N, F, P, Q), dtype=x.dtype, device=x.device, memory_format=fmt),
                x.new_empty(1, dtype=torch.int32))

    def conv_setup(ctx, inputs, output):
        x, weight, bias, stride, padding = inputs
        ctx.save_for_backward(x, weight)
        ctx.cfg = (list(stride), list(padding), bias is not None)
        ctx.set_materialize_grads(False)   # the count's gradient: None, not a zero tensor

    def conv_backward(ctx, dy, dcount):
        # dX is a dense transposed convolution (the zero channels get gradients too) and dW's
        # columns of zero channels are exact zeros: both run cuDNN (torch.nn.grad)
        if dy is None:
            return None, None, None, None, None
        x, weight = ctx.saved_tensors
        stride, padding, has_bias = ctx.cfg
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.nn.grad.conv2d_input(x.shape, weight, dy, stride, padding)
        if ctx.needs_input_grad[1]:
            dw = torch.nn.grad.conv2d_weight(x, weight.shape, dy, stride, padding)
        if has_bias and ctx.needs_input_grad[2]:
            db = dy.sum((0, 2, 3))
        return dx, dw, db, None, None

    sparse_conv2d.register_autograd(conv_backward, setup_context=conv_setup)

    @op("conv_channels", "(Tensor x) -> (Tensor, Tensor)")
    def conv_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return conv.index_launch(x)

    @conv_channels.register_fake
    def _(x):
        return x.new_empty(x.shape[1], dtype=torch.int32), x.new_empty(1, dtype=torch.int32)
