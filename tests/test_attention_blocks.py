"""CPU tests of the attention backward pass that need no torch: the kernels' block algorithm
written in NumPy (the forward's online softmax over the index's rows, then dQ, dK and dV over
the forward's decomposition: its blocks, gathered key tiles and dense-row tiles) against the
dense float64 reference; the plan's backward decisions and refusals. (test_attention_backward.py
checks that reference against torch autograd and the custom op on meta tensors.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import reference as R
from pitgen import testing as T
from pitgen.ops import attention as A

LOG2E = math.log2(math.e)


# -- the block algorithm in NumPy, as the kernels run it ----------------------------------------

def _allowed(m: np.ndarray, state: int, r0: int, c0: int, sq: int, sk: int) -> np.ndarray:
    """The kernels' element test of one block (rows r0.., cols c0..): range only on FULL
    blocks, the mask on PARTIAL ones."""
    ok = np.zeros((A.BM, A.BN), bool)
    rows, cols = min(A.BM, sq - r0), min(A.BN, sk - c0)
    ok[:rows, :cols] = True if state == A.FULL else m[r0:r0 + rows, c0:c0 + cols]
    return ok


def _tile(x: np.ndarray, r0: int, n: int) -> np.ndarray:
    """Rows r0 .. r0+n-1 of x, zero-filled past its end (the kernels' tile loads)."""
    t = np.zeros((n,) + x.shape[1:])
    got = x[r0:r0 + n]
    t[:len(got)] = got
    return t


def block_forward_backward(q, k, v, mask, dout, scale):
    """(out, lse, dq, dk, dv) by the kernels' loops: the index of the mask, the forward's online
    softmax over each query block's list (in log2 units, as the kernel), then delta, the dQ pass
    over the forward's decomposition (its blocks, gathered key tiles and dense-row tiles) and
    the dK/dV pass over the index's columns and dense-row tiles plus the gathered keys' sums,
    head groups summed."""
    b_, h_, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h_ // hkv
    m = np.broadcast_to(np.asarray(mask) != 0, (b_, h_, sq, sk))
    states = R.block_index_reference(m)                   # slices = B * H here
    order = R.block_order_reference(states)
    n_qb, n_kb = states.shape[1:]
    sl2 = scale * LOG2E
    out, lse = np.zeros_like(q), np.full((b_, h_, sq), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(b_):
        for h in range(h_):
            sl, kv = b * h_ + h, h // group
            for qb in order[sl]:                           # forward
                r0 = qb * A.BM
                qt = _tile(q[b, h], r0, A.BM)
                mx, lsum = np.full(A.BM, -np.inf), np.zeros(A.BM)
                acc = np.zeros((A.BM, d))
                for kb in np.flatnonzero(states[sl, qb]):
                    ok = _allowed(m[b, h], states[sl, qb, kb], r0, kb * A.BN, sq, sk)
                    s = np.where(ok, qt @ _tile(k[b, kv], kb * A.BN, A.BN).T * sl2, -np.inf)
                    mnew = np.maximum(mx, s.max(1))
                    base = np.where(mnew == -np.inf, 0.0, mnew)
                    alpha = np.exp2(mx - base)
                    p = np.exp2(s - base[:, None])
                    lsum = lsum * alpha + p.sum(1)
                    mx = mnew
                    acc = acc * alpha[:, None] + p @ _tile(v[b, kv], kb * A.BN, A.BN)
                rows = min(A.BM, sq - r0)
                inv = np.divide(1.0, lsum, out=np.zeros_like(lsum), where=lsum > 0)
                out[b, h, r0:r0 + rows] = (acc * inv[:, None])[:rows]
                with np.errstate(divide="ignore"):
                    row_lse = np.where(lsum > 0, (mx + np.log2(np.maximum(lsum, 1e-300)))
                                       / LOG2E, -np.inf)
                lse[b, h, r0:r0 + rows] = row_lse[:rows]
    delta = (dout * out).sum(-1)

    def p_and_ds(qt, kt, vt, dot, lse_rows, delta_rows, ok):
        l2 = np.where(np.isfinite(lse_rows), lse_rows * LOG2E, np.inf)
        p = np.where(ok, np.exp2(qt @ kt.T * sl2 - l2[:, None]), 0.0)
        return p, p * (dot @ vt.T - delta_rows[:, None])

    # the backward walks the forward's decomposition (reference.key_index_reference): FULL and
    # PARTIAL blocks over the rows that stay, gathered key tiles (their keys' dK and dV summed
    # into per-key float sums, as the dQ kernel's atomics), dense-row tiles (all keys)
    ki = R.key_index_reference(m)
    gdk, gdv = np.zeros_like(k), np.zeros_like(v)
    for b in range(b_):
        for h in range(h_):                                 # dQ: a row of the index
            sl, kv = b * h_ + h, h // group
            drows = ki.drows[sl, :ki.dcount[sl]]
            for qb in order[sl]:
                r0 = qb * A.BM
                qt, dot = _tile(q[b, h], r0, A.BM), _tile(dout[b, h], r0, A.BM)
                moved = np.array([(int(ki.dense[sl, qb]) >> r) & 1 for r in range(A.BM)], bool)
                lr = np.concatenate([lse[b, h, r0:r0 + A.BM],
                                     np.full(max(0, r0 + A.BM - sq), np.inf)])
                lr = np.where(moved, np.inf, lr)           # a dense row's is its tile's
                dr = _tile(delta[b, h], r0, A.BM)
                acc = np.zeros((A.BM, d))
                for kb in np.flatnonzero(ki.states[sl, qb] % 3):   # FULL, PARTIAL
                    kt = _tile(k[b, kv], kb * A.BN, A.BN)
                    ok = _allowed(m[b, h], ki.states[sl, qb, kb], r0, kb * A.BN, sq, sk)
                    _, ds = p_and_ds(qt, kt, _tile(v[b, kv], kb * A.BN, A.BN), dot, lr, dr, ok)
                    acc += ds @ kt
                keys = ki.keys[sl, qb, :ki.counts[sl, qb]]
                for g0 in range(0, len(keys), A.BN):       # gathered key tiles
                    ids = keys[g0:g0 + A.BN]
                    kt, vt = k[b, kv, ids], v[b, kv, ids]
                    ok = np.array([[(int(x) >> r) & 1 for x in ki.bits[sl, qb, g0:g0 + len(ids)]]
                                   for r in range(A.BM)], bool)
                    p, ds = p_and_ds(qt, kt, vt, dot, lr, dr, ok)
                    acc += ds @ kt
                    np.add.at(gdk[b, kv], ids, ds.T @ qt)
                    np.add.at(gdv[b, kv], ids, p.T @ dot)
                rows = min(A.BM, sq - r0)
                keep = ~moved[:rows]
                dq[b, h, r0:r0 + rows][keep] = (scale * acc)[:rows][keep]
            for t0 in range(0, len(drows), A.BM):           # dense-row tiles: every key
                ids = drows[t0:t0 + A.BM]
                acc = np.zeros((len(ids), d))
                for kb in range(n_kb):
                    kt = _tile(k[b, kv], kb * A.BN, A.BN)
                    ok = np.arange(A.BN)[None, :] + kb * A.BN < np.full((len(ids), 1), sk)
                    _, ds = p_and_ds(q[b, h, ids], kt, _tile(v[b, kv], kb * A.BN, A.BN),
                                     dout[b, h, ids], lse[b, h, ids], delta[b, h, ids], ok)
                    acc += ds @ kt
                dq[b, h, ids] = scale * acc
        for hk in range(hkv):                               # dK, dV: a column of the index
            for kb in range(n_kb):
                c0 = kb * A.BN
                kt, vt = _tile(k[b, hk], c0, A.BN), _tile(v[b, hk], c0, A.BN)
                gk, gv = np.zeros((A.BN, d)), np.zeros((A.BN, d))
                for h in range(hk * group, (hk + 1) * group):
                    sl = b * h_ + h
                    for qb in np.flatnonzero(ki.states[sl, :, kb] % 3):
                        r0 = qb * A.BM
                        qt, dot = _tile(q[b, h], r0, A.BM), _tile(dout[b, h], r0, A.BM)
                        ok = _allowed(m[b, h], ki.states[sl, qb, kb], r0, c0, sq, sk)
                        ok &= ~np.array([(int(ki.dense[sl, qb]) >> r) & 1
                                         for r in range(A.BM)], bool)[:, None]
                        p, ds = p_and_ds(qt, kt, vt, dot, _tile(lse[b, h], r0, A.BM),
                                         _tile(delta[b, h], r0, A.BM), ok)
                        gv += p.T @ dot
                        gk += ds.T @ qt
                    ids = ki.drows[sl, :ki.dcount[sl]]
                    for t0 in range(0, len(ids), A.BM):   # the slice's dense-row tiles
                        r = ids[t0:t0 + A.BM]
                        ok = np.arange(A.BN)[None, :] + c0 < np.full((len(r), 1), sk)
                        p, ds = p_and_ds(q[b, h, r], kt, vt, dout[b, h, r], lse[b, h, r],
                                         delta[b, h, r], ok)
                        gv += p.T @ dout[b, h, r]
                        gk += ds.T @ q[b, h, r]
                cols = min(A.BN, sk - c0)
                dk[b, hk, c0:c0 + cols] = (scale * (gk[:cols] + gdk[b, hk, c0:c0 + cols]))
                dv[b, hk, c0:c0 + cols] = gv[:cols] + gdv[b, hk, c0:c0 + cols]
    return out, lse, dq, dk, dv


def test_block_algorithm_over_two_dense_tiles_and_long_gathered_lists():
    """BigBird with 4 global tokens in each of 17 query blocks: 68 dense rows (two dense-row
    tiles) and query blocks gathering more than one tile of keys (two K/V heads' query heads)."""
    rng = np.random.default_rng(1)
    sq, sk = 1100, 400
    g = np.array([qb * 64 + r for qb in range(17) for r in (1, 17, 33, 49)])
    mask = T.bigbird_mask(rng, sq, sk, 32, g, 40)
    ki = R.key_index_reference(mask[None])
    assert ki.dcount[0] > A.BM and ki.counts.max() > A.BN   # both paths past one tile
    q = rng.standard_normal((1, 2, sq, 16))
    k, v = rng.standard_normal((2, 1, 1, sk, 16))
    dout = rng.standard_normal((1, 2, sq, 16))
    _, _, dq, dk, dv = block_forward_backward(q, k, v, mask, dout, 0.3)
    for got, ref in zip((dq, dk, dv), R.attention_backward_reference(q, k, v, mask, dout, 0.3)):
        np.testing.assert_allclose(got, ref, atol=1e-11)


def _masks(rng, pattern: str, lead: tuple[int, ...], sq: int, sk: int) -> np.ndarray:
    def one():
        if pattern == "longformer":
            return T.longformer_mask(sq, sk, 40, T.random_global_tokens(rng, min(sq, sk), 2))
        if pattern == "bigbird":   # gathered key tiles and dense rows
            return T.bigbird_mask(rng, sq, sk, 32, T.random_global_tokens(rng, min(sq, sk), 3), 5)
        if pattern == "rows_masked":
            m = T.tile_mask(rng, sq, sk, (1, 1), 0.5)
            m[rng.random(sq) < 0.4] = False
            return m
        if pattern in ("empty", "full"):
            return T.granular_mask(rng, (sq, sk), pattern)
        return T.tile_mask(rng, sq, sk, {"block64": (64, 64), "micro16": (16, 16)}[pattern], 0.5)
    return np.stack([one() for _ in range(int(np.prod(lead, dtype=int)))]).reshape(*lead, sq, sk)


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), heads=st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]),
       sq=st.integers(1, 150), sk=st.integers(1, 150),
       pattern=st.sampled_from(["longformer", "bigbird", "rows_masked", "empty", "full",
                                "block64", "micro16"]),
       mask_lead=st.sampled_from(["none", "h", "bh", "b1"]), seed=st.integers(0, 2 ** 16))
