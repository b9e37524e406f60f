"""GPU tests of dynamic sparse attention: the GPU index (block states, gathered keys, dense
rows, order) equals the NumPy decision exactly, the fused kernel matches float64 NumPy on every
mask pattern (poisoned outputs), gathered key tiles and dense-row tiles included, corrupt index
contents stay in bounds, the module matches nn.MultiheadAttention with the same weights, and bad
input raises pitgen errors."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import lower
from pitgen import testing as T
from pitgen import reference as R
import pitgen
from pitgen.ops import attention as A
from pitgen.runtime import device_arch

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

PATTERNS = ("block64", "block128", "micro1x64", "micro16x16", "longformer", "rows_masked",
            "empty", "full", "element", "bigbird", "global", "full_rows")


def make_mask(rng: np.random.Generator, pattern: str, sq: int, sk: int, density: float) -> np.ndarray:
    """One [Sq, Sk] mask of the pattern."""
    if pattern in ("empty", "full", "element"):
        return T.granular_mask(rng, (sq, sk), pattern, density=density)
    if pattern == "longformer":
        return T.longformer_mask(sq, sk, 32, T.random_global_tokens(rng, min(sq, sk), 3))
    if pattern == "bigbird":     # gathered keys (random, global) and dense rows (global)
        return T.bigbird_mask(rng, sq, sk, 32, T.random_global_tokens(rng, min(sq, sk), 3), 6)
    if pattern == "global":      # global tokens only: dense rows, single gathered columns
        return T.longformer_mask(sq, sk, 0, T.random_global_tokens(rng, min(sq, sk), 2))
    if pattern == "full_rows":   # some rows allow every key, the rest scattered keys
        m = T.tile_mask(rng, sq, sk, (1, 1), density * 0.05)
        m[rng.random(sq) < 0.04] = True
        return m
    if pattern == "rows_masked":   # dense-ish, with whole rows masked out
        m = T.tile_mask(rng, sq, sk, (1, 1), 0.5)
        m[rng.random(sq) < 0.4] = False
        return m
    tile = {"block64": (64, 64), "block128": (128, 128), "micro1x64": (1, 64),
            "micro16x16": (16, 16)}[pattern]
    return T.tile_mask(rng, sq, sk, tile, density)


def _forget() -> None:
    A.plan_attention.cache_clear()
    A._CHECKED.clear()
    A._EAGER.clear()


@contextlib.contextmanager
def mainloop(name: str):
    """The calls inside run the forward on ``name`` ("mma_sync": Hopper's wgmma turned off, so
    both kernels run on a Hopper GPU); yields whether the plan multiplies on wgmma."""
    with pytest.MonkeyPatch.context() as mp:
        if name == "mma_sync":
            mp.setattr(lower, "WGMMA_ARCHS", ())
        _forget()
        try:
            yield device_arch() in lower.WGMMA_ARCHS
        finally:
            _forget()


def operands(rng, b, h, sq, sk, d, dtype):
    tdt = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", tdt)
               for s in ((b, h, sq, d), (b, h, sk, d), (b, h, sk, d)))
    return q, k, v


def poison(monkeypatch):
    """Make torch.empty_like (the output allocation) return NaNs so unwritten rows show."""
    real = torch.empty_like

    def nan_like(x, *a, **k):
        y = real(x, *a, **k)
        return T.poison(y) if y.is_floating_point() else y
    monkeypatch.setattr(torch, "empty_like", nan_like)


@settings(max_examples=T.examples(15), deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), sq=st.sampled_from([1, 17, 64, 100, 193]),
       sk=st.sampled_from([1, 40, 64, 130, 256]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), pattern=st.sampled_from(PATTERNS),
       mask_dims=st.sampled_from([2, 3, 4]), density=st.sampled_from([0.1, 0.5, 0.9]),
       as_uint8=st.booleans(), seed=st.integers(0, 2 ** 16))
@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
def test_matches_float64_reference(loop, b, h, sq, sk, d, dtype, pattern, mask_dims, density,
                                   as_uint8, seed):
    rng = np.random.default_rng(seed)
    lead = {2: (), 3: (h,), 4: (b, h)}[mask_dims]
    mask = np.stack([make_mask(rng, pattern, sq, sk, density)
                     for _ in range(int(np.prod(lead, dtype=int)))]).reshape(*lead, sq, sk)
    q, k, v = operands(rng, b, h, sq, sk, d, dtype)
    tmask = torch.from_numpy(mask).cuda()
    if as_uint8:
        tmask = tmask.to(torch.uint8) * 3   # any non-zero byte attends
    with mainloop(loop) as wgmma, pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, tmask)
        assert A._check(q, k, v, tmask)[0].wgmma == wgmma
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
    T.assert_close(out, ref, dtype)

    check_index(A.block_index(q, k, v, tmask), mask)


def check_index(idx, mask):
    """The GPU index equals the NumPy decision (key_index_reference) exactly: states, plain
    block states, the stable longest-first order, each query block's gathered keys and row
    masks (ascending) and the dense rows."""
    ref = R.key_index_reference(mask)
    got = {name: x.cpu().numpy() for name, x in idx._asdict().items()}
    for name in ("states", "blocks", "order", "counts", "dcount"):
        np.testing.assert_array_equal(got[name], getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(got["blocks"], R.block_index_reference(mask))
    np.testing.assert_array_equal(got["dense"].view(np.uint64), ref.dense)
    for i, j in np.ndindex(ref.counts.shape):
        n = ref.counts[i, j]
        np.testing.assert_array_equal(got["keys"][i, j, :n], ref.keys[i, j, :n])
        np.testing.assert_array_equal(got["bits"][i, j, :n].view(np.uint64), ref.bits[i, j, :n])
    for i, n in enumerate(ref.dcount):
        np.testing.assert_array_equal(got["drows"][i, :n], ref.drows[i, :n])


@pytest.mark.parametrize("sq, sk", [(64 * 12, 64 * 300),     # nKB >= ORDER_BINS: scaled classes
                                    (64 * 300 + 5, 64 * 3)])  # nQB > one sorting chunk
def test_index_orders_rows_on_every_call_and_resets_its_counters(sq, sk):
    rng = np.random.default_rng(7)
    q = torch.randn(1, 2, sq, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, sk, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    n_qb = -(-sq // 64)
    for _ in range(3):                  # counters left zero by each call
        mask = np.stack([T.tile_mask(rng, sq, sk, (64, 64), d) for d in (0.05, 0.6)])
        keep = np.repeat(rng.random((2, n_qb, 1)) < 0.7, 64, axis=1)[:, :sq]
        mask &= keep                    # whole empty query blocks too
        check_index(A.block_index(q, k, v, torch.from_numpy(mask).cuda()), mask)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])   # the kernel flips Q for a negative one
def test_long_sequence_with_scale_and_unaligned_mask(d, scale):
    rng = np.random.default_rng(d)
    sq, sk = 1000, 1203   # Sk % 16 != 0: the byte index path
    mask = T.longformer_mask(sq, sk, 128, T.random_global_tokens(rng, sq, 8))
    mask &= T.tile_mask(rng, sq, sk, (16, 16), 0.7)
    q, k, v = operands(rng, 1, 2, sq, sk, d, "float16")
    out = A.sparse_attention(q, k, v, torch.from_numpy(mask).cuda(), scale=scale)
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask, scale=scale)
    T.assert_close(out, ref, "float16")


def test_mask_changes_every_call_and_index_reuse():
    rng = np.random.default_rng(1)
    q, k, v = operands(rng, 1, 2, 256, 256, 64, "float16")
    for density in (0.05, 0.5, 1.0):
        mask = T.tile_mask(rng, 256, 256, (1, 64), density)
        tm = torch.from_numpy(mask).cuda()
        ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
        T.assert_close(A.sparse_attention(q, k, v, tm), ref, "float16")
        idx = A.block_index(q, k, v, tm)
        T.assert_close(A.sparse_attention(q, k, v, tm, index=idx), ref, "float16")
        # any state byte but EMPTY, FULL and GATHERED (its keys come from the gathered list)
        # reads as partial: masked element by element, exact
        junk = torch.randint(4, 256, (1, 4, 4), dtype=torch.uint8, device="cuda")
        junk = torch.where(idx.states == A.GATHERED, idx.states, junk)
        T.assert_close(A.sparse_attention(q, k, v, tm, index=idx._replace(states=junk)), ref,
                       "float16")
        # order entries out of range are dropped, not followed (their rows stay unwritten, but
        # for rows moved to dense-row tiles)
        bad = torch.tensor([[3, -1, 1 << 30, 0]], dtype=torch.int32, device="cuda")
        out = A.sparse_attention(q, k, v, tm, index=idx._replace(order=bad))
        T.assert_close(out[:, :, list(range(64)) + list(range(192, 256))],
                       ref[:, :, list(range(64)) + list(range(192, 256))], "float16")


def test_module_matches_multihead_attention():
    torch.manual_seed(0)
    e, heads, n, length, src = 256, 4, 2, 150, 97
    mha = torch.nn.MultiheadAttention(e, heads, bias=True, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0, 0.1)
        mha.out_proj.bias.normal_(0, 0.1)
    mod = pitgen.ops.attention.SparseAttention(e, heads).cuda().half()
    mod.load_state_dict(mha.state_dict())
    assert set(mod.state_dict()) == set(mha.state_dict())
    x = torch.randn(n, length, e)
    kv = torch.randn(n, src, e)
    rng = np.random.default_rng(0)
    allowed = T.tile_mask(rng, length, src, (1, 16), 0.3)
    allowed[:, 0] = True   # no fully masked row: nn.MultiheadAttention gives NaN there
    attn_mask = torch.from_numpy(~allowed)
    with torch.no_grad():
        ref, _ = mha.double()(x.double(), kv.double(), kv.double(), attn_mask=attn_mask,
                              need_weights=False)
    xh, kvh = x.cuda().half(), kv.cuda().half()
    out, w = mod(xh, kvh, kvh, attn_mask=attn_mask.cuda())
    assert w is None
    T.assert_close(out, ref.numpy(), "float16")
    out2, _ = mod(xh, kvh, kvh, mask=torch.from_numpy(allowed).cuda())
    T.assert_close(out2, ref.numpy(), "float16")
    per_head = attn_mask.expand(n * heads, length, src).cuda()
    out3, _ = mod(xh, kvh, kvh, attn_mask=per_head)
    T.assert_close(out3, ref.numpy(), "float16")


def test_bad_input_is_refused_clearly():
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, 1, 2, 64, 64, 64, "float16")
    m = torch.ones(64, 64, dtype=torch.bool, device="cuda")
    with pytest.raises(pitgen.ShapeError, match="head dim"):
        A.sparse_attention(*operands(rng, 1, 2, 64, 64, 32, "float16"), m)
    with pytest.raises(pitgen.ShapeError, match="dtype"):
        A.sparse_attention(q.float(), k.float(), v.float(), m)
    with pytest.raises(pitgen.ShapeError, match="dtype"):
        A.sparse_attention(q, k.bfloat16(), v, m)
    with pytest.raises(pitgen.ShapeError, match="mask has shape"):
        A.sparse_attention(q, k, v, m[:, :63])
    with pytest.raises(pitgen.ShapeError, match="mask has shape"):
        A.sparse_attention(q, k, v, torch.ones(3, 64, 64, dtype=torch.bool, device="cuda"))
    with pytest.raises(pitgen.ShapeError, match="mask has dtype"):
        A.sparse_attention(q, k, v, m.float())
    with pytest.raises(pitgen.ShapeError, match="not contiguous"):
        A.sparse_attention(q.transpose(2, 3), k, v, m)
    with pytest.raises(pitgen.ShapeError, match="shape"):
        A.sparse_attention(q, k[:, :, :32].contiguous(), v, m)
    with pytest.raises(pitgen.DeviceError, match="cpu"):
        A.sparse_attention(q, k, v, m.cpu())
    with pytest.raises(pitgen.DeviceError, match="cpu"):
        A.sparse_attention(q.cpu(), k, v, m)
    odd = torch.empty(2 * 64 * 64 + 4, dtype=torch.float16, device="cuda")[4:]
    with pytest.raises(pitgen.ShapeError, match="aligned"):
        A.sparse_attention(q, odd.view(1, 2, 64, 64), v, m)
    with pytest.raises(pitgen.ShapeError, match="BlockIndex"):
        A.sparse_attention(q, k, v, m, index=torch.zeros(1, 1, 1, dtype=torch.uint8, device="cuda"))
    good = A.block_index(q, k, v, m)
    with pytest.raises(pitgen.ShapeError, match="index.states"):
        A.sparse_attention(q, k, v, m, index=good._replace(states=good.states.int()))
    with pytest.raises(pitgen.ShapeError, match="index.order"):
        A.sparse_attention(q, k, v, m, index=good._replace(order=good.order[:, :0]))
    with pytest.raises(pitgen.ShapeError, match="index.order is on cpu"):
        A.sparse_attention(q, k, v, m, index=good._replace(order=good.order.cpu()))
    with pytest.raises(pitgen.ShapeError, match="index.keys"):
        A.sparse_attention(q, k, v, m, index=good._replace(keys=good.keys[..., :1]))
    mod = pitgen.ops.attention.SparseAttention(128, 2).cuda().half()
    x = torch.randn(1, 8, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(pitgen.PlanError, match="need_weights"):
        mod(x, x, x, mask=torch.ones(8, 8, dtype=torch.bool, device="cuda"), need_weights=True)
    with pytest.raises(pitgen.ShapeError, match="key_padding_mask has shape"):
        mod(x, x, x, torch.zeros(1, 7, dtype=torch.bool, device="cuda"))
    with pytest.raises(pitgen.ShapeError, match="only bool"):
        mod(x, x, x, attn_mask=torch.zeros(8, 8, device="cuda"))


def test_empty_problems():
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, 1, 1, 0, 5, 64, "float16")
    assert A.sparse_attention(q, k, v, torch.ones(0, 5, dtype=torch.bool, device="cuda")).shape == (1, 1, 0, 64)
    q, k, v = operands(rng, 1, 1, 5, 0, 64, "float16")
    out = A.sparse_attention(q, k, v, torch.ones(5, 0, dtype=torch.bool, device="cuda"))
    assert out.shape == (1, 1, 5, 64) and not out.any()


@settings(max_examples=T.examples(15), deadline=None)
@given(b=st.integers(1, 2), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       sq=st.sampled_from([64, 130, 333, 700]), sk=st.sampled_from([64, 200, 512, 777]),
       d=st.sampled_from([64, 128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       pattern=st.sampled_from(["bigbird", "global", "full_rows", "longformer"]),
       mask_dims=st.sampled_from([2, 3, 4]), seed=st.integers(0, 2 ** 16))
@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
def test_gathered_keys_and_dense_rows_match_float64_reference(loop, b, hkv, group, sq, sk, d,
                                                              dtype, pattern, mask_dims, seed):
    """Masks whose index gathers keys and moves dense rows, at sizes with many key blocks:
    outputs and lse (poisoned first) against float64, GQA, every mask form, the index exact."""
    rng = np.random.default_rng(seed)
    h = hkv * group
    lead = {2: (), 3: (h,), 4: (b, h)}[mask_dims]
    mask = np.stack([make_mask(rng, pattern, sq, sk, 0.3)
                     for _ in range(int(np.prod(lead, dtype=int)))]).reshape(*lead, sq, sk)
    tdt = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((b, h, sq, d)).astype(np.float32)).to("cuda", tdt)
    k, v = (torch.from_numpy(rng.standard_normal((b, hkv, sk, d)).astype(np.float32)).to("cuda", tdt)
            for _ in range(2))
    tmask = torch.from_numpy(mask).cuda()
    with mainloop(loop) as wgmma, pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out, lse = A.sparse_attention(q, k, v, tmask, return_lse=True)
        assert A._check(q, k, v, tmask)[0].wgmma == wgmma
    args = [x.double().cpu().numpy() for x in (q, k, v)]
    T.assert_close(out, R.attention_reference(*args, mask), dtype)
    _, ref_lse = R.attention_probabilities(args[0], args[1], mask)
    got = lse.cpu().numpy()
    dead = np.isinf(ref_lse)
    assert np.isneginf(got[dead]).all()
    T.assert_close(got[~dead], ref_lse[~dead], dtype, what="lse")
    check_index(A.block_index(q, k, v, tmask), mask)


def test_bigbird_index_gathers_and_moves_rows():
    """The benchmark's kind of mask at a small size: most partial blocks become gathered keys,
    the global rows move to a dense-row tile, and the result is right."""
    rng = np.random.default_rng(3)
    s = 1024
    mask = T.bigbird_mask(rng, s, s, 128, T.random_global_tokens(rng, s, 4), 48)
    q, k, v = operands(rng, 1, 2, s, s, 64, "float16")
    tmask = torch.from_numpy(mask).cuda()
    idx = A.block_index(q, k, v, tmask)
    check_index(idx, mask)
    assert int(idx.dcount[0]) == 4 and (idx.states == A.GATHERED).sum() > (idx.states == A.PARTIAL).sum()
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
    T.assert_close(A.sparse_attention(q, k, v, tmask), ref, "float16")


def test_dense_row_decisions_on_every_finishing_path():
    """Each way a query block's last index CTA decides its dense rows, against the NumPy rule:
    rows that leave (every index CTA saw exactly them allowing all of its keys: decided from
    the sums), rows that stay because leaving saves no work, more candidates than may leave,
    and a row allowing all keys of one index CTA only (the candidates differ between CTAs: the
    pass over the column masks)."""
    rng = np.random.default_rng(11)
    sq, sk = 4 * 64, 2048                       # 4 index CTAs per query block
    mask = T.tile_mask(rng, sq, sk, (16, 16), 0.1)
    mask[3] = mask[40] = True                   # qb 0: two dense rows leave
    mask[64:128] = True                         # qb 1: two dense rows stay (no work saved) ...
    mask[66:128, 5::64] = False                 # ... the other rows miss a key of every block
    mask[128:134] = True                        # qb 2: six candidates, more than may leave
    mask[192] = True                            # qb 3: a dense row, and a row allowing all of
    mask[200, :512] = True                      # the first index CTA's keys
    q, k, v = operands(rng, 1, 2, sq, sk, 64, "float16")
    tmask = torch.from_numpy(mask).cuda()
    idx = A.block_index(q, k, v, tmask)
    check_index(idx, mask)
    dense = idx.dense.cpu().numpy().view(np.uint64)[0]
    assert [bin(int(x)).count("1") for x in dense] == [2, 0, 0, 1]
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
    T.assert_close(A.sparse_attention(q, k, v, tmask), ref, "float16")


@pytest.mark.parametrize("sk", [4000, 8704])   # 8 index CTAs a query block; 17 (no quiet CTAs)
def test_quiet_index_ctas_beside_gathering_and_candidate_ones(sk):
    """Index CTAs with no row allowing all of their keys and nothing gathered arrive without
    a release (at most 16 CTAs a query block); their query block's last CTA then reads only
    the gathering CTAs' sums and takes the visited blocks from the arrivals. Query blocks
    mixing them with CTAs that gather keys, hold full or partial blocks, or see a row allowing
    all of their keys, finished either way, against the NumPy index and float64 outputs."""
    rng = np.random.default_rng(sk)
    sq = 5 * 64
    mask = np.zeros((sq, sk), bool)
    mask[0:64, 700:703] = True                  # qb 0: quiet CTAs and one gathering three keys
    mask[64:128, 0:640] = True                  # qb 1: a full block, a partial one (no gather)
    mask[64:80, 2000:2064] = True               # ... a partial block in another CTA
    mask[128:192, 1500] = True                  # qb 2: one key allowed by every row (gathered)
    mask[130, :] = True                         # ... and a row allowing every key
    mask[192:256, sk - 512:] = True             # qb 3: the last CTA's keys all allowed
    mask[260, ::97] = True                      # qb 4: scattered keys of one row
    q, k, v = operands(rng, 1, 2, sq, sk, 64, "float16")
    tmask = torch.from_numpy(mask).cuda()
    for _ in range(3):                          # the counters left zero for the next launch
        check_index(A.block_index(q, k, v, tmask), mask)
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
    with pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, tmask)
    live = mask.any(-1)
    tlive = torch.from_numpy(live).cuda()
    T.assert_close(out[..., tlive, :], ref[..., live, :], "float16")
    assert bool((out[..., ~tlive, :] == 0).all())   # rows attending nothing are zeros


def test_corrupt_gathered_and_dense_entries_stay_in_bounds():
    """Ids and counts of a given index are range-checked before any address: key ids outside
    [0, Sk) are masked zero rows, counts are clamped, dense row ids outside [0, Sq) are neither
    loaded nor written. On a mask with no gathered key and no dense row the result is exact."""
    rng = np.random.default_rng(11)
    sq, sk = 200, 300
    mask = T.tile_mask(rng, sq, sk, (64, 64), 0.5)
    mask[:, 0] = False            # no row allows every key; partial blocks keep 63 columns
    q, k, v = operands(rng, 1, 2, sq, sk, 64, "float16")
    tm = torch.from_numpy(mask).cuda()
    idx = A.block_index(q, k, v, tm)
    assert not idx.counts.any() and not idx.dcount.any()
    cap = idx.keys.shape[-1]
    bad = idx._replace(
        counts=torch.full_like(idx.counts, 2 ** 31 - 1),
        keys=torch.randint(sk, 2 ** 31 - 1, idx.keys.shape, dtype=torch.int32, device="cuda")
        * torch.where(torch.rand(idx.keys.shape, device="cuda") < 0.5, -1, 1).int(),
        bits=torch.full_like(idx.bits, -1),
        drows=torch.where(torch.arange(idx.drows.numel(), device="cuda").view_as(idx.drows) % 2 == 0,
                          -5, sq + 7).int(),
        dcount=torch.full_like(idx.dcount, 2 ** 31 - 1))
    assert cap > 0
    ref = R.attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), mask)
    with pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, tm, index=bad)
    torch.cuda.synchronize()
    T.assert_close(out, ref, "float16")
