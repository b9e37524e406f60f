"""CPU model of the products kernel (1 x tk micro-tiles along m at high sparsity;
gemm_products.cu.j2 and the index of index.cu.j2 with row_table), in NumPy, on the sizes that
lowering and geometry choose: the index lists each k-tile's active rows in one list and keeps
per row its count, a bit per k-tile and its place in each list; the products kernel's CTAs take
items (k-tile, group of 64 listed rows, column tile) in k-tile-major order, form each item's
product in float32 and write each row straight to C (the row's only product) or to its slot
(list base of the k-tile + place), or nowhere (a slot past the capacity); the finishing pass
writes zeros to rows without products and sums the others' products in k-tile order, forming
those without a slot itself. Checked against the dense product on drawn shapes, masks and slot
capacities (every product with a slot, and capacities that leave some without), and against
what an index it must not trust may hold."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import testing as T
from pitgen.lower import Layout, Schedule, geometry, lower

OP = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
BM = 64   # rows per item (gemm_products.cu.j2)


def spec_of(M: int, N: int, K: int, tk: int):
    lay = Layout(M, N, K, (K, 1), (N, 1), (N, 1))
    spec = lower(OP, "A", "micro", "m", (1, tk), "float16", lay, schedule=Schedule(rows="products"))
    assert spec.gemm.a_mode == "products"
    return spec, geometry(spec, lay, sms=4)


def model_index(mask: np.ndarray, tk: int, rng: np.random.Generator):
    """Lists per k-tile in any order (the GPU appends with atomics) and the row table."""
    M, K = mask.shape
    nkt = -(-K // tk)
    counts = np.zeros(nkt, np.int64)
    ids = np.full((nkt, M), -1, np.int64)
    row_count = np.zeros(M, np.int64)
    bits = np.zeros((M, nkt), bool)
    place = np.full((M, nkt), -1, np.int64)
    for t in range(nkt):
        rows = np.flatnonzero(mask[:, t * tk:(t + 1) * tk].any(axis=1))
        rng.shuffle(rows)
        counts[t], ids[t, :rows.size] = rows.size, rows
        row_count[rows] += 1
        bits[rows, t] = True
        place[rows, t] = np.arange(rows.size)
    return counts, ids, (row_count, bits, place)


def model(a, b, counts, ids, table, tk: int, bn: int, grid: int, cap: int, out,
          accumulate: bool = False) -> np.ndarray:
    """``out`` as the products kernel and the finishing pass leave it; every read of the index
    is clamped or checked as the kernels do."""
    M, K = a.shape
    N = b.shape[1]
    nkt = counts.size
    row_count, bits, place = table
    cnt = np.clip(counts, 0, M)
    rbase = np.concatenate([[0], np.cumsum(cnt)])
    nt = -(-N // bn)
    items = [(t, g, j) for t in range(nkt) for g in range(-(-int(cnt[t]) // BM)) for j in range(nt)]
    out = out.astype(np.float32).copy()
    slots = np.full((cap, N), np.nan, np.float32)
    for cta in range(grid):   # persistent CTAs, item blockIdx.x + j * gridDim.x
        for t, g, j in items[cta::grid]:
            rows = [int(ids[t, p]) if p < cnt[t] else -1 for p in range(g * BM, g * BM + BM)]
            rows = [r if 0 <= r < M else -1 for r in rows]
            ks = np.arange(t * tk, min(K, (t + 1) * tk))
            cols = np.arange(j * bn, min(N, (j + 1) * bn))
            stage = np.array([a[r, ks] if r >= 0 else np.zeros(ks.size) for r in rows], np.float32)
            part = stage @ b[np.ix_(ks, cols)].astype(np.float32)
            for i, r in enumerate(rows):
                if r < 0:
                    continue
                slot = rbase[t] + g * BM + i
                if row_count[r] <= 1:
                    out[r, cols] = (out[r, cols] if accumulate else 0) + part[i]
                elif slot < cap:
                    slots[slot, cols] = part[i]
    for r in range(M):   # the finishing pass
        n = min(int(row_count[r]), nkt)
        if n == 1 or (accumulate and n == 0):
            continue
        total = np.zeros(N, np.float32)
        for t in np.flatnonzero(bits[r]):
            p = int(place[r, t])
            if not 0 <= p < cnt[t]:
                continue
            if rbase[t] + p < cap:
                total += slots[rbase[t] + p]
            else:   # no slot: formed here
                ks = np.arange(t * tk, min(K, (t + 1) * tk))
                total += a[r, ks].astype(np.float32) @ b[ks].astype(np.float32)
        out[r] = (out[r] if accumulate else 0) + total
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(M=st.one_of(st.integers(1, 70), st.sampled_from([129, 200])), N=st.integers(1, 300),
       K=st.sampled_from([8, 64, 136, 264]), tk=st.sampled_from([32, 64, 128]),
       density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]), cap_part=st.sampled_from([1.0, 0.3]),
       accumulate=st.booleans(), seed=st.integers(0, 2**16))
def test_model_is_the_dense_product(M, N, K, tk, density, cap_part, accumulate, seed):
    """On what lowering and geometry choose (BN, the persistent grid), any mask, slots for all
    products or for fewer (the finishing pass forms the rest)."""
    rng = np.random.default_rng(seed)
    spec, geo = spec_of(M, N, K, tk)
    assert (spec.index.row_table, spec.index.id_block, geo.cap) == (True, -(-M // 64) * 64, spec.index.id_block)
    mask = T.granular_mask(rng, (M, K), "micro", (1, tk), density)
    a = (rng.standard_normal((M, K)) * mask).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    counts, ids, table = model_index(mask, tk, rng)
    base = rng.standard_normal((M, N)).astype(np.float32)
    cap = max(1, int(M * cap_part))
    got = model(a, b, counts, ids, table, tk, spec.gemm.bn, geo.grid[0], cap, base, accumulate)
    ref = a.astype(np.float64) @ b + (base if accumulate else 0)
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-3), np.abs(got - ref).max()


def test_model_never_follows_a_bad_index():
    """Counts past M, ids outside [0, M) and places outside their list are clamped or skipped:
    nothing is read or written out of bounds, and rows the index does not list get zeros."""
    rng = np.random.default_rng(3)
    M, N, K, tk = 70, 33, 128, 64
    spec, geo = spec_of(M, N, K, tk)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    counts = np.array([10**6, -5])
    ids = np.full((2, M), -7)
    ids[0, :3] = [M + 1, 2, -1]
    row_count = np.zeros(M, np.int64)
    row_count[2] = 1
    bits = np.zeros((M, 2), bool)
    place = np.full((M, 2), 99)
    got = model(a, b, counts, ids, (row_count, bits, place), tk, spec.gemm.bn, geo.grid[0], M,
                np.full((M, N), np.nan, np.float32))
    want = np.zeros((M, N))
    want[2] = a[2, :64] @ b[:64]
    assert np.allclose(got, want, atol=1e-4)
