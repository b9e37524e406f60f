"""Lowering: a plan plus the operands' layouts -> the specification of one CUDA module.

Every decision that shapes generated code is made here (which kernel mode, tile, warps, stages,
vector widths, index strategy); the templates only spell the decisions out in CUDA. All GPU
kernels compute the normalised product ``C'[M',N'] = A'[M',K] * B'[K,N']`` where ``A'`` is the
sparse operand: dense × sparse (``B`` sparse) is lowered as ``C^T = B^T A^T``, and transposed
operands are just other strides.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import sympy

from .errors import PitgenError, PlanError
from .limits import GRID_Y_MAX, INT32_MAX
from .expr import Operator

DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
#: Shared memory one block may use: two blocks per SM on sm_90, one on sm_80.
SMEM_BUDGET = 112 * 1024


@dataclass(frozen=True)
class GemmForm:
    """Where M', N', K live in the user's tensors."""

    sparse: str  # plays A'[M', K]
    dense: str  # plays B'[K, N']
    out: str
    m_axis: str
    n_axis: str
    k_axis: str
    a_dims: tuple[int, int]  # dims of `sparse` holding (m', k)
    b_dims: tuple[int, int]  # dims of `dense` holding (k, n')
    c_dims: tuple[int, int]  # dims of `out` holding (m', n')


def gemm_form(op: Operator, sparse: str) -> GemmForm:
    """Recognise a matrix product (any operand order or transposition) with ``sparse`` as A'."""
    why = None
    if op.reducer != "sum" or op.epilogue or len(op.inputs) != 2:
        why = "it is not a sum of products of two tensors"
    elif op.output.rank != 2 or len(op.reduction_axes) != 1 or any(a.rank != 2 for a in op.inputs):
        why = "it is not a product of two matrices (2-D tensors, one reduction axis)"
    elif any(not isinstance(e, sympy.Symbol) for a in op.inputs for e in a.indices):
        why = "an index is not a bare axis"
    elif len({a.tensor for a in op.inputs}) != 2:
        why = "both operands are the same tensor"
    if why:
        raise PitgenError(f"no GPU kernel for {op.text!r} yet ({why}); pitgen.execute runs its "
                          f"plan on the CPU")
    names = [a.tensor for a in op.inputs]
    if sparse not in names:
        raise PlanError(f"sparse operand {sparse!r} is not an input of {op.text!r} "
                        f"(inputs: {', '.join(names)})")
    s = op.access(sparse)
    d = next(a for a in op.inputs if a.tensor != sparse)
    k = op.reduction_axes[0]
    m = next((a for a in s.axes if a != k), None)
    n = next((a for a in d.axes if a != k), None)
    if m is None or n is None or m == n or {m, n} != set(op.output.axes):
        raise PitgenError(f"no GPU kernel for {op.text!r} yet: each operand must hold the "
                          f"reduction axis {k} and one output axis")
    return GemmForm(sparse, d.tensor, op.output.tensor, m, n, k,
                    (s.bare_dim(m), s.bare_dim(k)), (d.bare_dim(k), d.bare_dim(n)),
                    (op.output.bare_dim(m), op.output.bare_dim(n)))


