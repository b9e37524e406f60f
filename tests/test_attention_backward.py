"""CPU tests of the attention backward pass that need torch: the dense float64 reference (which
test_attention_blocks.py holds the kernels' block algorithm to) against torch autograd; the
custom op's fake shapes and autograd wiring on meta tensors. (The backward template's nvcc
compiles are in test_attention.py, which runs without torch.)"""
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


# -- the custom op on meta tensors: fake shapes, autograd wiring --------------------------------

def _meta(shape, dtype=torch.float16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_fake_forward_shapes():
    op = A._ops()
    q, k, v = _meta((2, 8, 100, 64)), _meta((2, 2, 130, 64)), _meta((2, 2, 130, 64))
    plan = A.plan_attention(2, 8, 100, 130, 64, "float16", (2, 1, 100, 130), 2)
    out, lse, index = op(q, k, v, _meta((2, 1, 100, 130), torch.bool), 0.1, None, False, [])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    assert index.shape == (A._saved_size(plan),) and index.dtype == torch.uint8
    assert A._index_views(plan, index).states.shape == (2, 2, 3)   # the index's arrays
    assert A._ops() is op                                  # registered once
    # an expanded mask counts its stride-0 dims once; no mask (dense, causal): one slice
    expanded = _meta((2, 1, 100, 130), torch.bool).expand(2, 8, 100, 130)
    assert op(q, k, v, expanded, 0.1, None, False, [])[2].shape == index.shape
    one = A.plan_attention(2, 8, 100, 130, 64, "float16", (100, 130), 2)
    assert op(q, k, v, None, 0.1, None, True, [])[2].shape == (A._saved_size(one),)


@pytest.mark.parametrize("with_lse", [False, True])
def test_autograd_reaches_q_k_v_through_the_backward_op(with_lse):
    op = A._ops()
    q = _meta((1, 4, 70, 128), torch.bfloat16, grad=True)
    k, v = (_meta((1, 2, 90, 128), torch.bfloat16, grad=True) for _ in range(2))
    out, lse, _ = op(q, k, v, _meta((70, 90), torch.bool), 0.2, None, False, [])
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
                                _meta((100,), torch.uint8)],
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
