"""GPU tests of SDDMM (marker ``gpu``): index, compact tiles and dense-out mode against float64
NumPy references, for every tile kind and dtype, odd shapes, empty/full masks and rows/columns."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pitgen import testing as T
from hypothesis import given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import lower
from pitgen.ops import sddmm as S
from pitgen.ops.sddmm import sddmm
from pitgen.runtime import device_arch
from pitgen.reference import sddmm_index_reference, sddmm_reference, sddmm_tiles_reference
from pitgen.testing import assert_close, poison, term_scale

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

DTYPES = ("bfloat16", "float16", "float32")
TILES = [(32, 1), (1, 32), (16, 1), (1, 64), (32, 32), (16, 16), (64, 64), (64, 8)]
PATTERNS = ("random", "tiles", "empty", "full", "rows", "cols")


def make_mask(rng: np.random.Generator, M: int, N: int, pattern: str, tile) -> np.ndarray:
    """Masks with the structures that stress the index: elements, whole tiles, empty/full
    rows and columns, nothing, everything."""
    if pattern == "empty":
        return np.zeros((M, N), bool)
    if pattern == "full":
        return np.ones((M, N), bool)
    if pattern == "tiles":
        th, tw = tile
        grid = rng.random((-(-M // th), -(-N // tw))) < 0.3
        return np.kron(grid, np.ones(tile, bool))[:M, :N] & (rng.random((M, N)) < 0.7)
    m = rng.random((M, N)) < 0.1
    if pattern == "rows":
        m[rng.random(M) < 0.3, :] = True
        m[rng.random(M) < 0.3, :] = False
    elif pattern == "cols":
        m[:, rng.random(N) < 0.3] = True
        m[:, rng.random(N) < 0.3] = False
    return m


def check(got, want, dtype: str, q, k, mask, scale: float = 1.0) -> None:
    """Every element within the rounding of its own terms (float32 SDDMM runs on tf32 tensor
    cores): a norm bound would fail a short dot product that cancels and pass a dropped one."""
    terms = term_scale(lambda a, b: sddmm_reference(a, b, T._numpy(mask), scale), q, k)
    assert_close(got, want, "tf32" if dtype == "float32" else dtype, scale=terms)


def tiles_of(dense: np.ndarray, rows, cols, tile) -> np.ndarray:
    """The listed [th, tw] tiles of a dense [M, N] array, zero-padded at the edges."""
    th, tw = tile
    M, N = dense.shape
    pad = np.zeros((-(-M // th) * th, -(-N // tw) * tw))
    pad[:M, :N] = dense
    return np.stack([pad[r * th:(r + 1) * th, c * tw:(c + 1) * tw] for r, c in zip(rows, cols)]
                    ) if len(rows) else np.zeros((0,) + tuple(tile))


def operands(rng, M, N, D, dtype, transposed_views: bool):
    """q [M, D], k [N, D] on the GPU (as transposed views of [D, M] / [D, N] when asked)."""
    dt = getattr(torch, dtype)
    if transposed_views:
        q = torch.randn(D, M, device="cuda").to(dt).t()
        k = torch.randn(D, N, device="cuda").to(dt).t()
    else:
        q = torch.randn(M, D, device="cuda").to(dt)
        k = torch.randn(N, D, device="cuda").to(dt)
    return q, k


@settings(max_examples=T.examples(15), deadline=None)
@given(tile=st.sampled_from(TILES), dtype=st.sampled_from(DTYPES),
       M=st.integers(1, 150), N=st.integers(1, 150), D=st.integers(1, 100),
       pattern=st.sampled_from(PATTERNS), views=st.booleans(), seed=st.integers(0, 2**31))
def test_compact_tiles_match_reference(tile, dtype, M, N, D, pattern, views, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    q, k = operands(rng, M, N, D, dtype, views)
    mask_np = make_mask(rng, M, N, pattern, tile)
    mask = torch.from_numpy(mask_np).cuda()
    res = sddmm(q, k, mask, tile=tile, scale=0.5)
    count = int(res.count.item())
    rows = res.tile_rows[:count].cpu().numpy()
    cols = res.tile_cols[:count].cpu().numpy()
    got_index = set(zip(rows.tolist(), cols.tolist()))
    assert len(got_index) == count, "a tile was listed twice"
    assert got_index == sddmm_index_reference(mask_np, tile)
    qn, kn = q.double().cpu().numpy(), k.double().cpu().numpy()
    want = sddmm_tiles_reference(qn, kn, mask_np, tile, scale=0.5)
    vals = res.values[:count].double().cpu().numpy()
    got = np.stack([vals[t] for t in range(count)]) if count else np.zeros((0,) + tuple(tile))
    ref = np.stack([want[(r, c)] for r, c in zip(rows, cols)]) if count else got
    terms = term_scale(lambda a, b: sddmm_reference(a, b, mask_np, 0.5), qn, kn)
    assert_close(got, ref, "tf32" if dtype == "float32" else dtype,
                 scale=tiles_of(terms, rows, cols, tile))
    th, tw = tile
    pad = np.zeros((-(-M // th) * th, -(-N // tw) * tw), bool)
    pad[:M, :N] = mask_np
    for t, (r, c) in enumerate(zip(rows, cols)):  # exact masking inside every listed tile
        off = ~pad[r * th:(r + 1) * th, c * tw:(c + 1) * tw]
        assert np.all(got[t][off] == 0)
    dense = res.to_dense().double().cpu().numpy()
    assert dense.shape == (M, N)
    assert np.all(dense[~mask_np] == 0)
    check(dense, sddmm_reference(qn, kn, mask_np, 0.5), dtype, qn, kn, mask_np, 0.5)


@settings(max_examples=T.examples(15), deadline=None)
@given(tile=st.sampled_from(TILES), dtype=st.sampled_from(DTYPES),
       M=st.integers(1, 200), N=st.integers(1, 200), D=st.integers(1, 130),
       pattern=st.sampled_from(PATTERNS), views=st.booleans(), seed=st.integers(0, 2**31))
def test_dense_out_writes_masked_product_and_zeros(tile, dtype, M, N, D, pattern, views, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    q, k = operands(rng, M, N, D, dtype, views)
    mask_np = make_mask(rng, M, N, pattern, tile)
    mask = torch.from_numpy(mask_np.astype(np.uint8)).cuda()
    out = poison(torch.empty((M, N), device="cuda", dtype=q.dtype))
    assert sddmm(q, k, mask, tile=tile, out=out) is out
    got = out.double().cpu().numpy()
    want = sddmm_reference(q.double().cpu().numpy(), k.double().cpu().numpy(), mask_np)
    assert np.all(got[~mask_np] == 0), "an element outside the mask is not exactly 0"
    check(got, want, dtype, q, k, mask_np)


def test_dense_out_into_a_transposed_view_and_mask_changing_every_call():
    torch.manual_seed(0)
    q = torch.randn(96, 72, device="cuda", dtype=torch.float16)
    k = torch.randn(130, 72, device="cuda", dtype=torch.float16)
    base = torch.empty(130, 96, device="cuda", dtype=torch.float16)
    for step in range(3):
        mask = torch.rand(96, 130, device="cuda") < 0.2 * (step + 1)
        poison(base)
        sddmm(q, k, mask, tile=(32, 1), out=base.t())
        want = (q.double() @ k.double().t()) * mask
        check(base.t(), want, "float16", q, k, mask)
        assert torch.all(base.t()[~mask] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [(32, 1), (1, 32), (32, 32), (16, 8)])
def test_sixteen_byte_loads_with_odd_rows_and_columns(dtype, tile):
    torch.manual_seed(3)
    dt = getattr(torch, dtype)
    q = torch.randn(77, 96, device="cuda").to(dt)    # D = 96: 16-byte loads along d
    k = torch.randn(101, 96, device="cuda").to(dt)
    mask = torch.rand(77, 101, device="cuda") < 0.3
    out = poison(torch.empty((77, 101), device="cuda", dtype=dt))
    sddmm(q, k, mask, tile=tile, out=out)
    want = (q.double() @ k.double().t()) * mask
    check(out, want, dtype, q, k, mask)
    assert torch.all(out[~mask] == 0)
    dense = sddmm(q, k, mask, tile=tile).to_dense()
    assert torch.equal(dense, out)


@contextlib.contextmanager
def mainloop(name: str):
    """The calls inside run the tiles on ``name`` ("mma_sync": Hopper's wgmma turned off, so
    both kernels run on a Hopper GPU); yields whether a 16-bit plan with 16-byte operands
    multiplies on wgmma."""
    with pytest.MonkeyPatch.context() as mp:
        if name == "mma_sync":
            mp.setattr(lower, "WGMMA_ARCHS", ())
        S.plan_sddmm.cache_clear()
        try:
            yield device_arch() in lower.WGMMA_ARCHS
        finally:
            S.plan_sddmm.cache_clear()


@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
@settings(max_examples=T.examples(12), deadline=None)
@given(tile=st.sampled_from(TILES + [(1, 16), (64, 1)]), dtype=st.sampled_from(DTYPES[:2]),
       M=st.integers(1, 200), N=st.integers(1, 200), D8=st.integers(1, 40),
       pattern=st.sampled_from(PATTERNS), compact=st.booleans(), seed=st.integers(0, 2**31))
def test_both_mainloops_on_16_byte_operands(loop, tile, dtype, M, N, D8, pattern, compact, seed):
    """Contiguous 16-bit operands with D % 8 == 0 (up to 320: several 64-deep steps, a ragged
    last one): the wgmma tiles on Hopper, mma.sync elsewhere and with wgmma turned off."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    D = 8 * D8
    q, k = operands(rng, M, N, D, dtype, False)
    mask_np = make_mask(rng, M, N, pattern, tile)
    mask = torch.from_numpy(mask_np).cuda()
    qn, kn = q.double().cpu().numpy(), k.double().cpu().numpy()
    want = sddmm_reference(qn, kn, mask_np, 0.25)
    with mainloop(loop) as wgmma:
        vecs = (S.vector_width(dtype, D, q.stride(), q.data_ptr()),
                S.vector_width(dtype, D, k.stride(), k.data_ptr()))
        cfg = S.plan_sddmm(dtype, tile, tuple(q.stride()), tuple(k.stride()),
                           tuple(mask.stride()), vecs, device_arch())
        assert cfg.wgmma == wgmma
        if compact:
            got = sddmm(q, k, mask, tile=tile, scale=0.25).to_dense()
        else:
            got = poison(torch.empty((M, N), device="cuda", dtype=q.dtype))
            sddmm(q, k, mask, tile=tile, out=got, scale=0.25)
    got = got.double().cpu().numpy()
    assert np.all(got[~mask_np] == 0), "an element outside the mask is not exactly 0"
    check(got, want, dtype, qn, kn, mask_np, 0.25)


