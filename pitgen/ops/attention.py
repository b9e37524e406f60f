"""Dynamic block-sparse attention, fused flash-attention style, with a mask that may change on
every call.

Derivation (PIT rules): the scores ``S[b,h,i,j] += Q[b,h,i,d] * K[b,h,j,d]`` have b, h, i, j
spatial and invariant (a CTA per (b, h, query block) writes back to its own rows), and in
``O[b,h,i,d] += P[b,h,i,j] * V[b,h,j,d]`` the key axis j is an invariant *reduction* axis: key
blocks may be visited in any order. With an online softmax (running max and sum, also
order-free) the kernel can therefore walk a compact, unordered list of the non-empty key blocks
of its query block, which the GPU builds every call (no sort of key blocks, no host sync).

Pipeline per call: index kernel (reads the mask once, 16-byte loads; writes a state byte per
(mask slice, query block, key block): empty, partial, full or gathered (a partial block whose
allowed columns, keys allowed for some row of the query block, are at most GATHER_MAX: those
keys move to the query block's gathered key list with a 64-bit row mask each, since j is
invariant they can be visited in any grouping; and a query block's few rows allowing every key
move to dense-row tiles, since i is invariant too); every entry is written, so nothing is reset
first; the last CTA of each slice orders the query blocks by their work, longest first) →
attention kernel (CTAs in that order, since i is invariant too: the longest lists start first
instead of finishing last; each compacts its row of states into a list in shared memory with
warp ballots, then runs mma.sync m16n8k16 over it and then over its gathered key tiles of 64
keys (K/V rows loaded by key id: SRead) with a STAGES-deep cp.async pipeline; element mask
only on partial blocks, a row-bit test on gathered tiles; dense-row tiles load Q rows by id,
split their key blocks over several CTAs and merge, and write rows back by id: SWrite). Fully
masked rows give zeros. docs/attention.md states the rule.

``SparseAttention`` (a drop-in for ``torch.nn.MultiheadAttention(batch_first=True)``) is built
on first access, so importing this module needs no torch.
"""
from __future__ import annotations

import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import cache, lower
from ..errors import PlanError, ShapeError
from ..limits import INDEX_THREADS
from ..operands import check_tensor, on_operand_device, raw_key, validated
from ..opspec import OpSpec, Permutation
from ..runtime import (KEPT_SCRATCH, TorchLaunch, capturing, device_arch, kept_buffer,
                       kept_scratch, stream_counters, tensor_map)
from . import lazy_torch_classes
from .library import tracing

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
#: The wgmma forward's (no K/V fragments in registers): at D=64, 4 CTAs per SM (128 registers)
#: run BigBird and Longformer 13-14% faster than 3 and the 128-block mask 3% slower (H200,
#: docs/attention.md); at D=128, 3 (168 registers; their shared memory fits with unpadded mask
#: rows) run BigBird 8% faster than 2 (H200, session 39). Fewer where shared memory holds fewer
#: (``AttentionPlan.__post_init__``).
MIN_BLOCKS_WGMMA = {64: 4, 128: 3}
#: Per head dim: pipeline stages of the backward kernels (K/V for dQ, Q/dO for dK/dV).
STAGES_BWD = {64: 2, 128: 2}
#: Per head dim: CTAs per SM of the backward kernels (accumulators dQ, or dK and dV, plus S and
#: dP per block). At D=64, 3 (168 registers, a few spilled) beat 2 by 20% on the micro mask and
#: 8% on Longformer (H100, docs/attention.md); at D=128, 1 and 2 are level.
MIN_BLOCKS_BWD = {64: 3, 128: 1}
#: Threads of the backward's key-block order kernel (one CTA).
ORDER_THREADS = 256
#: Dynamic shared memory an SM grants one CTA.
SMEM_LIMIT = 227 * 1024
#: Shared memory of an SM (sm_80 / sm_90), and what it keeps per resident CTA.
SM_SMEM, CTA_SMEM_RESERVED = 228 * 1024, 1024
#: Index state bytes. GATHERED: a partial block whose allowed columns went to the gathered key
#: tiles (so does the backward).
EMPTY, PARTIAL, FULL, GATHERED = 0, 1, 2, 3
#: A partial 64x64 block with at most this many allowed columns (keys allowed for at least one
#: row of the query block) is gathered. Cost per visit: a partial block costs one block
#: iteration with the element mask whatever its column count; its c allowed keys cost c / 64 of
#: a gathered tile iteration (the same MMAs and a row-bit test). At 16 a gathered block costs at
#: most a quarter of its visit, and the gathered list per query block is bounded by 16 * nKB
#: slots (12 bytes each: id and row mask), 4.7% of the mask's bytes; blocks with more allowed
#: columns (window edges, dense micro-tiles) stay partial, where the contiguous tile load wins.
GATHER_MAX = 16
#: log2(e): the kernels take the scores' scale in log2 units
LOG2E = math.log2(math.e)
#: A query block moves at most this many rows allowing every key (Longformer's and BigBird's
#: global rows) to dense-row tiles, so a slice has at most nQB * DENSE_ROWS_MAX / 64 dense tiles
#: (their grid and workspace are sized from shapes); more such rows stay in their block.
DENSE_ROWS_MAX = 4
#: Key-block ranges a dense-row tile is split into (its rows visit every key block: unsplit, its
#: chain would be the longest in the grid), merged by the tile's last part.
DENSE_SPLIT = 8
#: Count classes of the query-block order (exact counts below this many key blocks).
ORDER_BINS = INDEX_THREADS
#: Bytes per row of a shared-memory mask tile: BN, padded so a warp's rows use distinct banks;
#: BN where that padding would cost a CTA per SM (``AttentionPlan.mask_row``).
MASK_ROW = BN + 16


# -- the operator -------------------------------------------------------------------------------

#: The state bytes as the templates name them.
STATE_NAMES = {"EMPTY": EMPTY, "PARTIAL": PARTIAL, "FULL": FULL, "GATHERED": GATHERED}

ATTENTION = OpSpec(
    "attention", "attention.cu.j2",
    {"pit_attn_index_vec": "Piii" + "P" * 14 + "i", "pit_attn_index_byte": "Piii" + "P" * 14 + "i",
     "pit_attention": "PPPPPPPPiiiiiiifPPPiPPPiiiPP",
     "pit_attention_vec": "PPPPPPPPiiiiiiifPPPiPPPiiiPP",
     # sm_90a: K's and V's TMA maps first
     "pit_attention_tma": "MMPPPPPPPPiiiiiiifPPPiPPPiiiPP",
     "pit_attention_tma_vec": "MMPPPPPPPPiiiiiiifPPPiPPPiiiPP",
     "pit_attn_layout_index": "Piiiii" + "P" * 9 + "i",
     "pit_attention_fused_layout": "P" + "i" * 7 + "P" * 11 + "iP" + "iii" + "P" * 5 + "iiii" + "f"
                                   + "ii" + "PP",
     **dict.fromkeys(("pit_attention_fused", "pit_attention_fused_vec"),
                     "Piii" + "P" * 14 + "iP" + "iiii" + "PPPPP" + "iiii" + "f" + "ii" + "PP")},
    permutes=(
        # a CTA per (batch, head, query block), taken in any order: longest rows first
        Permutation("query blocks", SCORES, "spatial", "Q"),
        # key blocks visited in any order, empty ones dropped, the allowed keys of sparse
        # partial blocks regrouped into gathered tiles (online softmax is order-free)
        Permutation("key blocks", OUTPUT, "reduction", "V")),
    dtypes=("float16", "bfloat16"))

#: dQ = scale * dS K and dK = scale * dS^T Q with dS = P * (dP - delta), dV = P^T dO.
GRAD_Q = "G[b,h,i,d] += T[b,h,i,j] * K[b,h,j,d]"
GRAD_K = "G[b,h,j,d] += T[b,h,i,j] * Q[b,h,i,d]"

