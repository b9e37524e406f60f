"""Sparse training of a linear layer ``y = x Wᵀ + b`` (x [batch, in], W [out, in]) with pitgen's
kernels in forward and backward.

Dynamic weight sparsity (W_eff = W ⊙ M, M changes between steps):
  yᵀ = W_eff xᵀ          GEMM with W_eff as the sparse operand (micro-tiles along in), index
                         built from M
  dX = dY W_eff          cuBLAS by default; pitgen's GEMM with W_eff sparse on request
                         (``dx_micro_tile``): a (32, 1) pattern is 1 wide along dX's spatial axis
  dW = (dYᵀ X) ⊙ M       SDDMM into a dense gradient: computed only where M is set, 0 elsewhere
  db = Σ dY
Dynamic activation sparsity (x has run-time zeros, e.g. after ReLU):
  y  = x Wᵀ              GEMM with x sparse along k (micro-tiles, auto-planned)
  dW = dYᵀ X             GEMM with X sparse along the reduction (batch) axis
  dX = dY W              dense: neither dY nor W carries x's zeros (the ReLU's own backward
                         applies them upstream), so there is nothing to skip.

Every expression goes through the rule engine for the axes its micro-tiles permute. Compiled
kernels are cached per (expression, dtype, micro-tile) at module level, so steps reuse them.
Both linears are ``torch.library`` ops with their backward registered (``pitgen::sparse_weight_linear``,
``pitgen::sparse_input_linear``: :mod:`pitgen.ops.library`), so ``torch.compile`` traces them
as single ops, forward and backward; eager calls run the same bodies and formulas without the
ops' dispatch (a ``torch.autograd.Function`` where an input requires grad). ``SparseLinear``
is built on first access: importing this module needs no torch.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from .. import cache
from ..checks import dtype_name
from ..errors import PlanError, ShapeError
from ..operands import check_tensor, on_operand_device
from .library import needs_grad, ops, tracing
from .matmul import SparseKernel, compile as compile_kernel
from .sddmm import SDDMM, normalise_tile
from .sddmm import dense as sddmm_dense

if TYPE_CHECKING:
    from torch import Tensor

# yᵀ = W_eff xᵀ: W[m,k] sparse (A, k = in features reduced; xᵀ contiguous so the gathered
# rows of B are contiguous); dX = dY W_eff: W[k,n] sparse (k = out features, reduced).
WEIGHT_FORWARD = "C[m,n] += A[m,k] * B[k,n]"
WEIGHT_DX = "C[m,n] += A[m,k] * B[k,n]"
# y = x Wᵀ: x[m,k] sparse; dW = dYᵀ X: X[k,n] sparse (k = batch, reduced).
INPUT_FORWARD = "C[m,n] += A[m,k] * B[n,k]"
INPUT_DW = "C[m,n] += A[k,m] * B[k,n]"

#: (expression, sparse operand, dtype, micro-tile, shapes) -> its compiled kernel
_KERNELS = cache.memo("linear.kernels")


def kernel(expr: str, sparse: str, dtype: str, micro_tile: str,
           shapes: tuple = ()) -> SparseKernel:
    """The cached :class:`SparseKernel` of one (expression, dtype, micro-tile). 'auto' kernels
    are also keyed by the operands' ``shapes``: each new shape plans once (one small host sync
    on its first call), and a plan made for one shape never runs another."""
    key = (expr, sparse, dtype, micro_tile, shapes if micro_tile == "auto" else ())
    if key not in _KERNELS:
        _KERNELS[key] = compile_kernel(expr, sparse=sparse, dtype=dtype, micro_tile=micro_tile)
    return _KERNELS[key]


def _gemm(expr: str, sparse: str, dtype: str, micro_tile: str, a: Any, b: Any,
          mask: Any = None) -> Any:
    """``expr`` on (A=a, B=b) through the cached kernel, launched directly (this runs inside
    the ``pitgen::`` ops). An 'auto' plan that has no GPU kernel (extents below one mma tile,
    e.g. a batch of 1) runs torch's dense product instead."""
    k = kernel(expr, sparse, dtype, micro_tile, (tuple(a.shape), tuple(b.shape)))
    try:
        return k.prepare(a, b, mask=mask).run()
    except PlanError:
        if micro_tile != "auto":
            raise
    import torch
    op = k.operator
    spec = ",".join("".join(op.access(t).axes) for t in ("A", "B")) + "->" + "".join(op.output.axes)
    return torch.einsum(spec, a, b)