@dataclass(frozen=True)
class GemmSpec:
    name: str
    a_mode: str  # 'box' | 'packed' | 'rows' (the row-owner kernel, gemm_rows.cu.j2) | 'products'
    # (gemm_products.cu.j2: 1 x tk micro-tiles along m at high sparsity, a CTA per product group)
    block_list: bool  # box mode over the k-blocks listed per m-tile
    ksub: int  # k-iterations per listed block (block width / BK)
    c_pair: bool  # store two adjacent outputs at once (n contiguous, N even, aligned)
    accumulate: bool
    bm: int  # rows: the output rows one CTA owns; products: the index's list capacity (M, padded)
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    a_vec: int
    b_vec: int
    a_smem_kcontig: bool
    b_smem_ncontig: bool
    mainloop: str = "mma_sync"  # 'mma_sync' (sm_80 on) | 'wgmma' (sm_90a: wm x wn consumer warpgroups)
    c_vec: bool = False  # C rows in 16-byte stores (n contiguous, aligned, N % 8 == 0; mma.sync
    # 16-bit tiles whose warps span a multiple of 32 columns)
    gather: int = 0  # rows: active rows gathered per step (m16 groups of G // 16)
    c_mfast: bool = False  # rows: C written with adjacent threads on adjacent m (m contiguous)
    tk: int = 0  # rows: the k-tile, the micro-tile's extent along k (a compile-time constant)
    pingpong: bool = False  # wgmma: two consumers take alternate tiles whole (wm x 64 rows, wn 1;
    # rows: alternate steps)
    order_local: int = 0  # wgmma block plans: up to this many m-tiles, ordered by the kernel itself
    #: mma.sync tile kernel: launched as a programmatic dependent of the index pass (sm_90), so
    #: it waits for that grid first
    early: bool = False

    @property
    def threads(self) -> int:
        if self.mainloop == "wgmma":  # a producer warpgroup and the consumers
            return 128 * ((2 if self.pingpong else self.wm * self.wn) + 1)
        return self.wm * self.wn * 32

    def smem_bytes(self, dtype: str) -> int:
        if self.a_mode == "products":  # stages of 64 gathered rows and B's k-tile (padded)
            b = self.bk * (self.bn + 8) if self.b_smem_ncontig else self.bn * (self.bk + 8)
            return self.stages * (64 * (self.bk + 8) + b) * DTYPES[dtype]
        if self.mainloop == "wgmma" and self.a_mode == "rows":  # 64 gathered rows per stage, and
            # the owned rows' fp32 accumulator (rows padded by 8 words)
            return (self.stages * (self.gather + self.bn) * self.bk * DTYPES[dtype] + 1024
                    + 16 * self.stages + self.bm * (self.bn + 8) * 4)
        if self.mainloop == "wgmma":  # swizzled stages, 1024-byte alignment slack, the barriers
            return self.stages * (self.bm + self.bn) * self.bk * DTYPES[dtype] + 1024 + 16 * self.stages
        pad = 16 // DTYPES[dtype]
        b = self.bk * (self.bn + pad) if self.b_smem_ncontig else self.bn * (self.bk + pad)
        if self.a_mode == "rows":  # gathered rows, the fp32 accumulator, step and row lists (and
            # accumulating, a flag per owned row)
            lists = (self.threads * (4 + 2 * (self.bm // self.gather))
                     + 2 * (self.stages + 1) * self.gather + (self.bm if self.accumulate else 0))
            return (self.stages * (self.gather * (self.bk + pad) + b) * DTYPES[dtype]
                    + self.bm * (self.bn + 4) * 4 + lists)
        a = self.bm * (self.bk + pad) if self.a_smem_kcontig else self.bk * (self.bm + pad)
        return self.stages * (a + b) * DTYPES[dtype]


#: 16-byte loads each thread of a vector-strategy index CTA keeps in flight: 32 KB a CTA. With 2
#: (8 KB CTAs, 4,096 of them for a 4096^2 operand in 1 x 64 tiles) the pass took 19.3 us on an
#: H200 where a streaming read of the same 32 MB takes 14.4.
INDEX_VECTOR_LOADS = 8


@dataclass(frozen=True)
class IndexSpec:
    name: str
    kind: str  # 'micro' | 'block'
    strategy: str  # 'thread' | 'warp' | 'vector' (micro)
    long_extent: int  # L: extent of a micro-tile along its long dim (micro)
    pack: bool  # write the packed values (micro along k)
    block_rows: int  # block extent along m' (block)
    block_cols: int  # block extent along k (block)
    id_contiguous: bool  # block: adjacent k adjacent in memory
    vec: int = 1  # block: elements per 16-byte test where the layout allows (checked at run time)
    id_block: int = 0  # micro: ids listed per run of this many (rows: the GEMM's row block)
    ordered: bool = False  # block: the last CTA also sorts the groups by count (wgmma m-tile order)
    row_table: bool = False  # rows: also each row's k-tile bits and list places (products kernel)
    lanes: int = 0  # vector: threads per tile (16-byte vectors in one tile)

    @property
    def per_block(self) -> int:
        """Tiles one 256-thread index CTA tests: a thread each, a warp each, INDEX_VECTOR_LOADS
        16-byte vectors a thread, or (blocks) all of it for one."""
        if self.kind == "block":
            return 1
        if self.strategy == "vector":
            return INDEX_VECTOR_LOADS * 256 // self.lanes
        return {"thread": 256, "warp": 8}[self.strategy]


@dataclass(frozen=True)
class ModuleSpec:
    dtype: str
    expression: str
    sparse: str
    plan_kind: str
    plan_axis: str | None
    plan_shape: tuple[int, ...]
    gemm: GemmSpec
    index: IndexSpec | None
    fused: bool = False  # also pit_gemm_fused: the index pass and the tiles in one launch

    def context(self) -> dict:
        """Template context of ``module.cu.j2``: every decision, nested as the dataclasses
        (the index's with its CTA's tile count)."""
        ctx = asdict(self)
        if self.index is not None:
            ctx["index"]["per_block"] = self.index.per_block
        if self.gemm.a_mode == "products":
            ctx["gemm"].update(kt_max=PRODUCTS_KT_MAX, ctas_per_sm=PRODUCTS_CTAS_PER_SM,
                              finish_threads=PRODUCTS_FINISH_THREADS, l2_keep=PRODUCTS_L2_KEEP)
        return ctx


@dataclass(frozen=True)
class Layout:
    """Extents and element strides of the normalised problem, plus pointer alignment (bytes)."""

    M: int
    N: int
    K: int
    sa: tuple[int, int]  # A' (m', k)
    sb: tuple[int, int]  # B' (k, n')
    sc: tuple[int, int]  # C' (m', n')
    align_a: int = 16
    align_b: int = 16
    align_c: int = 16


@dataclass(frozen=True)
class Schedule:
    """Optional overrides of the tile kernel's schedule (None: the heuristic's choice)."""

    bn: int | None = None
    bk: int | None = None
    wm: int | None = None
    wn: int | None = None
    stages: int | None = None
    bm: int | None = None  # rows mode only: the output rows one CTA owns (a multiple of 64)
    #: micro-tiles along m: 'products' prefers the products kernel (rows with at most a product
    #: or two: very sparse masks) where it fits the layout, else (None) the row-owner kernel
    rows: str | None = None


def _vec(dtype: str, extent: int, other_stride: int, align: int) -> int:
    """Widest copy (elements, at most 16 bytes) that keeps every chunk inside one aligned run."""
    size = DTYPES[dtype]
    v = 16 // size
    while v > 1 and (extent % v or other_stride % v or align % (v * size)):
        v //= 2
    return v


#: Tuned defaults by the tile's m extent: (BN, BK, warps along m, warps along n, stages). From
#: scripts/tune_schedules.py on an H100 (fp16, 4096^3; docs/performance.md).
SCHEDULES = {128: (128, 64, 2, 4, 3), 64: (256, 32, 2, 4, 4), 32: (256, 32, 1, 4, 3),
             16: (128, 32, 1, 4, 3)}


#: Packed micro-tiles along k in fp16/bf16 on sm_90, which stay on mma.sync there
#: (docs/hopper.md): (BN, BK, warps along m and n, stages) by the tile's m extent, from sweeps
#: on an H200 (fp16 4096^3; docs/performance.md). Session 48, with B' gathered through L1:
#: 32x1 at 50/10/1% 397/103/34 -> 305/83/36 us and 16x1 at 10% 153 -> 138 us with 256-wide
#: 2-stage tiles; 64 and 128 rows keep session 47's 128-wide 3-stage one. SCHEDULES (tuned
#: on an H100 for sm_80) stay for the other archs and fp32 (whose 128-row tile would spill at
#: one warp along m).
PACKED_SM90 = {16: (256, 32, 1, 8, 2), 32: (256, 32, 1, 4, 2), 64: (128, 32, 1, 4, 3),
               128: (128, 32, 1, 4, 3)}

#: Copies per thread and k-step of a B' tile that no vector load can move (an unaligned or
#: odd-strided B'), beyond which the default BN halves (down to 64): each copy is an unrolled
#: scalar load with its own pointer, and a 256-wide tile of them (128 per thread) took nvcc
#: 15 s to compile, against 3 s for the same kernel at this cap.
SCALAR_CHUNKS = 32

#: Devices whose tile kernels run on wgmma (compiled for sm_90a); others keep mma.sync.
WGMMA_ARCHS = ("sm_90",)
#: Dynamic shared memory one wgmma CTA may use (one CTA per SM).
WGMMA_SMEM = 227 * 1024


def _tma_dim(strides: tuple[int, int], extents: tuple[int, int], size: int,
             align: int) -> int | None:
    """The operand's contiguous dim (0 or 1) when a TMA tensor map can describe it (unit
    stride there, the other a multiple of 16 bytes past the row, 16-byte aligned base)."""
    for d in (1, 0):
        other = strides[1 - d]
        if (strides[d] == 1 and (other * size) % 16 == 0 and other >= extents[d]
                and align % 16 == 0):
            return d
    return None


#: Which wgmma plans run ping-pong consumers (alternate whole tiles, one's epilogue under the
#: other's products, each tile at most 128 x 128) rather than split ones (each consumer 64 rows
#: of every 128 x 256 tile): "always" or "never". Ping-pong and a 128-wide tile for sparse block
#: plans led until their tiles were drawn from a counter (session 17); since then the split
#: 128 x 256 tile is as fast or faster at every density measured (H200, 128x128 blocks, whole
#: call, split 256 / split 128 / ping-pong 128, ms: 4096^3 fp16 at 10% 0.051 / 0.056 / 0.053,
#: at 30% 0.092 / 0.106 / 0.099, at 50% 0.133 / 0.149 / 0.151; 8192^3 fp16 at 10% 0.238 /
#: 0.263 / 0.272, at 50% 0.870 / 1.088 / 1.128; bf16 alike but 4096^3 at 10%: 0.052 / 0.053 /
#: 0.048).
PINGPONG = "never"


#: Block plans on wgmma with at most this many m-tiles have the tile kernel's producer warpgroup
#: order the m-tiles by count (a rank each, from the counts, in shared memory), not the index
#: pass's last CTA: its fences, atomic and sort took 3 us after the scan of a 4096^3 operand
#: (H100, a per-CTA %globaltimer trace). 256 m-tiles are 512 comparisons per producer thread.
ORDER_LOCAL = 256


def _c_vec(layout: Layout, size: int) -> bool:
    """Whether C' rows take 16-byte chunks: n contiguous, rows and base 16-byte aligned, N a
    multiple of 8."""
    return (layout.sc[1] == 1 and (layout.sc[0] * size) % 16 == 0 and layout.N % 8 == 0
            and layout.align_c % 16 == 0)


def _c_rows_vec(layout: Layout, size: int, accumulate: bool) -> bool:
    """Whether a tile kernel writes C' in 16-byte row chunks: _c_vec, nothing to read back."""
    return not accumulate and _c_vec(layout, size)


def _c_pair(layout: Layout, size: int) -> bool:
    """Whether two adjacent outputs store at once: n contiguous, N and the row stride even, the
    base aligned to the pair."""
    return (layout.N % 2 == 0 and layout.sc[1] == 1 and layout.sc[0] % 2 == 0
            and layout.align_c % (2 * size) == 0)


def _b_copies(dtype: str, layout: Layout, kext: int | None) -> tuple[bool, int]:
    """B' in shared memory as [k][n] (else [n][k]) and its elements per copy: vectors along n
    where n is contiguous, along k where k is (vectors dividing ``kext``; None: not taken
    along k), else one element at a time."""
    if layout.sb[1] == 1:
        return True, _vec(dtype, layout.N, layout.sb[0], layout.align_b)
    if layout.sb[0] == 1 and kext is not None:
        return False, _vec(dtype, kext, layout.sb[1], layout.align_b)
    return True, 1


def _hopper(block_list: bool, tk: int, bm: int, dtype: str, layout: Layout, accumulate: bool,
            c_pair: bool) -> GemmSpec | None:
    """The wgmma kernel for a box plan (dense, or k-blocks listed per m-tile) on sm_90a, or None
    where only the mma.sync one fits: fp16 and bf16, 64- or 128-row tiles, k-blocks of whole
    64-wide k-tiles, and operands TMA can map."""
    size = DTYPES[dtype]
    if dtype == "float32" or bm not in (64, 128) or (block_list and tk % 64):
        return None
    da = _tma_dim(layout.sa, (layout.M, layout.K), size, layout.align_a)
    db = _tma_dim(layout.sb, (layout.K, layout.N), size, layout.align_b)
    if da is None or db is None:
        return None
    wm = bm // 64
    pingpong = PINGPONG == "always"
    # a ping-pong consumer holds a whole tile's accumulators: at most 128 x 128
    bn = 256 if layout.N > 128 and not (pingpong and bm == 128) else 128
    wn = 1 if pingpong else 2 // wm
    order_local = ORDER_LOCAL if block_list else 0   # two int arrays of static shared memory
    stages = min(8, (WGMMA_SMEM - 2048 - 8 * order_local) // ((bm + bn) * 64 * size))
    c_vec = _c_rows_vec(layout, size, accumulate)
    return GemmSpec("pit_gemm", "box", block_list, tk // 64 if block_list else 1,
                    c_pair, accumulate, bm, bn, 64, wm, wn, stages, 16 // size, 16 // size,
                    da == 1, db == 1, "wgmma", c_vec, pingpong=pingpong,
                    order_local=order_local)


#: The row-owner kernel's defaults (rows mode): BN, BK (at most), rows gathered per step, warps
#: along the gathered rows and along n, stages. BM, the rows a CTA owns, is the first of ROWS_BM
#: that covers M. Every row block reads all of B' (M/BM times in all) and every column slab the
#: active rows of A' (N/BN times), while the BM x BN fp32 accumulator must fit beside the
#: pipeline: 512 x 32 reads B' half as often as 256 x 64 for the same accumulator, which is
#: what sparse rows want (at 90% sparsity the A' reads are a fifth of the B' reads; at 99% a
#: fiftieth). BK up to 64: one stage per 1 x 64 k-tile, half the iterations of BK 32 with the
#: same MMAs (H100, 4096^3 fp16, 512 x 32: 0.574 -> 0.415 ms at 90%, 0.509 -> 0.330 ms at 99%;
#: an iteration costs about the same whatever its work, docs/performance.md). At most 110 KiB
#: of shared memory in fp16: two CTAs per H100 SM.
ROWS_SCHEDULE = (32, 64, 64, 4, 2, 4)
ROWS_BM = (64, 128, 256, 512)


def rows_block(rows: int) -> int:
    """BM, the rows of C' a row-owner CTA owns when C' has ``rows`` (the planner counts that
    kernel's steps per row block: each k-tile's active rows of a block take whole steps)."""
    return next((b for b in ROWS_BM if b >= rows), ROWS_BM[-1])


def _fit(gemm: GemmSpec, dtype: str, stages: bool = True, bn: bool = True,
         bm: bool = False) -> GemmSpec:
    """``gemm`` within SMEM_BUDGET as far as the knobs it may turn allow: fewer stages (down to
    2), then half of BN (down to 32), then (rows mode) half of BM (down to 64)."""
    while gemm.smem_bytes(dtype) > SMEM_BUDGET:
        if stages and gemm.stages > 2:
            gemm = replace(gemm, stages=gemm.stages - 1)
        elif bn and gemm.bn > 32:
            half = gemm.bn // 2
            gemm = replace(gemm, bn=half, wn=min(gemm.wn, max(1, half // 16)))
        elif bm and gemm.bm > 64:
            gemm = replace(gemm, bm=gemm.bm // 2)
        else:
            break
    return gemm


#: Static shared memory of the wgmma row-owner kernel beside its dynamic stages and accumulator
#: (the producers' ids in flight, a window of counts for the producers and for each consumer
#: warpgroup, a flag per owned row), with room to spare.
ROWS_SM90_STATIC = 8192


def _hopper_rows(tk: int, bm: int, dtype: str, layout: Layout, accumulate: bool,
                 schedule: Schedule) -> GemmSpec | None:
    """The row-owner kernel on wgmma (gemm_rows_sm90.cu.j2), or None where only the mma.sync
    one fits: fp16 and bf16, k-tiles of whole 64-deep stages, A' rows gathered in 16-byte
    copies (k contiguous, rows 16-byte aligned, K a multiple of 8), B' mapped by TMA, and no
    schedule knob but BM and BN. A producer warpgroup (up to four warps, each filling its own
    stages) and two consumer warpgroups taking the steps in turn (`pingpong`), BN = 64 by
    default; at BM = 512 the fp32 accumulator takes 144 KiB, four stages most of the rest."""
    size = DTYPES[dtype]
    if (dtype == "float32" or tk not in (64, 128, 256) or layout.sa[1] != 1
            or (layout.sa[0] * size) % 16 or layout.align_a % 16 or layout.K % 8
            or (schedule.bk, schedule.wm, schedule.wn, schedule.stages) != (None,) * 4):
        return None
    db = _tma_dim(layout.sb, (layout.K, layout.N), size, layout.align_b)
    bn = schedule.bn or 64
    if db is None or bn % 64 or bn > 256:
        return None
    acc = bm * (bn + 8) * 4
    stage = (64 + bn) * 64 * size + 16
    fit = (WGMMA_SMEM - ROWS_SM90_STATIC - 1024 - acc) // stage
    # 4 or 8 stages, each producer warp's own, at least two k-tiles' worth
    stages = 8 if fit >= 8 else 4 if fit >= 4 else 0
    if 2 * (tk // 64) > stages:
        return None
    c_vec = _c_rows_vec(layout, size, accumulate)
    return GemmSpec("pit_gemm", "rows", False, 1, False, accumulate, bm, bn, 64, 1, 1, stages,
                    16 // size, 16 // size, True, db == 1, "wgmma", c_vec, gather=64, pingpong=True,
                    c_mfast=not c_vec and layout.sc[0] == 1 and layout.sc[1] != 1, tk=tk)


def _rows(tk: int, dtype: str, layout: Layout, accumulate: bool,
          schedule: Schedule, arch: str = "sm_80") -> tuple[GemmSpec, IndexSpec]:
    """The row-owner kernel of 1 x tk micro-tiles along m and its index (the active rows of each
    k-tile listed per row block of BM): each CTA owns BM rows x BN columns, walks the k-tiles in
    order and keeps the owned rows' sums in an fp32 accumulator in shared memory (a k-tile's
    gathered rows differ from the next one's, so no register holds a row), and writes C once:
    no workspace, no atomics, a grid of exactly the output tiles."""
    size, kstep = DTYPES[dtype], 8 if dtype == "float32" else 16
    bn, bk_max, gather, wm, wn, stages = ROWS_SCHEDULE
    bm = schedule.bm or rows_block(layout.M)
    if schedule.bn:
        bn, wn = schedule.bn, max(1, min(8 // wm, schedule.bn // 16))
    wm, wn, stages = schedule.wm or wm, schedule.wn or wn, schedule.stages or stages
    # fp32 keeps BK 32: a 64-deep fp32 stage would cost the 512-row block (not measured)
    bk = schedule.bk or min(bk_max if size == 2 else 32, -(-tk // kstep) * kstep)
    gather = min(gather, bm)
    if bk % kstep:
        raise PlanError(f"BK = {bk} does not fit the {dtype} mma shape (a multiple of {kstep})")
    if bm % 64 or gather % (16 * wm) or bn % (16 * wn if dtype != "float32" else 8 * wn):
        raise PlanError(f"{wm}x{wn} warps do not divide the row-owner tile (rows {bm}, gathered "
                        f"{gather} at a time, BN {bn}) into mma tiles")
    # k-tile boundaries must not split a copy: vectors along k divide tk as well as K
    kext = layout.K if tk >= layout.K else math.gcd(layout.K, tk)
    a_vec = _vec(dtype, kext, layout.sa[0], layout.align_a) if layout.sa[1] == 1 else 1
    b_nc, b_vec = _b_copies(dtype, layout, kext)
    c_pair = _c_pair(layout, size)
    gemm = GemmSpec("pit_gemm", "rows", False, 1, c_pair, accumulate, bm, bn, bk, wm, wn, stages,
                    a_vec, b_vec, True, b_nc, gather=gather,
                    c_mfast=not c_pair and layout.sc[0] == 1 and layout.sc[1] != 1, tk=tk)
    gemm = _fit(gemm, dtype, schedule.stages is None, schedule.bn is None, schedule.bm is None)
    if arch in WGMMA_ARCHS:
        gemm = _hopper_rows(tk, bm, dtype, layout, accumulate, schedule) or gemm
    if gemm.smem_bytes(dtype) > SMEM_BUDGET and gemm.mainloop != "wgmma":
        raise PlanError(f"the row-owner tile {gemm.bm}x{gemm.bn}x{bk} with {gemm.stages} stages "
                        f"needs {gemm.smem_bytes(dtype)} bytes of shared memory (at most "
                        f"{SMEM_BUDGET})")
    # k contiguous: a tile is a run of tk elements, tested in 16-byte vectors where they are
    # whole, a warp's lanes hold whole tiles and a CTA's 64 tiles take whole rounds of 256
    # threads (4 to 32 threads per tile), else a warp per tile
    tpt = tk * size // 16
    strategy = ("thread" if layout.sa[1] != 1 else
                "vector" if (tk * size) % 16 == 0 and tpt in (4, 8, 16, 32) and gemm.bm % 64 == 0
                else "warp")
    return gemm, IndexSpec("pit_build_index", "micro", strategy, tk, False, 0, 0, False,
                           id_block=gemm.bm, lanes=tpt if strategy == "vector" else 0)


#: The products kernel: k-tiles at most (their prefix sums live in each CTA's shared memory),
#: persistent CTAs per SM (three of 256 threads: 85 registers each), its tile (BN, warps along
#: m, n) and cp.async stages. H200, 4096^3 at 99%, products kernel alone: BN 128 with three CTAs
#: an SM 29.5 us, with two 30.9 (H100 33.9, 34.5), BN 256 with two 31.2 (three stages 38.2 on
#: the H100), BN 128 with four CTAs (64 registers) 38.2 on the H100.
PRODUCTS_KT_MAX = 512
PRODUCTS_CTAS_PER_SM = 3
PRODUCTS_TILE = (128, 2, 4)
PRODUCTS_STAGES = 2
#: threads of the finishing pass's CTA (a row of C' each; 64-1024 measured, 256 the fastest)
PRODUCTS_FINISH_THREADS = 256
#: bytes of slots the products kernel stores evict_last (the finishing pass discards every slot
#: line it reads, so that none is written back): about half the L2 of the A100 and Hopper parts
#: (40-50 MB; a part with a smaller L2 gets the same share, not measured there). H100, 4096^3 at
#: 99%, whole call: 0 / 12 / 24 / 40 MB 75.8-76.4 / 75.7-76.0 / 74.8-75.8 / 75.8-76.1 us,
#: 77.4-78.5 before (docs/performance.md, session 30)
PRODUCTS_L2_KEEP = 24 << 20
#: fp32 slot rows per row of C' (N columns each): a product whose place in the k-tile-major list
#: of all products is past them is formed by the finishing pass itself, correct but slow
PRODUCTS_SLOTS_PER_ROW = 2
#: micro-tile extents along k that the products kernel takes (its index tests 16-byte vectors)
PRODUCTS_EXTENTS = (32, 64, 128, 256)


def products_fit(products: int, rows: int) -> bool:
    """Whether a mask of ``products`` micro-tiles over ``rows`` rows of C' is the products
    kernel's to run: at most PRODUCTS_SLOTS_PER_ROW per row on average, so that its slots hold
    them (the planner prices it there, and the matmul API then asks lowering for it)."""
    return products <= rows * PRODUCTS_SLOTS_PER_ROW


def _products(tk: int, dtype: str, layout: Layout, accumulate: bool
              ) -> tuple[GemmSpec, IndexSpec] | None:
    """The products kernel of 1 x tk micro-tiles along m (gemm_products.cu.j2) and its index
    (each k-tile's active rows in one list, plus the row table), or None where it does not fit:
    fp16/bf16, A' rows gathered in 16-byte copies (k contiguous, rows and base 16-byte aligned,
    K a multiple of 8), a k-tile the index tests in 16-byte vectors (32 to 256 wide), at most
    PRODUCTS_KT_MAX k-tiles. Its cost follows the products, not the k-tiles: the plan for masks
    where rows of C' hold one or two on average (the row-owner kernel walks every k-tile of
    every row block whatever it holds)."""
    size = DTYPES[dtype]
    if (dtype == "float32" or tk not in PRODUCTS_EXTENTS or layout.sa[1] != 1
            or (layout.sa[0] * size) % 16 or layout.align_a % 16 or layout.K % 8
            or -(-layout.K // tk) > PRODUCTS_KT_MAX):
        return None
    bn, wm, wn = PRODUCTS_TILE
    b_nc, b_vec = _b_copies(dtype, layout, math.gcd(layout.K, tk))
    ids = -(-layout.M // 64) * 64
    gemm = GemmSpec("pit_gemm", "products", False, 1, _c_pair(layout, size), accumulate, ids, bn,
                    min(tk, 64), wm, wn, PRODUCTS_STAGES, 16 // size, b_vec, True, b_nc,
                    c_vec=_c_vec(layout, size), tk=tk)
    return gemm, IndexSpec("pit_build_index", "micro", "vector", tk, False, 0, 0, False,
                           id_block=ids, row_table=True, lanes=tk * size // 16)


def _warps(bm: int, bn: int) -> tuple[int, int]:
    """Warps along m and n when BN is overridden: warp tiles of at most 64 rows, <= 8 warps."""
    wm = max(1, bm // 64)
    return wm, max(1, min(8 // wm, bn // 16))


def lower(op: Operator, sparse: str, kind: str, axis: str | None, shape: tuple[int, ...],
          dtype: str, layout: Layout, accumulate: bool = False,
          schedule: Schedule = Schedule(), arch: str = "sm_80") -> ModuleSpec:
    """The module that runs one plan choice (kind/axis/shape over ``sparse``) on ``layout``
    for a device of ``arch`` (``sm_90``: the wgmma kernel where it fits the plan, unless a
    schedule override asks for the mma.sync one's knobs)."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} has no GPU kernel (supported: {', '.join(DTYPES)})")
    if schedule.rows not in (None, "products"):
        raise PlanError(f"Schedule.rows is {schedule.rows!r}; expected 'products' or None")
    f = gemm_form(op, sparse)
    for what, n in (("M*K", layout.M * layout.K), ("K*N", layout.K * layout.N),
                     ("M*N", layout.M * layout.N)):
        if n > INT32_MAX:
            raise PlanError(f"{what} = {n} elements would overflow the kernels' int32 indices")
    kstep = 8 if dtype == "float32" else 16
    sm, sk = f.a_dims
    tm, tk = (shape[sm], shape[sk]) if shape else (0, 0)
    # A micro-tile or block clipped to the operand spans all of M' (or all of K): there is one
    # such tile along that dim, so the next extent the kernels have computes the same thing.
    if kind in ("micro", "block"):
        if 1 < tm >= layout.M:
            tm = next((b for b in sorted(SCHEDULES) if b >= tm), tm)
        if 1 < tk >= layout.K:
            tk = -(-tk // kstep) * kstep
    index = None
    block_list, a_mode = False, "box"
    bk = schedule.bk
    if kind == "dense":
        bm = 128
    elif kind == "block":
        bm, bk = tm, min(tk, 32 if dtype == "float32" else 64)
        block_list = True
        vec = 16 // DTYPES[dtype]  # the kernel takes the 16-byte path when the layout allows
        index = IndexSpec("pit_build_index", "block", "warp", 0, False, tm, tk, layout.sa[1] == 1,
                          vec if tk % vec == 0 else 1)
    elif kind == "micro" and axis == f.k_axis:
        bm = tm
        a_mode = "packed"
        strategy = "thread" if layout.sa[1] == 1 else "warp"
        index = IndexSpec("pit_build_index", "micro", strategy, tm, True, 0, 0, False)
    elif kind == "micro" and axis == f.m_axis:
        products = _products(tk, dtype, layout, accumulate) if schedule.rows == "products" else None
        gemm, index = products or _rows(tk, dtype, layout, accumulate, schedule, arch)
        return ModuleSpec(dtype, op.text, sparse, kind, axis, tuple(shape), gemm, index)
    else:
        raise PlanError(f"plan {kind} along {axis} has no GPU kernel for {op.text!r}")
    if bm not in SCHEDULES:
        raise PlanError(f"tile {bm}x{tk or bk} of {sparse} does not fit the {dtype} mma shape "
                        f"(m extent 16, 32, 64 or 128)")
    packed_sm90 = a_mode == "packed" and arch in WGMMA_ARCHS and dtype != "float32"
    bn, bk_def, wm, wn, stages = PACKED_SM90[bm] if packed_sm90 else SCHEDULES[bm]
    if schedule.bn:
        bn = schedule.bn
        wm, wn = _warps(bm, bn)
    bk = bk or (bk_def if dtype != "float32" else 32)
    wm, wn, stages = schedule.wm or wm, schedule.wn or wn, schedule.stages or stages
    if bk % kstep or (block_list and tk % bk):
        raise PlanError(f"tile {bm}x{tk or bk} of {sparse} does not fit the {dtype} mma shape "
                        f"(k extent a multiple of {kstep})")
    if bm % (16 * wm) or bn % (16 * wn if dtype != "float32" else 8 * wn):
        raise PlanError(f"{wm}x{wn} warps do not divide the {bm}x{bn} tile into mma tiles")
    if a_mode == "packed":
        a_kc, a_vec = False, 16 // DTYPES[dtype]
    elif layout.sa[1] == 1:
        a_kc, a_vec = True, _vec(dtype, layout.K, layout.sa[0], layout.align_a)
    elif layout.sa[0] == 1:
        a_kc, a_vec = False, _vec(dtype, layout.M, layout.sa[1], layout.align_a)
    else:
        a_kc, a_vec = True, 1
    b_nc, b_vec = _b_copies(dtype, layout, None if a_mode == "packed" else layout.K)
    if schedule == Schedule() and b_vec == 1:   # scalar copies of B': see SCALAR_CHUNKS
        while bn > 64 and bk * bn // (32 * wm * wn) > SCALAR_CHUNKS:
            bn //= 2
    c_pair = _c_pair(layout, DTYPES[dtype])
    gemm = GemmSpec("pit_gemm", a_mode, block_list, tk // bk if block_list else 1,
                    c_pair, accumulate, bm, bn, bk, wm, wn, stages, a_vec, b_vec, a_kc, b_nc)
    if schedule == Schedule():
        gemm = _fit(gemm, dtype)
    if DTYPES[dtype] == 2 and (gemm.bn // gemm.wn) % 32 == 0:   # quad_chunk's four 8-column chunks
        gemm = replace(gemm, c_vec=_c_rows_vec(layout, 2, accumulate))
    gemm = replace(gemm, early=arch in WGMMA_ARCHS)
    if arch in WGMMA_ARCHS and schedule == Schedule() and a_mode == "box":
        gemm = _hopper(block_list, tk, bm, dtype, layout, accumulate, c_pair) or gemm
        if gemm.mainloop == "wgmma" and block_list:   # persistent CTAs take m-tiles longest first
            index = replace(index, ordered=True)
    return ModuleSpec(dtype, op.text, sparse, kind, axis, tuple(shape), gemm, index)


def lower_first(op: Operator, sparse: str, choices: list[tuple], dtype: str, layout: Layout,
                **options) -> tuple[int, ModuleSpec]:
    """The first of ``choices`` ((kind, axis, shape), best first) that has a kernel
    on ``layout``, with its position: an 'auto' plan falls back through its candidates (dense
    last) instead of refusing. The first choice's PlanError when none has."""
    first: PlanError | None = None
    for i, (kind, axis, shape) in enumerate(choices):
        try:
            return i, lower(op, sparse, kind, axis, shape, dtype, layout, **options)
        except PlanError as e:
            first = first or e
    raise first if first is not None else PlanError("no plan to lower")


@dataclass(frozen=True)
class Geometry:
    """Launch shapes of one lowered GEMM: the tile kernel's grid, the k extent of a rows-mode
    k-tile, the index's lists and their capacity, the index build's grid and its (long
    stride, id stride, long extent, id extent) arguments, and the flat grid of the K = 0 pass."""

    grid: tuple[int, ...]
    tk: int
    groups: int
    cap: int
    index_grid: tuple[int, int]
    index_args: tuple[int, int, int, int]
    flat: tuple[int, int]
    finish: tuple[int, int] = (0, 0)  # products: the finishing pass, a CTA per row of C'


def geometry(spec: ModuleSpec, layout: Layout, sms: int = 132) -> Geometry:
    """Grids and index sizes of ``spec`` on ``layout`` (``sms``: the device's multiprocessors,
    one persistent wgmma CTA each, PRODUCTS_CTAS_PER_SM products CTAs); PlanError past CUDA's
    grid limits. Rows mode lists each k-tile's rows per row block: list kt * (row blocks) + rb,
    BM ids each (products: one row block of all M)."""
    M, N, K, g, ix = layout.M, layout.N, layout.K, spec.gemm, spec.index
    rows = g.a_mode in ("rows", "products")
    tk = ix.long_extent if rows and ix else 0
    grid_m = (M + g.bm - 1) // g.bm
    groups = cap = 0
    index_grid: tuple[int, int] = (0, 0)
    index_args = (0, 0, 0, 0)
    if ix is not None:
        if rows:
            lines = (K + tk - 1) // tk  # the index grid's rows: k-tiles
            groups, cap = lines * grid_m, g.bm
            index_args = (layout.sa[1], layout.sa[0], K, M)
            ids = M
        else:
            lines = groups = grid_m
            cap = K if g.a_mode == "packed" else (K + g.bk * g.ksub - 1) // (g.bk * g.ksub)
            index_args = (layout.sa[0], layout.sa[1], M, K)
            ids = cap
        if lines > GRID_Y_MAX:
            raise PlanError(f"{lines} tile groups exceed the grid limit {GRID_Y_MAX}")
        index_grid = ((ids + ix.per_block - 1) // ix.per_block, lines)
    grid: tuple[int, ...] = ((N + g.bn - 1) // g.bn, grid_m)
    if g.mainloop == "wgmma" and not rows:  # persistent CTAs; rows: a CTA per output tile
        grid = (max(1, min(grid[0] * grid[1], sms)), 1)
    finish = (0, 0)
    if g.a_mode == "products":  # persistent CTAs over the products; the finish: a CTA per row
        grid, finish = (max(1, sms) * PRODUCTS_CTAS_PER_SM, 1), (M, 1)
    if grid_m > GRID_Y_MAX:
        raise PlanError(f"{grid_m} m-tiles exceed the grid limit {GRID_Y_MAX}")
    return Geometry(grid, tk, groups, cap, index_grid, index_args,
                    (min((M * N + 255) // 256, 65535), 1), finish)


#: the most CTAs (index pass and output tiles together) of a fused launch: one wave on any
#: sm_80+ data-center GPU (108 SMs and up), where a second driver call would cost the host more
#: than the problem costs the GPU
FUSED_MAX_CTAS = 96


def fuse(spec: ModuleSpec, geo: Geometry) -> ModuleSpec:
    """``spec`` with the one-launch kernel (gemm_fused.cu.j2) where it applies: an mma.sync tile
    kernel over an index (packed micro-tiles along k, or listed blocks, unordered) whose index
    CTAs and output tiles together fit FUSED_MAX_CTAS."""
    g, ix = spec.gemm, spec.index
    if ix is None or g.mainloop != "mma_sync" or g.a_mode in ("rows", "products") or ix.ordered \
            or g.threads > 256:
        return spec
    ctas = geo.index_grid[0] * geo.index_grid[1] + geo.grid[0] * geo.grid[1]
    return replace(spec, fused=True) if ctas <= FUSED_MAX_CTAS else spec
