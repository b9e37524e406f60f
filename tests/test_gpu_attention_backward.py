"""GPU tests of the attention backward pass: dQ, dK, dV (and the lse and its gradient) against
float64 references of masked attention on every mask pattern, both dtypes, D 64/128, odd
lengths, broadcast masks and grouped-query attention, with poisoned gradient buffers; the
SparseAttention module's training step against nn.MultiheadAttention in float64 (every
parameter's gradient); the no-grad path and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pitgen
import pitgen.nn
from pitgen import reference as R
from pitgen import testing as T
from pitgen.ops import attention as A

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

PATTERNS = ("block64", "block128", "micro1x64", "micro16x16", "longformer", "window_global",
            "rows_masked", "empty", "full", "element")


def make_mask(rng: np.random.Generator, pattern: str, sq: int, sk: int, density: float) -> np.ndarray:
    """One [Sq, Sk] mask of the pattern."""
    if pattern in ("empty", "full", "element"):
        return T.granular_mask(rng, (sq, sk), pattern, density=density)
    if pattern == "longformer":
        return T.longformer_mask(sq, sk, 32, T.random_global_tokens(rng, min(sq, sk), 3))
    if pattern == "window_global":   # window + global tokens, cut by 16x16 tiles: partial blocks
        m = T.longformer_mask(sq, sk, 96, T.random_global_tokens(rng, min(sq, sk), 4))
        return m & T.tile_mask(rng, sq, sk, (16, 16), 0.8)
    if pattern == "rows_masked":     # whole rows masked out: zero output and zero gradients
        m = T.tile_mask(rng, sq, sk, (1, 1), 0.5)
        m[rng.random(sq) < 0.4] = False
        return m
    tile = {"block64": (64, 64), "block128": (128, 128), "micro1x64": (1, 64),
            "micro16x16": (16, 16)}[pattern]
    return T.tile_mask(rng, sq, sk, tile, density)


def masks(rng, pattern, lead, sq, sk, density):
    n = int(np.prod(lead, dtype=int))
    return np.stack([make_mask(rng, pattern, sq, sk, density) for _ in range(n)]).reshape(
        *lead, sq, sk)


def operands(rng, b, h, hkv, sq, sk, d, dtype, grad=True):
    tdt = getattr(torch, dtype)
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", tdt)
            .requires_grad_(grad) for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))]


def poison(monkeypatch):
    """torch.empty_like (every output and gradient buffer of the kernels) returns NaNs, so an
    element a kernel never writes fails."""
    real = torch.empty_like

    def nan_like(x, *a, **k):
        y = real(x, *a, **k)
        return T.poison(y) if y.is_floating_point() else y
    monkeypatch.setattr(torch, "empty_like", nan_like)


def numpy64(*xs):
    return [x.detach().double().cpu().numpy() for x in xs]


def magnitudes(q, k, v, mask, dout, scale=None):
    """(dq, dk, dv) summed over absolute terms, with their reduction lengths: the scale that
    the gradients' rounding follows where they cancel (e.g. one key: dS = P (dP - delta) = 0
    exactly, up to rounding of terms of this size)."""
    q, k, v, dout = (np.abs(x) for x in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    p, _ = R.attention_probabilities(q, k, mask, scale)      # any P of the right support
    p = (p > 0).astype(np.float64)
    kr, vr = (np.repeat(x, group, axis=1) for x in (k, v))
    ds = p * (dout @ vr.swapaxes(-1, -2) + (dout * (p @ vr)).sum(-1, keepdims=True))
    dq = scale * ds @ kr
    dk, dv = scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ dout
    if group > 1:
        dk, dv = (x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2) for x in (dk, dv))
    return (dq, k.shape[2]), (dk, q.shape[2] * group), (dv, q.shape[2] * group)


def check_grads(q, k, v, mask, dout, dtype, scale=None, dlse=None):
    args = (*numpy64(q, k, v), mask, dout.double().cpu().numpy())
    ref = R.attention_backward_reference(*args, scale, None if dlse is None else dlse.cpu().numpy())
    for name, x, r, (mag, n) in zip(("dq", "dk", "dv"), (q, k, v), ref,
                                    magnitudes(*args, scale)):
        assert x.grad is not None, f"{name}: no gradient reached the input"
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        T.assert_close(x.grad, r, dtype, magnitude=mag, k=n, what=name)


@settings(max_examples=T.examples(25), deadline=None)
@given(b=st.integers(1, 2), heads=st.sampled_from([(1, 1), (3, 3), (4, 2), (4, 1)]),
       sq=st.sampled_from([1, 17, 64, 100, 193]), sk=st.sampled_from([1, 40, 64, 130, 256]),
       d=st.sampled_from([64, 128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       pattern=st.sampled_from(PATTERNS), mask_lead=st.sampled_from(["", "h", "bh", "b1", "11"]),
       density=st.sampled_from([0.1, 0.5, 0.9]), as_uint8=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_gradients_match_float64_reference(b, heads, sq, sk, d, dtype, pattern, mask_lead,
                                           density, as_uint8, seed):
    h, hkv = heads
    rng = np.random.default_rng(seed)
    lead = {"": (), "h": (h,), "bh": (b, h), "b1": (b, 1), "11": (1, 1)}[mask_lead]
    mask = masks(rng, pattern, lead, sq, sk, density)
    q, k, v = operands(rng, b, h, hkv, sq, sk, d, dtype)
    tmask = torch.from_numpy(mask).cuda()
    if as_uint8:
        tmask = tmask.to(torch.uint8) * 3   # any non-zero byte attends
    dout = torch.randn(b, h, sq, d, device="cuda").to(q.dtype)
    with pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, tmask)
        out.backward(dout)
    T.assert_close(out, R.attention_reference(*numpy64(q, k, v), mask), dtype, what="out")
    check_grads(q, k, v, mask, dout, dtype)


@pytest.mark.parametrize("d, dtype", [(64, "float16"), (128, "bfloat16")])
def test_lse_and_its_gradient(d, dtype):
    rng = np.random.default_rng(d)
    b, h, hkv, sq, sk = 2, 4, 2, 150, 203   # Sk % 16 != 0: the byte-mask kernels
    mask = masks(rng, "window_global", (b, 1), sq, sk, 0.5)
    mask[0, 0, :7] = False                   # fully masked rows: lse -inf, zero gradients
    q, k, v = operands(rng, b, h, hkv, sq, sk, d, dtype)
    tmask = torch.from_numpy(mask).cuda()
    out, lse = A.sparse_attention(q, k, v, tmask, scale=0.2, return_lse=True)
    _, ref_lse = R.attention_probabilities(*numpy64(q, k), mask, 0.2)
    dead = np.isinf(ref_lse)
    got = lse.detach().cpu().numpy()
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert dead.any() and (got[dead] == -np.inf).all()
    T.assert_close(got[~dead], ref_lse[~dead], dtype, what="lse")
    dout = torch.randn_like(out)
    dlse = torch.randn(b, h, sq, device="cuda")
    live = torch.isfinite(lse)
    loss = (out.float() * dout.float()).sum() + (lse.where(live, 0.0) * dlse).sum()
    loss.backward()
    check_grads(q, k, v, mask, dout, dtype, 0.2, torch.where(live, dlse, 0.0))


@pytest.mark.parametrize("d, dtype, lead, heads", [(64, "float16", (1, 1), (4, 2)),
                                                    (128, "bfloat16", (2, 1), (2, 2)),
                                                    (64, "bfloat16", (2, 4), (4, 4))])
def test_gradients_over_gathered_keys_and_dense_rows(d, dtype, lead, heads):
    """The backward over the forward's decomposition: query blocks gathering more than one
    tile of keys (their dK, dV added to per-key sums), two dense-row tiles (68 global rows),
    GQA and broadcast masks; then the same call again (the sums and their flags left zero)."""
    rng = np.random.default_rng(d + heads[0])
    h, hkv = heads
    b, sq, sk = lead[0], 1100, 600
    g = np.array([qb * 64 + r for qb in range(17) for r in (1, 17, 33, 49)])
    n = int(np.prod(lead))
    mask = np.stack([T.bigbird_mask(rng, sq, sk, 32, g, 40 + i) for i in range(n)]).reshape(
        *lead, sq, sk)
    q, k, v = operands(rng, b, h, hkv, sq, sk, d, dtype)
    tmask = torch.from_numpy(mask).cuda()
    idx = A.block_index(q, k, v, tmask)
    assert idx.dcount.max().item() > A.BM and idx.counts.max().item() > A.BN
    dout = torch.randn(b, h, sq, d, device="cuda").to(q.dtype)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        with pytest.MonkeyPatch.context() as mp:
            poison(mp)
            A.sparse_attention(q, k, v, tmask).backward(dout)
        check_grads(q, k, v, mask, dout, dtype)
        grads.append([x.grad.clone() for x in (q, k, v)])
    assert torch.equal(grads[0][0], grads[1][0])   # dQ has no atomics: repeatable bit for bit


@pytest.mark.parametrize("pattern", ["empty", "full", "rows_masked"])
def test_extreme_masks_and_fully_masked_rows(pattern):
    rng = np.random.default_rng(3)
    sq, sk = 129, 67
    mask = make_mask(rng, pattern, sq, sk, 0.5)
    q, k, v = operands(rng, 1, 2, 2, sq, sk, 64, "float16")
    with pytest.MonkeyPatch.context() as mp:
        poison(mp)
        out = A.sparse_attention(q, k, v, torch.from_numpy(mask).cuda())
        dout = torch.randn_like(out)
        out.backward(dout)
    dead = torch.from_numpy(~mask.any(-1)).cuda()
    assert not out[:, :, dead].any() and not q.grad[:, :, dead].any()
    if pattern == "empty":
        assert not k.grad.any() and not v.grad.any()
    check_grads(q, k, v, mask, dout, "float16")


def test_broadcast_masks_are_not_copied_per_head():
    rng = np.random.default_rng(5)
    b, h, sq, sk = 2, 4, 100, 128
    q, k, v = operands(rng, b, h, h, sq, sk, 64, "float16", grad=False)
    per_batch = masks(rng, "micro16x16", (b, 1), sq, sk, 0.4)
    tm = torch.from_numpy(per_batch).cuda()
    assert A.block_index(q, k, v, tm).states.shape[0] == b               # one slice per batch
    expanded = tm.expand(b, h, sq, sk)                                    # stride 0 over heads
    assert A.block_index(q, k, v, expanded).states.shape[0] == b
    ref = R.attention_reference(*numpy64(q, k, v), per_batch)
    for m in (tm, expanded):
        T.assert_close(A.sparse_attention(q, k, v, m), ref, "float16")


def test_no_grad_and_index_reuse_paths():
    rng = np.random.default_rng(6)
    q, k, v = operands(rng, 1, 2, 1, 100, 140, 64, "float16")
    mask = masks(rng, "longformer", (), 100, 140, 0.5)
    tm = torch.from_numpy(mask).cuda()
    with torch.no_grad():
        out = A.sparse_attention(q, k, v, tm)
    assert out.grad_fn is None
    idx = A.block_index(q, k, v, tm)
    out = A.sparse_attention(q, k, v, tm, index=idx)      # grad through a given index
    dout = torch.randn_like(out)
    out.backward(dout)
    check_grads(q, k, v, mask, dout, "float16")


def test_module_training_step_matches_multihead_attention():
    torch.manual_seed(0)
    e, heads, n, length, src = 256, 4, 2, 150, 97
    mha = torch.nn.MultiheadAttention(e, heads, bias=True, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0, 0.1)
        mha.out_proj.bias.normal_(0, 0.1)
    mod = pitgen.nn.SparseAttention(e, heads).cuda().half()
    mod.load_state_dict(mha.state_dict())
    rng = np.random.default_rng(0)
    allowed = T.tile_mask(rng, length, src, (1, 16), 0.3)
    allowed[:, 0] = True   # no fully masked row: nn.MultiheadAttention gives NaN there
    attn_mask = torch.from_numpy(~allowed)
    x, kv, g = torch.randn(n, length, e), torch.randn(n, src, e), torch.randn(n, length, e)
    ref = mha.double()
    xd, kvd = x.double().requires_grad_(), kv.double().requires_grad_()
    out_ref, _ = ref(xd, kvd, kvd, attn_mask=attn_mask, need_weights=False)
    (out_ref * g.double()).sum().backward()

    xh = x.cuda().half().requires_grad_()
    kvh = kv.cuda().half().requires_grad_()
    out, w = mod(xh, kvh, kvh, attn_mask=attn_mask.cuda())
    assert w is None
    (out.float() * g.cuda()).sum().backward()
    T.assert_close(out, out_ref.detach().numpy(), "float16", what="out")
    params = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        assert params[name].grad is not None, f"{name}: no gradient"
        T.assert_close(params[name].grad, p.grad.numpy(), "float16", what=f"{name}.grad")
    T.assert_close(xh.grad, xd.grad.numpy(), "float16", what="query.grad")
    T.assert_close(kvh.grad, kvd.grad.numpy(), "float16", what="key/value.grad")


def test_bad_input_is_refused_clearly():
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, 1, 4, 4, 64, 64, 64, "float16")
    m = torch.ones(64, 64, dtype=torch.bool, device="cuda")
    with pytest.raises(pitgen.ShapeError, match="does not divide"):
        A.sparse_attention(q, k[:, :3].contiguous(), v[:, :3].contiguous(), m)
    with pytest.raises(pitgen.ShapeError, match="v has shape"):
        A.sparse_attention(q, k, v[:, :2].contiguous(), m)
    with pytest.raises(pitgen.ShapeError, match="mask has shape"):
        A.sparse_attention(q, k, v, torch.ones(1, 2, 64, 64, dtype=torch.bool, device="cuda"))
    with pytest.raises(pitgen.ShapeError, match="scale"):
        A.sparse_attention(q, k, v, m, scale=float("nan"))


def test_module_masks_in_multihead_attention_terms():
    torch.manual_seed(1)
    e, heads, n, length = 128, 2, 3, 90
    mha = torch.nn.MultiheadAttention(e, heads, bias=True, batch_first=True)
    mod = pitgen.nn.SparseAttention(e, heads).cuda().half()
    mod.load_state_dict(mha.state_dict())
    ref = mha.double()
    x = torch.randn(n, length, e)
    xh, xd = x.cuda().half(), x.double()
    causal = ~torch.ones(length, length, dtype=torch.bool).tril()      # True = not allowed
    padding = torch.zeros(n, length, dtype=torch.bool)
    padding[0, 60:] = padding[2, 1:30] = True                          # row 0 keeps key 0
    with torch.no_grad():
        want, _ = ref(xd, xd, xd, need_weights=False)
        got, _ = mod(xh, xh, xh)                                       # no mask: dense
        T.assert_close(got, want.numpy(), "float16", what="no mask")
        want, _ = ref(xd, xd, xd, attn_mask=causal, is_causal=True, need_weights=False)
        got, _ = mod(xh, xh, xh, is_causal=True)
        T.assert_close(got, want.numpy(), "float16", what="is_causal")
        want, _ = ref(xd, xd, xd, padding, False, causal)              # MHA's positional order
        got, _ = mod(xh, xh, xh, padding.cuda(), False, causal.cuda())
        T.assert_close(got, want.numpy(), "float16", what="key_padding_mask + attn_mask")
        got, _ = mod(xh, xh, xh, padding.cuda(), is_causal=True)
        T.assert_close(got, want.numpy(), "float16", what="key_padding_mask + is_causal")


@pytest.mark.parametrize("d, dtype, sq, sk, heads", [(64, "float16", 200, 200, (4, 2)),
                                                     (128, "bfloat16", 130, 257, (2, 2)),
                                                     (64, "bfloat16", 300, 100, (3, 1))])
def test_causal_and_dense_calls_read_no_mask(d, dtype, sq, sk, heads):
    rng = np.random.default_rng(sq + sk)
    for is_causal in (False, True):
        q, k, v = operands(rng, 2, *heads, sq, sk, d, dtype)
        mask = np.tril(np.ones((sq, sk), bool)) if is_causal else np.ones((sq, sk), bool)
        with pytest.MonkeyPatch.context() as mp:
            poison(mp)
            out = A.sparse_attention(q, k, v, is_causal=is_causal)
            dout = torch.randn_like(out)
            out.backward(dout)
        T.assert_close(out, R.attention_reference(*numpy64(q, k, v), mask), dtype, what="out")
        check_grads(q, k, v, mask, dout, dtype)
        with torch.no_grad():
            again = A.sparse_attention(q, k, v, is_causal=is_causal)   # the cached index
        T.assert_close(again, out.detach().double().cpu().numpy(), dtype, what="again")
    with pytest.raises(pitgen.ShapeError, match="not both"):
        A.sparse_attention(q, k, v, torch.from_numpy(mask).cuda(), is_causal=True)


@pytest.mark.parametrize("slices, nqb, nkb", [(1, 64, 64), (3, 5, 300), (2, 200, 7), (1, 1, 1)])
def test_key_block_order_is_a_stable_descending_sort(slices, nqb, nkb):
    """The dK/dV pass's order (pit_attn_bwd_order): key blocks by their count of FULL and
    PARTIAL states over every slice and query block, most first, ties in key-block order; key
    blocks side by side (nKB below and above the CTA's threads) and rows side by side."""
    rng = np.random.default_rng(nkb)
    states = rng.integers(0, 4, (slices, nqb, nkb), dtype=np.uint8)
    states[:, :, rng.random(nkb) < 0.3] = A.EMPTY   # empty columns: ties
    states[:, :, rng.random(nkb) < 0.2] = A.GATHERED  # gathered columns count nothing either
    plan = A.plan_attention(1, 1, 64 * nqb, 64 * nkb, 64, "float16", (64 * nqb, 64 * nkb))
    order = torch.full((nkb,), -1, dtype=torch.int32, device="cuda")
    ts = torch.from_numpy(states).cuda()
    A._Backward(plan, True, False).order(torch.cuda.current_stream().cuda_stream, ts.data_ptr(),
                                         slices * nqb, nkb, order.data_ptr())
    counts = np.isin(states, (A.PARTIAL, A.FULL)).sum((0, 1))
    assert order.cpu().numpy().tolist() == np.argsort(-counts, kind="stable").tolist()


@pytest.mark.parametrize("kind", ["mask", "block_mask", "causal"])
def test_repeated_training_calls_take_the_cached_paths(kind):
    """A call signature seen before runs its cached forward and bound backward (no checks, no
    index views): the same gradients as the float64 reference on every call, with poisoned
    buffers."""
    rng = np.random.default_rng(9)
    sq = sk = 320
    q, k, v = operands(rng, 2, 4, 2, sq, sk, 64, "float16")
    layout = rng.random((3, 3)) < 0.5
    layout[0, 0] = True
    mask = {"mask": masks(rng, "window_global", (), sq, sk, 0.5),
            "block_mask": np.kron(layout, np.ones((128, 128), bool))[:sq, :sk],
            "causal": np.tril(np.ones((sq, sk), bool))}[kind]
    given = {"mask": {"mask": torch.from_numpy(mask).cuda()},
             "block_mask": {"block_mask": torch.from_numpy(layout).cuda()},
             "causal": {"is_causal": True}}[kind]
    for call in range(3):
        for x in (q, k, v):
            x.grad = None
        dout = torch.randn(2, 4, sq, 64, device="cuda").to(q.dtype)
        with pytest.MonkeyPatch.context() as mp:
            poison(mp)
            out = A.sparse_attention(q, k, v, **given)
            assert out.grad_fn.fast is not None, "the cached forward ran"
            out.backward(dout)
        check_grads(q, k, v, mask, dout, "float16")
