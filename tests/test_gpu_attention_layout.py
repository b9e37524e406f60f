"""GPU tests of sparse attention over a block layout (``block_mask``): the layout's index on the
GPU equals the NumPy decision of the mask it stands for (every block FULL or EMPTY, the stable
longest-first order), the forward (both mainloops) and its lse match float64 NumPy with poisoned
outputs over ragged lengths, block sizes, broadcast layouts, empty and full layouts and GQA, the
gradients match float64 with poisoned buffers, an index built once serves later calls, and bad
layouts raise pitgen errors naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import reference as R
from pitgen import testing as T
from pitgen.ops import attention as A
from test_gpu_attention import mainloop, poison
from test_gpu_attention_backward import check_grads, numpy64

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")


def layout(rng: np.random.Generator, lead: tuple[int, ...], sq: int, sk: int,
           block: tuple[int, int], density: float) -> np.ndarray:
    """A random block layout [*lead, ceil(Sq / bq), ceil(Sk / bk)] (density 0: empty, 1: full)."""
    shape = (*lead, -(-sq // block[0]), -(-sk // block[1]))
    return rng.random(shape) < density


def check_layout_index(idx, mask: np.ndarray) -> None:
    """The layout's index: the plain state map of the mask it stands for (FULL or EMPTY
    wherever a layout block falls), the same as the forward's states, the stable
    longest-first order, nothing gathered and no dense rows."""
    got = {name: x.cpu().numpy() for name, x in idx._asdict().items()}
    states = R.block_index_reference(mask)
    np.testing.assert_array_equal(got["states"], states, err_msg="states")
    np.testing.assert_array_equal(got["blocks"], states, err_msg="blocks")
    np.testing.assert_array_equal(got["order"], R.block_order_reference(states), err_msg="order")
    assert not got["counts"].any() and not got["dense"].any() and not got["dcount"].any()


@settings(max_examples=T.examples(20), deadline=None)
@given(b=st.integers(1, 2), heads=st.sampled_from([(1, 1), (3, 3), (4, 2)]),
       sq=st.sampled_from([1, 70, 128, 200, 320]), sk=st.sampled_from([1, 64, 130, 256, 333]),
       d=st.sampled_from([64, 128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       block=st.sampled_from([64, 128, (64, 128), (192, 64)]),
       lead=st.sampled_from(["", "h", "bh", "b1"]), density=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       as_uint8=st.booleans(), seed=st.integers(0, 2 ** 16))
@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
def test_block_mask_matches_float64_reference(loop, b, heads, sq, sk, d, dtype, block, lead,
                                              density, as_uint8, seed):
    h, hkv = heads
    rng = np.random.default_rng(seed)
    pair = (block, block) if isinstance(block, int) else block
    lay = layout(rng, {"": (), "h": (h,), "bh": (b, h), "b1": (b, 1)}[lead], sq, sk, pair,
                 density)
    mask = R.block_layout_mask(lay, pair, sq, sk)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", tdt)
               for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    tl = torch.from_numpy(lay).cuda()
    if as_uint8:
        tl = tl.to(torch.uint8) * 5   # any non-zero byte attends
    with mainloop(loop), pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out, lse = A.sparse_attention(q, k, v, block_mask=tl, block_size=block, return_lse=True)
        idx = A.block_index(q, k, v, block_mask=tl, block_size=block)
        again = A.sparse_attention(q, k, v, index=idx, block_mask=tl, block_size=block)
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    ref = R.attention_reference(q64, k64, v64, mask)
    T.assert_close(out, ref, dtype)
    T.assert_close(again, ref, dtype, what="with the index given")
    _, ref_lse = R.attention_probabilities(q64, k64, mask, 1.0 / np.sqrt(d))
    got_lse = lse.cpu().numpy()
    live = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(got_lse), live) and not np.isnan(got_lse).any()
    np.testing.assert_allclose(got_lse[live], ref_lse[live], rtol=1e-3, atol=1e-3)
    check_layout_index(idx, mask)


@pytest.mark.parametrize("sq, sk, block", [(64 * 12, 64 * 300, 64),      # nKB >= ORDER_BINS
                                           (64 * 300 + 5, 64 * 3, 128),   # nQB > a chunk
                                           (64 * 200, 64 * 50, 64)])      # staged in 2 rounds
def test_layout_index_orders_long_lists_on_every_call(sq, sk, block):
    rng = np.random.default_rng(3)
    q = torch.randn(1, 2, sq, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, sk, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    for density in (0.05, 0.6, 0.0):
        lay = layout(rng, (2,), sq, sk, (block, block), density)
        idx = A.block_index(q, k, v, block_mask=torch.from_numpy(lay).cuda(), block_size=block)
        check_layout_index(idx, R.block_layout_mask(lay, block, sq, sk))


@settings(max_examples=T.examples(10), deadline=None)
@given(heads=st.sampled_from([(2, 2), (4, 1)]), sq=st.sampled_from([64, 150]),
       sk=st.sampled_from([100, 256]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), lead=st.sampled_from(["", "h", "b1"]),
       density=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2 ** 16))
def test_block_mask_gradients_match_float64_reference(heads, sq, sk, d, dtype, lead, density,
                                                      seed):
    (h, hkv), b, block = heads, 2, 64
    rng = np.random.default_rng(seed)
    lay = layout(rng, {"": (), "h": (h,), "b1": (b, 1)}[lead], sq, sk, (block, block), density)
    mask = R.block_layout_mask(lay, block, sq, sk)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", tdt)
               .requires_grad_() for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    dout = torch.randn(b, h, sq, d, device="cuda").to(tdt)
    with pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, block_mask=torch.from_numpy(lay).cuda(),
                                 block_size=block)
        out.backward(dout)
    T.assert_close(out, R.attention_reference(*numpy64(q, k, v), mask), dtype, what="out")
    check_grads(q, k, v, mask, dout, dtype)


def test_bad_layouts_are_refused_clearly():
    q = torch.randn(2, 3, 200, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 3, 300, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    good = torch.ones(2, 3, dtype=torch.bool, device="cuda")   # ceil(200/128) x ceil(300/128)
    A.sparse_attention(q, k, v, block_mask=good)
    with pytest.raises(pitgen.ShapeError,
                       match=r"block_mask has shape \(2, 2\); expected \[2, 3\]"):
        A.sparse_attention(q, k, v, block_mask=good[:, :2])
    with pytest.raises(pitgen.ShapeError, match="block_mask has shape"):
        A.sparse_attention(q, k, v, block_mask=torch.ones(4, 2, 3, dtype=torch.bool, device="cuda"))
    with pytest.raises(pitgen.ShapeError, match="block_size"):
        A.sparse_attention(q, k, v, block_mask=good, block_size=96)
    with pytest.raises(pitgen.ShapeError, match="block_size"):
        A.sparse_attention(q, k, v, block_mask=good, block_size=(128, 128, 128))
    with pytest.raises(pitgen.ShapeError, match="block_mask has dtype"):
        A.sparse_attention(q, k, v, block_mask=good.float())
    with pytest.raises(pitgen.DeviceError, match="cpu"):
        A.sparse_attention(q, k, v, block_mask=good.cpu())
    with pytest.raises(pitgen.ShapeError, match="one of mask"):
        A.sparse_attention(q, k, v, torch.ones(200, 300, dtype=torch.bool, device="cuda"),
                           block_mask=good)
    with pytest.raises(pitgen.ShapeError, match="one of mask"):
        A.sparse_attention(q, k, v, is_causal=True, block_mask=good)
    with pytest.raises(pitgen.ShapeError, match="a mask or a block_mask"):
        A.block_index(q, k, v)


@pytest.mark.parametrize("sq, sk, heads", [(200, 300, 3),        # one launch (a small problem)
                                           (64 * 40, 64 * 33, 4)])  # the index, then the forward
def test_strided_and_expanded_layouts_and_repeated_calls(sq, sk, heads):
    """A transposed (non-contiguous) layout is read as its values, a layout expanded over heads
    with stride 0 is one slice, and repeated calls of one signature (the cached eager path:
    one launch for a small problem) keep giving the right answer as the layout changes."""
    rng = np.random.default_rng(sq)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, heads, n, 64)).astype(np.float32))
               .to("cuda", torch.float16) for n in (sq, sk, sk))
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    nq, nk = -(-sq // 64), -(-sk // 64)
    for density in (0.3, 0.0, 1.0, 0.6):
        lay = rng.random((nk, nq)) < density
        t = torch.from_numpy(lay).cuda().t()                  # [nq, nk], not contiguous
        mask = R.block_layout_mask(lay.T, 64, sq, sk)
        with pytest.MonkeyPatch.context() as mp:
            poison(mp)
            out = A.sparse_attention(q, k, v, block_mask=t, block_size=64)
            wide = A.sparse_attention(q, k, v, block_mask=t.contiguous().expand(2, heads, nq, nk),
                                      block_size=64)
        ref = R.attention_reference(q64, k64, v64, mask)
        T.assert_close(out, ref, "float16")
        T.assert_close(wide, ref, "float16", what="expanded layout")
        assert A._check(q, k, v, t.contiguous().expand(2, heads, nq, nk), (64, 64))[0].slices == 1