ATTENTION_BWD = OpSpec(
    "attention backward", "attention_bwd.cu.j2",
    {**dict.fromkeys(("pit_attn_bwd_dq", "pit_attn_bwd_dq_vec"),
                     "P" * 12 + "i" * 7 + "ff" + "PPPi" + "PPP" + "iii" + "PP" + "PPP"),
     **dict.fromkeys(("pit_attn_bwd_dkv", "pit_attn_bwd_dkv_vec"),
                     "P" * 11 + "i" * 8 + "ff" + "PPP" + "i" + "PPP"),
     "pit_attn_bwd_order": "PiiP"},
    permutes=(
        # dQ: a CTA per (batch, head, query block) in the forward's order, walking its key
        # blocks in any order (j reduces)
        Permutation("dQ query blocks", GRAD_Q, "spatial", "T"),
        Permutation("dQ key blocks", GRAD_Q, "reduction", "K"),
        # dK, dV: a CTA per (batch, head, key block), walking the query blocks of its column of
        # the index in any order (i reduces)
        Permutation("dKV key blocks", GRAD_K, "spatial", "T"),
        Permutation("dKV query blocks", GRAD_K, "reduction", "Q")),
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
    kv_heads: int = 0    # 0: heads (GQA: fewer K/V heads, kv head = h // group)
    wgmma: bool = False  # the forward's products on wgmma (sm_90a)
    fused: bool = False  # the module of the one-launch forward alone (a small problem, a mask)

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", STAGES[self.d])
        if not self.min_blocks:   # the table's, or as many as shared memory holds
            want = (MIN_BLOCKS_WGMMA if self.wgmma else MIN_BLOCKS)[self.d]
            object.__setattr__(self, "min_blocks",
                               max(1, min(want, self._resident(BN))))
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads

    @property
    def warps(self) -> int:
        return self.bm // 16

    @property
    def tma(self) -> bool:
        """The forward's block tiles by TMA (sm_90a, a launch of its own): one thread issues a
        block's K/V boxes instead of 128 threads' cp.async addressing."""
        return self.wgmma and not self.fused

    def forward_kernel(self, vec: bool) -> str:
        """The forward kernel's name: the mask tiles by cp.async (``vec``) or read in place."""
        return ("pit_attention_tma" if self.tma else "pit_attention") + ("_vec" if vec else "")

    def kv_maps(self, k: Any, v: Any) -> tuple[bytes, ...]:
        """The TMA maps the forward kernel takes first (none without ``tma``): K and V as
        [batch x K/V head][Sk][D], a box of BN rows x 64 columns (one 128-byte swizzle row)."""
        if not self.tma:
            return ()
        dims = (self.d, self.sk, self.batch * self.kv_heads)
        return tuple(tensor_map(t.data_ptr(), self.dtype, dims, (self.d, self.sk * self.d),
                                (64, self.bn, 1)) for t in (k, v))

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
    def gather_cap(self) -> int:
        """Gathered-key slots per (mask slice, query block): GATHER_MAX per key block."""
        return GATHER_MAX * self.n_kb

    @property
    def dense_split(self) -> int:
        """Parts of a dense-row tile: DENSE_SPLIT key-block ranges, at most one block each."""
        return min(DENSE_SPLIT, self.n_kb)

    @property
    def dense_tiles(self) -> int:
        """Dense-row tiles per slice the grid and workspace hold (DENSE_ROWS_MAX per block)."""
        return -(-self.n_qb * DENSE_ROWS_MAX // self.bm)

    @property
    def dense_workspace(self) -> int:
        """float32 elements of the dense tiles' partial results: per (batch x head, tile,
        part) the unnormalised output rows and each row's running max and sum."""
        return (self.batch * self.heads * self.dense_tiles * self.dense_split
                * self.bm * (self.d + 2))

    @property
    def kpc(self) -> int:
        return INDEX_COLUMNS // self.bn

    def _smem(self, mask_row: int) -> int:
        return 2 * self.stages * self.bn * self.d * 2 + self.stages * self.bm * mask_row \
            + 4 * self.n_kb + (1024 if self.wgmma else 0)   # slack to align the stages

    def _resident(self, mask_row: int) -> int:
        """Forward CTAs an SM's shared memory holds with mask rows of ``mask_row`` bytes."""
        return SM_SMEM // (self._smem(mask_row) + self.static_smem + CTA_SMEM_RESERVED)

    @property
    def mask_row(self) -> int:
        """Bytes per row of the forward's mask tiles: MASK_ROW (padded), or BN where only that
        lets min_blocks CTAs share an SM (BigBird at D=128, H200: 3 CTAs with 4-way bank
        conflicts on the mask reads 73.5 us, with a conflict-free swizzle 76.3, 2 padded 79.9)."""
        padded = self._resident(MASK_ROW) >= self.min_blocks
        return MASK_ROW if padded or self._resident(BN) < self.min_blocks else BN

    @property
    def smem(self) -> int:
        """Dynamic shared memory of the attention kernel: K, V and mask-tile stages + the block
        list."""
        return self._smem(self.mask_row)

    @property
    def static_smem(self) -> int:
        """Static shared memory of the attention kernel, at most: the gathered ids' ring
        (``IDS_RING`` tiles of BN ids: 2 * stages - 2, at least 2) and a few words."""
        return 4 * self.bn * max(2, 2 * self.stages - 2) + 64 + (8 * self.stages if self.tma else 0)

    @property
    def mask_strides(self) -> tuple[int, int]:
        """Slice index = b * sb + h * sh (0 along a broadcast dim)."""
        return (self.mask_heads if self.mask_batch > 1 else 0, 1 if self.mask_heads > 1 else 0)

    def index_grid(self) -> tuple[int, int, int]:
        return (-(-self.n_kb // self.kpc), self.n_qb, self.slices)

    def fused_grid(self) -> tuple[int, int, int] | None:
        """The one-launch forward's grid (the index CTAs, then the forward's), or None where the
        two grids together exceed lower.FUSED_MAX_CTAS: a larger problem's GPU work outweighs the
        second driver call."""
        (ix, iy, iz), (ax, ay, _) = self.index_grid(), self.forward_grid()
        ctas = ix * iy * iz + ax * ay
        return (ctas, 1, 1) if ctas <= lower.FUSED_MAX_CTAS else None

    def fused_layout_grid(self) -> tuple[int, int, int] | None:
        """``fused_grid`` of a block layout's call: a CTA per layout slice builds its index,
        then the forward's CTAs; None past lower.FUSED_MAX_CTAS."""
        ax, ay, _ = self.forward_grid()
        ctas = self.slices + ax * ay
        return (ctas, 1, 1) if ctas <= lower.FUSED_MAX_CTAS else None

    def dq_grid(self, dense: bool) -> tuple[int, int, int]:
        """The backward's dQ kernel: (batch x head, y): with ``dense`` (a mask: the index may
        have moved rows) y < dense_tiles * dense_split the dense-row tiles' parts, then the
        query blocks by rank in the forward's order."""
        parts = self.dense_tiles * self.dense_split if dense else 0
        return (self.batch * self.heads, parts + self.n_qb, 1)

    def forward_grid(self) -> tuple[int, int, int]:
        """(batch x head, y, 1): y < dense_split the parts of dense-row tile 0 (dispatched
        first), then the query blocks by rank y - dense_split in the order, then the parts of
        the other dense-row tiles (those past the slice's dense rows do nothing)."""
        return (self.batch * self.heads, self.dense_tiles * self.dense_split + self.n_qb, 1)

    def context(self) -> dict[str, Any]:
        """Template context (everything the CUDA source depends on)."""
        return {"dtype": self.dtype, "d": self.d, "bm": self.bm, "bn": self.bn,
                "warps": self.warps, "kpc": self.kpc, "index_threads": INDEX_THREADS,
                "stages": self.stages, "min_blocks": self.min_blocks, "mask_row": self.mask_row,
                "gather_max": GATHER_MAX, "dense_rows_max": DENSE_ROWS_MAX, "wgmma": self.wgmma,
                "fused": self.fused, "tma": self.tma, "forward_name": self.forward_kernel(False),
                **STATE_NAMES}

    # -- backward --

    @property
    def smem_dq(self) -> int:
        """Dynamic shared memory of the dQ kernel: K, V and mask-tile stages, the query block's
        Q and dO tiles (its gathered keys' dK and dV products) + the key-block list."""
        st = STAGES_BWD[self.d]
        return (2 * st * self.bn * self.d * 2 + 2 * self.bm * self.d * 2 + st * self.bm * MASK_ROW
                + 4 * self.n_kb)

    @property
    def gathered_workspace(self) -> int:
        """int32 words of the backward's gathered-key sums: float32 dK and dV rows per (batch x
        K/V head, key) and a flag per (batch x K/V head, key block) (zero between launches)."""
        return self.batch * self.kv_heads * (2 * self.sk * self.d + self.n_kb)

    @property
    def smem_dkv(self) -> int:
        """Dynamic shared memory of the dK/dV kernel: its own K and V tiles, Q, dO, lse, delta
        and mask-tile stages + the query-block list."""
        st = STAGES_BWD[self.d]
        return (2 * self.bn * self.d * 2 + st * (2 * self.bm * self.d * 2 + 2 * self.bm * 4
                                                  + self.bm * MASK_ROW) + 4 * self.n_qb)

    def dkv_grid(self) -> tuple[int, int, int]:
        """(batch x K/V head, key block)."""
        return (self.batch * self.kv_heads, self.n_kb, 1)

    def check_backward(self) -> None:
        """ShapeError where the backward's block lists do not fit shared memory."""
        for what, n, smem in (("Sk", self.sk, self.smem_dq), ("Sq", self.sq, self.smem_dkv)):
            if smem > SMEM_LIMIT:
                raise ShapeError(f"{what}={n} makes a block list that does not fit shared memory "
                                 f"in the backward pass ({smem} > {SMEM_LIMIT} bytes)")

    def backward_context(self) -> dict[str, Any]:
        """Template context of the backward kernels."""
        return {"dtype": self.dtype, "d": self.d, "bm": self.bm, "bn": self.bn,
                "warps": self.warps, "stages": STAGES_BWD[self.d],
                "min_blocks": MIN_BLOCKS_BWD[self.d], "mask_row": MASK_ROW, "wgmma": False,
                "fused": False, "order_threads": ORDER_THREADS, **STATE_NAMES}


@cache.lru("attention.plans")
def plan_attention(batch: int, heads: int, sq: int, sk: int, d: int, dtype: str,
                   mask_shape: tuple[int, ...], kv_heads: int = 0,
                   arch: str = "sm_80") -> AttentionPlan:
    """Check the problem against what the kernel runs and fix its tiles; the rule derivation runs
    here so that a kernel permuting a non-invariant axis could not be planned. The mask's
    leading dims broadcast (each 1 or the full extent: [Sq, Sk], [H|1, Sq, Sk] or
    [B|1, H|1, Sq, Sk]); ``kv_heads`` (0: ``heads``) must divide ``heads``; on a device of
    ``arch`` in ``lower.WGMMA_ARCHS`` the forward multiplies on wgmma. Cached per shape
    (every call plans; a refusal raises again each time)."""
    ATTENTION.derive()
    if d not in HEAD_DIMS:
        raise ShapeError(f"head dim D={d} is not supported; sparse_attention runs D in {HEAD_DIMS}")
    ATTENTION.check_dtype(dtype)
    kv_heads = kv_heads or heads
    if kv_heads < 1 or heads % kv_heads:
        raise ShapeError(f"k/v have {kv_heads} heads, which does not divide q's {heads} heads "
                         f"(grouped-query attention needs H % Hkv == 0)")
    if len(mask_shape) not in (2, 3, 4):
        raise ShapeError(f"mask has shape {tuple(mask_shape)}; expected [Sq, Sk], [H, Sq, Sk] "
                         f"or [B, H, Sq, Sk]")
    full = (batch, heads, sq, sk)[-len(mask_shape):]
    lead = tuple(mask_shape)[:-2]
    if (tuple(mask_shape)[-2:] != full[-2:]
            or any(m not in (1, f) for m, f in zip(lead, full[:-2]))):
        raise ShapeError(f"mask has shape {tuple(mask_shape)}; expected {full} "
                         f"(trailing dims of [B, H, Sq, Sk] = {(batch, heads, sq, sk)}; "
                         f"B and H may be 1 to broadcast)")
    mh = mask_shape[-3] if len(mask_shape) >= 3 else 1
    mb = mask_shape[-4] if len(mask_shape) == 4 else 1
    if batch * heads >= 2 ** 31 or -(-sq // BM) > 65535 or mb * mh > 65535:
        raise ShapeError(f"batch x heads = {batch * heads}, mask slices = {mb * mh} or Sq = {sq} "
                         f"({-(-sq // BM)} query blocks) exceeds the grid limits 2**31 - 1, "
                         f"65535 and 65535")
    if max(batch * heads * max(sq, sk) * d, mb * mh * sq * sk) >= 2 ** 62:
        raise ShapeError("problem too large for 64-bit offsets")
    plan = AttentionPlan(batch, heads, sq, sk, d, dtype, mb, mh, bm=BM, kv_heads=kv_heads,
                         wgmma=arch in lower.WGMMA_ARCHS)
    room = SMEM_LIMIT - plan.static_smem
    if plan.smem > room:
        raise ShapeError(f"Sk={sk} keys make a block list of {plan.n_kb} entries that does not fit "
                         f"shared memory; sparse_attention runs Sk up to "
                         f"{(room - plan.smem + 4 * plan.n_kb) // 4 * plan.bn}")
    return plan


# -- NumPy references ---------------------------------------------------------------------------


# -- mask patterns ------------------------------------------------------------------------------


# -- GPU ----------------------------------------------------------------------------------------

def _mask_shape(mask: Any) -> tuple[int, ...]:
    """The shape the kernels see: a leading dim broadcast by stride 0 (``expand``) counts once."""
    return tuple(1 if dim < mask.dim() - 2 and mask.stride(dim) == 0 else n
                 for dim, n in enumerate(mask.shape))


def _mask_u8(mask: Any) -> Any:
    """The mask as contiguous uint8 bytes without a copy where possible (bool is stored as one
    byte); a leading dim broadcast by stride 0 (``expand``) is taken once, not copied."""
    import torch
    shape = _mask_shape(mask)
    if shape != tuple(mask.shape):
        mask = mask[tuple(slice(0, n) for n in shape)]
    mask = mask.contiguous()
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask


def check_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> tuple[int, ...]:
    """(B, H, Hkv, Sq, Sk, D) of q [B, H, Sq, D], k and v [B, Hkv, Sk, D] (H % Hkv == 0), or
    ShapeError naming the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x) != 4:
            raise ShapeError(f"{name} has {len(x)} dims {tuple(x)}; expected 4: "
                             f"[B, H, S, D] (SDPA's layout)")
    b, h, sq, d = q
    if k[0] != b or k[3] != d:
        raise ShapeError(f"k has shape {tuple(k)}; expected [{b}, Hkv, Sk, {d}] for q "
                         f"{tuple(q)}")
    if tuple(v) != tuple(k):
        raise ShapeError(f"v has shape {tuple(v)}; expected k's shape {tuple(k)}")
    if k[1] < 1 or h % k[1]:
        raise ShapeError(f"k/v have {k[1]} heads, which does not divide q's {h} heads "
                         f"(grouped-query attention needs H % Hkv == 0)")
    return b, h, k[1], sq, k[2], d


#: raw_key of (q, k, v, mask) -> the plan their validation gave (operands.validated)
_CHECKED = cache.memo("attention.checked")


def _check(q: Any, k: Any, v: Any, mask: Any,
           block: tuple[int, ...] = ()) -> tuple[AttentionPlan, Any]:
    """The plan, and the mask as the kernels read it (``_mask_u8``; None stays None: no mask
    to read, the index says dense or causal). With ``block`` (query rows, key columns of a
    layout block) ``mask`` is a block layout (``sparse_attention``'s block_mask), read by the
    layout index alone."""
    plan = validated(_CHECKED, (raw_key(q, k, v, mask), block),
                     lambda: _validate(q, k, v, mask, block))
    return plan, (None if mask is None else _mask_u8(mask))


#: Query rows x key columns of a block layout's block unless ``block_size`` says otherwise
#: (FlexAttention's BlockMask default).
BLOCK_SIZE = 128


@functools.lru_cache(maxsize=64)
def _block_size(block_size: Any) -> tuple[int, int]:
    """(rows, columns) of a layout block: an int or a pair, positive multiples of the kernels'
    64 x 64 blocks (a layout block is then whole 64 x 64 blocks, FULL or EMPTY)."""
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if (len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0
                              or x % b for x, b in zip(pair, (BM, BN)))):
        raise ShapeError(f"block_size must be an int or a pair of positive multiples of "
                         f"{BM} (query rows, key columns), got {block_size!r}")
    return pair


def _layout_shape(shape: tuple[int, ...], batch: int, heads: int, sq: int, sk: int,
                  block: tuple[int, int]) -> tuple[int, ...]:
    """The mask shape a block layout of ``shape`` stands for ([..., Sq, Sk], the leading dims
    kept: what the plan's slices and strides follow), or ShapeError naming the shape it needs."""
    want = (-(-sq // block[0]), -(-sk // block[1]))
    lead = tuple(shape[:-2])
    full = (batch, heads)[2 - len(lead):] if len(lead) <= 2 else ()
    if (len(shape) not in (2, 3, 4) or tuple(shape[-2:]) != want
            or any(m not in (1, f) for m, f in zip(lead, full))):
        raise ShapeError(f"block_mask has shape {tuple(shape)}; expected [{want[0]}, {want[1]}], "
                         f"[H|1, {want[0]}, {want[1]}] or [B|1, H|1, {want[0]}, {want[1]}] "
                         f"(B = {batch}, H = {heads}; ceil(Sq / {block[0]}) x ceil(Sk / "
                         f"{block[1]}) blocks of block_size {block})")
    return (*lead, sq, sk)


def _validate(q: Any, k: Any, v: Any, mask: Any, block: tuple[int, ...] = ()) -> AttentionPlan:
    """Every check of q, k, v and mask (a pitgen error naming the argument), then the plan."""
    check_tensor("q", q, ATTENTION.dtypes, ndim=4)
    dtype = str(q.dtype).replace("torch.", "")
    check_tensor("k", k, (dtype,), ndim=4)
    check_tensor("v", v, (dtype,), ndim=4)
    b, h, hkv, sq, sk, d = check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    arch = device_arch()
    if mask is None:
        return plan_attention(b, h, sq, sk, d, dtype, (sq, sk), hkv, arch)
    what = "block_mask" if block else "mask"
    check_tensor(what, mask, ("bool", "uint8"), contiguous=False)
    for name, x in (("k", k), ("v", v), (what, mask)):
        if x.device != q.device:
            raise ShapeError(f"{name} is on {x.device} but q is on {q.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data_ptr() % 16:
            raise ShapeError(f"{name} is not 16-byte aligned (a view at an odd offset); "
                             f"pass {name}.clone()")
    shape = _mask_shape(mask)
    if block:
        shape = _layout_shape(shape, b, h, sq, sk, block)
    return plan_attention(b, h, sq, sk, d, dtype, shape, hkv, arch)


class BlockIndex(NamedTuple):
    """What the index pass builds on the GPU. ``states`` uint8 [slices, nQB, nKB]: the forward's
    decision per 64x64 block over the query block's rows that stay in it (EMPTY, PARTIAL, FULL
    or GATHERED; what the backward walks too); ``blocks``: the plain block states over all rows
    (EMPTY, PARTIAL, FULL: ``block_index_reference``); ``order`` int32 [slices, nQB]: each slice's query blocks by descending
    work (visited blocks + gathered tiles), the order the attention CTAs take them in; the
    gathered keys of each query block: ``counts`` int32 [slices, nQB], ``keys`` int32
    [slices, nQB, cap] (ascending key ids, the first ``counts`` valid) and ``bits`` int64
    [slices, nQB, cap] (per key, bit r set when row r of the query block allows it), cap =
    GATHER_MAX * nKB (0 for the static index of a call without a mask); the dense rows (rows
    allowing every key, moved out of their query block into dense-row tiles): ``dense`` int64
    [slices, nQB] (per query block, bit r: row r moved), ``drows`` int32 [slices, nQB * 64]
    (their row ids, ascending; the first ``dcount`` valid) and ``dcount`` int32 [slices]."""
    states: Any
    blocks: Any
    order: Any
    counts: Any
    keys: Any
    bits: Any
    dense: Any
    drows: Any
    dcount: Any


def _cols_row(plan: AttentionPlan) -> int:
    """64-bit words of a query block's row of the index pass's ``cols`` scratch (the template's
    ``cols_row``): its column masks, per index CTA two sums (over all rows, and over the rows
    less the CTA's dense-row candidates), those cut decisions' states (bytes, rounded up to 16)
    and staged gathered keys (a row mask and an int32 id per slot, KPC * GATHER_MAX per CTA)."""
    gx, stage = plan.index_grid()[0], plan.kpc * GATHER_MAX
    return plan.n_kb * plan.bn + 2 * gx + 2 * -(-plan.n_kb // 16) + gx * stage * 3 // 2


@cache.lru("attention.index_layout")
def _index_layout(plan: AttentionPlan) -> tuple[tuple[tuple[str, tuple, str, int], ...], int]:
    """(field, shape, torch dtype name, byte offset) of each BlockIndex array (gathered lists of
    ``gather_cap`` slots), then the index pass's scratch (``cols``: per (slice, query block) a
    ``_cols_row``, an even count so rows stay 16-byte aligned; ``work``: per query block its
    visited blocks + gathered tiles), in one buffer, each at a 16-byte boundary (the gathered
    row masks load with cp.async); and its size. Cached: every call of a shape reads it."""
    s, nq, nk, cap = plan.slices, plan.n_qb, plan.n_kb, plan.gather_cap
    fields = [("states", (s, nq, nk), "uint8", 1), ("blocks", (s, nq, nk), "uint8", 1),
              ("order", (s, nq), "int32", 4), ("counts", (s, nq), "int32", 4),
              ("keys", (s, nq, cap), "int32", 4), ("bits", (s, nq, cap), "int64", 8),
              ("dense", (s, nq), "int64", 8), ("drows", (s, nq * plan.bm), "int32", 4),
              ("dcount", (s,), "int32", 4),
              ("cols", (s, nq, _cols_row(plan)), "int64", 8),
              ("work", (s, nq), "int32", 4)]
    out, off = [], 0
    for name, shape, dtype, size in fields:
        out.append((name, shape, dtype, off))
        off += -(-math.prod(shape) * size // 16) * 16
    return tuple(out), off


def _index_view(buf: Any, shape: tuple, dtype: str, off: int) -> Any:
    """One array of the index buffer (an ``_index_layout`` entry's shape, dtype, offset)."""
    import torch
    dt = getattr(torch, dtype)
    return buf[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape)


def _index_views(plan: AttentionPlan, buf: Any) -> BlockIndex:
    """The BlockIndex arrays as views of one uint8 buffer of ``_index_layout``'s size (the
    scratch stays in the buffer, alive with the views)."""
    return BlockIndex(**{name: _index_view(buf, shape, dtype, off)
                         for name, shape, dtype, off in _index_layout(plan)[0]
                         if name in BlockIndex._fields})


#: device index -> runtime.stream_counters cache of the index pass's row counts and done
#: counters (the pass zeroes them again after use)
_COUNTERS = cache.memo("attention.counters")


def _vector_mask(plan: AttentionPlan, mask: Any) -> bool:
    """Whether the kernels may read the mask 16 bytes at a time (rows and base 16-byte aligned);
    else their byte-by-byte variants run."""
    return mask is not None and plan.sk % 16 == 0 and mask.data_ptr() % 16 == 0


def causal_states(sq: int, sk: int, bm: int = BM, bn: int = BN) -> np.ndarray:
    """The state map (uint8 [1, nQB, nKB]) of the causal mask (key j allowed for query i when
    j <= i), from block positions: FULL when every in-range element is below the diagonal,
    EMPTY when none is, else PARTIAL (``block_index_reference`` of the materialised mask)."""
    r0 = np.arange(0, sq, bm)[:, None]
    r1 = np.minimum(r0 + bm, sq) - 1
    c0 = np.arange(0, sk, bn)[None, :]
    c1 = np.minimum(c0 + bn, sk) - 1
    return np.where(c0 > r1, EMPTY, np.where(c1 <= r0, FULL, PARTIAL)).astype(np.uint8)[None]


#: (Sq, Sk, causal, device index) -> (BlockIndex, its buffer) of a call without a mask (dense:
#: every block FULL; causal: causal_states), built on the host once per shape
_STATIC = cache.memo("attention.static_index")


def _saved_size(plan: AttentionPlan) -> int:
    """Bytes of the index the backward walks: the index buffer's arrays (``_index_layout``)
    before its scratch, the buffer a differentiable forward saves."""
    return next(off for name, _, _, off in _index_layout(plan)[0]
                if name == "cols")


def _static(plan: AttentionPlan, causal: bool, device: Any) -> tuple[BlockIndex, Any]:
    """The index of a mask-free call and the buffer (``_saved_size``) its arrays view; the
    kernels then read no mask (a null mask with a PARTIAL block is the causal element test)."""
    import torch

    key = (plan.sq, plan.sk, causal, device.index)
    hit = _STATIC.get(key)
    if hit is None:
        states = (causal_states(plan.sq, plan.sk) if causal
                  else np.full((1, plan.n_qb, plan.n_kb), FULL, np.uint8))
        # longest rows first, ties in block order (exact counts: the GPU's order bins them)
        order = np.argsort(-(states != EMPTY).sum(-1), axis=-1, kind="stable").astype(np.int32)
        buf = torch.zeros(_saved_size(plan), dtype=torch.uint8, device=device)
        idx = _index_views(plan, buf)   # nothing gathered, no dense rows: zeros
        for name, x in (("states", states), ("blocks", states), ("order", order)):
            getattr(idx, name).copy_(torch.from_numpy(x))
        hit = _STATIC[key] = (idx, buf)
    return hit


def _pack_index(plan: AttentionPlan, index: BlockIndex) -> Any:
    """A given index's arrays copied into one buffer as a differentiable forward saves it
    (``_saved_size``)."""
    import torch
    buf = torch.empty(_saved_size(plan), dtype=torch.uint8, device=index.states.device)
    for dst, src in zip(_index_views(plan, buf), index):
        dst.copy_(src)
    return buf


def _index_buffer(plan: AttentionPlan, device: Any) -> Any:
    """A fresh buffer of the index pass (``_index_layout``: the arrays, then its scratch)."""
    import torch
    return torch.empty(_index_layout(plan)[1], dtype=torch.uint8, device=device)


def _index(kernels: Any, plan: AttentionPlan, mask: Any, launch: Any,
           buf: Any = None) -> BlockIndex:
    """Enqueue the index kernel on ``launch``'s stream; returns the index it fills (views of
    ``buf``, an ``_index_buffer``, or of a fresh one)."""
    if mask is None:
        raise PlanError("the index of a call without a mask is not built on the GPU")
    buf = _index_buffer(plan, mask.device) if buf is None else buf
    counters = _counters(plan, _COUNTERS.setdefault(mask.device.index, {}), launch.stream,
                         mask.device)
    vec = _vector_mask(plan, mask)
    kernels.launch("pit_attn_index_vec" if vec else "pit_attn_index_byte", plan.index_grid(),
                   (INDEX_THREADS, 1, 1), launch.stream,
                   *_index_args(plan, mask.data_ptr(), counters.data_ptr(),
                                _arrays(buf.data_ptr(), _array_offsets(plan))))
    return _index_views(plan, buf)


def _layout_index(kernels: Any, plan: AttentionPlan, layout: Any, block: tuple[int, int],
                  launch: Any, buf: Any = None) -> BlockIndex:
    """Enqueue the index kernel of a block layout (``_check``'s uint8 bytes, [..., nQL, nKL]) on
    ``launch``'s stream: one CTA per slice reads the layout, not a mask; returns the index it
    fills (every block FULL or EMPTY, nothing gathered, no dense rows; views of ``buf`` as
    ``_index``'s)."""
    buf = _index_buffer(plan, layout.device) if buf is None else buf
    kernels.launch("pit_attn_layout_index", (plan.slices, 1, 1), (INDEX_THREADS, 1, 1),
                   launch.stream, layout.data_ptr(),
                   *_layout_args(plan, _layout_blocks(plan, layout, block),
                                 _arrays(buf.data_ptr(), _array_offsets(plan))))
    return _index_views(plan, buf)


#: the index buffer's arrays in the index kernels' argument order
INDEX_ARRAYS = ("states", "blocks", "order", "counts", "keys", "bits", "dense", "drows",
                "dcount", "cols", "work")
#: positions in INDEX_ARRAYS of the arrays the layout index writes, in its argument order
#: (finish_slice's done counter, which it leaves zero: a word of the unused cols scratch)
LAYOUT_ARRAYS = tuple(INDEX_ARRAYS.index(n) for n in ("states", "blocks", "order", "counts",
                                                      "dense", "drows", "dcount", "work",
                                                      "cols"))


def _layout_blocks(plan: AttentionPlan, layout: Any,
                   block: tuple[int, int]) -> tuple[int, int, int, int]:
    """(nQL, nKL, query blocks per layout row, key blocks per layout column) of a layout."""
    n_ql, n_kl = layout.shape[-2:]
    return n_ql, n_kl, block[0] // plan.bm, block[1] // plan.bn


def _layout_args(plan: AttentionPlan, blocks: tuple[int, int, int, int],
                 arrays: list[int]) -> tuple:
    """The layout index kernel's arguments after the layout: its ``_layout_blocks``, nKB,
    the buffer's arrays (``_arrays``) it writes, nQB."""
    return (*blocks, plan.n_kb, *(arrays[i] for i in LAYOUT_ARRAYS), plan.n_qb)


def _array_offsets(plan: AttentionPlan) -> tuple[int, ...]:
    """Byte offset of each of INDEX_ARRAYS in the index buffer (``_index_layout``)."""
    offsets = {name: off for name, _, _, off in _index_layout(plan)[0]}
    return tuple(offsets[n] for n in INDEX_ARRAYS)


def _arrays(base: int, offsets: tuple[int, ...]) -> list[int]:
    """Addresses of INDEX_ARRAYS in the index buffer at ``base``."""
    return [base + off for off in offsets]


def _counter_words(plan: AttentionPlan) -> int:
    """int32 words of the index pass's counters (``_counters``), the fused forward's after them."""
    return plan.slices * (6 * plan.n_qb + 1)


def _counters(plan: AttentionPlan, by_stream: dict, stream: int, device: Any) -> Any:
    """The index pass's counters on ``stream`` (zero between launches): per (slice, query
    block) two 64-bit masks (the rows that miss some key; the rows some index CTA saw allowing
    all of its keys), then per (slice, query block) a 64-bit done counter (its arrivals and
    what they carry) and per slice an int32 one; for a fused plan then the one-launch forward's
    ticket, finish and index-done counters. The caller holds the tensor until its launch is
    enqueued (a captured call's are fresh: runtime.stream_counters)."""
    return stream_counters(by_stream, stream, _counter_words(plan) + 3 * plan.fused, device)


#: device index -> runtime.stream_counters cache of the dense-row tiles' merge counters (the
#: merging part zeroes its tile's again)
_MERGE = cache.memo("attention.merge_counters")


def _dense_args(plan: AttentionPlan, mask: Any, stream: int, device: Any) -> tuple[tuple, Any]:
    """The attention kernel's dense-row tile arguments (nQB, parts per tile, tiles per slice,
    workspace, merge counters) and the tensors behind them (kept alive by the caller until the
    launch is enqueued); a call without a mask has no dense rows: null pointers."""
    import torch
    if mask is None:
        return (plan.n_qb, plan.dense_split, plan.dense_tiles, 0, 0), None
    ws = torch.empty(plan.dense_workspace, dtype=torch.float32, device=device)
    merge = stream_counters(_MERGE.setdefault(device.index, {}), stream,
                            plan.batch * plan.heads * plan.dense_tiles, device)
    return ((plan.n_qb, plan.dense_split, plan.dense_tiles, ws.data_ptr(), merge.data_ptr()),
            (ws, merge))


def _index_args(plan: AttentionPlan, mask: int, counters: int, arrays: list[int]) -> tuple:
    """The index kernels' arguments: the mask, sizes, the buffer's arrays (``_arrays``), the
    counters (``_counters``' layout) and the gathered capacity."""
    qdone = counters + 16 * plan.slices * plan.n_qb
    return (mask, plan.sq, plan.sk, plan.n_kb, *arrays, counters, qdone,
            qdone + 8 * plan.slices * plan.n_qb, plan.gather_cap)


@on_operand_device
def block_index(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                block_mask: Tensor | None = None,
                block_size: int | tuple[int, int] = BLOCK_SIZE) -> BlockIndex:
    """The block index that ``sparse_attention`` builds, on the GPU, no host sync: the state map
    (as ``block_index_reference``; slices = the mask's leading dims, flattened) and the
    query-block order and the gathered keys (as ``key_index_reference``; the keys of a query
    block are a set: their order in the list varies between calls). Of a ``block_mask`` (as
    ``sparse_attention`` takes it): the state map of the mask it stands for (FULL or EMPTY) and
    its order; nothing gathered."""
    if (mask is None) == (block_mask is None):
        raise ShapeError("block_index needs a mask or a block_mask (one of them)")
    block = () if block_mask is None else _block_size(block_size)
    plan, m = _check(q, k, v, mask if block_mask is None else block_mask, block)
    with TorchLaunch() as launch:
        kernels = ATTENTION.module(plan)
        return (_layout_index(kernels, plan, m, block, launch) if block
                else _index(kernels, plan, m, launch))


def _given_index(plan: AttentionPlan, index: Any, device: Any) -> BlockIndex:
    """Check an index passed to sparse_attention (shapes, dtypes, device; its contents are
    never trusted by the kernel: ids and counts are range-checked before any address)."""
    import torch
    layout, _ = _index_layout(plan)
    want = {name: (shape, getattr(torch, dtype)) for name, shape, dtype, _ in layout
            if name in BlockIndex._fields}
    if not isinstance(index, BlockIndex):
        raise ShapeError(f"index must be the BlockIndex ({', '.join(BlockIndex._fields)}) from "
                         f"block_index, got {type(index).__name__}")
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


def _ptr(mask: Any) -> int:
    """The mask's address for the kernels; 0 (no mask: the index decides, and a PARTIAL block
    tests the causal condition) for None."""
    return 0 if mask is None else mask.data_ptr()


def _scale(plan: AttentionPlan, scale: float | None) -> float:
    scale = 1.0 / math.sqrt(plan.d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ShapeError(f"scale must be finite, got {scale}")
    return scale


def _forward(plan: AttentionPlan, q: Any, k: Any, v: Any, mask: Any, scale: float,
             index: BlockIndex | None, want_lse: bool, causal: bool = False,
             block: tuple[int, ...] = (), buf: Any = None) -> tuple[Any, Any, BlockIndex]:
    """(out, lse or None, the index used): the index pass (unless given, or static where
    ``mask`` is None: dense, or ``causal``; with ``block``, of the block layout ``mask``; into
    ``buf``, an ``_index_buffer``, where given) and the attention kernel, enqueued on torch's
    stream; ``mask`` as ``_check`` returns it."""
    import torch

    out = torch.empty_like(q)
    lse = (torch.empty((plan.batch, plan.heads, plan.sq), dtype=torch.float32, device=q.device)
           if want_lse else None)
    if out.numel() == 0 or plan.sk == 0:   # nothing to attend: zeros, lse -inf
        if lse is not None:
            lse.fill_(-math.inf)
        empty = index or _index_views(plan, torch.zeros(_index_layout(plan)[1],
                                                        dtype=torch.uint8, device=q.device))
        return out.zero_(), lse, empty
    kernels = ATTENTION.module(plan)
    with TorchLaunch() as launch:
        if mask is None:
            idx = _static(plan, causal, q.device)[0]
        elif index is not None:
            idx = _given_index(plan, index, q.device)
        else:
            idx = (_layout_index(kernels, plan, mask, block, launch, buf) if block
                   else _index(kernels, plan, mask, launch, buf))
        mask = None if block else mask   # a layout's blocks are FULL: the kernel reads no mask
        sb, sh = plan.mask_strides
        name = plan.forward_kernel(_vector_mask(plan, mask))
        dense, _keep = _dense_args(plan, mask, launch.stream, q.device)
        kernels.launch(name, plan.forward_grid(), (plan.warps * 32, 1, 1),
                       launch.stream, *plan.kv_maps(k, v), q.data_ptr(), k.data_ptr(),
                       v.data_ptr(), out.data_ptr(),
                       0 if lse is None else lse.data_ptr(), _ptr(mask),
                       idx.states.data_ptr(), idx.order.data_ptr(), plan.sq, plan.sk, plan.heads,
                       plan.group, sb, sh, plan.n_kb, scale * LOG2E,
                       idx.counts.data_ptr(), idx.keys.data_ptr(), idx.bits.data_ptr(),
                       idx.keys.shape[-1], idx.dense.data_ptr(), idx.drows.data_ptr(),
                       idx.dcount.data_ptr(), *dense, smem=plan.smem, early=plan.wgmma)
    return out, lse, idx


#: device index -> runtime.stream_counters cache of the backward's gathered-key sums (the dK/dV
#: kernel zeroes what the dQ kernel added)
_GATHERED = cache.memo("attention.gathered_sums")


def _backward(plan: AttentionPlan, dout: Any, q: Any, k: Any, v: Any, mask: Any, out: Any,
              lse: Any, saved: Any, scale: float, dlse: Any = None) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) over the forward's index (``saved``: its buffer, ``_saved_size`` bytes), as
    the forward ran it: the dQ kernel over the query blocks in the forward's order walks their
    FULL and PARTIAL blocks, then their gathered key tiles, whose keys' dK and dV it adds by
    float32 atomics to per-key sums; its first CTAs are the dense-row tiles' parts (dQ of the
    rows that allow every key, over split key ranges, summed in order by the tile's last part).
    The dK/dV kernel over key blocks (most non-empty FULL/PARTIAL blocks over all slices first,
    the order a one-CTA kernel lists) walks the column of the state map, then the slice's
    dense-row tiles, and adds the gathered sums where its key block has any. delta =
    rowsum(dO * O) - dlse comes from the dQ kernel. No host sync; the only atomics are the
    gathered keys' (so their dK, dV sums are not bit-for-bit repeatable). ``mask`` as the
    kernels read it (None: a call without one, or a block layout's)."""
    import torch

    if q.numel() == 0 or k.numel() == 0:
        plan.check_backward()
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    key = (plan, mask is not None, _vector_mask(plan, mask))
    kernels = validated(_BACKWARDS, key, lambda: _Backward(plan, *key[1:]))
    return kernels(dout, q, k, v, _ptr(mask), out, lse, saved, scale, dlse)


class _Backward:
    """The backward's three kernels for one plan, bound once (as ``_EagerForward`` binds the
    forward's): the key-block order, dQ and dK/dV with their grids and shared memory, the index
    arrays' offsets in the saved buffer and the scratch's layout (delta, the order, the dense
    tiles' workspace), so that a call allocates the three gradients and makes three launches."""

    __slots__ = ("plan", "masked", "order", "dq", "dkv", "offsets", "kv_at", "ws_at", "size",
                 "consts")

    def __init__(self, plan: AttentionPlan, masked: bool, vec: bool) -> None:
        plan.check_backward()
        kernels = ATTENTION_BWD.module(plan.backward_context())
        suffix, threads = "_vec" if vec else "", (plan.warps * 32, 1, 1)
        #: with a mask the index may have moved rows to dense-row tiles and gathered keys
        self.plan, self.masked = plan, masked
        self.order = kernels.bind("pit_attn_bwd_order", (1, 1, 1), (ORDER_THREADS, 1, 1),
                                  4 * plan.n_kb)
        self.dq = kernels.bind("pit_attn_bwd_dq" + suffix, plan.dq_grid(masked), threads,
                               plan.smem_dq)
        self.dkv = kernels.bind("pit_attn_bwd_dkv" + suffix, plan.dkv_grid(), threads,
                                plan.smem_dkv)
        at = dict(zip(INDEX_ARRAYS, _array_offsets(plan)))
        #: the index arrays the kernels read, in their argument order
        self.offsets = tuple(at[n] for n in ("states", "order", "counts", "keys", "bits",
                                             "dense", "drows", "dcount"))
        delta = 4 * plan.batch * plan.heads * plan.sq
        self.kv_at = -(-delta // 256) * 256
        self.ws_at = self.kv_at + -(-4 * plan.n_kb // 256) * 256
        self.size = self.ws_at + (4 * plan.dense_workspace if masked else 0)
        sb, sh = plan.mask_strides
        self.consts = (plan.sq, plan.sk, plan.heads, plan.group, sb, sh)

    def __call__(self, dout: Any, q: Any, k: Any, v: Any, mask: int, out: Any, lse: Any,
                 saved: Any, scale: float, dlse: Any) -> tuple[Any, Any, Any]:
        """(dq, dk, dv), enqueued on torch's stream (``mask``: the mask's address or 0)."""
        import torch
        plan = self.plan
        dout, out = dout.contiguous(), out.contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        base = saved.data_ptr()
        states, order, counts, keys, bits, dense, drows, dcount = (base + o for o in self.offsets)
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr())
        with TorchLaunch() as launch:
            s, device = launch.stream, q.device
            buf, lock = kept_scratch(s, self.size, device)
            delta = buf.data_ptr()
            kv_order, ws = delta + self.kv_at, delta + self.ws_at
            if self.masked:
                held = (stream_counters(_MERGE.setdefault(device.index, {}), s,
                                        plan.batch * plan.heads * plan.dense_tiles, device),
                        stream_counters(_GATHERED.setdefault(device.index, {}), s,
                                        plan.gathered_workspace, device))
                merge, sums = held[0].data_ptr(), held[1].data_ptr()
                rows = plan.batch * plan.kv_heads * plan.sk * plan.d
                gathered, dtiles = (sums, sums + 4 * rows, sums + 8 * rows), plan.dense_tiles
            else:
                ws, merge, gathered, dtiles = 0, 0, (0, 0, 0), 0
            with lock or nullcontext():
                self.order(s, states, plan.slices * plan.n_qb, plan.n_kb, kv_order)
                self.dq(s, *args, out.data_ptr(), 0 if dlse is None else dlse.data_ptr(), delta,
                        dq.data_ptr(), mask, states, order, *self.consts, plan.n_kb,
                        scale * LOG2E, scale, counts, keys, bits, plan.gather_cap, dense, drows,
                        dcount, plan.n_qb, plan.dense_split, dtiles, ws, merge, *gathered)
                self.dkv(s, *args, delta, dk.data_ptr(), dv.data_ptr(), mask, states, kv_order,
                         *self.consts, plan.n_qb, plan.n_kb, scale * LOG2E, scale, dense, drows,
                         dcount, dtiles, *gathered)
        return dq, dk, dv


#: (plan, with a mask, vector mask reads) -> its _Backward
_BACKWARDS = cache.memo("attention.backwards")


# -- autograd: torch.library custom ops, registered on first use ---------------------------------

#: the registered ops: process state, not a cache (pitgen.cache.clear() must not drop them: the
#: next call would register them again, under torch.compile a graph break in the trace)
_OPS: dict[str, Any] = {}


def _ops() -> Any:
    """The ``pitgen::sparse_attention`` op (forward: out, lse, and for the backward the index
    as one buffer, ``_saved_size`` bytes; a given index comes as its arrays) with its fake and
    autograd (``pitgen::sparse_attention_backward``), registered once per process on first use
    so that importing pitgen needs no torch."""
    hit = _OPS.get("forward")
    if hit is not None:
        return hit
    import torch
    from torch import Tensor

    def fake_plan(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                  block: list[int]) -> AttentionPlan:
        b, h, hkv, sq, sk, d = check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
        shape = (sq, sk) if mask is None else tuple(_mask_shape(mask))
        if block and mask is not None:
            shape = _layout_shape(shape, b, h, sq, sk, tuple(block))
        return plan_attention(b, h, sq, sk, d, str(q.dtype).replace("torch.", ""), shape, hkv)

    # Short schemas: torch's custom-op dispatch costs grow with the argument count (its
    # fill_defaults walks the schema per argument), so the index travels as one list.
    @torch.library.custom_op(
        "pitgen::sparse_attention", mutates_args=(),
        schema="(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, Tensor[]? index, "
               "bool is_causal, int[] block) -> (Tensor, Tensor, Tensor)")
    @on_operand_device
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                index: list[Tensor] | None, is_causal: bool,
                block: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        return _saving_forward(q, k, v, mask, scale, index, is_causal, tuple(block))

    @forward.register_fake
    def _(q, k, v, mask, scale, index, is_causal, block):
        p = fake_plan(q, k, v, mask, block)
        return (torch.empty_like(q), q.new_empty((p.batch, p.heads, p.sq), dtype=torch.float32),
                q.new_empty((_saved_size(p),), dtype=torch.uint8))

    @torch.library.custom_op(
        "pitgen::sparse_attention_backward", mutates_args=(),
        schema="(Tensor dout, Tensor[] saved, Tensor? mask, float scale, Tensor? dlse, "
               "int[] block) -> (Tensor, Tensor, Tensor)")
    @on_operand_device
    def backward(dout: Tensor, saved: list[Tensor], mask: Tensor | None, scale: float,
                 dlse: Tensor | None, block: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """saved: q, k, v, out, lse, and the forward's index buffer."""
        q, k, v, out, lse, index = saved
        plan, m = _check(q, k, v, mask, tuple(block))
        return _backward(plan, dout, q, k, v, None if block else m, out, lse, index, scale, dlse)

    @backward.register_fake
    def _(dout, saved, mask, scale, dlse, block):
        q, k, v = saved[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, mask, scale = inputs[:5]
        out, lse, index = output
        ctx.save_for_backward(q, k, v, mask, out, lse, index)
        ctx.scale, ctx.block = scale, inputs[7]
        # outputs without a gradient (lse, the index arrays) come as None, not as zero
        # tensors: materialising them was three allocations and fills per backward
        ctx.set_materialize_grads(False)
        ctx.index = None if inputs[5] is None else len(inputs[5])   # a list: a list of Nones

    def grad(ctx: Any, dout: Tensor, dlse: Tensor | None, _i: Any) -> tuple:
        q, k, v, mask, out, lse, index = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(dout, [q, k, v, out, lse, index], mask, ctx.scale, dlse, ctx.block)
        index = None if ctx.index is None else [None] * ctx.index
        block = [None] * len(ctx.block)   # an int[] input's gradient: its structure, Nones
        return dq, dk, dv, None, None, index, None, block   # mask, scale, index, causal, block

    forward.register_autograd(grad, setup_context=setup_context)
    _OPS["forward"] = forward
    return forward


def _saving_forward(q: Any, k: Any, v: Any, mask: Any, scale: float, index: Any,
                    is_causal: bool, block: tuple[int, ...] = ()) -> tuple[Any, Any, Any]:
    """The forward that autograd records: (out, lse, the index buffer the backward walks,
    ``_saved_size`` bytes, aliasing neither a cached index nor the inputs) (the custom op's
    body, and the eager autograd function's); ``mask`` a block layout with ``block``."""
    if index is None:
        fast = _eager(q, k, v, mask, is_causal, True, block=block)
        if fast is not None:
            return fast(q, k, v, mask, scale, with_index=True)
    plan, m = _check(q, k, v, mask, block)
    given = None if index is None else BlockIndex(*index)
    buf = None if m is None or given is not None else _index_buffer(plan, q.device)
    out, lse, _ = _forward(plan, q, k, v, m, scale, given, True, is_causal, block, buf)
    if m is None:   # the cached static index: a copy
        return out, lse, _static(plan, is_causal, q.device)[1].clone()
    if given is not None:   # the caller's arrays: packed into a buffer of their own
        return out, lse, _pack_index(plan, given)
    return out, lse, buf[:_saved_size(plan)]


@functools.cache
def _eager_function() -> type:
    """``sparse_attention`` with autograd for eager calls: a ``torch.autograd.Function`` over
    the custom op's forward and backward bodies. The custom op (``_ops``) is what torch.compile
    and torch.export see; eagerly its dispatch (two Python dispatch chains per op, the
    forward's and the backward's) cost about a millisecond of host time per training step
    against 0.19 ms of GPU work on the 128-block mask (H200)."""
    import torch

    class SparseAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, mask: Any, scale: float | None,
                    index: Any, is_causal: bool, block: tuple[int, ...],
                    fast: _EagerForward | None) -> tuple[Any, Any]:
            # fast: this call signature's cached forward (built with lse), which reads the
            # mask in place, so the backward needs no checks either
            if fast is not None:
                out, lse, saved = fast(q, k, v, mask, scale, with_index=True)
                scale = fast.default_scale if scale is None else _scale(fast.plan, scale)
            else:
                out, lse, saved = _saving_forward(q, k, v, mask, scale, index, is_causal, block)
            ctx.save_for_backward(q, k, v, mask, out, lse, saved)
            ctx.scale, ctx.block, ctx.fast = scale, block, fast
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> tuple:
            q, k, v, mask, out, lse, saved = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            if ctx.fast is not None:
                plan, m = ctx.fast.plan, mask
            else:
                plan, m = _check(q, k, v, mask, ctx.block)
            dq, dk, dv = _backward(plan, dout, q, k, v, None if ctx.block else m, out, lse,
                                   saved, ctx.scale, dlse)
            return dq, dk, dv, None, None, None, None, None, None

    return SparseAttentionFunction


class _EagerForward:
    """The forward of one call signature (``raw_key`` of q, k, v and mask, is_causal,
    return_lse) with everything but the data decided once: plan, kernels bound to their grids
    and shared memory, the mask read in place, the static index of a mask-free call, every
    argument that is not an address, and the index buffer's layout with the dense-row
    workspace behind it. A steady-state eager call without autograd allocates out (and lse),
    takes that buffer from the stream's kept scratch when it is small (runtime.kept_scratch;
    fresh for autograd) and makes two driver launches (one without a mask): issue 16's
    host-time budget. The index pass's and the merge's counters are this forward's own, per
    stream (zero between launches; fresh while the stream captures a graph)."""

    __slots__ = ("plan", "lse_shape", "static", "static_ptrs", "index", "attend", "size",
                 "arrays", "saved", "index_counters", "merge_counters", "sizes", "dense", "ws",
                 "default_scale", "device", "fused", "grids", "launches", "layout")

    def __init__(self, plan: AttentionPlan, mask: Any, causal: bool, want_lse: bool,
                 device: Any, block: tuple[int, ...] = ()) -> None:
        #: a block layout's ``_layout_blocks`` (``block``: ``mask`` is a layout; its kernel
        #: reads no mask), else None
        self.layout = _layout_blocks(plan, mask, block) if block else None
        vec = _vector_mask(plan, None if block else mask)
        grid = (None if mask is None else plan.fused_layout_grid() if block
                else plan.fused_grid())
        #: the one-launch forward of a small problem with a mask or layout
        #: (pit_attention_fused*, in a module of its own), or None: the index pass and the
        #: attention kernel
        self.fused = self.index = self.attend = None
        if grid is not None:
            plan = replace(plan, fused=True)
            name = ("pit_attention_fused_layout" if block else
                    "pit_attention_fused_vec" if vec else "pit_attention_fused")
            self.fused = ATTENTION.module(plan).bind(name, grid, (INDEX_THREADS, 1, 1),
                                                     plan.smem)
        else:
            kernels = ATTENTION.module(plan)
            self.index = (None if mask is None else
                          kernels.bind("pit_attn_layout_index", (plan.slices, 1, 1),
                                       (INDEX_THREADS, 1, 1)) if block else
                          kernels.bind("pit_attn_index_vec" if vec else "pit_attn_index_byte",
                                       plan.index_grid(), (INDEX_THREADS, 1, 1)))
            self.attend = kernels.bind(plan.forward_kernel(vec),
                                       plan.forward_grid(), (plan.warps * 32, 1, 1), plan.smem,
                                       early=plan.wgmma)
        #: the index grid's extents and the forward grid's width (the fused kernel's arguments)
        self.grids = (*plan.index_grid(), plan.forward_grid()[0])
        self.plan, self.device = plan, device
        self.lse_shape = (plan.batch, plan.heads, plan.sq) if want_lse else None
        #: the static index of a call without a mask and its buffer (``_static``)
        self.static = None if mask is not None else _static(plan, causal, device)
        #: the attention kernel's index addresses of a call without a mask (the static index)
        self.static_ptrs = None if mask is not None else tuple(
            getattr(self.static[0], n).data_ptr() for n in ("states", "order", "counts", "keys",
                                                         "bits", "dense", "drows", "dcount"))
        #: the index buffer (_index_layout), then the dense rows' float32 workspace (a call
        #: with a mask); the arrays' offsets in the index kernel's argument order
        index_bytes = _index_layout(plan)[1]
        self.arrays = _array_offsets(plan)
        self.ws = -(-index_bytes // 256) * 256
        self.size = self.ws + 4 * plan.dense_workspace
        #: bytes of the index buffer the custom op returns for the backward
        self.saved = _saved_size(plan)
        #: stream handle -> this forward's index and merge counters there (stream_counters)
        self.index_counters: dict[int, Any] = {}
        self.merge_counters: dict[int, Any] = {}
        sb, sh = plan.mask_strides
        self.sizes = (plan.sq, plan.sk, plan.heads, plan.group, sb, sh, plan.n_kb)
        self.dense = (plan.n_qb, plan.dense_split, plan.dense_tiles)
        self.default_scale = 1.0 / math.sqrt(plan.d)
        #: stream handle -> (kept buffer's address, counters, the fused launch's arguments
        #: between the mask and q, and after the scale): what an eager fused call reuses while
        #: the stream's kept buffer stays at that address (_fused_args)
        self.launches: dict[int, tuple] = {}

    def _fused_args(self, base: int, counters: tuple[Any, Any]) -> tuple:
        """The ``launches`` entry of a stream over its kept buffer at ``base`` and its
        counters (``_counters``; the arguments depend on these addresses alone: a buffer the
        stream keeps later at the same address, of the same size or larger, takes them as they
        are)."""
        plan = self.plan
        c, merge = counters[0].data_ptr(), counters[1].data_ptr()
        arrays = _arrays(base, self.arrays)
        sync = c + 4 * _counter_words(plan)
        if self.layout is not None:   # pit_attention_fused_layout's: the layout's index arrays
            a = dict(zip(INDEX_ARRAYS, arrays))
            mid = (*self.layout, plan.sq, plan.sk, plan.n_kb,
                   *(a[n] for n in ("states", "blocks", "order", "counts", "keys", "bits",
                                    "dense", "drows", "dcount", "work", "cols")),
                   plan.gather_cap, sync, plan.slices, self.grids[-1], plan.n_qb)
        else:
            mid = (*_index_args(plan, 0, c, arrays)[1:], sync, *self.grids)
        return base, counters, mid, (*self.dense[1:], base + self.ws, merge)

    @staticmethod
    def eligible(plan: AttentionPlan, q: Any, mask: Any, index: Any) -> bool:
        """Calls the closure runs as the general path would: a non-empty problem whose mask (if
        any) the kernels read in place (contiguous bool/uint8 without stride-0 dims)."""
        return (index is None and q.numel() > 0 and plan.sk > 0
                and (mask is None or (mask.is_contiguous()
                                      and _mask_shape(mask) == tuple(mask.shape))))

    def _counters(self, stream: int) -> tuple[Any, Any]:
        """This forward's index counters (``_counters``' layout) and merge counters on
        ``stream`` (runtime.stream_counters; held by the call until its launches are enqueued)."""
        plan = self.plan
        return (_counters(plan, self.index_counters, stream, self.device),
                stream_counters(self.merge_counters, stream,
                                plan.batch * plan.heads * plan.dense_tiles, self.device))

    def __call__(self, q: Any, k: Any, v: Any, mask: Any, scale: float | None,
                 with_index: bool = False) -> Any:
        """out, or (out, lse) when built with want_lse; with_index (the custom op's forward,
        want_lse): (out, lse, the index buffer the backward walks), aliasing no cached index."""
        import torch
        plan = self.plan
        scale = self.default_scale if scale is None else _scale(plan, scale)
        out = torch.empty_like(q)
        lse = None if self.lse_shape is None else torch.empty(
            self.lse_shape, dtype=torch.float32, device=q.device)
        if self.fused is not None and not with_index and self.size <= KEPT_SCRATCH:
            with TorchLaunch() as launch:   # the steady state: one launch, arguments reused
                s = launch.stream
                if not capturing():
                    buf, lock = kept_buffer(s, self.size, q.device)
                    entry = self.launches.get(s)
                    if entry is None or entry[0] != buf.data_ptr():
                        entry = self.launches[s] = self._fused_args(buf.data_ptr(),
                                                                    self._counters(s))
                    with lock:
                        self.fused(s, mask.data_ptr(), *entry[2], q.data_ptr(), k.data_ptr(),
                                   v.data_ptr(), out.data_ptr(),
                                   0 if lse is None else lse.data_ptr(), *self.sizes[2:6],
                                   scale * LOG2E, *entry[3])
                    return (out, lse) if lse is not None else out
        with TorchLaunch() as launch:
            s, lock = launch.stream, None
            if mask is None:
                states, order, counts, keys, bits, dense, drows, dcount = self.static_ptrs
                mptr = cap = ws = merge = 0
            else:
                held = self._counters(s)
                counters, merge = held[0].data_ptr(), held[1].data_ptr()
                if with_index:   # views of it are returned
                    buf = torch.empty(self.size, dtype=torch.uint8, device=q.device)
                else:
                    buf, lock = kept_scratch(s, self.size, q.device)
                base = buf.data_ptr()
                arrays = _arrays(base, self.arrays)
                states, _, order, counts, keys, bits, dense, drows, dcount = arrays[:9]
                mptr, cap, ws = mask.data_ptr(), plan.gather_cap, base + self.ws
            with lock or nullcontext():
                if self.fused is not None:   # one launch (a mask or layout, a small problem)
                    _, _, mid, tail = self._fused_args(base, held)
                    self.fused(s, mptr, *mid, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                               out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                               *self.sizes[2:6], scale * LOG2E, *tail)
                else:
                    if self.layout is not None:   # the layout's index; the forward reads no mask
                        self.index(s, mptr, *_layout_args(plan, self.layout, arrays))
                        mptr = 0
                    elif mask is not None:
                        self.index(s, *_index_args(plan, mptr, counters, arrays))
                    self.attend(s, *self.plan.kv_maps(k, v), q.data_ptr(), k.data_ptr(),
                                v.data_ptr(), out.data_ptr(),
                                0 if lse is None else lse.data_ptr(), mptr, states, order,
                                *self.sizes, scale * LOG2E, counts, keys, bits, cap,
                                dense, drows, dcount, *self.dense, ws, merge)
        if with_index:
            if mask is None:
                return out, lse, self.static[1].clone()
            return out, lse, buf[:self.saved]
        return (out, lse) if lse is not None else out


#: (raw_key of q, k, v, mask, is_causal, return_lse, block) -> its _EagerForward
_EAGER = cache.memo("attention.eager")


def _eager(q: Any, k: Any, v: Any, mask: Any, causal: bool, want_lse: bool,
           plan: AttentionPlan | None = None, m: Any = None,
           block: tuple[int, ...] = ()) -> _EagerForward | None:
    """The cached forward of this call signature (``mask`` a block layout with ``block``),
    built (after the checks, or from the given plan and checked mask) when the call is
    eligible; None when it is not."""
    key = (raw_key(q, k, v, mask), causal, want_lse, block)
    fast = _EAGER.get(key)
    if fast is None:
        if plan is None:
            plan, m = _check(q, k, v, mask, block)
        if not _EagerForward.eligible(plan, q, mask, None):
            return None
        fast = validated(_EAGER, key,
                         lambda: _EagerForward(plan, m, causal, want_lse, q.device, block))
    return fast


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     scale: float | None = None, index: BlockIndex | None = None, *,
                     is_causal: bool = False, return_lse: bool = False,
                     block_mask: Tensor | None = None,
                     block_size: int | tuple[int, int] = BLOCK_SIZE) -> Any:
    """out[b,h,i] = sum_j softmax_j(scale * q_i . k_j over {j : mask[.., i, j]}) v_j.

    q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (SDPA's layout; Hkv divides H: grouped-query attention,
    query head h reads K/V head h // (H / Hkv)): contiguous, 16-byte aligned CUDA tensors,
    float16 or bfloat16, D in {64, 128}; mask bool or uint8 (non-zero = attend) broadcastable
    to [B, H, Sq, Sk]: [Sq, Sk], [H|1, Sq, Sk] or [B|1, H|1, Sq, Sk] (a broadcast dim, also
    one expanded with stride 0, is read once, not copied per head; a non-contiguous mask is
    copied). Without a mask every key is attended, or with ``is_causal=True`` keys j <= i
    (SDPA's convention); neither reads a mask: their index is computed once per shape. scale
    defaults to 1/sqrt(D). Rows with no set element are zeros. The index is built on the GPU
    on every call (nothing waits for the host) unless ``index`` passes the ``BlockIndex`` from
    ``block_index`` for this same mask (used to time the two stages apart; any contents stay
    in bounds, but only block_index's give the right answer).

    ``block_mask`` instead of a mask: bool or uint8 [ceil(Sq / bq), ceil(Sk / bk)] (or with
    [H|1] and [B|1] before, as a mask), (bq, bk) = ``block_size`` (an int: square; multiples of
    64, default 128, FlexAttention's), key j attended by query i where
    ``block_mask[..., i // bq, j // bk]``: the mask those blocks make, without reading one (the
    index reads nQL x nKL bytes, not Sq x Sk).

    Differentiable in q, k, v (``torch.library`` op ``pitgen::sparse_attention``): the forward
    then also saves the per-row log-sum-exp and the index, and the backward computes dQ, dK, dV
    over the same blocks. ``return_lse=True`` returns ``(out, lse)``, lse float32 [B, H, Sq]
    (natural log; -inf on rows with nothing to attend), itself differentiable."""
    import torch

    traced = tracing()   # then the op checks and plans when it runs (sympy is not traced)
    grad = traced or (torch.is_grad_enabled()
                      and any(getattr(x, "requires_grad", False) for x in (q, k, v)))
    block: tuple[int, ...] = ()
    if block_mask is not None:
        if mask is not None or is_causal:
            raise ShapeError("pass one of mask, is_causal=True and block_mask (combine them "
                             "into a mask)")
        mask, block = block_mask, _block_size(block_size)
    if index is None and not traced:   # the key holds the current device: theirs (no guard)
        fast = _EAGER.get((raw_key(q, k, v, mask), is_causal, return_lse or grad, block))
        if fast is not None:
            if not grad:
                return fast(q, k, v, mask, scale)
            out, lse = _eager_function().apply(q, k, v, mask, scale, None, is_causal, block,
                                               fast)
            return (out, lse) if return_lse else out
    return _sparse_attention(q, k, v, mask, scale, index, traced, grad, is_causal, return_lse,
                             block)


@on_operand_device
def _sparse_attention(q: Any, k: Any, v: Any, mask: Any, scale: float | None, index: Any,
                      traced: bool, grad: bool, is_causal: bool, return_lse: bool,
                      block: tuple[int, ...] = ()) -> Any:
    """``sparse_attention`` past its fast path, on the operands' device; ``mask`` the block
    layout where ``block`` is given."""
    if is_causal and mask is not None:
        raise ShapeError("pass a mask or is_causal=True, not both (combine them into the mask)")
    if traced:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    else:
        plan, m = _check(q, k, v, mask, block)
        scale = _scale(plan, scale)
        if index is not None:
            if m is None:
                raise ShapeError("index is the block index of a mask; a call without one has none")
            _given_index(plan, index, q.device)
    if grad and not traced:   # eager autograd without the custom op's dispatch
        fast = _eager(q, k, v, mask, is_causal, True, plan, m, block) if index is None else None
        out, lse = _eager_function().apply(q, k, v, mask, scale, index, is_causal, block, fast)
    elif grad:
        out, lse, _ = _ops()(q, k, v, mask, scale, None if index is None else list(index),
                              is_causal, list(block))
    else:
        fast = (_eager(q, k, v, mask, is_causal, return_lse, plan, m, block)
                if index is None else None)
        if fast is not None:   # later calls go straight to it (sparse_attention's fast path)
            return fast(q, k, v, mask, scale)
        out, lse, _ = _forward(plan, q, k, v, m, scale, index, return_lse, is_causal, block)
    return (out, lse) if return_lse else out


# -- nn.MultiheadAttention drop-in (built on first access) --------------------------------------

def _build_module() -> type:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from .library import ops
    ops()  # registered before any model using SparseAttention is traced

    class SparseAttention(nn.Module):
        """Drop-in for ``nn.MultiheadAttention(embed_dim, num_heads, bias=True,
        batch_first=True)`` (same parameters and state_dict) running ``sparse_attention``;
        trains like it (gradients reach the projections and the inputs through the sparse
        backward).

        ``forward`` takes nn.MultiheadAttention's arguments in its order. Its bool masks
        follow nn.MultiheadAttention (**True = NOT allowed**): ``key_padding_mask`` [N, S],
        ``attn_mask`` [L, S] or [N * num_heads, L, S]; ``is_causal=True`` adds a causal mask
        (query i attends keys j <= i). ``mask=`` takes pitgen's convention instead (True =
        attend; [L, S], [H|1, L, S] or [N|1, H|1, L, S]). Given masks combine; with none,
        every key is attended. Rows with nothing allowed give zeros (nn.MultiheadAttention
        gives NaN). Returns (out, None): attention weights are never stored, so
        ``need_weights=True`` is refused."""

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

        def _allowed(self, n: int, length: int, src: int, device: Any, key_padding_mask: Any,
                     attn_mask: Any, is_causal: bool, mask: Any) -> tuple[Any, bool]:
            """(pitgen's mask (True = attend), is_causal) for sparse_attention: the given masks
            combined ([L, S], [N, 1, L, S], [N, H, L, S] or as ``mask`` was given, never
            copied per head without need); no mask for a dense or plain causal call."""
            for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
                if m is not None and m.dtype != torch.bool:
                    raise ShapeError(f"{name} has dtype {m.dtype}; only bool masks (True = not "
                                     f"allowed) are supported")
            parts = [] if mask is None else [mask]
            if attn_mask is not None:
                if attn_mask.dim() == 3:
                    if attn_mask.shape[0] != n * self.num_heads:
                        raise ShapeError(f"attn_mask has shape {tuple(attn_mask.shape)}; dim 0 "
                                         f"must be N * num_heads = {n * self.num_heads}")
                    attn_mask = attn_mask.view(n, self.num_heads, *attn_mask.shape[1:])
                elif attn_mask.dim() != 2:
                    raise ShapeError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected "
                                     f"[L, S] or [N * num_heads, L, S]")
                parts.append(~attn_mask)
            if key_padding_mask is not None:
                if tuple(key_padding_mask.shape) != (n, src):
                    raise ShapeError(f"key_padding_mask has shape "
                                     f"{tuple(key_padding_mask.shape)}; expected [N, S] = "
                                     f"{(n, src)}")
                parts.append(~key_padding_mask.view(n, 1, 1, src))
            if not parts:
                return None, is_causal
            if is_causal:
                parts.append(torch.ones(length, src, dtype=torch.bool, device=device).tril())
            allowed = parts[0]
            for m in parts[1:]:
                allowed = allowed & m
            if allowed.shape[-2:] != (length, src):   # key padding alone: [N, 1, 1, S]
                allowed = allowed.expand(*allowed.shape[:-2], length, src)
            return allowed, False

        def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None,
                    need_weights: bool = False, attn_mask: Any = None,
                    average_attn_weights: bool = True, is_causal: bool = False, *,
                    mask: Any = None) -> tuple[Any, None]:
            if need_weights:
                raise PlanError("need_weights=True is not supported (weights are never stored)")
            for name, x in (("query", query), ("key", key), ("value", value)):
                if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                    raise ShapeError(f"{name} has shape {tuple(x.shape)}; expected "
                                     f"[N, L, {self.embed_dim}] (batch_first)")
            n, length = query.shape[:2]
            if key.shape[:2] != value.shape[:2] or key.shape[0] != n:
                raise ShapeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must "
                                 f"share [N, S] with N = {n}")
            allowed, causal = self._allowed(n, length, key.shape[1], query.device,
                                            key_padding_mask, attn_mask, is_causal, mask)
            e = self.embed_dim
            w, b = self.in_proj_weight, self.in_proj_bias
            q = self._heads(query, w[:e], b[:e])
            k = self._heads(key, w[e:2 * e], b[e:2 * e])
            v = self._heads(value, w[2 * e:], b[2 * e:])
            o = sparse_attention(q, k, v, allowed, is_causal=causal)
            o = o.transpose(1, 2).reshape(n, length, e)
            return self.out_proj(o), None

    return SparseAttention


__getattr__ = lazy_torch_classes(__name__, ("SparseAttention",), lambda: {"SparseAttention": _build_module()})