def test_block_algorithm_matches_the_dense_reference(b, heads, sq, sk, pattern, mask_lead, seed):
    h, hkv = heads
    rng = np.random.default_rng(seed)
    lead = {"none": (), "h": (h,), "bh": (b, h), "b1": (b, 1)}[mask_lead]
    mask = _masks(rng, pattern, lead, sq, sk)
    d = 16   # the algorithm does not depend on D; small keeps the loops quick
    q = rng.standard_normal((b, h, sq, d))
    k, v = rng.standard_normal((2, b, hkv, sk, d))
    dout = rng.standard_normal((b, h, sq, d))
    scale = 0.3
    out, lse, dq, dk, dv = block_forward_backward(q, k, v, mask, dout, scale)
    p, ref_lse = R.attention_probabilities(q, k, mask, scale)
    np.testing.assert_allclose(out, R.attention_reference(q, k, v, mask, scale), atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], rtol=1e-12)
    for got, ref in zip((dq, dk, dv), R.attention_backward_reference(q, k, v, mask, dout, scale)):
        np.testing.assert_allclose(got, ref, atol=1e-11)
    full = np.broadcast_to(mask != 0, (b, h, sq, sk))
    dead = ~full.any(-1)           # rows with nothing to attend: zero output, zero gradient
    assert not out[dead].any() and not dq[dead].any()


