"""CPU model of the row-owner kernel (rows mode: micro-tiles 1 x tk along m; gemm_rows.cu.j2 and
the index of index.cu.j2 with id_block), in NumPy, on the sizes that lowering and
geometry choose: the index lists each k-tile's active rows per row block; each CTA walks its row
block's k-tiles window by window, gathers a k-tile's rows G at a time into m16 groups, sums each
step over its BK-deep stages in float32 and adds it to the owned rows' float32 accumulator, then
writes its rows once. Checked against the dense product on drawn shapes and masks (M 1..65 and
several row blocks, K not a multiple of 16 or 64, K below the micro-tile, empty and full masks,
more k-tiles than one window), and against what an index it must not trust may hold."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import testing as T
from pitgen.index import build_index
from pitgen.lower import Geometry, Layout, ModuleSpec, geometry, lower
from pitgen.planner import make_plan

OP = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
DTYPES = ("float16", "bfloat16", "float32")


def plan(M: int, N: int, K: int, tk: int, dtype: str) -> tuple[ModuleSpec, Geometry]:
    """What lowering and geometry choose for row-major operands and micro-tiles 1 x tk."""
    lay = Layout(M, N, K, (K, 1), (N, 1), (N, 1))
    spec = lower(OP, "A", "micro", "m", (1, tk), dtype, lay)
    return spec, geometry(spec, lay)


def model_index(mask: np.ndarray, geo: Geometry, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """The index as the GPU builds it: list kt * blocks + rb holds the rows of block rb (``cap``
    rows) that hold a non-zero in k-tile kt, in any order (shuffled here: the GPU appends with
    atomics), -1 past its count."""
    M, K = mask.shape
    bm, tk = geo.cap, geo.tk
    blocks = -(-M // bm)
    counts = np.zeros(geo.groups, np.int32)
    ids = np.full((geo.groups, geo.cap), -1, np.int32)
    for kt in range(-(-K // tk)):
        active = mask[:, kt * tk:(kt + 1) * tk].any(axis=1)
        for rb in range(blocks):
            rows = np.flatnonzero(active[rb * bm:(rb + 1) * bm]) + rb * bm
            rng.shuffle(rows)
            counts[kt * blocks + rb] = rows.size
            ids[kt * blocks + rb, :rows.size] = rows
    return counts, ids


def model_kernel(a: np.ndarray, b: np.ndarray, counts: np.ndarray, ids: np.ndarray,
                 spec: ModuleSpec, geo: Geometry, out: np.ndarray,
                 accumulate: bool = False) -> np.ndarray:
    """``out`` as the kernel leaves it. Every read of the index and the operands is checked to be
    in bounds (NumPy would wrap a negative index silently)."""
    g = spec.gemm
    M, K = a.shape
    N = b.shape[1]
    bm, gather, bk, tk = g.bm, g.gather, g.bk, geo.tk
    window, chunks = g.threads, g.bm // g.gather  # WINDOW = THREADS, CHUNKS = BM / G
    blocks, nkt = geo.grid[1], (K - 1) // tk + 1 if K else 0
    sub_n = -(-min(tk, K) // bk)
    assert geo.grid[0] * g.bn >= N and counts.shape == (nkt * blocks,) == (geo.groups,)
    assert ids.shape == (geo.groups, bm)
    out = out.copy()
    for rb in range(blocks):  # one CTA per (column slab, row block); the slabs split only N
        r0 = rb * bm
        owned = min(bm, M - r0)
        acc = np.zeros((owned, N), np.float32)
        touched = np.zeros(owned, bool)
        for w0 in range(0, nkt, window):
            steps = []
            for ktl in range(min(window, nkt - w0)):
                cnt = min(max(int(counts[(w0 + ktl) * blocks + rb]), 0), bm)
                steps += [(w0 + ktl, ch, cnt) for ch in range(-(-cnt // gather))]
            assert len(steps) <= window * chunks  # the step list's capacity
            for kt, ch, cnt in steps:
                n_rows = min(gather, cnt - ch * gather)
                listed = [int(ids[kt * blocks + rb, ch * gather + i]) - r0 for i in range(n_rows)]
                slots = [r if 0 <= r < owned else -1 for r in listed]
                slots += [-1] * (-n_rows % 16)  # the rest of the last m16 group: zeros
                assert len(slots) <= gather
                kbeg = kt * tk
                klen = min(tk, K - kbeg)
                part = np.zeros((len(slots), N), np.float32)  # the step's fragments
                for sub in range(sub_n):
                    ks = np.arange(kbeg + sub * bk, kbeg + min((sub + 1) * bk, klen))
                    assert ks.size == 0 or 0 <= ks[0] <= ks[-1] < K
                    stage = np.zeros((len(slots), ks.size), np.float32)
                    for i, r in enumerate(slots):
                        if r >= 0:
                            stage[i] = a[r0 + r, ks]
                    part += stage @ b[ks].astype(np.float32)
                valid = [r for r in slots if r >= 0]
                assert len(set(valid)) == len(valid), "a step's rows are distinct"
                for i, r in enumerate(slots):
                    if r >= 0:
                        acc[r] += part[i]
                        touched[r] = True
        for i in range(owned):
            if not accumulate:
                out[r0 + i] = acc[i]
            elif touched[i]:
                out[r0 + i] += acc[i]
    return out


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as the kernel's operands hold it (bfloat16: the mantissa cut to 7 bits)."""
    if dtype == "bfloat16":
        return (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return x.astype(np.float16 if dtype == "float16" else np.float32).astype(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(M=st.one_of(st.integers(1, 65), st.sampled_from([129, 300])),
       N=st.integers(1, 40), K=st.one_of(st.integers(1, 200), st.sampled_from([64, 333, 2100])),
       tk=st.sampled_from([8, 16, 40, 64, 512]), dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(T.MASK_KINDS), density=st.sampled_from([0.05, 0.3, 0.9]),
       accumulate=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_model_is_the_dense_product(M, N, K, tk, dtype, kind, density, accumulate, seed):
    rng = np.random.default_rng(seed)
    spec, geo = plan(M, N, K, tk, dtype)
    mask = T.granular_mask(rng, (M, K), kind, (1, tk), density)
    a = stored(rng.standard_normal((M, K)) * mask, dtype)
    b = stored(rng.standard_normal((K, N)), dtype)
    counts, ids = model_index(mask, geo, rng)
    choice = make_plan(OP, "A", micro_tile=(1, tk)).choice
    ref_sets = build_index(mask, OP, "A", choice).sets()
    blocks = geo.groups // len(ref_sets)
    merged = {(kt,): frozenset(int(r) for rb in range(blocks)
                               for r in ids[kt * blocks + rb, :counts[kt * blocks + rb]])
              for kt in range(len(ref_sets))}
    assert merged == ref_sets  # the same rows per k-tile as the reference index
    base = rng.standard_normal((M, N)).astype(np.float32) if accumulate else T.poison(
        np.empty((M, N), np.float32))
    got = model_kernel(a, b, counts, ids, spec, geo, base, accumulate)
    want = a.astype(np.float64) @ b + (base if accumulate else 0)
    scale = T.term_scale(np.matmul, a, b)
    extra = base.astype(np.float64) ** 2 if accumulate else 0
    T.assert_close(got, want, "float32", scale=np.sqrt(scale ** 2 + extra))
    if accumulate:  # rows no k-tile lists are left exactly as they were
        untouched = ~mask.any(axis=1)
        assert np.array_equal(got[untouched], base[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_of_empty_and_full_masks_every_m_to_65(dtype):
    rng = np.random.default_rng(0)
    for M in range(1, 66):
        K, N = 77, 9
        spec, geo = plan(M, N, K, 32, dtype)
        b = stored(rng.standard_normal((K, N)), dtype)
        for full in (False, True):
            mask = np.full((M, K), full)
            a = stored(rng.standard_normal((M, K)) * mask, dtype)
            counts, ids = model_index(mask, geo, rng)
            assert counts.sum() == (M * 3 if full else 0)  # 3 k-tiles of 32 cover K = 77
            got = model_kernel(a, b, counts, ids, spec, geo, T.poison(np.empty((M, N), np.float32)))
            T.assert_close(got, a.astype(np.float64) @ b, "float32",
                           scale=T.term_scale(np.matmul, a, b))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(M=st.integers(1, 300), K=st.integers(1, 300), tk=st.sampled_from([16, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_model_never_follows_a_bad_index(M, K, tk, seed):
    """Counts beyond [0, BM] are clamped; ids of other row blocks, past M or negative are
    dropped: the result is the product over the rows the index lists that the CTA owns."""
    rng = np.random.default_rng(seed)
    N = 5
    spec, geo = plan(M, N, K, tk, "float32")
    bm, blocks = geo.cap, geo.grid[1]
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    counts = rng.integers(-3, bm + 40, geo.groups).astype(np.int32)
    ids = np.empty((geo.groups, bm), np.int32)
    want = np.zeros((M, N))
    for grp in range(geo.groups):
        kt, rb = divmod(grp, blocks)
        pool = np.unique(np.concatenate([
            np.arange(rb * bm, min(M, rb * bm + bm)),          # its own rows
            rng.integers(-2**31, 2**31 - 1, bm, dtype=np.int64),  # anything
            [-1, M, M + bm, rb * bm - 1, rb * bm + bm]]))       # just outside
        ids[grp] = rng.permutation(pool)[:bm].astype(np.int32)
        listed = ids[grp, :min(max(counts[grp], 0), bm)]
        kept = [r for r in listed if rb * bm <= r < min(M, rb * bm + bm)]
        ks = slice(kt * tk, min(K, kt * tk + tk))
        for r in kept:
            want[r] += a[r, ks].astype(np.float64) @ b[ks]
    got = model_kernel(a, b, counts, ids, spec, geo, T.poison(np.empty((M, N), np.float32)))
    T.assert_close(got, want, "float32", scale=T.term_scale(np.matmul, a, b))
