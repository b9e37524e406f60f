"""CPU tests of the attention backward pass and its PyTorch-shaped API: the kernels' block
algorithm (forward with lse, delta, dQ over a row of the index, dK/dV over a column, GQA groups)
written in NumPy against the dense float64 reference, which is itself checked against torch
autograd; the plan's backward decisions and refusals; the custom op's fake shapes and autograd
wiring on meta tensors. (The backward template's nvcc compiles are in test_attention.py,
which runs without torch.)"""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pitgen
from pitgen import reference as R
from pitgen import testing as T
from pitgen.ops import attention as A

torch = pytest.importorskip("torch", reason="the autograd tests need torch")

ARCHS = ("sm_80", "sm_90")
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
    over the same lists and the dK/dV pass over the index's columns, head groups summed."""
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

    for b in range(b_):
        for h in range(h_):                                 # dQ: a row of the index
            sl, kv = b * h_ + h, h // group
            for qb in order[sl]:
                r0 = qb * A.BM
                qt, dot = _tile(q[b, h], r0, A.BM), _tile(dout[b, h], r0, A.BM)
                lr = np.concatenate([lse[b, h, r0:r0 + A.BM],
                                     np.full(max(0, r0 + A.BM - sq), np.inf)])
                dr = _tile(delta[b, h], r0, A.BM)
                acc = np.zeros((A.BM, d))
                for kb in np.flatnonzero(states[sl, qb]):
                    kt = _tile(k[b, kv], kb * A.BN, A.BN)
                    ok = _allowed(m[b, h], states[sl, qb, kb], r0, kb * A.BN, sq, sk)
                    _, ds = p_and_ds(qt, kt, _tile(v[b, kv], kb * A.BN, A.BN), dot, lr, dr, ok)
                    acc += ds @ kt
                rows = min(A.BM, sq - r0)
                dq[b, h, r0:r0 + rows] = (scale * acc)[:rows]
        for hk in range(hkv):                               # dK, dV: a column of the index
            for kb in range(n_kb):
                c0 = kb * A.BN
                kt, vt = _tile(k[b, hk], c0, A.BN), _tile(v[b, hk], c0, A.BN)
                gk, gv = np.zeros((A.BN, d)), np.zeros((A.BN, d))
                for h in range(hk * group, (hk + 1) * group):
                    sl = b * h_ + h
                    for qb in np.flatnonzero(states[sl, :, kb]):
                        r0 = qb * A.BM
                        qt, dot = _tile(q[b, h], r0, A.BM), _tile(dout[b, h], r0, A.BM)
                        ok = _allowed(m[b, h], states[sl, qb, kb], r0, c0, sq, sk)
                        p, ds = p_and_ds(qt, kt, vt, dot, _tile(lse[b, h], r0, A.BM),
                                         _tile(delta[b, h], r0, A.BM), ok)
                        gv += p.T @ dot
                        gk += ds.T @ qt
                cols = min(A.BN, sk - c0)
                dk[b, hk, c0:c0 + cols] = (scale * gk)[:cols]
                dv[b, hk, c0:c0 + cols] = gv[:cols]
    return out, lse, dq, dk, dv


def _masks(rng, pattern: str, lead: tuple[int, ...], sq: int, sk: int) -> np.ndarray:
    def one():
        if pattern == "longformer":
            return T.longformer_mask(sq, sk, 40, T.random_global_tokens(rng, min(sq, sk), 2))
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
       pattern=st.sampled_from(["longformer", "rows_masked", "empty", "full", "block64",
                                "micro16"]),
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


