"""SDDMM ``S[i,j] += Q[i,d] * K[j,d]`` only where a dynamic mask is set.

The rules say i and j are spatial and invariant (tiles of S can be computed in any order and
written to their own place: SRead of Q's and K's rows, SWrite of S) and d is a reduction. So the
non-empty tiles of the mask are found on the GPU every call (atomic appends, buffers sized for the
upper bound, no host sync), each CTA multiplies a row group of Q by the gathered K rows of its
listed tiles on tensor cores, and masked elements get the product, the others an exact 0.

A ``(1, L)`` tile of S is an ``(L, 1)`` tile of Sᵀ = K Qᵀ: it runs the same kernel with Q and K,
and the mask's and output's strides, swapped.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import cache, lower
from ..errors import PlanError, ShapeError
from ..limits import GRID_Y_MAX, INDEX_THREADS
from ..operands import check_tensor, on_operand_device
from ..opspec import OpSpec, Permutation
from ..runtime import TorchLaunch, device_arch
from .library import no_backward, ops

if TYPE_CHECKING:
    from torch import Tensor

EXPR = "S[i,j] += Q[i,d] * K[j,d]"
EXTENTS = (16, 32, 64)           # tile extents along the dense-row side (mma's m16 multiple)
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # tile extents along the gathered side (divide BN = 64)
BN = 64
#: The wgmma kernel's k-steps in flight (4 x (8 KB of K rows + TH x 128 B of Q rows): three to
#: five CTAs per SM).
WGMMA_STAGES = 4
SDDMM = OpSpec(
    "sddmm", "sddmm.cu.j2",
    {"pit_sddmm_index": "PiiiiiPP", "pit_sddmm_tiles": "PiiPiiPiiiiiifPPPiiPPPP"},
    # a (th, tw) tile gathers rows of Q and rows of K in any order (SRead) and its values go
    # back to their own (i, j) (SWrite): both spatial axes are permuted
    permutes=(Permutation("rows", EXPR, "spatial", "Q"),
              Permutation("columns", EXPR, "spatial", "K")),
    dtypes=("float16", "bfloat16", "float32"))


@dataclass(frozen=True)
class SddmmConfig:
    """What the template needs for one problem: tile in the kernels' (untransposed) view, dtype,
    which axis adjacent threads walk when loading Q, K and the mask."""

    dtype: str
    th: int
    tw: int
    transposed: bool
    strategy: str            # index: "thread" (one thread per tile) or "warp"
    lanes_along_cols: bool   # index, warp strategy: lanes along the mask's columns
    q_dfast: bool            # adjacent threads load adjacent d of Q (else adjacent rows)
    k_dfast: bool
    q_vec: int = 1           # elements per 16-byte load of Q along d (1: element loads)
    k_vec: int = 1
    wgmma: bool = False      # the tiles on wgmma (sm_90a): S^T = K' Q^T, cp.async stages

    @property
    def smem(self) -> int:
        """Dynamic shared memory of the tile kernel: the wgmma kernel's stages (64 gathered K
        rows and TH Q rows of 128 bytes each) and 1 KB of slack to align them; 0 for mma.sync."""
        return WGMMA_STAGES * (BN + self.th) * 128 + 1024 if self.wgmma else 0

    def context(self) -> dict[str, Any]:
        """Template context: tile, CTA shape and load orders."""
        return {"dtype": self.dtype, "th": self.th, "tw": self.tw, "bn": BN,
                "bk": 64 if self.wgmma else 16 if self.dtype == "float32" else 32,
                "wm": 1 if self.th == 16 else 2, "wgmma": self.wgmma, "stages": WGMMA_STAGES,
                "strategy": self.strategy, "lanes_along_cols": self.lanes_along_cols,
                "q_dfast": self.q_dfast, "k_dfast": self.k_dfast, "q_vec": self.q_vec,
                "k_vec": self.k_vec}


def normalise_tile(tile: Any) -> tuple[int, int]:
    """``(th, tw)``: (L, 1), (1, L) micro-tiles or (b, b') blocks; PlanError naming the rule."""
    try:
        th, tw = (int(t) for t in tile)
    except (TypeError, ValueError):
        raise PlanError(f"tile must be a pair (rows, cols), got {tile!r}") from None
    if th in EXTENTS and tw in WIDTHS or th == 1 and tw in EXTENTS:
        return th, tw
    raise PlanError(f"tile {(th, tw)} is not supported: use (L, w) with L in {EXTENTS} and w in "
                    f"{WIDTHS}, or (1, L) with L in {EXTENTS}")


def vector_width(dtype: str, D: int, strides: tuple[int, int], ptr: int) -> int:
    """Elements per 16-byte load along d when the operand allows it (d contiguous, rows and
    base 16-byte aligned, D a multiple), else 1."""
    v = 4 if dtype == "float32" else 8
    ok = strides[1] == 1 and strides[0] % v == 0 and D % v == 0 and ptr % 16 == 0
    return v if ok else 1


@cache.lru("sddmm.plans", maxsize=1024)
def plan_sddmm(dtype: str, tile: Any, q_strides: tuple[int, int], k_strides: tuple[int, int],
               mask_strides: tuple[int, int], vecs: tuple[int, int] = (1, 1),
               arch: str = "sm_80") -> SddmmConfig:
    """Choose the kernel variant: (1, L) tiles run transposed; loads walk each operand's
    contiguous axis (16 bytes at a time where ``vecs``, from :func:`vector_width` of q and k,
    allow); the index uses one thread per tile where the mask's tile columns are adjacent in
    memory, else one warp per tile with lanes along the contiguous axis. On an ``arch`` in
    ``lower.WGMMA_ARCHS`` the tiles multiply on wgmma where both operands load in 16-byte
    pieces and the dtype is 16-bit (wgmma's tf32 and transposed 16-bit operands are not
    used: fp32 and strided views keep mma.sync)."""
    SDDMM.check_dtype(dtype)
    th, tw = normalise_tile(tile)
    SDDMM.derive()
    transposed = th == 1
    if transposed:
        th, tw = tw, th
        q_strides, k_strides = k_strides, q_strides
        mask_strides = mask_strides[::-1]
        vecs = vecs[::-1]
    sm_m, sm_n = mask_strides
    thread = tw == 1 and abs(sm_n) <= abs(sm_m)
    wgmma = arch in lower.WGMMA_ARCHS and dtype != "float32" and vecs == (8, 8)
    return SddmmConfig(dtype, th, tw, transposed, "thread" if thread else "warp",
                       abs(sm_n) <= abs(sm_m), abs(q_strides[1]) <= abs(q_strides[0]),
                       abs(k_strides[1]) <= abs(k_strides[0]), vecs[0], vecs[1], wgmma)


def grid_of(cfg: SddmmConfig, M: int, N: int) -> dict[str, tuple[int, int, int]]:
    """Launch grids in the kernels' view (M rows by N columns of S): index over (tiles, groups),
    compute over (groups, chunks of BN/tw listed tiles): the upper bound, empty chunks exit."""
    groups, items = -(-M // cfg.th), -(-N // cfg.tw)
    per = INDEX_THREADS if cfg.strategy == "thread" else INDEX_THREADS // 32
    chunks = -(-items // (BN // cfg.tw))
    if groups > GRID_Y_MAX or chunks > GRID_Y_MAX:
        raise ShapeError(f"S of {M}x{N} has too many tiles of {cfg.th}x{cfg.tw} for one launch "
                         f"({groups} groups, {chunks} chunks; at most {GRID_Y_MAX})")
    return {"index": (-(-items // per), groups, 1), "tiles": (groups, chunks, 1)}


# -- GPU ----------------------------------------------------------------------------------------

@dataclass
class SparseTiles:
    """Compact SDDMM result: tile ``t < count`` covers rows ``tile_rows[t]*th ..`` and columns
    ``tile_cols[t]*tw ..`` of S with ``values[t]`` (zeros where the mask is 0 or outside S).
    Slots past ``count`` are undefined; ``count`` stays on the device (reading it syncs)."""

    values: Any
    tile_rows: Any
    tile_cols: Any
    count: Any
    shape: tuple[int, int]
    tile: tuple[int, int]

    def to_dense(self) -> Any:
        """Dense [M, N] S ⊙ mask with torch ops on the device (no host sync)."""
        import torch
        th, tw = self.tile
        M, N = self.shape
        cap = self.values.shape[0]
        dev = self.values.device
        dense = torch.zeros((-(-M // th)) * th, (-(-N // tw)) * tw, dtype=self.values.dtype,
                            device=dev)
        if cap == 0:
            return dense[:M, :N]
        valid = torch.arange(cap, device=dev, dtype=torch.int32) < self.count
        zero = torch.zeros((), dtype=torch.int32, device=dev)
        r = torch.where(valid, self.tile_rows, zero).long()
        c = torch.where(valid, self.tile_cols, zero).long()
        rows = r[:, None, None] * th + torch.arange(th, device=dev)[None, :, None]
        cols = c[:, None, None] * tw + torch.arange(tw, device=dev)[None, None, :]
        flat = (rows * dense.shape[1] + cols).reshape(-1)
        vals = torch.where(valid[:, None, None], self.values,
                           torch.zeros((), dtype=self.values.dtype, device=dev))
        dense.view(-1).scatter_add_(0, flat, vals.reshape(-1))  # slots past count add 0 at 0
        return dense[:M, :N]


def _check_int32(name: str, x: Any) -> None:
    span = sum((n - 1) * abs(s) for n, s in zip(x.shape, x.stride())) + 1
    if span >= 2 ** 31:
        raise ShapeError(f"{name} spans {span} elements; int32 offsets overflow")


#: dQ = dS' K and dK = dS'ᵀ Q (dS' = dS ⊙ M, the masked gradient): pitgen's GEMM, dS' sparse
GRAD_EXPR = "C[m,n] += A[m,k] * B[k,n]"


@on_operand_device
def sddmm(q: Tensor, k: Tensor, mask: Tensor, tile: tuple[int, int] = (32, 1),
          out: Tensor | None = None, scale: float = 1.0,
          layout: Any = None) -> SparseTiles | Tensor:
    """``S = scale · Q Kᵀ`` where ``mask`` is set, on the GPU, no host synchronisation.

    q [M, D], k [N, D]: float16, bfloat16 or float32 (tf32 tensor cores), same dtype, any
    strides (dYᵀ as a view needs no copy). mask: bool or uint8 [M, N], any strides. tile:
    ``(L, 1)``/``(1, L)`` micro-tiles or ``(b, b')`` blocks. Returns:

    - ``layout=None``: :class:`SparseTiles` (compact tiles; no backward);
    - ``out`` (dense [M, N], q's dtype): S ⊙ mask written into it (0 where the mask is 0),
      returned (no backward);
    - ``layout=torch.strided``: a new dense S ⊙ mask, differentiable (``pitgen::sddmm``):
      dQ = dS' K and dK = dS'ᵀ Q with dS' = dS ⊙ M run pitgen's JIT GEMM with dS' sparse
      and ``micro_tile='auto'`` (the planner picks micro-tiles, blocks or cuBLAS from the
      mask's coverage: one small host copy on each shape's first backward, none after);
    - ``layout=torch.sparse_csr``: the same values as a CSR tensor (mask order), built on the
      GPU; sizing it reads the mask's non-zero count back (one host sync). Differentiable
      through its values.

    Every path runs through a ``torch.library`` op (``torch.compile`` sees one op); the CSR
    path's sizing is data-dependent (a graph break unless torch captures dynamic shapes).
    """
    import torch

    check_tensor("q", q, SDDMM.dtypes, ndim=2, contiguous=False)
    dtype = str(q.dtype).replace("torch.", "")
    check_tensor("k", k, (dtype,), ndim=2, shape=(None, q.shape[1]), contiguous=False)
    M, N = q.shape[0], k.shape[0]
    check_tensor("mask", mask, ("bool", "uint8"), ndim=2, shape=(M, N), contiguous=False)
    if out is not None:
        check_tensor("out", out, (dtype,), ndim=2, shape=(M, N), contiguous=False)
        if 0 in out.stride() and out.numel() > 1:
            raise ShapeError(f"out has a zero stride {tuple(out.stride())}; pass a writable tensor")
        if layout is not None:
            raise PlanError("sddmm: pass out= or layout=, not both")
    if layout not in (None, torch.strided, torch.sparse_csr):
        raise PlanError(f"sddmm: layout must be None (SparseTiles), torch.strided or "
                        f"torch.sparse_csr, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("mask", mask)) + ((("out", out),) if out is not None else ()):
        _check_int32(name, x)
    th, tw = normalise_tile(tile)
    pit = ops()
    if layout is None:
        why = "use layout=torch.strided or torch.sparse_csr for gradients"
        no_backward("pitgen::sddmm_tiles" if out is None else "pitgen::sddmm_out", q, k, hint=why)
        if out is not None:
            pit.sddmm_out(q, k, mask, [th, tw], float(scale), out)
            return out
        values, rows, cols, count = pit.sddmm_tiles(q, k, mask, [th, tw], float(scale))
        return SparseTiles(values, rows, cols, count, (M, N), (th, tw))
    dense = pit.sddmm(q, k, mask, [th, tw], float(scale))
    if layout == torch.strided:
        return dense
    nz = mask.nonzero()  # the one host sync: the CSR's size
    crow = torch.zeros(M + 1, dtype=torch.int64, device=q.device)
    crow[1:] = torch.cumsum((mask != 0).sum(1), 0)
    with warnings.catch_warnings():  # torch's "sparse CSR support is in beta" notice
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, nz[:, 1].contiguous(), dense[nz[:, 0], nz[:, 1]],
                                       (M, N), check_invariants=False)


@on_operand_device
def dense(q: Tensor, k: Tensor, mask: Tensor, tile: Any, scale: float) -> Tensor:
    """``scale · (Q Kᵀ) ⊙ M`` into a new dense tensor: ``pitgen::sddmm``'s body, and what an
    eager backward (the weight-sparse linear's dW) calls instead of the op."""
    return launch(q, k, mask, tuple(tile), q.new_empty(q.shape[0], k.shape[0]), scale)


def launch(q: Tensor, k: Tensor, mask: Tensor, tile: tuple[int, int], out: Tensor | None,
           scale: float) -> SparseTiles | Tensor:
    """The SDDMM's launches on validated operands (the body of the ``pitgen::sddmm*`` ops):
    :class:`SparseTiles`, or ``out`` filled."""
    import torch

    dtype = str(q.dtype).replace("torch.", "")
    M, D = q.shape
    N = k.shape[0]
    vecs = (vector_width(dtype, D, q.stride(), q.data_ptr()),
            vector_width(dtype, D, k.stride(), k.data_ptr()))
    cfg = plan_sddmm(dtype, normalise_tile(tile), tuple(q.stride()), tuple(k.stride()),
                     tuple(mask.stride()), vecs, device_arch())  # cached: once per layout
    th, tw = normalise_tile(tile)
    qa, ka, m_str = (k, q, mask.stride()[::-1]) if cfg.transposed else (q, k, mask.stride())
    Mv, Nv = qa.shape[0], ka.shape[0]
    grids = grid_of(cfg, Mv, Nv)
    groups, items = grids["tiles"][0], -(-Nv // cfg.tw)
    dev = q.device
    counts = torch.zeros(groups, dtype=torch.int32, device=dev)
    ids = torch.empty(groups * items, dtype=torch.int32, device=dev)
    m8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if out is None:
        cap = groups * items
        values = torch.empty(cap, th, tw, dtype=q.dtype, device=dev)
        tile_rows = torch.empty(cap, dtype=torch.int32, device=dev)
        tile_cols = torch.empty(cap, dtype=torch.int32, device=dev)
        total = torch.zeros(1, dtype=torch.int32, device=dev)
        vptr, rptr, cptr, tptr = (values.data_ptr(), tile_rows.data_ptr(), tile_cols.data_ptr(),
                                  total.data_ptr())
        if cfg.transposed:
            rptr, cptr = cptr, rptr
        optr, o_str = 0, (0, 0)
    else:
        out.zero_()  # elements of tiles the mask leaves empty
        vptr = rptr = cptr = tptr = 0
        optr, o_str = out.data_ptr(), out.stride()[::-1] if cfg.transposed else out.stride()
    kern = SDDMM.module(cfg)
    with TorchLaunch() as L:
        kern.launch("pit_sddmm_index", grids["index"], (INDEX_THREADS, 1, 1), L.stream,
                    m8.data_ptr(), m_str[0], m_str[1], Mv, Nv, items, counts.data_ptr(),
                    ids.data_ptr())
        kern.launch("pit_sddmm_tiles", grids["tiles"], (128, 1, 1), L.stream,
                    qa.data_ptr(), qa.stride(0), qa.stride(1), ka.data_ptr(), ka.stride(0),
                    ka.stride(1), m8.data_ptr(), m_str[0], m_str[1], Mv, Nv, D, items,
                    np.float32(scale), counts.data_ptr(), ids.data_ptr(), optr, o_str[0],
                    o_str[1], vptr, rptr, cptr, tptr, smem=cfg.smem)
        if out is not None:
            return out
    return SparseTiles(values, tile_rows, tile_cols, total, (M, N), (th, tw))