def gemm_body(a: Any, b: Any, mask: Any, expr: str, sparse: str, micro_tile: str) -> Any:
    """``pitgen::gemm``'s body: what an eager backward calls instead of the op."""
    return _gemm(expr, sparse, dtype_name(a.dtype), micro_tile, a, b, mask).contiguous()


def weight_forward(x: Any, weight: Any, mask: Any, bias: Any, micro_tile: str) -> Any:
    """``x (W ⊙ M)ᵀ + b`` (``pitgen::sparse_weight_linear``'s body): a transposed view, the
    kernel writes yᵀ."""
    w_eff = weight * mask  # the sparse GEMM needs W's values outside M to be zero
    xt = x.t().contiguous()  # B of yᵀ = W_eff xᵀ
    y = _gemm(WEIGHT_FORWARD, "A", dtype_name(x.dtype), micro_tile, w_eff, xt, mask).t()
    if bias is not None:
        y.add_(bias)
    return y


def weight_grads(x: Any, weight: Any, mask: Any, dy: Any, needs: Any, dx_micro_tile: str,
                 sddmm_tile: Any, has_bias: bool, gemm: Any = gemm_body,
                 sddmm: Any = sddmm_dense) -> tuple[Any, Any, Any]:
    """(dx, dW, db) of ``weight_forward`` for ``needs`` = needs_input_grad of (x, weight, mask,
    bias); ``gemm`` and ``sddmm``: pitgen's ops where torch traces the backward, their bodies in
    an eager one."""
    dy = dy.contiguous()  # autograd may hand over expanded (stride-0) gradients
    dx = dw = db = None
    if needs[0]:
        w_eff = weight * mask
        dx = (dy @ w_eff if dx_micro_tile == "dense" else
              gemm(dy, w_eff, mask, WEIGHT_DX, "B", dx_micro_tile))
    if needs[1]:
        # dW = (dYᵀ X) ⊙ M: dYᵀ and Xᵀ copied once so the SDDMM reads 16 bytes at a time
        dw = sddmm(dy.t().contiguous(), x.t().contiguous(), mask, sddmm_tile, 1.0)
    if has_bias and needs[3]:
        db = dy.sum(0)
    return dx, dw, db


def input_forward(x: Any, weight: Any, bias: Any, micro_tile: str) -> Any:
    """``x Wᵀ + b`` skipping x's zeros (``pitgen::sparse_input_linear``'s body)."""
    y = _gemm(INPUT_FORWARD, "A", dtype_name(x.dtype), micro_tile, x, weight).contiguous()
    if bias is not None:
        y.add_(bias)
    return y


def input_grads(x: Any, weight: Any, dy: Any, needs: Any, micro_tile: str, has_bias: bool,
                gemm: Any = gemm_body) -> tuple[Any, Any, Any]:
    """(dx, dW, db) of ``input_forward`` for ``needs`` = needs_input_grad of (x, weight, bias);
    ``gemm`` as in :func:`weight_grads`."""
    dy = dy.contiguous()
    dx = dw = db = None
    if needs[0]:
        dx = dy @ weight  # dense: see this module's docstring
    if needs[1]:
        dw = gemm(dy, x, None, INPUT_DW, "B", micro_tile)
    if has_bias and needs[2]:
        db = dy.sum(0)
    return dx, dw, db


@functools.cache
def _eager_functions() -> dict[str, Any]:
    """The two linears with autograd for eager calls: ``torch.autograd.Function``s over the
    ops' bodies and backward formulas. The ops are what torch.compile sees; eagerly their
    dispatch (the op's, its autograd wrapper's and the backward's nested ops') cost ~0.3 ms of
    host per training step (4096 x 3072 -> 768, H200: 1.24-1.36 -> 0.97 ms of wall for 0.35 ms
    of GPU work)."""
    import torch

    class WeightLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, mask: Any, bias: Any, micro_tile: str,
                    dx_micro_tile: str, sddmm_tile: list[int]) -> Any:
            ctx.save_for_backward(x, weight, mask)
            ctx.cfg = (dx_micro_tile, sddmm_tile, bias is not None)
            return weight_forward(x, weight, mask, bias, micro_tile)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> tuple:
            x, weight, mask = ctx.saved_tensors
            dx, dw, db = weight_grads(x, weight, mask, dy, ctx.needs_input_grad, *ctx.cfg)
            return dx, dw, None, db, None, None, None

    class InputLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, micro_tile: str) -> Any:
            ctx.save_for_backward(x, weight)
            ctx.cfg = (micro_tile, bias is not None)
            return input_forward(x, weight, bias, micro_tile)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> tuple:
            x, weight = ctx.saved_tensors
            dx, dw, db = input_grads(x, weight, dy, ctx.needs_input_grad, *ctx.cfg)
            return dx, dw, db, None

    return {"weight": WeightLinear, "input": InputLinear}


