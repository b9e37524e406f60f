"""Dynamic block-sparse attention, fused flash-attention style, with a mask that may change on
every call.

Derivation (PIT rules): the scores ``S[b,h,i,j] += Q[b,h,i,d] * K[b,h,j,d]`` have b, h, i, j
spatial and invariant (a CTA per (b, h, query block) writes back to its own rows), and in
``O[b,h,i,d] += P[b,h,i,j] * V[b,h,j,d]`` the key axis j is an invariant *reduction* axis: key
blocks may be visited in any order. With an online softmax (running max and sum, also
order-free) the kernel can therefore walk a compact, unordered list of the non-empty key blocks
of its query block, which the GPU builds every call (no sort of key blocks, no host sync).

Pipeline per call: index kernel (reads the mask once, 16-byte loads; writes a state byte per
(mask slice, query block, key block): empty, partial or full; every entry is written, so
nothing is reset first; the last CTA of each slice orders the query blocks by their count of
non-empty key blocks, longest first) → attention kernel (CTAs in that order, since i is
invariant too: the longest lists start first instead of finishing last; each compacts its row
of states into a list in shared memory with warp ballots, then runs mma.sync m16n8k16 over it
with a STAGES-deep cp.async pipeline; element mask only on partial blocks). Fully masked rows
give zeros.

``SparseAttention`` (a drop-in for ``torch.nn.MultiheadAttention(batch_first=True)``) is built
on first access, so importing this module needs no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import cache
from ..errors import PlanError, ShapeError
from ..limits import INDEX_THREADS
from ..operands import check_tensor
from ..opspec import OpSpec, Permutation
from ..runtime import TorchLaunch, stream_counters
from . import lazy_torch_classes

if TYPE_CHECKING:
    from torch import Tensor

SCORES = "S[b,h,i,j] += Q[b,h,i,d] * K[b,h,j,d]"
OUTPUT = "O[b,h,i,d] += P[b,h,i,j] * V[b,h,j,d]"
HEAD_DIMS = (64, 128)
#: Query rows x key columns of one block; one warp owns 16 query rows.
BM, BN = 64, 64
#: Mask columns one index CTA covers (KPC = INDEX_COLUMNS // BN key blocks).
INDEX_COLUMNS = 512
#: Per head dim: K/V pipeline stages, and CTAs per SM that __launch_bounds__ budgets registers
#: for (scripts/tune_attention.py on an H100, docs/attention.md: at D=64, 2 stages x 3 CTAs is
#: fastest on all three benchmark masks since the mask tiles load with K/V; at D=128, 2 x 2 is
#: within 2% of 3 x 2 with less shared memory).
STAGES = {64: 2, 128: 2}
MIN_BLOCKS = {64: 3, 128: 2}
#: Dynamic shared memory an SM grants one CTA.
SMEM_LIMIT = 227 * 1024
#: Index state bytes.
EMPTY, PARTIAL, FULL = 0, 1, 2
#: Count classes of the query-block order (exact counts below this many key blocks).
ORDER_BINS = INDEX_THREADS
#: Bytes per row of a shared-memory mask tile: BN, padded so a warp's rows use distinct banks.
MASK_ROW = BN + 16


# -- the operator -------------------------------------------------------------------------------

ATTENTION = OpSpec(
    "attention", "attention.cu.j2",
    {"pit_attn_index_vec": "PiiiPPPP", "pit_attn_index_byte": "PiiiPPPP",
     "pit_attention": "PPPPPPPiiiiiif", "pit_attention_vec": "PPPPPPPiiiiiif"},
    permutes=(
        # a CTA per (batch, head, query block), taken in any order: longest rows first
        Permutation("query blocks", SCORES, "spatial", "Q"),
        # key blocks visited in any order, empty ones dropped (online softmax is order-free)
        Permutation("key blocks", OUTPUT, "reduction", "V")),
    dtypes=("float16", "bfloat16"))


@dataclass(frozen=True)
class AttentionPlan:
    """Decisions for one problem shape: tile sizes, grids, shared memory, mask broadcasting."""
    batch: int
    heads: int
    sq: int
    sk: int
    d: int
    dtype: str
    mask_batch: int     # 1 or batch
    mask_heads: int     # 1 or heads
    bm: int = BM
    bn: int = BN
    stages: int = 0      # 0: STAGES[d]
    min_blocks: int = 0  # 0: MIN_BLOCKS[d]

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", STAGES[self.d])
        if not self.min_blocks:
            object.__setattr__(self, "min_blocks", MIN_BLOCKS[self.d])

    @property
    def warps(self) -> int:
        return self.bm // 16

    @property
    def n_qb(self) -> int:
        return -(-self.sq // self.bm)

    @property
    def n_kb(self) -> int:
        return -(-self.sk // self.bn)

    @property
    def slices(self) -> int:
        return self.mask_batch * self.mask_heads

    @property
    def kpc(self) -> int:
        return INDEX_COLUMNS // self.bn

    @property
    def smem(self) -> int:
        """Dynamic shared memory of the attention kernel: K, V and mask-tile stages + the block
        list."""
        return 2 * self.stages * self.bn * self.d * 2 + self.stages * self.bm * MASK_ROW \
            + 4 * self.n_kb

    @property
    def mask_strides(self) -> tuple[int, int]:
        """Slice index = b * sb + h * sh (0 along a broadcast dim)."""
        return (self.mask_heads if self.mask_batch > 1 else 0, 1 if self.mask_heads > 1 else 0)

    def index_grid(self) -> tuple[int, int, int]:
        return (-(-self.n_kb // self.kpc), self.n_qb, self.slices)

    def attention_grid(self) -> tuple[int, int, int]:
        """(batch x head, rank in the query-block order): every head's longest rows first."""
        return (self.batch * self.heads, self.n_qb, 1)

    def context(self) -> dict[str, Any]:
        """Template context (everything the CUDA source depends on)."""
        return {"dtype": self.dtype, "d": self.d, "bm": self.bm, "bn": self.bn,
                "warps": self.warps, "kpc": self.kpc, "index_threads": INDEX_THREADS,
                "stages": self.stages, "min_blocks": self.min_blocks, "mask_row": MASK_ROW}