# -- plan: GQA, broadcast masks, backward decisions ---------------------------------------------

def test_plan_gqa_and_broadcast_masks():
    p = A.plan_attention(2, 8, 100, 130, 64, "float16", (2, 1, 100, 130), 2)
    assert (p.kv_heads, p.group, p.slices, p.mask_strides) == (2, 4, 2, (1, 0))
    assert p.dkv_grid() == (4, 3, 1) and p.dq_grid(False) == (16, 2, 1)
    assert p.dq_grid(True) == (16, 1 * 3 + 2, 1)   # a dense-row tile in 3 parts, then 2 blocks
    p = A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 1, 100, 130))
    assert (p.kv_heads, p.group, p.slices, p.mask_strides) == (8, 1, 1, (0, 0))
    assert A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 100, 130)).slices == 1
    assert A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 8, 100, 130)).mask_strides == (0, 1)
    p = A.plan_attention(1, 4, 100, 4096, 128, "bfloat16", (100, 4096), 4)
    st_ = A.STAGES_BWD[128]
    assert p.smem_dq == (2 * st_ * 64 * 128 * 2 + 2 * 64 * 128 * 2 + st_ * 64 * A.MASK_ROW
                        + 4 * 64)
    assert p.smem_dkv == 2 * 64 * 128 * 2 + st_ * (2 * 64 * 128 * 2 + 2 * 64 * 4 + 64 * 80) + 4 * 2
    ctx = p.backward_context()
    assert ctx["stages"] == st_ and ctx["min_blocks"] == A.MIN_BLOCKS_BWD[128]
    p.check_backward()