def _micro(tile: Any) -> str:
    """'32x1' from (32, 1) or '32x1'; 'auto' passes through."""
    if isinstance(tile, str):
        return tile
    th, tw = (int(t) for t in tile)
    return f"{th}x{tw}"


def _check_linear(x: Any, weight: Any, bias: Any) -> str:
    """Validate x [batch, in], weight [out, in], bias [out] (CUDA, one dtype); returns the dtype.
    The weight's dtype is the layer's: an input of another dtype is named as the problem."""
    check_tensor("weight", weight, SDDMM.dtypes, ndim=2, contiguous=False)
    dtype = str(weight.dtype).replace("torch.", "")
    check_tensor("x", x, (dtype,), ndim=2, shape=(None, weight.shape[1]), contiguous=False)
    if bias is not None:
        check_tensor("bias", bias, (dtype,), ndim=1, shape=(weight.shape[0],), contiguous=False)
    return dtype


@functools.lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    """The torch classes, built once on first use."""
    import torch

    ops()  # registered before any model using SparseLinear is traced

    class SparseLinear(torch.nn.Linear):
        """Drop-in for ``nn.Linear`` (same ``weight``/``bias`` parameters) whose weight is
        multiplied by a dynamic mask (buffer ``weight_mask``, all True at first; :meth:`set_mask`,
        :meth:`prune_`), or, with ``sparse_input=True``, whose input zeros are skipped instead.
        A pruned layer's state_dict carries its mask (``weight_mask``), so it reloads pruned;
        an unpruned one's is exactly ``nn.Linear``'s, and an ``nn.Linear`` state_dict loads as
        dense."""

        def __init__(self, in_features: int, out_features: int, bias: bool = True,
                     device: Any = None, dtype: Any = None, sparse_input: bool = False,
                     micro_tile: Any = (32, 1), dx_micro_tile: Any = "dense",
                     sddmm_tile: Any = (32, 1)):
            super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
            self.sparse_input = sparse_input
            self.micro_tile = _micro(micro_tile)
            self.dx_micro_tile = _micro(dx_micro_tile)
            self.sddmm_tile = normalise_tile(sddmm_tile)
            self.register_buffer("weight_mask", torch.ones(out_features, in_features,
                                                           dtype=torch.bool, device=device),
                                 persistent=False)

        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            if not bool(self.weight_mask.all()):  # saving may wait for the device
                mask = self.weight_mask
                destination[prefix + "weight_mask"] = mask if keep_vars else mask.detach()

        def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
            super()._load_from_state_dict(state_dict, prefix, *args)
            key, unexpected_keys = prefix + "weight_mask", args[3]
            if key in state_dict:
                self.set_mask(state_dict[key].to(self.weight.device))
                if key in unexpected_keys:
                    unexpected_keys.remove(key)
            else:  # an unpruned layer's or an nn.Linear's: dense
                self.weight_mask.fill_(True)

        def set_mask(self, mask: Any) -> None:
            """Use ``mask`` (bool/uint8 [out, in], this module's device) from the next step."""
            if not isinstance(mask, torch.Tensor) or mask.shape != self.weight.shape:
                raise ShapeError(f"mask must be a tensor of shape {tuple(self.weight.shape)}, got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            if mask.dtype not in (torch.bool, torch.uint8):
                raise ShapeError(f"mask has dtype {mask.dtype}; expected bool or uint8")
            if mask.device != self.weight.device:
                raise ShapeError(f"mask is on {mask.device}, the weight on {self.weight.device}")
            self.weight_mask.copy_(mask != 0)

        @torch.no_grad()
        def prune_(self, sparsity: float, tile: Any = (1, 1)) -> Any:
            """Keep the largest-magnitude ``1 - sparsity`` of the weight (scored per ``tile`` of
            [out, in], e.g. (32, 1); the last tiles of each dim may be partial), on the weight's
            device with no host sync; returns the mask."""
            if not 0.0 <= sparsity <= 1.0:
                raise PlanError(f"sparsity must be in [0, 1], got {sparsity}")
            th, tw = (int(t) for t in tile)
            out_f, in_f = self.weight.shape
            if th < 1 or tw < 1:
                raise ShapeError(f"tile {(th, tw)} must have positive extents")
            gh, gw = -(-out_f // th), -(-in_f // tw)
            pad = (0, gw * tw - in_f, 0, gh * th - out_f)

            def per_tile(t: Any) -> Any:
                return torch.nn.functional.pad(t, pad).reshape(gh, th, gw, tw).sum(dim=(1, 3))

            w = self.weight.detach().float()
            score = (per_tile(w.abs()) / per_tile(torch.ones_like(w))).flatten()  # tile means
            drop = int(round(sparsity * score.numel()))
            if drop == 0:
                keep = torch.ones_like(score, dtype=torch.bool)
            elif drop >= score.numel():
                keep = torch.zeros_like(score, dtype=torch.bool)
            else:
                thr = torch.kthvalue(score, drop).values
                keep = score > thr
            grid = keep.reshape(gh, gw).repeat_interleave(th, 0).repeat_interleave(tw, 1)
            self.weight_mask.copy_(grid[:out_f, :in_f])
            return self.weight_mask

        def forward(self, x: Any) -> Any:
            if self.sparse_input:
                return sparse_input_linear(x, self.weight, self.bias)
            return sparse_weight_linear(x, self.weight, self.weight_mask, self.bias,
                                        micro_tile=self.micro_tile,
                                        dx_micro_tile=self.dx_micro_tile,
                                        sddmm_tile=self.sddmm_tile)

        def extra_repr(self) -> str:
            mode = "sparse_input" if self.sparse_input else f"weight micro_tile={self.micro_tile}"
            return f"{super().extra_repr()}, {mode}"

    return {"SparseLinear": SparseLinear}


def _flat(x: Any) -> tuple[Any, tuple[int, ...]]:
    """x [..., in] as [batch, in] and the leading shape to restore (plain checks that
    torch.compile traces without a break)."""
    import torch
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ShapeError(f"x must be a tensor [..., in_features], got {type(x).__name__}")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


@on_operand_device
def sparse_weight_linear(x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None = None,
                         micro_tile: Any = (32, 1), dx_micro_tile: Any = "dense",
                         sddmm_tile: Any = (32, 1)) -> Any:
    """``x (weight ⊙ mask)ᵀ + bias`` with gradients; mask (bool/uint8 [out, in]) may change every
    call. ``micro_tile`` (in [out, in] order, or 'auto') is the forward GEMM's micro-tile,
    ``sddmm_tile`` the SDDMM's tile for dW. ``dx_micro_tile`` is dX's: 'dense' (cuBLAS on
    W ⊙ M) by default, because a (32, 1) pattern is 1 wide along dX's *spatial* axis, where
    pitgen gathers rows per 32-wide k-tile (1.6 ms vs 0.16 ms at 4096², H100, measured before
    the row-owner kernel replaced fp32 atomics there);
    'auto' or a micro-tile runs pitgen's GEMM with W ⊙ M sparse. No host synchronisation,
    except that an 'auto' kernel plans once per operand shape (one small copy back then).
    The result is a transposed view (the kernel writes yᵀ)."""
    x2, lead = _flat(x)
    _check_linear(x2, weight, bias)
    check_tensor("mask", mask, ("bool", "uint8"), ndim=2, shape=tuple(weight.shape), contiguous=False)
    mt, dxt, st = _micro(micro_tile), _micro(dx_micro_tile), list(normalise_tile(sddmm_tile))
    if tracing():
        y = ops().sparse_weight_linear(x2, weight, mask, bias, mt, dxt, st)
    elif needs_grad(x2, weight, bias):
        y = _eager_functions()["weight"].apply(x2, weight, mask, bias, mt, dxt, st)
    else:
        y = weight_forward(x2, weight, mask, bias, mt)
    return y.reshape(*lead, weight.shape[0])


@on_operand_device
def sparse_input_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                        micro_tile: str | tuple[int, int] = "auto") -> Tensor:
    """``x weightᵀ + bias`` with gradients, skipping x's zeros in forward and dW. With
    ``micro_tile='auto'`` each kernel plans once per operand shape, on that shape's first call,
    from coverage counts copied back from the GPU (one small host sync then; none later)."""
    x2, lead = _flat(x)
    _check_linear(x2, weight, bias)
    mt = _micro(micro_tile)
    if tracing():
        y = ops().sparse_input_linear(x2, weight, bias, mt)
    elif needs_grad(x2, weight, bias):
        y = _eager_functions()["input"].apply(x2, weight, bias, mt)
    else:
        y = input_forward(x2, weight, bias, mt)
    return y.reshape(*lead, weight.shape[0])


def __getattr__(name: str) -> Any:
    if name == "SparseLinear":
        return _classes()[name]
    raise AttributeError(f"module 'pitgen.ops.linear' has no attribute {name!r}")