@cache.lru("attention.plans")
def plan_attention(batch: int, heads: int, sq: int, sk: int, d: int, dtype: str,
                   mask_shape: tuple[int, ...]) -> AttentionPlan:
    """Check the problem against what the kernel runs and fix its tiles; the rule derivation runs
    here so that a kernel permuting a non-invariant axis could not be planned. Cached per shape
    (every call plans; a refusal raises again each time)."""
    ATTENTION.derive()
    if d not in HEAD_DIMS:
        raise ShapeError(f"head dim D={d} is not supported; sparse_attention runs D in {HEAD_DIMS}")
    ATTENTION.check_dtype(dtype)
    if len(mask_shape) not in (2, 3, 4):
        raise ShapeError(f"mask has shape {tuple(mask_shape)}; expected [Sq, Sk], [H, Sq, Sk] "
                         f"or [B, H, Sq, Sk]")
    full = (batch, heads, sq, sk)[-len(mask_shape):]
    if tuple(mask_shape) != full:
        raise ShapeError(f"mask has shape {tuple(mask_shape)}; expected {full} "
                         f"(trailing dims of [B, H, Sq, Sk] = {(batch, heads, sq, sk)})")
    mh = heads if len(mask_shape) >= 3 else 1
    mb = batch if len(mask_shape) == 4 else 1
    if batch * heads >= 2 ** 31 or -(-sq // BM) > 65535 or mb * mh > 65535:
        raise ShapeError(f"batch x heads = {batch * heads}, mask slices = {mb * mh} or Sq = {sq} "
                         f"({-(-sq // BM)} query blocks) exceeds the grid limits 2**31 - 1, "
                         f"65535 and 65535")
    if max(batch * heads * max(sq, sk) * d, mb * mh * sq * sk) >= 2 ** 62:
        raise ShapeError("problem too large for 64-bit offsets")
    plan = AttentionPlan(batch, heads, sq, sk, d, dtype, mb, mh, bm=BM)
    if plan.smem > SMEM_LIMIT:
        raise ShapeError(f"Sk={sk} keys make a block list of {plan.n_kb} entries that does not fit "
                         f"shared memory; sparse_attention runs Sk up to "
                         f"{(SMEM_LIMIT - plan.smem + 4 * plan.n_kb) // 4 * plan.bn}")
    return plan


# -- NumPy references ---------------------------------------------------------------------------


# -- mask patterns ------------------------------------------------------------------------------


# -- GPU ----------------------------------------------------------------------------------------

def _mask_u8(mask: Any) -> Any:
    """The mask as uint8 bytes without a copy where possible (bool is stored as one byte)."""
    import torch
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask


def _check(q: Any, k: Any, v: Any, mask: Any) -> AttentionPlan:
    check_tensor("q", q, ATTENTION.dtypes, ndim=4)
    dtype = str(q.dtype).replace("torch.", "")
    b, h, sq, d = q.shape
    check_tensor("k", k, (dtype,), ndim=4, shape=(b, h, None, d))
    sk = k.shape[2]
    check_tensor("v", v, (dtype,), ndim=4, shape=(b, h, sk, d))
    check_tensor("mask", mask, ("bool", "uint8"), contiguous=False)
    for name, x in (("k", k), ("v", v), ("mask", mask)):
        if x.device != q.device:
            raise ShapeError(f"{name} is on {x.device} but q is on {q.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data_ptr() % 16:
            raise ShapeError(f"{name} is not 16-byte aligned (a view at an odd offset); "
                             f"pass {name}.clone()")
    return plan_attention(b, h, sq, sk, d, dtype, tuple(mask.shape))


class BlockIndex(NamedTuple):
    """What the index pass builds on the GPU: ``states`` uint8 [slices, nQB, nKB] (EMPTY,
    PARTIAL, FULL per 64x64 block) and ``order`` int32 [slices, nQB], each slice's query blocks
    by descending count of non-empty key blocks (the order the attention CTAs take them in)."""
    states: Any
    order: Any


#: device index -> runtime.stream_counters cache of the index pass's row counts and done
#: counters (the pass zeroes them again after use)
_COUNTERS = cache.memo("attention.counters")


def _vector_mask(plan: AttentionPlan, mask: Any) -> bool:
    """Whether the kernels may read the mask 16 bytes at a time (rows and base 16-byte aligned);
    else their byte-by-byte variants run."""
    return plan.sk % 16 == 0 and mask.data_ptr() % 16 == 0


def _index(kernels: Any, plan: AttentionPlan, mask: Any, launch: Any) -> BlockIndex:
    """Enqueue the index kernel on ``launch``'s stream; returns the state map and order it
    fills."""
    import torch
    states = torch.empty((plan.slices, plan.n_qb, plan.n_kb), dtype=torch.uint8,
                         device=mask.device)
    order = torch.empty((plan.slices, plan.n_qb), dtype=torch.int32, device=mask.device)
    counters = stream_counters(_COUNTERS.setdefault(mask.device.index, {}), launch.stream,
                               plan.slices * (plan.n_qb + 1), mask.device)
    rowcount = counters.data_ptr()
    done = rowcount + 4 * plan.slices * plan.n_qb
    vec = _vector_mask(plan, mask)
    kernels.launch("pit_attn_index_vec" if vec else "pit_attn_index_byte", plan.index_grid(),
                   (INDEX_THREADS, 1, 1), launch.stream, mask.data_ptr(), plan.sq, plan.sk,
                   plan.n_kb, states.data_ptr(), rowcount, done, order.data_ptr())
    return BlockIndex(states, order)


def block_index(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> BlockIndex:
    """The block index that ``sparse_attention`` builds, on the GPU, no host sync: the state map
    (as ``block_index_reference``; slices = the mask's leading dims, flattened) and the
    query-block order (as ``block_order_reference``)."""
    plan = _check(q, k, v, mask)
    with TorchLaunch() as launch:
        return _index(ATTENTION.module(plan), plan, _mask_u8(mask.contiguous()), launch)


def _given_index(plan: AttentionPlan, index: Any, device: Any) -> BlockIndex:
    """Check an index passed to sparse_attention (shapes, dtypes, device; its contents are
    never trusted by the kernel)."""
    import torch
    want = {"states": ((plan.slices, plan.n_qb, plan.n_kb), torch.uint8),
            "order": ((plan.slices, plan.n_qb), torch.int32)}
    if not isinstance(index, BlockIndex):
        raise ShapeError(f"index must be the BlockIndex (states, order) from block_index, got "
                         f"{type(index).__name__}")
    for name, (shape, dtype) in want.items():
        x = getattr(index, name)
        if (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype
                or not x.is_contiguous()):
            raise ShapeError(f"index.{name} must be a contiguous {dtype} tensor of shape "
                             f"{shape} from block_index, got "
                             f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}")
        if x.device != device:
            raise ShapeError(f"index.{name} is on {x.device} but q is on {device}")
    return index


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None,
                     index: BlockIndex | None = None) -> Tensor:
    """out[b,h,i] = sum_j softmax_j(scale * q_i . k_j over {j : mask[.., i, j]}) v_j.

    q [B, H, Sq, D], k/v [B, H, Sk, D]: contiguous, 16-byte aligned CUDA tensors, float16 or
    bfloat16, D in {64, 128}; mask bool or uint8 (non-zero = attend) of shape [Sq, Sk],
    [H, Sq, Sk] or [B, H, Sq, Sk], broadcast over missing leading dims (a non-contiguous mask is
    copied). scale defaults to 1/sqrt(D). Rows with no set element are zeros. The index is built
    on the GPU on every call (nothing waits for the host) unless ``index`` passes the
    ``BlockIndex`` from ``block_index`` for this same mask (used to time the two stages apart;
    any contents stay in bounds, but only block_index's give the right answer)."""
    import torch

    plan = _check(q, k, v, mask)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    if plan.sk == 0:
        return out.zero_()
    scale = 1.0 / math.sqrt(plan.d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ShapeError(f"scale must be finite, got {scale}")
    mask = _mask_u8(mask.contiguous())
    kernels = ATTENTION.module(plan)
    sb, sh = plan.mask_strides
    with TorchLaunch() as launch:
        idx = (_index(kernels, plan, mask, launch) if index is None
               else _given_index(plan, index, q.device))
        name = "pit_attention_vec" if _vector_mask(plan, mask) else "pit_attention"
        kernels.launch(name, plan.attention_grid(), (plan.warps * 32, 1, 1),
                       launch.stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                       mask.data_ptr(), idx.states.data_ptr(), idx.order.data_ptr(), plan.sq,
                       plan.sk, plan.heads, sb, sh, plan.n_kb, scale * math.log2(math.e),
                       smem=plan.smem)
    return out


# -- nn.MultiheadAttention drop-in (built on first access) --------------------------------------

def _build_module() -> type:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SparseAttention(nn.Module):
        """Drop-in for ``nn.MultiheadAttention(embed_dim, num_heads, bias=True,
        batch_first=True)`` (same parameters and state_dict) running ``sparse_attention``.

        ``attn_mask`` follows nn.MultiheadAttention: bool, **True = NOT allowed**, shape [L, S]
        or [N * num_heads, L, S]. ``mask=`` takes pitgen's convention instead (True = attend;
        [L, S], [H, L, S] or [N, H, L, S]). Exactly one of them is required. Rows with nothing
        allowed give zeros (nn.MultiheadAttention gives NaN). Returns (out, None)."""

        def __init__(self, embed_dim: int, num_heads: int, bias: bool = True,
                     batch_first: bool = True, device: Any = None, dtype: Any = None):
            super().__init__()
            if not bias or not batch_first:
                raise PlanError("SparseAttention supports bias=True, batch_first=True only")
            if embed_dim % num_heads or embed_dim // num_heads not in HEAD_DIMS:
                raise ShapeError(f"embed_dim {embed_dim} / num_heads {num_heads} must be a head "
                                 f"dim in {HEAD_DIMS}")
            kw = {"device": device, "dtype": dtype}
            self.embed_dim, self.num_heads = embed_dim, num_heads
            self.head_dim = embed_dim // num_heads
            self.batch_first = True
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **kw))
            self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True, **kw)
            nn.init.xavier_uniform_(self.in_proj_weight)
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

        def _heads(self, x: Any, w: Any, b: Any) -> Any:
            n, length, _ = x.shape
            y = F.linear(x, w, b).view(n, length, self.num_heads, self.head_dim)
            return y.transpose(1, 2).contiguous()

        def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None,
                    need_weights: bool = False, *, mask: Any = None) -> tuple[Any, None]:
            if need_weights:
                raise PlanError("need_weights=True is not supported (weights are never stored)")
            if (attn_mask is None) == (mask is None):
                raise ShapeError("pass exactly one of attn_mask (True = not allowed) or "
                                 "mask (True = attend)")
            for name, x in (("query", query), ("key", key), ("value", value)):
                if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                    raise ShapeError(f"{name} has shape {tuple(x.shape)}; expected "
                                     f"[N, L, {self.embed_dim}] (batch_first)")
            n, length = query.shape[:2]
            if key.shape[:2] != value.shape[:2] or key.shape[0] != n:
                raise ShapeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must "
                                 f"share [N, S] with N = {n}")
            if attn_mask is not None:
                if attn_mask.dtype != torch.bool:
                    raise ShapeError(f"attn_mask has dtype {attn_mask.dtype}; only bool masks "
                                     f"(True = not allowed) are supported")
                if attn_mask.dim() == 3:
                    if attn_mask.shape[0] != n * self.num_heads:
                        raise ShapeError(f"attn_mask has shape {tuple(attn_mask.shape)}; dim 0 "
                                         f"must be N * num_heads = {n * self.num_heads}")
                    attn_mask = attn_mask.view(n, self.num_heads, *attn_mask.shape[1:])
                elif attn_mask.dim() != 2:
                    raise ShapeError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected "
                                     f"[L, S] or [N * num_heads, L, S]")
                mask = ~attn_mask
            e = self.embed_dim
            w, b = self.in_proj_weight, self.in_proj_bias
            q = self._heads(query, w[:e], b[:e])
            k = self._heads(key, w[e:2 * e], b[e:2 * e])
            v = self._heads(value, w[2 * e:], b[2 * e:])
            o = sparse_attention(q, k, v, mask)
            o = o.transpose(1, 2).reshape(n, length, e)
            return self.out_proj(o), None

    return SparseAttention


__getattr__ = lazy_torch_classes(__name__, ("SparseAttention",), lambda: {"SparseAttention": _build_module()})