def test_no_host_sync_in_the_call():
    q = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    mask = torch.rand(256, 256, device="cuda") < 0.1
    sddmm(q, k, mask)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = sddmm(q, k, mask, tile=(32, 1))
        res.to_dense()
        sddmm(q, k, mask, out=torch.empty(256, 256, device="cuda", dtype=torch.float16))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_inputs_raise_pitgen_errors():
    q = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    k = torch.randn(48, 32, device="cuda", dtype=torch.float16)
    mask = torch.ones(64, 48, device="cuda", dtype=torch.bool)
    with pytest.raises(pitgen.ShapeError, match="mask"):
        sddmm(q, k, mask.t())
    with pytest.raises(pitgen.ShapeError, match="dtype"):
        sddmm(q, k.float(), mask)
    with pytest.raises(pitgen.ShapeError, match="k has shape"):
        sddmm(q, k[:, :16], mask)
    with pytest.raises(pitgen.DeviceError):
        sddmm(q.cpu(), k, mask)
    with pytest.raises(pitgen.ShapeError, match="mask"):
        sddmm(q, k, mask.float())
    with pytest.raises(pitgen.PlanError, match="tile"):
        sddmm(q, k, mask, tile=(3, 5))
    with pytest.raises(pitgen.ShapeError, match="out"):
        sddmm(q, k, mask, out=torch.empty(64, 47, device="cuda", dtype=torch.float16))
