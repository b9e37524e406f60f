"""Fused Mixture-of-Experts FFN layer: y[t] = sum_j gates[t,j] * FFN_{expert_ids[t,j]}(x[t]).

Derived through the PIT rules: in both expert GEMMs (``I[t,f] += X[t,h] * W1[h,f]`` and
``Y[t,o] += I[t,f] * W2[f,o]``) the token axis t is spatial and permutation invariant, so the
(token, j) pairs routed to one expert are gathered into dense row tiles in any order (SRead, no
sort) and their results scattered back to their tokens (SWrite). The routing index (per-expert
counts, offsets, the pairs of every expert's segment and the tile list) is built on the GPU every
call with atomics and a one-block scan; grids are sized for the upper bound
``ceil(T*topk/BM) + E`` tiles and surplus tiles exit, so nothing waits for the host.

No capacity factor: every pair with an id in ``[0, E)`` is computed; pairs with other ids are
skipped (they contribute nothing). ``moe_ffn(..., check=True)`` refuses such ids instead.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import cache, lower
from ..errors import PlanError, ShapeError
from ..limits import INDEX_THREADS
from ..operands import check_tensor, on_operand_device, raw_key, validated
from ..opspec import OpSpec, Permutation
from ..runtime import (TorchLaunch, device_arch, device_index, device_sms, kept_scratch, memset_d32,
                       stream_counters, tensor_map)
from . import lazy_torch_classes
from .library import needs_grad, ops, tracing

if TYPE_CHECKING:
    from torch import Tensor

ACTIVATIONS = ("relu", "gelu", "silu", "identity")
GEMM1 = "I[t,f] += X[t,h] * W1[h,f]"
GEMM2 = "Y[t,o] += I[t,f] * W2[f,o]"

MOE = OpSpec(
    "moe", "moe.cu.j2",
    # PyCUDA argument signatures, in the order of the kernels' parameter lists in moe.cu.j2
    {"moe_route": "PiiiPPPPPPPPPi", "moe_place": "PPPiiPPi",
     "moe_gemm1": "PPPPPPPPPiiiii", "moe_gemm1_routed": "Piii" + "P" * 11 + "iiii",
     "moe_gemm2": "PPPPPPPPPPPiiiiii", "moe_small": "PiiP" + "P" * 8 + "iii", "moe_finish": "PPq",
     "moe_place_gather": "PPPiiPPiPPi", "moe_gemm1_sm90": "MM" + "P" * 7 + "i" * 6,
     "moe_gemm2_sm90": "MM" + "P" * 9 + "i" * 7},
    permutes=(
        # tokens gathered into per-expert row blocks (SRead), any order within an expert ...
        Permutation("tokens in", GEMM1, "spatial", "X"),
        # ... and scattered back to their rows, gate-weighted (SWrite)
        Permutation("tokens out", GEMM2, "spatial", "I")),
    dtypes=("float16", "bfloat16", "float32"))

#: the experts' weight gradients in the backward: a reduction over the rows routed to each
WGRAD = "W[h,f] += X[r,h] * D[r,f]"

MOE_BACKWARD = OpSpec(
    "moe backward", "moe_backward.cu.j2",
    {"moe_rows_nn": "P" * 6 + "i" * 6, "moe_rows_nt": "P" * 6 + "i" * 6,
     "moe_rows_act": "P" * 11 + "i" * 7, "moe_wgrad": "PPPPiiii", "moe_gather": "P" * 17 + "i" * 6},
    permutes=(
        # each tile's rows times their expert's weight, where it lies (SRead of the rows) ...
        Permutation("tile rows", GEMM1, "spatial", "X"),
        # ... and an expert's rows (any order, zero rows between experts' tiles) as the k
        # tiles of its weight gradient's GEMM
        Permutation("expert rows", WGRAD, "reduction", "X")),
    dtypes=("float16", "bfloat16"))

#: moe_rows' CTA: ROWS_M rows (a routing tile holds one or two) x ROWS_N columns, 4 stages
#: of 32 of k
ROWS_M, ROWS_N = 64, 128


@dataclass(frozen=True)
class BackwardPlan:
    """The backward kernels' tiles: ``moe_wgrad``'s BM x BN of W[e] per CTA, BK rows a stage,
    WM x WN warps (``moe_rows``' is ROWS_M x ROWS_N, 32 of k a stage)."""

    dtype: str
    activation: str = "identity"   # moe_rows_act's epilogue
    bm: int = 128
    bn: int = 128
    bk: int = 32
    wm: int = 2
    wn: int = 4
    stages: int = 4

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    @property
    def smem(self) -> int:
        return self.stages * self.bk * (self.bm + self.bn + 16) * 2

    @property
    def rows_smem(self) -> int:
        """moe_rows': per stage ROWS_M x 40 of A and the larger of 32 x (ROWS_N + 8) and
        ROWS_N x 40 of W."""
        return self.stages * (ROWS_M * 40 + max(32 * (ROWS_N + 8), ROWS_N * 40)) * 2

    def context(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "activation": self.activation, "rows_m": ROWS_M,
                "rows_n": ROWS_N, "bm": self.bm, "bn": self.bn, "bk": self.bk, "wm": self.wm,
                "wn": self.wn, "stages": self.stages}


@dataclass(frozen=True)
class MoEPlan:
    """Decisions for one layer shape: tile sizes, pipeline depth and the grids (upper bounds)."""

    tokens: int
    topk: int
    experts: int
    hidden: int
    ffn: int
    dtype: str
    activation: str
    id_type: str   # C type of expert ids: "int" or "long long"
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    #: 'mma_sync' (every device; wm x wn warps) or 'wgmma' (sm_90a: a producer and two
    #: consumer warpgroups, TMA; wm, wn unused)
    mainloop: str = "mma_sync"

    @property
    def pairs(self) -> int:
        return self.tokens * self.topk

    @property
    def vec(self) -> int:
        """Elements per 16-byte cp.async chunk."""
        return 4 if self.dtype == "float32" else 8

    @property
    def threads(self) -> int:
        return 384 if self.mainloop == "wgmma" else self.wm * self.wn * 32

    @property
    def max_tiles(self) -> int:
        """Upper bound of sum_e ceil(count_e / BM) over any routing: ceil(P / BM) + E."""
        return -(-self.pairs // self.bm) + self.experts

    @property
    def smem(self) -> int:
        """Dynamic shared memory of a GEMM block: STAGES x (A tile + B tile), padded rows
        (wgmma: swizzled, unpadded, 1024-byte alignment slack and two mbarriers per stage)."""
        if self.mainloop == "wgmma":
            return self.stages * ((self.bm + self.bn) * self.bk * 2 + 16) + 1024
        pad, size = (4, 4) if self.dtype == "float32" else (8, 2)
        return self.stages * (self.bm * (self.bk + pad) + self.bk * (self.bn + pad)) * size

    def gemm_grid(self, n: int, sms: int = 0) -> tuple[int, int, int]:
        """Tiles along x (consecutive blocks share a weight column tile: L2 reuse), N tiles along
        y; wgmma: persistent CTAs, at most one per multiprocessor (``sms``)."""
        if self.mainloop == "wgmma":
            return (max(1, min(sms, self.max_tiles * -(-n // self.bn))), 1, 1)
        return (self.max_tiles, -(-n // self.bn), 1)

    def index_grid(self) -> tuple[int, int, int]:
        return (max(1, -(-self.pairs // INDEX_THREADS)), 1, 1)

    def context(self) -> dict[str, Any]:
        """Template context of moe.cu.j2."""
        return {"dtype": self.dtype, "activation": self.activation, "id_type": self.id_type,
                "bm": self.bm, "bn": self.bn, "bk": self.bk, "wm": self.wm, "wn": self.wn,
                "stages": self.stages, "vec": self.vec, "route_threads": INDEX_THREADS,
                "mainloop": self.mainloop}


def block_m(pairs: int, experts: int) -> int:
    """Rows per expert tile: 128 when an expert gets >= 256 rows on average, else 64."""
    return 128 if pairs >= 256 * experts else 64


@cache.lru("moe.plans")
def plan_moe(tokens: int, topk: int, experts: int, hidden: int, ffn: int, dtype: str = "float16",
             activation: str = "gelu", id_dtype: str = "int32", arch: str = "sm_80") -> MoEPlan:
    """Check the shapes against the PIT rules and choose the tiles for a device of ``arch``.

    mma.sync: BM = 128 when an expert gets >= 256 rows on average (fewer weight re-reads per
    row), else 64, so that a lightly loaded expert reads each weight tile once for all its
    tokens. Hopper, fp16/bf16, more pairs than one routing block: the wgmma kernels, 128 x 128
    tiles, 6 stages of 64-deep k (per-kernel times, H100, E 64 / 128: 3-6% below 128 x 256 x 4
    stages and 128 x 192 x 5; decode-sized batches keep the mma.sync path, whose first GEMM
    routes inside)."""
    MOE.derive()
    MOE.check_dtype(dtype)
    if activation not in ACTIVATIONS:
        raise PlanError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if id_dtype not in ("int32", "int64"):
        raise ShapeError(f"expert_ids has dtype {id_dtype}; expected int32 or int64")
    if topk < 1 or experts < 1:
        raise ShapeError(f"need topk >= 1 and at least one expert (topk={topk}, E={experts})")
    vec = 4 if dtype == "float32" else 8
    for name, v in (("H (hidden)", hidden), ("F (ffn)", ffn)):
        if v < 1 or v % vec:
            raise ShapeError(f"{name} = {v} must be a positive multiple of {vec} for {dtype} "
                             f"(16-byte vector loads)")
    pairs = tokens * topk
    if pairs >= 2**31 or pairs * max(hidden, ffn) >= 2**62 or experts >= 2**31 - 1:
        raise ShapeError(f"T*topk = {pairs} rows is too large (int32 row ids)")
    if arch in lower.WGMMA_ARCHS and dtype != "float32" and pairs > INDEX_THREADS:
        return MoEPlan(tokens, topk, experts, hidden, ffn, dtype, activation,
                       "int" if id_dtype == "int32" else "long long", 128, 128, 64, 2, 1, 6,
                       "wgmma")
    bm = block_m(pairs, experts)
    stages = 3 if (bm == 128 or dtype == "float32") else 4
    return MoEPlan(tokens, topk, experts, hidden, ffn, dtype, activation,
                   "int" if id_dtype == "int32" else "long long", bm, 128, 32, 2, 4, stages)


# -- NumPy references (CPU) --------------------------------------------------------------------

class Routing(NamedTuple):
    """The routing index: per-expert row counts and offsets (E + 1), the (token, j) pair of
    every compact row (expert segments in order), and the tile list (expert, first row)."""

    counts: np.ndarray
    offsets: np.ndarray
    row_pair: np.ndarray
    tile_e: np.ndarray
    tile_r: np.ndarray


# -- GPU path ----------------------------------------------------------------------------------

def _name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _aligned_operands(x: Any, w1: Any, w2: Any, b1: Any, b2: Any) -> None:
    """The kernels' 16-byte loads need aligned operands (a real tensor's address: not while
    torch traces)."""
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
        if t is not None and t.data_ptr() % 16:
            raise ShapeError(f"{name} is not 16-byte aligned (a view with a storage offset?); "
                             f"pass {name}.clone()")


def _round(nbytes: int) -> int:
    return -(-nbytes // 128) * 128


class _Launch:
    """moe_ffn's launches for one plan, decided once: kernels bound to their grids and shared
    memory, and one scratch allocation laid out as the routing index's int32 words (counts,
    rank, offsets, row_pair, tile_e, tile_r, ntiles), the intermediate [pairs, F], for
    topk > 1 the fp32 sums [T, H] and, on the wgmma path, the token rows in expert order
    [pairs, H], each at a 128-byte boundary (the stream's kept scratch
    when small: ``runtime.kept_scratch``). A steady-state call allocates y and makes its
    launches: routing, placing and the two expert GEMMs; a batch of at most INDEX_THREADS pairs
    routes inside the first GEMM (``moe_gemm1_routed``), and a top-1 one is the whole layer in
    one launch (``moe_small``); top-k > 1: a driver memset of the fp32 sums first and a
    finishing pass last. Nothing else (issue 16's host time). The routing counters (and
    moe_small's tickets) are this plan's own, per stream, zero between launches."""

    __slots__ = ("plan", "sizes", "words", "offsets", "direct", "esize", "bytes", "inter",
                 "sums", "xs", "route_index", "place", "gemm1", "routed", "small", "gemm2",
                 "finish", "pending", "wgmma")

    def __init__(self, plan: MoEPlan) -> None:
        kernels = MOE.module(plan)
        P, E, T, H, F, t = (plan.pairs, plan.experts, plan.tokens, plan.hidden, plan.ffn,
                            plan.max_tiles)
        self.plan = plan
        self.sizes = (E, max(P, 1), E + 1, max(P, 1), t, t, 1)
        self.offsets = tuple(4 * int(o) for o in np.cumsum((0,) + self.sizes[:-1]))
        self.words = sum(self.sizes)
        self.direct = plan.topk == 1
        self.esize = 4 if plan.dtype == "float32" else 2
        ints, inter = _round(4 * self.words), _round(P * F * self.esize)
        #: wgmma: the pairs' token rows in expert order (xs, moe_place_gather) follow the sums
        self.wgmma = plan.mainloop == "wgmma"
        self.bytes = (ints, inter, _round(0 if self.direct else T * H * 4),
                      P * H * self.esize if self.wgmma else 0)
        #: byte offsets in the scratch of the intermediate, the fp32 sums and xs
        self.inter, self.sums, self.xs = ints, ints + inter, ints + inter + self.bytes[2]
        index, block = plan.index_grid(), (INDEX_THREADS, 1, 1)
        self.route_index = kernels.bind("moe_route", index, block)
        threads = (plan.threads, 1, 1)
        if self.wgmma:  # index[0] > 1 here: P > INDEX_THREADS
            self.place = kernels.bind("moe_place_gather",
                                      (min(4096, -(-P * (H // 8) // INDEX_THREADS)), 1, 1), block)
            sms = device_sms()
            # programmatic dependent launches: each starts as the kernel before it completes
            self.gemm1 = kernels.bind("moe_gemm1_sm90", plan.gemm_grid(F, sms), threads, plan.smem,
                                      early=True)
            self.gemm2 = kernels.bind("moe_gemm2_sm90", plan.gemm_grid(H, sms), threads, plan.smem,
                                      early=True)
            self.routed = self.small = None
        else:
            self.place = None if index[0] == 1 else kernels.bind("moe_place", index, block)
            self.gemm1 = kernels.bind("moe_gemm1", plan.gemm_grid(F), threads, plan.smem)
            #: batches of one routing block: moe_gemm1_routed routes inside (two launches, top-1)
            routed_smem = -(-plan.smem // 16) * 16 + 4 * (3 * INDEX_THREADS + 2 * E + 2 * t + 2)
            self.routed = None if index[0] > 1 or plan.threads < INDEX_THREADS else kernels.bind(
                "moe_gemm1_routed", plan.gemm_grid(F), threads, routed_smem)
            #: and top-1: the whole layer in one launch, a CTA per tile of either GEMM
            self.small = None if self.routed is None or not self.direct else kernels.bind(
                "moe_small", (t * (plan.gemm_grid(F)[1] + plan.gemm_grid(H)[1]), 1, 1), threads,
                routed_smem)
            self.gemm2 = kernels.bind("moe_gemm2", plan.gemm_grid(H), threads, plan.smem)
        self.finish = None if self.direct else kernels.bind(
            "moe_finish", (min(-(-T * H // 256), 4096), 1, 1), (256, 1, 1))
        #: device index -> stream handle -> moe_route's counters there (stream_counters; the
        #: default stream of every device is handle 0)
        self.pending: dict[int, dict[int, Any]] = {}

    def route(self, stream: int, ids: int, base: int, device: Any, y: int = 0, x: int = 0,
              xs: int = 0) -> tuple[int, ...]:
        """Enqueue the routing index build into the words at ``base``; their addresses. ``y``
        (top-1): the output, whose rows of tokens with an out-of-range id are zeroed; wgmma:
        the token rows of ``x`` are copied to ``xs`` in expert order."""
        plan = self.plan
        counts, rank, offsets, row_pair, tile_e, tile_r, ntiles = (base + o for o in self.offsets)
        pending = stream_counters(self.pending.setdefault(device.index, {}), stream,
                                  plan.experts + 1, device)   # held until the launch
        self.route_index(stream, ids, plan.pairs, plan.experts, plan.max_tiles, pending.data_ptr(),
                         counts, rank, offsets, tile_e, tile_r, ntiles, row_pair, y, plan.hidden)
        if self.wgmma:
            self.place(stream, ids, rank, offsets, plan.pairs, plan.experts, row_pair, y,
                       plan.hidden, x, xs, plan.topk)
        elif self.place is not None:
            self.place(stream, ids, rank, offsets, plan.pairs, plan.experts, row_pair, y,
                       plan.hidden)
        return counts, rank, offsets, row_pair, tile_e, tile_r, ntiles

    def __call__(self, x: Any, expert_ids: Any, gates: Any, w1: Any, w2: Any, b1: Any,
                 b2: Any) -> Any:
        import torch
        T, H = self.plan.tokens, self.plan.hidden
        g = gates if gates.dtype == torch.float32 and gates.is_contiguous() else \
            gates.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        yp = y.data_ptr()
        with TorchLaunch() as launch:
            s = launch.stream
            scratch, lock = kept_scratch(s, sum(self.bytes), x.device)
            base = scratch.data_ptr()
            ws = yp if self.direct else base + self.sums
            with lock or nullcontext():
                if not self.direct:  # the fp32 sums the experts add into start at zero
                    memset_d32(ws, 0, T * H, s)
                gemms = self._wgmma if self.wgmma else self._mma_sync
                gemms(s, base, x, expert_ids, w1, w2, b1, b2, yp, ws, g)
                if self.finish is not None:
                    self.finish(s, ws, yp, np.int64(T * H))
        return y

    def _mma_sync(self, s: int, base: int, x: Any, expert_ids: Any, w1: Any, w2: Any, b1: Any,
                  b2: Any, yp: int, ws: int, g: Any) -> None:
        """The mma.sync path: routing and placing (or, for one routing block, the routing
        inside the first GEMM), then both GEMMs gathering and scattering token rows; one
        top-1 routing block: the whole layer in one launch."""
        plan = self.plan
        T, H, F, E, topk = plan.tokens, plan.hidden, plan.ffn, plan.experts, plan.topk
        b1p, hbuf = 0 if b1 is None else b1.data_ptr(), base + self.inter
        if self.small is not None:
            tickets = stream_counters(self.pending.setdefault(x.device.index, {}), s,
                                      2 + plan.max_tiles, x.device)   # held until the launch
            self.small(s, expert_ids.data_ptr(), E, plan.max_tiles, tickets.data_ptr(), yp,
                       x.data_ptr(), w1.data_ptr(), b1p, hbuf, w2.data_ptr(),
                       0 if b2 is None else b2.data_ptr(), g.data_ptr(), T, H, F)
            return
        if self.routed is not None:
            counts, _, offsets, row_pair, tile_e, tile_r, ntiles = (base + o for o in self.offsets)
            self.routed(s, expert_ids.data_ptr(), plan.pairs, E, plan.max_tiles, counts, offsets,
                        row_pair, tile_e, tile_r, ntiles, yp if self.direct else 0,
                        x.data_ptr(), w1.data_ptr(), b1p, hbuf, T, topk, H, F)
        else:
            _, _, offsets, row_pair, tile_e, tile_r, ntiles = self.route(
                s, expert_ids.data_ptr(), base, x.device, yp if self.direct else 0)
            self.gemm1(s, x.data_ptr(), w1.data_ptr(), b1p, hbuf, row_pair, tile_e, tile_r,
                       offsets, ntiles, T, topk, E, H, F)
        self.gemm2(s, hbuf, w2.data_ptr(), 0 if b2 is None else b2.data_ptr(), yp, ws,
                   g.data_ptr(), row_pair, tile_e, tile_r, offsets, ntiles, T, topk, E, F, H,
                   int(self.direct))

    def _wgmma(self, s: int, base: int, x: Any, expert_ids: Any, w1: Any, w2: Any, b1: Any,
               b2: Any, yp: int, ws: int, g: Any) -> None:
        """The Hopper path: routing, placing with the row copy into expert order, then both
        GEMMs from TMA descriptors (each remembered per address)."""
        plan = self.plan
        T, H, F, E, topk, P, dt = (plan.tokens, plan.hidden, plan.ffn, plan.experts, plan.topk,
                                   plan.pairs, plan.dtype)
        hbuf, xs = base + self.inter, base + self.xs
        _, _, offsets, row_pair, tile_e, tile_r, ntiles = self.route(
            s, expert_ids.data_ptr(), base, x.device, yp if self.direct else 0, x.data_ptr(), xs)
        idx = (row_pair, tile_e, tile_r, offsets, ntiles)
        box_a, box_b = (plan.bk, 64), (64, plan.bk, 1)
        self.gemm1(s, tensor_map(xs, dt, (H, P), H, box_a),
                   tensor_map(w1.data_ptr(), dt, (F, H, E), (F, H * F), box_b),
                   0 if b1 is None else b1.data_ptr(), hbuf, *idx, T, topk, E, H, F,
                   plan.max_tiles)
        self.gemm2(s, tensor_map(hbuf, dt, (F, P), F, box_a),
                   tensor_map(w2.data_ptr(), dt, (H, F, E), (H, F * H), box_b),
                   0 if b2 is None else b2.data_ptr(), yp, ws, g.data_ptr(), *idx, T, topk, E, F,
                   H, int(self.direct), plan.max_tiles)


#: (MoEPlan, device index) -> its _Launch (bound kernels of that device's modules)
_LAUNCHES = cache.memo("moe.launches")


def _launcher(plan: MoEPlan) -> _Launch:
    return validated(_LAUNCHES, (plan, device_index()), lambda: _Launch(plan))


_BACKWARD_LAUNCHES = cache.memo("moe.backward_launches")


def _backward_launch(kernel: str, dtype: str, rows: int, cols: int, z: int,
                     activation: str = "identity") -> Any:
    """A backward kernel bound to its grid, once per shape and device: ``moe_wgrad`` for W
    [z, rows, cols], ``moe_rows_*`` for C [rows, cols], ``moe_gather`` for ``rows`` tiles of
    ``cols`` rows."""
    def bind() -> Any:
        plan = BackwardPlan(dtype, activation)
        mod = MOE_BACKWARD.module(plan)
        if kernel == "moe_wgrad":
            grid = (-(-cols // plan.bn), -(-rows // plan.bm), z)
            return mod.bind(kernel, grid, (plan.threads, 1, 1), plan.smem)
        if kernel == "moe_gather":   # rows: the chunk's tiles, cols: rows a tile
            return mod.bind(kernel, (rows, 1, 1), (32, 8, 1), (4 * cols + 8 * 256) * 4)
        return mod.bind(kernel, (-(-cols // ROWS_N), rows // ROWS_M, 1), (plan.threads, 1, 1),
                        plan.rows_smem)
    return validated(_BACKWARD_LAUNCHES, (kernel, dtype, rows, cols, z, activation,
                                          device_index()), bind)


def _rows_operands(a: Any, w: Any, tile_e: Any, ntiles: Any, row0: int, tile_rows: int,
                   trans: bool) -> tuple[int, int, int, int, str]:
    """moe_rows' checks (a pitgen error naming what is wrong); (R, K, N, E, dtype)."""
    check_tensor("a", a, ("float16", "bfloat16"), ndim=2)
    dt = _name(a)
    check_tensor("w", w, (dt,), ndim=3)
    check_tensor("tile_e", tile_e, ("int32",), ndim=1)
    check_tensor("ntiles", ntiles, ("int32",), ndim=1, shape=(1,))
    R, K = a.shape
    E, wk, N = (w.shape[0], w.shape[2], w.shape[1]) if trans else w.shape
    if wk != K:
        raise ShapeError(f"moe_rows: a has {K} columns but w's rows hold {wk} (trans={trans})")
    if K % 8 or N % 8:
        raise ShapeError(f"moe_rows: K ({K}) and N ({N}) must be multiples of 8")
    if tile_rows <= 0 or tile_rows % ROWS_M or R % ROWS_M or row0 < 0 or row0 % tile_rows:
        raise ShapeError(f"moe_rows: rows ({R}), tile_rows ({tile_rows}) and row0 ({row0}) "
                         f"must be multiples of {ROWS_M}, row0 of tile_rows")
    if R // ROWS_M > 65535:
        raise ShapeError(f"moe_rows: {R} rows pass the grid's 65535 blocks of {ROWS_M}; "
                         f"split them")
    if (row0 + R) // tile_rows > tile_e.shape[0]:
        raise ShapeError(f"moe_rows: rows {row0}..{row0 + R} pass the tile list's "
                         f"{tile_e.shape[0]} tiles of {tile_rows}")
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        raise ShapeError("moe_rows: a and w must start at 16-byte aligned addresses")
    return R, K, N, E, dt


@on_operand_device
def expert_rows(a: Tensor, w: Tensor, tile_e: Tensor, ntiles: Tensor, row0: int,
                tile_rows: int, trans: bool, bias: Tensor | None = None) -> Tensor:
    """C float32 [R, N]: row r of ``a`` [R, K] times the weight of its tile's expert, ``w``
    [E, K, N] (``trans``: ``w`` [E, N, K], C = a W[e]ᵀ), plus ``bias[e]`` (float32 [E, N]) where
    given: the backward's pre-activation with b1 added in the epilogue, not by two more ops and
    a pass over C. Row r is row r of list slot ``(row0 + r) // tile_rows`` of the routing tile
    list ``tile_e`` (int32; ``ntiles`` [1] valid entries); rows of slots past them, or whose
    expert is outside [0, E), are zeros. float16 or bfloat16 operands of one dtype, contiguous,
    K and N multiples of 8; R and ``tile_rows`` multiples of 64, ``row0`` of ``tile_rows``. One
    launch (``moe_rows_*``): the weights are read where they lie, not copied per tile. The body
    of ``pitgen::moe_rows``."""
    import torch

    R, K, N, E, dt = _rows_operands(a, w, tile_e, ntiles, row0, tile_rows, trans)
    if bias is not None:
        check_tensor("bias", bias, ("float32",), ndim=2, shape=(E, N))
    c = torch.empty(R, N, dtype=torch.float32, device=a.device)
    if c.numel():
        run = _backward_launch("moe_rows_nt" if trans else "moe_rows_nn", dt, R, N, 1)
        with TorchLaunch() as launch:
            run(launch.stream, a.data_ptr(), w.data_ptr(), c.data_ptr(),
                0 if bias is None else bias.data_ptr(), tile_e.data_ptr(), ntiles.data_ptr(),
                row0, R, tile_rows, K, N, E)
    return c


@on_operand_device
def expert_rows_act(dy: Tensor, w: Tensor, h: Tensor, gate: Tensor, tile_e: Tensor,
                    ntiles: Tensor, row0: int, tile_rows: int, activation: str, pair: Tensor,
                    dg: Tensor, db1: Tensor) -> tuple[Tensor, Tensor]:
    """The activation's backward over the rows of a chunk of the tile list, in one launch
    (``moe_rows_act``): G = dy W[e]ᵀ as :func:`expert_rows` with ``trans`` (``w`` [E, N, K]),
    consumed in the product's epilogue with the pre-activation ``h`` (float32 [R, N]) and the
    rows' ``gate`` (float32 [R]): (dh, a) with a = act(h) and dh = act'(h) · gate · G in dy's
    dtype. It also adds each row's G · a into ``dg[pair[r]]`` (float32 [P]; pair int32 [R], ids
    outside [0, P) skipped) and each live tile's column sums of dh, as stored, into ``db1[e]``
    (float32 [E, N]): the dgates and db1 terms the eager step took three more ops for (it is
    host-bound). G itself is never stored. The body of ``pitgen::moe_rows_act``."""
    R, K, N, E, dt = _rows_operands(dy, w, tile_e, ntiles, row0, tile_rows, True)
    if activation not in ACTIVATIONS:
        raise ShapeError(f"activation must be one of {', '.join(ACTIVATIONS)}; "
                         f"got {activation!r}")
    check_tensor("h", h, ("float32",), shape=(R, N))
    check_tensor("gate", gate, ("float32",), shape=(R,))
    check_tensor("pair", pair, ("int32",), ndim=1, shape=(R,))
    check_tensor("dg", dg, ("float32",), ndim=1)
    check_tensor("db1", db1, ("float32",), ndim=2, shape=(E, N))
    dh, a = dy.new_empty(R, N), dy.new_empty(R, N)
    if dh.numel():
        run = _backward_launch("moe_rows_act", dt, R, N, 1, activation)
        with TorchLaunch() as launch:
            run(launch.stream, dy.data_ptr(), w.data_ptr(), h.data_ptr(), gate.data_ptr(),
                pair.data_ptr(), dh.data_ptr(), a.data_ptr(), dg.data_ptr(), db1.data_ptr(),
                tile_e.data_ptr(), ntiles.data_ptr(), row0, R, tile_rows, K, N, E,
                dg.shape[0])
    return dh, a


@on_operand_device
def wgrad(a: Tensor, b: Tensor, rows: Tensor, experts: int, tile_rows: int = 0) -> Tensor:
    """W [experts, M, N] in the operands' dtype with ``W[e] = a[r0:r1]ᵀ b[r0:r1]``,
    ``r0, r1 = rows[e], rows[e + 1]`` (clamped to [0, R]): the weight gradients of experts
    whose routed rows lie in consecutive ranges of ``a`` [R, M] and ``b`` [R, N] (float16 or
    bfloat16, one dtype, contiguous, M and N multiples of 8; ``rows`` int32 [>= experts + 1]).
    With ``tile_rows`` > 0, ``rows`` are the routing's pair offsets and expert e's range is its
    pair count rounded up to whole tiles, after the rounded counts of the experts before it:
    the tile list's rows, so the backward passes its offsets and no torch ops build the bounds.
    One GEMM per expert over its rows (``moe_wgrad``): no partials, no atomics; an expert
    without rows gets zeros. The body of ``pitgen::moe_wgrad``."""
    check_tensor("a", a, ("float16", "bfloat16"), ndim=2)
    dt = _name(a)
    check_tensor("b", b, (dt,), ndim=2, shape=(a.shape[0], None))
    check_tensor("rows", rows, ("int32",), ndim=1)
    R, M = a.shape
    N = b.shape[1]
    if M % 8 or N % 8:
        raise ShapeError(f"moe_wgrad: a's and b's widths ({M}, {N}) must be multiples of 8")
    if not 0 <= experts < 65536 or rows.shape[0] < experts + 1:
        raise ShapeError(f"moe_wgrad: {experts} experts need rows of at least {experts + 1} "
                         f"entries (got {rows.shape[0]}) and fewer than 65536 experts")
    if tile_rows < 0:
        raise ShapeError(f"moe_wgrad: tile_rows must be >= 0 (0: rows as given), got {tile_rows}")
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        raise ShapeError("moe_wgrad: a and b must start at 16-byte aligned addresses")
    w = a.new_empty(experts, M, N)   # fp32 accumulators, rounded once: the weights' dtype
    if w.numel():
        run = _backward_launch("moe_wgrad", dt, M, N, experts)
        with TorchLaunch() as launch:
            run(launch.stream, a.data_ptr(), b.data_ptr(), w.data_ptr(), rows.data_ptr(), R, M, N,
                tile_rows)
    return w


@on_operand_device
def gather_rows(x: Tensor, dy: Tensor, gates: Tensor, b2: Tensor | None, row_pair: Tensor,
                tile_e: Tensor, tile_r: Tensor, offsets: Tensor, ntiles: Tensor, row0: int,
                rows: int, tile_rows: int, topk: int, dg: Tensor,
                db2: Tensor) -> tuple[Tensor, ...]:
    """The backward's per-row bookkeeping and gathers for ``rows`` rows of the routing tile
    list from row ``row0`` (whole tiles of ``tile_rows``), in one launch (``moe_gather``) where
    torch ops took ~40: (xg, dyg, do, gate, pair, tok). Row r of tile c holds pair p =
    ``row_pair[tile_r[t] + r]`` (t = row0 / tile_rows + c) while that row is one of its
    expert's and p in [0, P); otherwise the row is zeros, its pair -1 and token 0. xg, dyg: x's
    and dy's rows of token p // topk ([rows, H], x's dtype); do = dyg · gate (rounded once);
    gate = ``gates[p]`` (float32 [rows]). With ``b2``, each live row's dy · b2[e] is added into
    ``dg[p]`` (float32 [P]); each live tile's float32 sum of do over its rows is added into
    ``db2[e]`` (float32 [E, H]): the bias terms of dgates and db2, by atomics as
    ``index_add_`` made them. x, dy [T, H] float16/bfloat16 contiguous, H a multiple of 8;
    gates float32 [T · topk]; b2 float32 [E, H] or None; the routing words int32. The body of
    ``pitgen::moe_gather``."""
    import torch

    check_tensor("x", x, ("float16", "bfloat16"), ndim=2)
    dt = _name(x)
    T, H = x.shape
    P = T * topk
    check_tensor("dy", dy, (dt,), ndim=2, shape=(T, H))
    check_tensor("gates", gates, ("float32",), ndim=1, shape=(P,))
    for name, t in (("row_pair", row_pair), ("tile_e", tile_e), ("tile_r", tile_r),
                    ("offsets", offsets), ("ntiles", ntiles)):
        check_tensor(name, t, ("int32",), ndim=1)
    E, nt = offsets.shape[0] - 1, tile_e.shape[0]
    if b2 is not None:
        check_tensor("b2", b2, ("float32",), ndim=2, shape=(E, H))
    check_tensor("dg", dg, ("float32",), ndim=1, shape=(P,))
    check_tensor("db2", db2, ("float32",), ndim=2, shape=(E, H))
    if H % 8 or x.data_ptr() % 16 or dy.data_ptr() % 16:
        raise ShapeError(f"moe_gather: H ({H}) must be a multiple of 8 and x, dy 16-byte aligned")
    if topk < 1 or P < 1 or E < 1 or row_pair.shape[0] < P or tile_r.shape[0] != nt \
            or ntiles.shape[0] != 1:
        raise ShapeError(f"moe_gather: need topk >= 1, a token, an expert, row_pair of >= "
                         f"{P} entries, tile_r as long as tile_e ({nt}) and ntiles [1]")
    if tile_rows <= 0 or rows < 0 or rows % tile_rows or row0 < 0 or row0 % tile_rows \
            or (row0 + rows) // tile_rows > nt:
        raise ShapeError(f"moe_gather: rows {row0}..{row0 + rows} must be whole tiles of "
                         f"{tile_rows} within the list's {nt}")
    C = rows // tile_rows
    xg, dyg, do = (x.new_empty(rows, H) for _ in range(3))
    gate = torch.empty(rows, dtype=torch.float32, device=x.device)
    pair, tok = (torch.empty(rows, dtype=torch.int32, device=x.device) for _ in range(2))
    if C:
        run = _backward_launch("moe_gather", dt, C, tile_rows, 1)
        with TorchLaunch() as launch:
            run(launch.stream, x.data_ptr(), dy.data_ptr(), gates.data_ptr(),
                0 if b2 is None else b2.data_ptr(), row_pair.data_ptr(), tile_e.data_ptr(),
                tile_r.data_ptr(), offsets.data_ptr(), ntiles.data_ptr(), xg.data_ptr(),
                dyg.data_ptr(), do.data_ptr(), gate.data_ptr(), pair.data_ptr(), tok.data_ptr(),
                dg.data_ptr(), db2.data_ptr(), row0, tile_rows, H, P, topk, E)
    return xg, dyg, do, gate, pair, tok


@on_operand_device
def moe_route(expert_ids: Tensor, num_experts: int, block_m: int = 64) -> tuple[Routing, Tensor]:
    """Build the routing index on the GPU for ``expert_ids [T, topk]`` (int32/int64 CUDA tensor);
    returns (Routing of device tensors, ntiles [1]). ``tile_e/tile_r`` hold ``ntiles`` valid
    entries. For inspection and tests; :func:`moe_ffn` builds it itself."""
    check_tensor("expert_ids", expert_ids, ("int32", "int64"), ndim=2)
    if block_m not in (64, 128):
        raise PlanError(f"block_m must be 64 or 128, got {block_m}")
    import torch

    T, topk = expert_ids.shape
    plan = plan_moe(T, topk, num_experts, 8, 8, "float16", "identity", _name(expert_ids))
    plan = MoEPlan(**{**plan.__dict__, "bm": block_m})
    run = _launcher(plan)
    ints = torch.empty(run.words, dtype=torch.int32, device=expert_ids.device)
    with TorchLaunch() as launch:
        run.route(launch.stream, expert_ids.data_ptr(), ints.data_ptr(), expert_ids.device)
    counts, _, offsets, row_pair, tile_e, tile_r, ntiles = torch.split(ints, run.sizes)
    return Routing(counts, offsets, row_pair, tile_e, tile_r), ntiles


#: (raw_key of moe_ffn's tensors, activation) -> the launches their validation gave
#: (operands.validated)
_CHECKED = cache.memo("moe.checked")


def _validate(x: Any, expert_ids: Any, gates: Any, w1: Any, w2: Any, b1: Any, b2: Any,
              activation: str) -> MoEPlan:
    """Every check of moe_ffn's operands (a pitgen error naming the argument), then the plan."""
    check_tensor("x", x, MOE.dtypes, ndim=2)
    dt = _name(x)
    T, H = x.shape
    check_tensor("w1", w1, (dt,), ndim=3, shape=(None, H, None))
    E, _, F = w1.shape
    check_tensor("w2", w2, (dt,), ndim=3, shape=(E, F, H))
    check_tensor("expert_ids", expert_ids, ("int32", "int64"), ndim=2, shape=(T, None))
    topk = expert_ids.shape[1]
    check_tensor("gates", gates, ("float32", dt), ndim=2, shape=(T, topk))
    if b1 is not None:
        check_tensor("b1", b1, (dt,), ndim=2, shape=(E, F))
    if b2 is not None:
        check_tensor("b2", b2, (dt,), ndim=2, shape=(E, H))
    return plan_moe(T, topk, E, H, F, dt, activation, _name(expert_ids), device_arch())


def _checked(x: Any, expert_ids: Any, gates: Any, w1: Any, w2: Any, b1: Any, b2: Any,
             activation: str) -> _Launch:
    """``_validate`` and the operands' alignment, then the plan's launches, memoised per call
    signature (raw_key): a steady-state call finds its launches with one lookup."""
    key = raw_key(x, expert_ids, gates, w1, w2, b1, b2) if isinstance(activation, str) else None

    def check_all() -> _Launch:
        plan = _validate(x, expert_ids, gates, w1, w2, b1, b2, activation)
        _aligned_operands(x, w1, w2, b1, b2)
        return _launcher(plan)

    return validated(_CHECKED, None if key is None else (key, activation), check_all)


def moe_ffn(x: Tensor, expert_ids: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
            b1: Tensor | None = None, b2: Tensor | None = None,
            activation: str = "gelu", check: bool = True) -> Tensor:
    """Fused MoE FFN on CUDA torch tensors: ``y[t] = sum_j gates[t,j] * (act(x[t] @ w1[e] + b1[e])
    @ w2[e] + b2[e])`` with ``e = expert_ids[t,j]``.

    x [T, H] float16/bfloat16/float32 (float32 runs tf32 tensor cores); expert_ids [T, topk]
    int32/int64; gates [T, topk] float32 or x's dtype; w1 [E, H, F], w2 [E, F, H], b1 [E, F],
    b2 [E, H] in x's dtype, all contiguous on one device; H and F multiples of 8 (4 for float32).
    ``activation``: relu, gelu (tanh approximation), silu or identity.

    check=True validates that every id is in [0, E) and every gate is finite with torch ops and
    synchronises with the host once to read the verdict (skipped while torch.compile or
    torch.export traces). check=False never synchronises: pairs with out-of-range ids are
    skipped (they add nothing, and get no gradient), NaN gates propagate.

    Differentiable in x, gates, w1, w2, b1 and b2 (:func:`moe_backward`). Runs as the
    ``torch.library`` op ``pitgen::moe_ffn`` when torch traces; eagerly it launches the op's
    body directly (the same kernels, less host time), through a ``torch.autograd.Function``
    over the same body and backward when an input requires grad."""
    if not check and isinstance(activation, str):
        # a call signature seen before, nothing to differentiate: its launches, without the
        # device guard (the key holds the current device, which was the operands' then)
        key = raw_key(x, expert_ids, gates, w1, w2, b1, b2)
        run = _CHECKED.get((key, activation)) if key is not None else None
        if run is not None and run.plan.tokens and not needs_grad(x, gates, w1, w2, b1, b2):
            return run(x, expert_ids, gates, w1, w2, b1, b2)
    return _moe_ffn(x, expert_ids, gates, w1, w2, b1, b2, activation, check)


@on_operand_device
def _moe_ffn(x: Any, expert_ids: Any, gates: Any, w1: Any, w2: Any, b1: Any, b2: Any,
             activation: str, check: bool) -> Any:
    """``moe_ffn`` past its fast path, on the operands' device."""
    import torch

    if tracing():  # the op validates and plans when it runs (the rule engine is not traced)
        return ops().moe_ffn(x, expert_ids, gates, w1, w2, b1, b2, activation)
    run = _checked(x, expert_ids, gates, w1, w2, b1, b2, activation)
    T, E, topk = x.shape[0], w1.shape[0], expert_ids.shape[1]
    if check and T * topk:
        bad = torch.stack([((expert_ids < 0) | (expert_ids >= E)).sum(),
                           (~torch.isfinite(gates)).sum()]).cpu()  # the one host sync
        if bad[0]:
            raise ShapeError(f"expert_ids: {int(bad[0])} ids outside [0, {E})")
        if bad[1]:
            raise ShapeError(f"gates: {int(bad[1])} values are NaN or infinite")
    if not needs_grad(x, gates, w1, w2, b1, b2):
        # nothing to differentiate: the op's launches, without the dispatcher's host cost
        return run(x, expert_ids, gates, w1, w2, b1, b2) if T else torch.empty_like(x)
    # the op's body and backward formula through autograd, without the op's dispatch
    return _eager_function().apply(x, expert_ids, gates, w1, w2, b1, b2, activation)


#: the backward kernels' bodies, for an eager backward (the ops' names: moe_backward's kernels)
_KERNEL_BODIES = SimpleNamespace(moe_rows=expert_rows, moe_rows_act=expert_rows_act,
                                 moe_wgrad=wgrad, moe_gather=gather_rows)


@functools.cache
def _eager_function() -> type:
    """``moe_ffn`` with autograd for eager calls: a ``torch.autograd.Function`` over the op's
    body (``launch``) and :func:`moe_backward` with the routing called directly. The op
    (``pitgen::moe_ffn``) is what torch.compile sees."""
    import torch

    class MoEFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, ids: Any, gates: Any, w1: Any, w2: Any, b1: Any, b2: Any,
                    activation: str) -> Any:
            _save(ctx, (x, ids, gates, w1, w2, b1, b2, activation))
            return launch(x, ids, gates, w1, w2, b1, b2, activation)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> tuple:
            return _grads(ctx, dy, route_tensors, _KERNEL_BODIES)

    return MoEFunction


def launch(x: Tensor, expert_ids: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
           b1: Tensor | None, b2: Tensor | None, activation: str) -> Tensor:
    """The fused FFN's launches (the body of ``pitgen::moe_ffn``), after every check."""
    import torch

    run = _checked(x, expert_ids, gates, w1, w2, b1, b2, activation)
    if run.plan.tokens == 0:
        return torch.empty_like(x)
    return run(x, expert_ids, gates, w1, w2, b1, b2)


#: bytes one backward chunk holds of its tiles' expert weights (w1 and w2, gathered per tile)
#: and their gradients' partials (in the operands' dtype and in float32)
BACKWARD_CHUNK_BYTES = 512 << 20


def _act_grad(activation: str, da: Any, h: Any) -> Any:
    """d act(h) / dh applied to ``da`` (aten's own backward formulas: traceable)."""
    import torch
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, h, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(da, h)
    if activation == "relu":
        return torch.where(h > 0, da, torch.zeros((), dtype=da.dtype, device=da.device))
    return da


def _act(activation: str, h: Any) -> Any:
    import torch.nn.functional as fn
    if activation == "gelu":
        return fn.gelu(h, approximate="tanh")
    if activation == "silu":
        return fn.silu(h)
    if activation == "relu":
        return fn.relu(h)
    return h


def route_tensors(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, ...]:
    """(row_pair, tile_e, tile_r, offsets, ntiles): ``pitgen::moe_route``'s outputs, views of
    one buffer (the op copies them; an eager backward takes them as they are)."""
    r, ntiles = moe_route(expert_ids, num_experts, block_m)
    return r.row_pair, r.tile_e, r.tile_r, r.offsets, ntiles


def _bmm32(a: Tensor, b: Tensor) -> Tensor:
    """The batched product with a float32 result: of float16 operands written from cuBLAS's
    float32 accumulators where torch offers ``out_dtype`` (else rounded, then converted)."""
    import torch
    if a.dtype == torch.float16:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except TypeError:   # a torch without bmm's out_dtype
            pass
    return torch.bmm(a, b).float()


def moe_backward(x: Tensor, expert_ids: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                 b1: Tensor | None, b2: Tensor | None, activation: str,
                 dy: Tensor, route: Any = None, kernels: Any = None) -> tuple[Any, ...]:
    """(dx, dgates, dw1, dw2, db1, db2) of :func:`moe_ffn` for the output gradient ``dy``.

    Over the forward's own routing index (``pitgen::moe_route``: the expert-sorted rows and the
    BM-row tile list, built on the GPU), walked in static chunks of tiles. A chunk gathers its
    tiles' token rows (padded rows zeroed), recomputes the pre-activation h = x W1 + b1, takes
    G = dy W2ᵀ, then dgates = G · a + dy · b2 per pair (a = act(h): no second product, and no
    rounding of a, whose terms cancel), dh = act'(h) ⊙ gate · G, dx += dh W1ᵀ by token and the
    biases' gradients per tile, every sum in float32.

    On CUDA with float16 or bfloat16 operands the chunk is pitgen's backward kernels
    (``kernels``: ``torch.ops.pitgen`` where torch traces, their bodies in an eager backward):
    ``moe_gather`` builds its rows, gates and pairs in one launch and adds the bias terms of
    dgates and db2 (the eager step is host-bound, so ~40 torch ops there cost more than the
    kernel), ``moe_rows`` multiplies each tile's rows by its expert's weight where it lies (b1
    added in its epilogue), ``moe_rows_act`` takes G and leaves dh and a from its epilogue,
    adding G · a into dgates and dh's tile sums into db1 (G never stored), and the weight
    gradients are one GEMM per expert over its rows (``moe_wgrad``, over the chunks'
    rows kept in the operands' dtype): no weight copied per tile, no partials, no atomics on
    them. Elsewhere (float32, the CPU) they are batched matmuls over each tile's gathered
    weights (float16 on the tensor cores, the rest in float32), each tile's weight-gradient
    partial added into its expert's by ``index_add_``. No host synchronisation: grids and chunk
    counts come from the shapes. ``route``: the routing (``pitgen::moe_route`` where torch
    traces, its body in an eager backward)."""
    import torch

    T, H = x.shape
    E, _, F = w1.shape
    topk = expert_ids.shape[1]
    P = T * topk
    f32 = torch.float32
    dev = x.device
    dx = torch.zeros(T, H, dtype=f32, device=dev)
    dg = torch.zeros(max(P, 1), dtype=f32, device=dev)
    db1 = torch.zeros(E, F, dtype=f32, device=dev)
    db2 = torch.zeros(E, H, dtype=f32, device=dev)
    grouped = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    dw1 = dw2 = None
    if P:
        bm = block_m(P, E)  # the forward's tiles (plan_moe's rule; sizes may be symbolic here)
        row_pair, tile_e, tile_r, offsets, ntiles = (route or ops().moe_route)(expert_ids, E, bm)
        nt = tile_e.shape[0]
        # the products' dtype: the kernels take float16 and bfloat16 (fp32 accumulators); the
        # batched matmuls float16, while bfloat16's 8-bit mantissa rounded their three chained
        # products to 3% off float64 (dx, dgates), so they run it and float32 in float32
        cdt = x.dtype if grouped or x.dtype == torch.float16 else f32
        gf = gates.to(f32).reshape(-1).contiguous()
        xc, dyc = x.to(cdt), dy.to(cdt).contiguous()
        # a chunk's row tensors (float32), and without the kernels its tiles' two weights and
        # their gradients' partials
        size = torch.finfo(cdt).bits // 8
        tile_bytes = bm * (H + F) * 24 + (0 if grouped else (2 * size + 8) * H * F)
        chunk = max(1, min(nt, BACKWARD_CHUNK_BYTES // tile_bytes))
        b1f = None if b1 is None else b1.to(f32)
        b2f = None if b2 is None else b2.to(f32)
        if grouped:
            k = kernels or ops()
            whole = chunk >= nt   # one chunk: its row tensors are moe_wgrad's operands themselves
            if not whole:   # moe_wgrad's operands: every tile's rows, zero past its expert's
                rows_x, rows_dh = x.new_empty(nt * bm, H), x.new_empty(nt * bm, F)
                rows_a, rows_do = x.new_empty(nt * bm, F), x.new_empty(nt * bm, H)
        else:
            # the routing words are int32 and index as they are: no int64 copies
            ar = torch.arange(bm, device=dev, dtype=torch.int32)
            w1x, w2x = w1.to(cdt), w2.to(cdt)
            dw1 = torch.zeros(E, H, F, dtype=f32, device=dev)
            dw2 = torch.zeros(E, F, H, dtype=f32, device=dev)
        for s in range(0, nt, chunk):
            C = min(nt, s + chunk) - s
            if grouped:
                # the chunk's rows, gates, pairs and tokens in one launch, dy · b2 added into
                # dg and do's sums per tile into db2 (the eager step is host-bound: ~30 us an op)
                xg, dyg, do, gate, pair, tok = k.moe_gather(
                    xc, dyc, gf, b2f, row_pair, tile_e, tile_r, offsets, ntiles, s * bm,
                    C * bm, bm, topk, dg, db2)
                h = k.moe_rows(xg, w1, tile_e, ntiles, s * bm, bm, False, b1f)
                # G = dy W2ᵀ consumed in its epilogue: dh and a stored, G · a added into dg
                # and dh's tile sums into db1 (G never stored)
                dh, a = k.moe_rows_act(dyg, w2, h, gate, tile_e, ntiles, s * bm, bm, activation,
                                       pair, dg, db1)
                if whole:
                    rows_x, rows_dh, rows_a, rows_do = xg, dh, a, do
                else:
                    span = slice(s * bm, (s + C) * bm)
                    rows_x[span], rows_dh[span], rows_a[span], rows_do[span] = xg, dh, a, do
                dx.index_add_(0, tok, k.moe_rows(dh, w1, tile_e, ntiles, s * bm, bm, True, None))
                continue
            live = torch.arange(s, s + C, device=dev, dtype=torch.int32) < ntiles
            e = torch.where(live, tile_e[s:s + C], 0).clamp_(0, E - 1)
            rows = torch.where(live, tile_r[s:s + C], 0)[:, None] + ar   # [C, BM]
            ok = live[:, None] & (rows < offsets[e + 1][:, None]) & (rows < P)
            pair = row_pair[rows.clamp_(0, P - 1)]
            ok &= (pair >= 0) & (pair < P)   # as moe_gather: a pair id out of range is no row
            pair = torch.where(ok, pair, 0)
            tok = pair // topk
            okc = ok.to(cdt)[..., None]
            xg = xc[tok] * okc                                    # [C, BM, H]
            dyg = dyc[tok] * okc                                  # [C, BM, H]
            gate = gf[pair] * ok                                  # [C, BM]; padded rows 0
            w1c, w2c = w1x[e], w2x[e]                             # [C, H, F], [C, F, H]
            h = _bmm32(xg, w1c)
            if b1f is not None:
                h = h + b1f[e][:, None, :]
            a = _act(activation, h)
            g = _bmm32(dyg, w2c.transpose(1, 2))                  # dy W2ᵀ, float32
            dgp = (g * a).sum(-1)
            dh = _act_grad(activation, g * gate[..., None], h)
            dhc = dh.to(cdt)
            dyf = dyg.to(f32)
            if b2f is not None:
                dgp = dgp + (dyf * b2f[e][:, None, :]).sum(-1)
            dg.index_add_(0, pair.reshape(-1), dgp.reshape(-1))
            do = dyf * gate[..., None]                            # float32; padded rows 0
            db2.index_add_(0, e, do.sum(1))
            db1.index_add_(0, e, dh.sum(1, dtype=f32))
            dw2.index_add_(0, e, _bmm32(a.to(cdt).transpose(1, 2), do.to(cdt)))
            dw1.index_add_(0, e, _bmm32(xg.transpose(1, 2), dhc))
            dx.index_add_(0, tok.reshape(-1), _bmm32(dhc, w1c.transpose(1, 2)).reshape(-1, H))
        if grouped:
            # expert e's tiles are ceil(count / BM) consecutive ones, in expert order: its
            # rows' range follows from the offsets (the kernel rounds and sums them)
            dw1 = k.moe_wgrad(rows_x, rows_dh, offsets, E, bm)
            dw2 = k.moe_wgrad(rows_a, rows_do, offsets, E, bm)
    if dw1 is None:   # no pair: nothing routed
        dw1 = torch.zeros(E, H, F, dtype=f32, device=dev)
        dw2 = torch.zeros(E, F, H, dtype=f32, device=dev)
    return (dx.to(x.dtype), dg[:P].reshape(T, topk).to(gates.dtype), dw1.to(w1.dtype),
            dw2.to(w2.dtype), None if b1 is None else db1.to(b1.dtype),
            None if b2 is None else db2.to(b2.dtype))


def _save(ctx: Any, inputs: tuple) -> None:
    """What the backward needs of ``moe_ffn``'s inputs (x, ids, gates, w1, w2, b1, b2,
    activation): the op's setup and the eager function's forward."""
    *tensors, activation = inputs
    ctx.save_for_backward(*tensors)
    ctx.activation = activation


def _grads(ctx: Any, dy: Any, route: Any = None, kernels: Any = None) -> tuple:
    """``moe_ffn``'s input gradients (none for the ids and the activation) from what
    :func:`_save` kept; ``route`` and ``kernels`` as :func:`moe_backward` takes them."""
    x, ids, gates, w1, w2, b1, b2 = ctx.saved_tensors
    dx, dg, dw1, dw2, db1, db2 = moe_backward(x, ids, gates, w1, w2, b1, b2, ctx.activation, dy,
                                              route, kernels)
    return dx, None, dg, dw1, dw2, db1, db2, None


def register_backward(op: Any) -> None:
    """Register :func:`moe_backward` as ``pitgen::moe_ffn``'s autograd formula."""
    op.register_autograd(_grads, setup_context=lambda ctx, inputs, output: _save(ctx, inputs))


# -- torch module (built lazily: importing pitgen.ops.moe needs no torch) ---------------------------



def _build_module_class() -> Any:
    import torch
    from torch import nn

    ops()  # registered before any model using MoE is traced

    class MoE(nn.Module):
        """Drop-in MoE FFN block: router ``nn.Linear(H, E, bias=False)``, softmax over experts,
        top-k (gates are the top-k probabilities, not renormalised), then the fused expert FFN.

        state_dict: ``router.weight [E, H]``, ``w1 [E, H, F]``, ``w2 [E, F, H]`` and, with
        ``bias=True``, ``b1 [E, F]``, ``b2 [E, H]``; expert e computes
        ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``. ``forward(x)`` takes [..., H] and returns
        the same shape; it never synchronises with the host."""

        def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int = 1,
                     activation: str = "gelu", bias: bool = True, device: Any = None,
                     dtype: Any = None) -> None:
            super().__init__()
            if activation not in ACTIVATIONS:
                raise PlanError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
            if not 1 <= topk <= num_experts:
                raise PlanError(f"topk = {topk} must be in [1, num_experts = {num_experts}]")
            kw = {"device": device, "dtype": dtype}
            self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
            self.activation = activation
            self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
            self.w1 = nn.Parameter(torch.randn(num_experts, hidden, ffn, **kw) * hidden ** -0.5)
            self.w2 = nn.Parameter(torch.randn(num_experts, ffn, hidden, **kw) * ffn ** -0.5)
            if bias:
                self.b1 = nn.Parameter(torch.zeros(num_experts, ffn, **kw))
                self.b2 = nn.Parameter(torch.zeros(num_experts, hidden, **kw))
            else:
                self.register_parameter("b1", None)
                self.register_parameter("b2", None)

        def route(self, x2: Any) -> tuple[Any, Any]:
            """(expert_ids [N, topk] int64, gates [N, topk] float32) for rows x2 [N, H]."""
            probs = torch.softmax(self.router(x2).float(), dim=-1)
            gates, ids = probs.topk(self.topk, dim=-1)
            return ids, gates

        def forward(self, x: Any) -> Any:
            if x.shape[-1] != self.hidden:
                raise ShapeError(f"x has shape {tuple(x.shape)}; last dim must be {self.hidden}")
            x2 = x.reshape(-1, self.hidden).contiguous()
            ids, gates = self.route(x2)
            y = moe_ffn(x2, ids, gates, self.w1, self.w2, self.b1, self.b2, self.activation,
                        check=False)
            return y.reshape(x.shape)

        def extra_repr(self) -> str:
            return (f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, "
                    f"topk={self.topk}, activation={self.activation}")

    return MoE


__getattr__ = lazy_torch_classes(__name__, ("MoE",), lambda: {"MoE": _build_module_class()})


def weight_bytes(experts: int, hidden: int, ffn: int, itemsize: int = 2) -> int:
    """Bytes of all expert weights (w1 and w2): what one layer call must read at least."""
    return 2 * experts * hidden * ffn * itemsize


def flops(pairs: int, hidden: int, ffn: int) -> int:
    """Multiply-add FLOPs of both expert GEMMs over all routed pairs."""
    return 4 * pairs * hidden * ffn


__all__ = ["MOE", "MoEPlan", "Routing", "plan_moe", "moe_route", "moe_ffn", "weight_bytes", "flops",
           "ACTIVATIONS"]