def _torch_attention(q, k, v, mask, scale):
    """Masked attention in torch float64 (rows with nothing allowed: zeros), for autograd."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    m = torch.as_tensor(np.broadcast_to(mask, q.shape[:2] + (q.shape[2], k.shape[2])).copy())
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~m, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    lse = torch.logsumexp(s, -1)
    return p @ v, lse


@pytest.mark.parametrize("heads, with_lse", [((2, 2), False), ((4, 2), True), ((3, 1), True)])
def test_dense_reference_matches_torch_autograd(heads, with_lse):
    h, hkv = heads
    rng = np.random.default_rng(h + hkv)
    b, sq, sk, d = 2, 37, 45, 8
    mask = rng.random((b, h, sq, sk)) < 0.3
    mask[0, 0, :5] = False                      # fully masked rows
    q = torch.tensor(rng.standard_normal((b, h, sq, d)), requires_grad=True)
    k = torch.tensor(rng.standard_normal((b, hkv, sk, d)), requires_grad=True)
    v = torch.tensor(rng.standard_normal((b, hkv, sk, d)), requires_grad=True)
    dout = rng.standard_normal((b, h, sq, d))
    dlse = rng.standard_normal((b, h, sq)) if with_lse else None
    out, lse = _torch_attention(q, k, v, mask, 0.4)
    loss = (out * torch.tensor(dout)).sum()
    if with_lse:
        live = torch.isfinite(lse)
        loss = loss + (lse.where(live, 0.0) * torch.tensor(dlse)).sum()
    loss.backward()
    if dlse is not None:
        dlse = np.where(mask.any(-1), dlse, 0.0)
    ref = R.attention_backward_reference(q.detach().numpy(), k.detach().numpy(),
                                         v.detach().numpy(), mask, dout, 0.4, dlse)
    for got, x in zip(ref, (q, k, v)):
        np.testing.assert_allclose(got, x.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(R.attention_reference(q.detach().numpy(), k.detach().numpy(),
                                                     v.detach().numpy(), mask, 0.4),
                               out.detach().numpy(), atol=1e-12)


# -- plan: GQA, broadcast masks, backward decisions ---------------------------------------------

def test_plan_gqa_and_broadcast_masks():
    p = A.plan_attention(2, 8, 100, 130, 64, "float16", (2, 1, 100, 130), 2)
    assert (p.kv_heads, p.group, p.slices, p.mask_strides) == (2, 4, 2, (1, 0))
    assert p.dkv_grid() == (4, 3, 1) and p.attention_grid() == (16, 2, 1)
    p = A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 1, 100, 130))
    assert (p.kv_heads, p.group, p.slices, p.mask_strides) == (8, 1, 1, (0, 0))
    assert A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 100, 130)).slices == 1
    assert A.plan_attention(2, 8, 100, 130, 64, "float16", (1, 8, 100, 130)).mask_strides == (0, 1)
    p = A.plan_attention(1, 4, 100, 4096, 128, "bfloat16", (100, 4096), 4)
    st_ = A.STAGES_BWD[128]
    assert p.smem_dq == 2 * st_ * 64 * 128 * 2 + st_ * 64 * A.MASK_ROW + 4 * 64
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


# -- the custom op on meta tensors: fake shapes, autograd wiring --------------------------------

def _meta(shape, dtype=torch.float16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_fake_forward_shapes():
    op = A._ops()
    q, k, v = _meta((2, 8, 100, 64)), _meta((2, 2, 130, 64)), _meta((2, 2, 130, 64))
    out, lse, states, order = op(q, k, v, _meta((2, 1, 100, 130), torch.bool), 0.1,
                                 None, False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    assert states.shape == (2, 2, 3) and states.dtype == torch.uint8
    assert order.shape == (2, 2) and order.dtype == torch.int32
    assert A._ops() is op                                  # registered once
    # an expanded mask counts its stride-0 dims once; no mask (dense, causal): one slice
    expanded = _meta((2, 1, 100, 130), torch.bool).expand(2, 8, 100, 130)
    assert op(q, k, v, expanded, 0.1, None, False)[2].shape == (2, 2, 3)
    assert op(q, k, v, None, 0.1, None, True)[2].shape == (1, 2, 3)


@pytest.mark.parametrize("with_lse", [False, True])
def test_autograd_reaches_q_k_v_through_the_backward_op(with_lse):
    op = A._ops()
    q = _meta((1, 4, 70, 128), torch.bfloat16, grad=True)
    k, v = (_meta((1, 2, 90, 128), torch.bfloat16, grad=True) for _ in range(2))
    out, lse, _, _ = op(q, k, v, _meta((70, 90), torch.bool), 0.2, None, False, [])
    loss = out.float().sum() + (lse.sum() if with_lse else 0)
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    # the op records its autograd: out has a grad_fn, the index outputs none
    assert out.grad_fn is not None


def test_backward_op_fake_shapes():
    A._ops()
    q, k, v = _meta((1, 4, 70, 64)), _meta((1, 1, 90, 64)), _meta((1, 1, 90, 64))
    dq, dk, dv = torch.ops.pitgen.sparse_attention_backward(
        _meta((1, 4, 70, 64)), [q, k, v, _meta((1, 4, 70, 64)), _meta((1, 4, 70), torch.float32),
                                _meta((1, 2, 2), torch.uint8), _meta((1, 2), torch.int32)],
        _meta((70, 90), torch.bool), 0.125, None, [])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_importing_pitgen_imports_no_torch():
    code = ("import sys, pitgen, pitgen.nn, pitgen.ops.attention as A; "
            "A.plan_attention(1, 2, 8, 8, 64, 'float16', (8, 8)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- rendering and nvcc --------------------------------------------------------------------------

#: Two compiles keep the suite fast, yet each D, each dtype and each arch is built once.
# -- SparseAttention's masks in nn.MultiheadAttention's terms (CPU tensors) -----------------------

def test_module_combines_masks_like_multihead_attention():
    import pitgen.nn

    mod = pitgen.nn.SparseAttention(128, 2)
    n, length, src = 3, 5, 7
    rng = np.random.default_rng(0)
    attn = torch.from_numpy(rng.random((length, src)) < 0.3)          # True = not allowed
    per_head = torch.from_numpy(rng.random((n * 2, length, src)) < 0.3)
    pad = torch.from_numpy(rng.random((n, src)) < 0.3)
    mine = torch.from_numpy(rng.random((2, length, src)) < 0.7)       # True = attend
    causal = torch.ones(length, src, dtype=torch.bool).tril()

    def allowed(*a, **k):
        args = dict(key_padding_mask=None, attn_mask=None, is_causal=False, mask=None)
        args.update(k)
        return mod._allowed(n, length, src, "cpu", *a, **args)

    assert allowed() == (None, False)                                  # dense: no mask
    assert allowed(is_causal=True) == (None, True)                     # causal: no mask either
    m, c = allowed(attn_mask=attn)
    assert not c and torch.equal(m, ~attn)
    m, _ = allowed(attn_mask=per_head)
    assert torch.equal(m, ~per_head.view(n, 2, length, src))
    m, _ = allowed(key_padding_mask=pad)                               # [N, 1, L, S], not per head
    assert m.shape == (n, 1, length, src)
    assert torch.equal(m, (~pad)[:, None, None, :].expand(n, 1, length, src))
    m, c = allowed(key_padding_mask=pad, attn_mask=attn, is_causal=True, mask=mine)
    assert not c
    assert torch.equal(m, mine & ~attn & (~pad)[:, None, None, :] & causal)
    with pytest.raises(pitgen.ShapeError, match="key_padding_mask has shape"):
        allowed(key_padding_mask=pad[:, :3])
    with pytest.raises(pitgen.ShapeError, match="only bool"):
        allowed(attn_mask=attn.float())
    with pytest.raises(pitgen.ShapeError, match="N \\* num_heads"):
        allowed(attn_mask=per_head[:2])
    x = torch.zeros(n, length, 128)
    with pytest.raises(pitgen.PlanError, match="need_weights"):
        mod(x, x, x, need_weights=True)