@pytest.mark.parametrize("args, match", [
    ((1, 4, 8, 8, 64, "float16", (8, 8), 3), "does not divide"),
    ((2, 4, 8, 8, 64, "float16", (3, 1, 8, 8)), "mask has shape"),
    ((2, 4, 8, 8, 64, "float16", (2, 2, 8, 8)), "mask has shape"),
    ((2, 4, 8, 8, 64, "float16", (1, 8, 9)), "mask has shape"),
])
def test_plan_refuses_bad_heads_and_masks(args, match):
    with pytest.raises(pitgen.ShapeError, match=match):
        A.plan_attention(*args)


def test_backward_refuses_what_does_not_fit_shared_memory():
    p = A.plan_attention(1, 1, 3_000_000, 64, 64, "float16", (3_000_000, 64), 1)  # forward fits
    with pytest.raises(pitgen.ShapeError, match="Sq=3000000 .* backward"):
        p.check_backward()


@pytest.mark.parametrize("q, k, v, match", [
    ((1, 2, 8, 64), (1, 2, 8), (1, 2, 8, 64), "k has 3 dims"),
    ((1, 2, 8, 64), (2, 2, 8, 64), (2, 2, 8, 64), "k has shape"),
    ((1, 2, 8, 64), (1, 2, 8, 32), (1, 2, 8, 32), "k has shape"),
    ((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 9, 64), "v has shape"),
    ((1, 4, 8, 64), (1, 3, 8, 64), (1, 3, 8, 64), "does not divide"),
])
def test_shape_check_names_the_argument(q, k, v, match):
    with pytest.raises(pitgen.ShapeError, match=match):
        A.check_shapes(q, k, v)


def test_check_shapes_returns_the_problem():
    assert A.check_shapes((2, 8, 10, 64), (2, 2, 12, 64), (2, 2, 12, 64)) == (2, 8, 2, 10, 12, 64)


@settings(max_examples=40, deadline=None)
@given(sq=st.integers(1, 300), sk=st.integers(1, 300))
def test_causal_states_are_the_index_of_the_causal_mask(sq, sk):
    causal = np.tril(np.ones((sq, sk), bool))
    np.testing.assert_array_equal(A.causal_states(sq, sk), R.block_index_reference(causal))
