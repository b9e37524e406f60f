"""Float64 NumPy references of every GPU operator, in one place: what each kernel must compute,
and the index each builds, stated without tiles or threads. The tests, the benchmarks and users
checking their own runs compare against these."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .errors import PlanError, ShapeError
from .graph.formats import BSR, CSR, ELL, Hyb, Relational, check_dense_operand
from .ops.attention import (BM, BN, DENSE_ROWS_MAX, EMPTY, FULL, GATHER_MAX, GATHERED,
                             ORDER_BINS, PARTIAL)
from .ops.moe import ACTIVATIONS, Routing
from .ops.sddmm import normalise_tile


# -- attention ----------------------------------------------------------------------------------


def block_index_reference(mask: np.ndarray, bm: int = BM, bn: int = BN) -> np.ndarray:
    """The GPU index in NumPy: ``states[slice, qb, kb]`` (uint8) EMPTY when the block holds no
    set element, FULL when every in-range element is set, PARTIAL otherwise."""
    m = np.asarray(mask) != 0
    sq, sk = m.shape[-2:]
    m = m.reshape(-1, sq, sk)
    nq, nk = -(-sq // bm), -(-sk // bn)
    pad = np.ones((m.shape[0], nq * bm, nk * bn), bool)   # out-of-range elements: "set" for all
    pad[:, :sq, :sk] = m
    all_ = pad.reshape(m.shape[0], nq, bm, nk, bn).all(axis=(2, 4))
    pad[:, sq:, :] = pad[:, :, sk:] = False                # ... and "unset" for any
    any_ = pad.reshape(m.shape[0], nq, bm, nk, bn).any(axis=(2, 4))
    return np.where(any_, np.where(all_, FULL, PARTIAL), EMPTY).astype(np.uint8)


def block_layout_mask(layout: np.ndarray, block_size: int | tuple[int, int], sq: int,
                      sk: int) -> np.ndarray:
    """The element mask [..., Sq, Sk] a block layout stands for (``sparse_attention``'s
    block_mask): query i attends key j where ``layout[..., i // bq, j // bk]``."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    m = np.asarray(layout) != 0
    return m[..., np.arange(sq) // bq, :][..., np.arange(sk) // bk]


def count_bins(counts: np.ndarray, n_kb: int) -> np.ndarray:
    """The count class the GPU orders query blocks by: the count itself below ORDER_BINS key
    blocks, else scaled onto ORDER_BINS classes."""
    c = np.clip(np.asarray(counts, np.int64), 0, n_kb)
    return c if n_kb < ORDER_BINS else c * (ORDER_BINS - 1) // n_kb


def block_order_reference(states: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """The query-block order per slice (int32 [slices, nQB]): by descending count class of the
    work (visited blocks: any state but EMPTY and GATHERED, plus ceil(counts / BN) gathered key
    tiles), ties in ascending block order (the GPU's counting sort is stable, so it gives
    exactly this)."""
    states = np.asarray(states)
    work = ((states != EMPTY) & (states != GATHERED)).sum(-1)
    if counts is not None:
        work = work + -(-np.asarray(counts, np.int64) // BN)
    bins = count_bins(work, states.shape[-1])
    return np.argsort(-bins, axis=-1, kind="stable").astype(np.int32)


def column_rows_reference(mask: np.ndarray, bm: int = BM) -> np.ndarray:
    """uint64 [slices, nQB, Sk]: bit r of entry (s, qb, j) set when row qb * bm + r allows key j
    (each query block's allowed columns and which of its rows allow them)."""
    m = np.asarray(mask) != 0
    sq, sk = m.shape[-2:]
    m = m.reshape(-1, sq, sk)
    nq = -(-sq // bm)
    pad = np.zeros((m.shape[0], nq * bm, sk), bool)
    pad[:, :sq] = m
    rows = pad.reshape(m.shape[0], nq, bm, sk).transpose(0, 1, 3, 2)
    packed = np.packbits(rows, axis=-1, bitorder="little")          # [s, nq, sk, bm / 8]
    out = np.zeros((m.shape[0], nq, sk), np.uint64)
    for byte in range(packed.shape[-1]):
        out |= packed[..., byte].astype(np.uint64) << np.uint64(8 * byte)
    return out


class KeyIndex(NamedTuple):
    """``block_index``'s arrays as NumPy computes them (unused slots: key -1 with an empty row
    mask, dense row -1)."""
    states: np.ndarray   # uint8 [slices, nQB, nKB]: the forward's decision
    blocks: np.ndarray   # uint8 [slices, nQB, nKB]: block_index_reference (the backward's)
    order: np.ndarray    # int32 [slices, nQB]
    counts: np.ndarray   # int32 [slices, nQB]
    keys: np.ndarray     # int32 [slices, nQB, gather_max * nKB], ascending
    bits: np.ndarray     # uint64 [slices, nQB, gather_max * nKB]
    dense: np.ndarray    # uint64 [slices, nQB]
    drows: np.ndarray    # int32 [slices, nQB * BM], ascending
    dcount: np.ndarray   # int32 [slices]


def _cut(rows: np.ndarray, rows_in: np.ndarray, out: np.ndarray, nk: int,
         gather_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(states, allowed columns per block) of every block over the rows of its query block that
    are in range and not in ``out`` (uint64 [slices, nQB])."""
    s, nq, sk = rows.shape
    keep = (rows_in & ~out)[..., None]
    rb = np.zeros((s, nq, nk * BN), np.uint64)
    rb[..., :sk] = rows & keep
    allowed = (rb != 0).reshape(s, nq, nk, BN)
    ncols = allowed.sum(-1)
    in_range = (np.arange(nk * BN) < sk).reshape(nk, BN)
    full = ((rb.reshape(s, nq, nk, BN) == keep[..., None]) | ~in_range).all(-1)
    states = np.where(ncols == 0, EMPTY, np.where(full, FULL, np.where(
        ncols <= gather_max, GATHERED, PARTIAL))).astype(np.uint8)
    return states, ncols


def _work(states: np.ndarray, ncols: np.ndarray) -> np.ndarray:
    """Visited blocks + gathered tiles per query block."""
    visited = ((states == FULL) | (states == PARTIAL)).sum(-1)
    return visited + -(-np.where(states == GATHERED, ncols, 0).sum(-1) // BN)


def key_index_reference(mask: np.ndarray, gather_max: int = GATHER_MAX) -> KeyIndex:
    """The GPU index's decision in NumPy. Per (slice, query block qb): its dense rows are the
    in-range rows allowing every key; they leave qb (to dense-row tiles) when they are at most
    DENSE_ROWS_MAX and qb's work (visited full/partial blocks + gathered tiles of BN keys) over
    the remaining rows is smaller than over all its rows. Then per key block kb, over qb's remaining rows, with its allowed
    columns = keys allowed for at least one of them: EMPTY when none, FULL when every remaining
    row allows every in-range key, GATHERED when partial with at most ``gather_max`` allowed
    columns (they join qb's gathered keys, ascending, each with the mask of qb's remaining rows
    allowing it), else PARTIAL. The order: ``block_order_reference`` with the gathered counts;
    ``blocks``: ``block_index_reference`` (all rows)."""
    blocks = block_index_reference(mask)
    rows = column_rows_reference(mask)
    s, nq, nk = blocks.shape
    sq, sk = np.asarray(mask).shape[-2:]
    nrows = np.minimum(BM, sq - np.arange(nq) * BM)
    rows_in = np.where(nrows >= 64, ~np.uint64(0),
                       (np.uint64(1) << np.minimum(nrows, 63).astype(np.uint64)) - np.uint64(1))
    rows_in = np.broadcast_to(rows_in.astype(np.uint64), (s, nq))
    full = np.bitwise_and.reduce(rows, axis=-1) & rows_in if sk else np.zeros((s, nq), np.uint64)
    none = np.zeros((s, nq), np.uint64)
    work_all = _work(*_cut(rows, rows_in, none, nk, gather_max))
    work_cut = _work(*_cut(rows, rows_in, full, nk, gather_max))
    few = np.vectorize(lambda x: 0 < bin(int(x)).count("1") <= DENSE_ROWS_MAX, otypes=[bool])
    dense = np.where(few(full) & (work_cut < work_all), full, none) if full.size else none
    states, _ = _cut(rows, rows_in, dense, nk, gather_max)
    kept = rows & (rows_in & ~dense)[..., None]
    take = (kept != 0) & (np.repeat(states, BN, axis=-1)[..., :sk] == GATHERED)
    cap = gather_max * nk
    keys = np.full((s, nq, cap), -1, np.int32)
    bits = np.zeros((s, nq, cap), np.uint64)
    counts = take.sum(-1).astype(np.int32)
    drows = np.full((s, nq * BM), -1, np.int32)
    dcount = np.zeros(s, np.int32)
    for i, j in np.ndindex(s, nq):
        cols = np.flatnonzero(take[i, j])
        keys[i, j, :cols.size] = cols
        bits[i, j, :cols.size] = kept[i, j, cols]
    for i in range(s):
        moved = [qb * BM + r for qb in range(nq) for r in range(BM)
                 if (int(dense[i, qb]) >> r) & 1]
        drows[i, :len(moved)] = moved
        dcount[i] = len(moved)
    return KeyIndex(states, blocks, block_order_reference(states, counts), counts, keys, bits,
                    dense, drows, dcount)


def _attention_operands(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                        scale: float | None) -> tuple:
    """float64 q, k, v with K/V heads repeated to q's (grouped-query attention: query head h
    reads K/V head h // (H / Hkv)), the mask broadcast to [B, H, Sq, Sk], and the scale."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3] if q.ndim == 4 else 1
    if group > 1:
        k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    m = np.broadcast_to(np.asarray(mask) != 0, q.shape[:-2] + (q.shape[-2], k.shape[-2]))
    return q, k, v, m, scale, group


def attention_probabilities(q: np.ndarray, k: np.ndarray, mask: np.ndarray,
                            scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(P, lse) in float64: the masked softmax over allowed keys (rows with none are zeros)
    and the per-row log-sum-exp of the scaled scores (-inf on such rows)."""
    q, k, _, m, scale, _ = _attention_operands(q, k, k, mask, scale)
    s = np.where(m, np.einsum("bhid,bhjd->bhij", q, k) * scale, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(denom > 0, np.log(np.where(denom > 0, denom, 1.0)) + mx, -np.inf)[..., 0]
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
    return p, lse


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                        scale: float | None = None) -> np.ndarray:
    """Masked attention in float64; rows with no set element are zeros. k and v may have fewer
    heads than q (grouped-query attention); the mask broadcasts to [B, H, Sq, Sk]."""
    _, _, v, _, _, _ = _attention_operands(q, k, v, mask, scale)
    p, _ = attention_probabilities(q, k, mask, scale)
    return np.einsum("bhij,bhjd->bhid", p, v)


def attention_backward_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                                 dout: np.ndarray, scale: float | None = None,
                                 dlse: np.ndarray | None = None
                                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) of masked attention in float64, for the output gradient ``dout`` (and
    ``dlse``, a gradient of the log-sum-exp): dP = dO V^T, dS = P * (dP - rowsum(dO * O) + dlse),
    dq = scale dS K, dk = scale dS^T Q, dv = P^T dO; K/V gradients of a shared head (GQA)
    summed over its query heads. Rows with nothing allowed contribute nothing."""
    q64, k64, v64, _, scale, group = _attention_operands(q, k, v, mask, scale)
    p, _ = attention_probabilities(q, k, mask, scale)
    do = np.asarray(dout, np.float64)
    o = np.einsum("bhij,bhjd->bhid", p, v64)
    dp = np.einsum("bhid,bhjd->bhij", do, v64)
    delta = (do * o).sum(-1, keepdims=True)
    if dlse is not None:
        delta = delta - np.asarray(dlse, np.float64)[..., None]
    ds = p * (dp - delta)
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, k64)
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, q64)
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    if group > 1:
        dk, dv = (x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2) for x in (dk, dv))
    return dq, dk, dv


# -- MoE ----------------------------------------------------------------------------------------


def route_reference(expert_ids: np.ndarray, experts: int, bm: int) -> Routing:
    """NumPy version of the GPU index (pairs in ascending order inside a segment; the GPU's
    order is arbitrary, which the permutation-invariant t axis allows)."""
    ids = np.asarray(expert_ids).reshape(-1).astype(np.int64)
    valid = (ids >= 0) & (ids < experts)
    counts = np.bincount(ids[valid], minlength=experts).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    pairs = np.flatnonzero(valid)
    row_pair = pairs[np.argsort(ids[valid], kind="stable")]
    tile_e, tile_r = [], []
    for e in range(experts):
        for r in range(offsets[e], offsets[e + 1], bm):
            tile_e.append(e)
            tile_r.append(r)
    return Routing(counts, offsets, row_pair, np.array(tile_e, np.int64), np.array(tile_r, np.int64))


def activation_reference(v: np.ndarray, activation: str) -> np.ndarray:
    """The kernels' activations in float64 (GELU in its tanh approximation)."""
    if activation == "relu":
        return np.maximum(v, 0.0)
    if activation == "gelu":
        return 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    if activation == "silu":
        return v / (1.0 + np.exp(-v))
    if activation == "identity":
        return v
    raise PlanError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def moe_reference(x: np.ndarray, expert_ids: np.ndarray, gates: np.ndarray, w1: np.ndarray,
                  w2: np.ndarray, b1: np.ndarray | None = None, b2: np.ndarray | None = None,
                  activation: str = "gelu") -> np.ndarray:
    """Float64 reference of the layer, through the same routing (pairs with ids outside
    [0, E) contribute nothing)."""
    x = np.asarray(x, np.float64)
    T, topk = np.asarray(expert_ids).shape
    E = w1.shape[0]
    r = route_reference(expert_ids, E, bm=max(1, T * topk))
    g = np.asarray(gates, np.float64).reshape(-1)
    y = np.zeros((T, w2.shape[2]))
    for e in range(E):
        pr = r.row_pair[r.offsets[e]:r.offsets[e + 1]]
        if not len(pr):
            continue
        h = x[pr // topk] @ np.asarray(w1[e], np.float64)
        if b1 is not None:
            h += np.asarray(b1[e], np.float64)
        h = activation_reference(h, activation)
        o = h @ np.asarray(w2[e], np.float64)
        if b2 is not None:
            o += np.asarray(b2[e], np.float64)
        np.add.at(y, pr // topk, g[pr][:, None] * o)
    return y


# -- SDDMM over micro-tiles of a dynamic mask ---------------------------------------------------


def sddmm_index_reference(mask: np.ndarray, tile: Any) -> set[tuple[int, int]]:
    """The (tile row, tile col) of every tile of ``mask`` holding a set element."""
    th, tw = normalise_tile(tile)
    M, N = mask.shape
    gm, gn = -(-M // th), -(-N // tw)
    pad = np.zeros((gm * th, gn * tw), bool)
    pad[:M, :N] = mask != 0
    hit = pad.reshape(gm, th, gn, tw).any(axis=(1, 3))
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(hit))}


def sddmm_reference(q: np.ndarray, k: np.ndarray, mask: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Dense float64 S ⊙ mask."""
    s = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    return np.where(mask != 0, s, 0.0)


def sddmm_tiles_reference(q: np.ndarray, k: np.ndarray, mask: np.ndarray, tile: Any,
                    scale: float = 1.0) -> dict[tuple[int, int], np.ndarray]:
    """Float64 values [th, tw] of every non-empty tile (elements outside S are 0)."""
    th, tw = normalise_tile(tile)
    s = sddmm_reference(q, k, mask, scale)
    M, N = s.shape
    pad = np.zeros((-(-M // th) * th, -(-N // tw) * tw))
    pad[:M, :N] = s
    return {(r, c): pad[r * th:(r + 1) * th, c * tw:(c + 1) * tw]
            for r, c in sddmm_index_reference(mask, tile)}


# -- graph formats: SpMM and SDDMM per layout ---------------------------------------------------


def spmm_csr(a: CSR, x: np.ndarray) -> np.ndarray:
    """Y[i, f] = sum_j A[i, j] X[j, f], straight from CSR."""
    x = check_dense_operand("X", x, a.shape[1])
    y = np.zeros((a.shape[0], x.shape[1]))
    np.add.at(y, a.row_ids(), a.values()[:, None] * x[a.indices])
    return y


def sddmm_csr(a: CSR, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """E[i, j] = sum_f U[i, f] V[j, f] at A's non-zeros, in CSR order (A's values unused)."""
    u, v = _sddmm_operands(a.shape, u, v)
    return np.einsum("nf,nf->n", u[a.row_ids()], v[a.indices])


def _csr_order(shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray,
               vals: np.ndarray) -> np.ndarray:
    """Values gathered from a layout, put back into CSR (row-major) order."""
    return vals[np.argsort(rows.astype(np.int64) * shape[1] + cols, kind="stable")]


def _sddmm_operands(shape: tuple[int, int], u: np.ndarray,
                    v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u = check_dense_operand("U", u, shape[0])
    v = check_dense_operand("V", v, shape[1])
    if u.shape[1] != v.shape[1]:
        raise ShapeError(f"U and V need the same feature width, got {u.shape[1]} and "
                         f"{v.shape[1]}")
    return u, v


def rgcn_reference(a: Relational, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Y[i, f] = sum_r sum_j A[r, i, j] (X[j] @ W[r])[f], relation by relation, edge by edge."""
    x = check_dense_operand("X", x, a.shape[2])
    w = np.asarray(w, np.float64)
    if w.shape[:2] != (a.shape[0], x.shape[1]) or w.ndim != 3:
        raise ShapeError(f"W must be [relations = {a.shape[0]}, F_in = {x.shape[1]}, F_out], got "
                         f"{w.shape}")
    y = np.zeros((a.shape[1], w.shape[2]))
    vals = a.values()
    for r in range(a.shape[0]):
        e = a.rel == r
        np.add.at(y, a.row[e], vals[e, None] * (x[a.col[e]] @ w[r]))
    return y


def spmm_ell(e: ELL, x: np.ndarray) -> np.ndarray:
    """One pass per padded slot; a padded slot (-1) contributes nothing, as in a masked kernel."""
    x = check_dense_operand("X", x, e.shape[1])
    y = np.zeros((e.shape[0], x.shape[1]))
    for s in range(e.width):
        live = e.cols[:, s] >= 0
        y[live] += e.vals[live, s, None] * x[e.cols[live, s]]
    return y


def sddmm_ell(e: ELL, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    u, v = _sddmm_operands(e.shape, u, v)
    out = np.zeros(e.cols.shape)
    for s in range(e.width):
        live = np.flatnonzero(e.cols[:, s] >= 0)
        out[live, s] = np.einsum("nf,nf->n", u[live], v[e.cols[live, s]])
    return out[e.cols >= 0]  # ELL keeps each row's order, so row-major slots are CSR order


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - x.shape[0], x.shape[1]))])


def spmm_bsr(m: BSR, x: np.ndarray) -> np.ndarray:
    """A dense b x b times b x F product per block, accumulated into its block row."""
    x = check_dense_operand("X", x, m.shape[1])
    (nbr, nbc), b = m.grid, m.block
    xb = _padded(x, nbc * b).reshape(nbc, b, x.shape[1])
    y = np.zeros((nbr, b, x.shape[1]))
    np.add.at(y, m.block_rows(), np.einsum("nij,njf->nif", m.blocks, xb[m.indices]))
    return y.reshape(nbr * b, x.shape[1])[: m.shape[0]]


def sddmm_bsr(m: BSR, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A dense U_block V_block^T per block, sampled at the block's mask."""
    u, v = _sddmm_operands(m.shape, u, v)
    (nbr, nbc), b = m.grid, m.block
    ub = _padded(u, nbr * b).reshape(nbr, b, u.shape[1])
    vb = _padded(v, nbc * b).reshape(nbc, b, v.shape[1])
    brow = m.block_rows()
    full = np.einsum("nif,njf->nij", ub[brow], vb[m.indices])
    n, i, j = np.nonzero(m.mask)
    return _csr_order(m.shape, brow[n] * b + i, m.indices[n].astype(np.int64) * b + j,
                      full[n, i, j])


def spmm_hyb(h: Hyb, x: np.ndarray) -> np.ndarray:
    """Per bucket, per padded slot; scatter-add where bucket rows may share an output row."""
    x = check_dense_operand("X", x, h.shape[1])
    y = np.zeros((h.shape[0], x.shape[1]))
    for bk in h.buckets:
        for s in range(bk.width):
            live = bk.cols[:, s] >= 0
            contrib = bk.vals[live, s, None] * x[bk.cols[live, s]]
            if bk.needs_atomics:
                np.add.at(y, bk.row_ids[live], contrib)
            else:
                y[bk.row_ids[live]] += contrib
    return y


def sddmm_hyb(h: Hyb, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    u, v = _sddmm_operands(h.shape, u, v)
    rows, cols, vals = [], [], []
    for bk in h.buckets:
        for s in range(bk.width):
            live = np.flatnonzero(bk.cols[:, s] >= 0)
            r, c = bk.row_ids[live], bk.cols[live, s]
            rows.append(r)
            cols.append(c)
            vals.append(np.einsum("nf,nf->n", u[r], v[c]))
    if not rows:
        return np.zeros(0)
    return _csr_order(h.shape, np.concatenate(rows), np.concatenate(cols), np.concatenate(vals))


# -- sparse-channel convolution --------------------------------------------------------------


def active_channels_reference(x: np.ndarray) -> np.ndarray:
    """The GPU channel index in NumPy: int32 ids of the channels of X [N, C, H, W] holding a
    non-zero in any sample, increasing (-0.0 counts as zero, NaN as non-zero)."""
    x = np.asarray(x)
    return np.flatnonzero((x != 0).any(axis=(0, 2, 3))).astype(np.int32)


def conv2d_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                     stride: tuple[int, int] = (1, 1),
                     padding: tuple[int, int] = (0, 0)) -> np.ndarray:
    """``Y[n,f,p,q] = bias[f] + sum_{c,r,s} X[n,c,p*sh+r-ph,q*sw+s-pw] W[f,c,r,s]`` in float64
    (zeros outside X), as torch's conv2d with dilation 1 and groups 1."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    N, C, H, W = x.shape
    F, Cw, R, S = w.shape
    if Cw != C:
        raise ShapeError(f"weight has {Cw} input channels, x has {C}")
    (sh, sw), (ph, pw) = stride, padding
    P, Q = (H + 2 * ph - R) // sh + 1, (W + 2 * pw - S) // sw + 1
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    y = np.zeros((N, F, P, Q))
    for r in range(R):
        for s in range(S):
            win = xp[:, :, r:r + sh * (P - 1) + 1:sh, s:s + sw * (Q - 1) + 1:sw]
            y += np.einsum("ncpq,fc->nfpq", win, w[:, :, r, s])
    if bias is not None:
        y += np.asarray(bias, np.float64)[None, :, None, None]
    return y
