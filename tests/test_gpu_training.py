"""GPU tests of sparse training (marker ``gpu``): forward and every gradient of both autograd
Functions against dense float64 autograd, gradients exactly zero off the weight mask, several
optimizer steps with a new mask each step, and state_dict round trips with nn.Linear."""
from __future__ import annotations

import pytest

from pitgen import testing as T
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pitgen
import pitgen.nn
from pitgen.ops.linear import sparse_input_linear, sparse_weight_linear
from pitgen.testing import assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

#: float32 runs tf32 tensor cores: each product carries ~4e-4 rounding (two operands rounded to
#: 10 mantissa bits), so an output of one or a few elements (out_f = 1, a masked row) lands
#: near 5e-4 by chance; 1e-3 is 2x tf32's unit roundoff, far below what a wrong kernel gives.
TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-3}


def check(got, want, dtype: str, mag=None, k: int = 1, factor: float = 1.0) -> None:
    """pitgen.testing.assert_close with this module's bounds (``factor`` times TOL). With
    ``mag`` (the same product over absolute values) and the reduction length k, a result that
    cancels to much less than its k random-signed terms (one masked dot product, say) is held
    to the error its terms' rounding makes, not to its own size."""
    assert_close(got, want, "tf32" if dtype == "float32" else dtype, tol=factor * TOL[dtype],
                 magnitude=mag, k=k)


def weight_mask(kind: str, out_f: int, in_f: int, density: float):
    if kind == "micro":  # 32x1 micro-tiles of [out, in]
        g = torch.rand(-(-out_f // 32), in_f, device="cuda") < density
        return g.repeat_interleave(32, 0)[:out_f]
    if kind == "empty":
        return torch.zeros(out_f, in_f, dtype=torch.bool, device="cuda")
    if kind == "full":
        return torch.ones(out_f, in_f, dtype=torch.bool, device="cuda")
    return torch.rand(out_f, in_f, device="cuda") < density


def reference(x, w, b, mask, dy):
    """Dense float64 autograd of y = x (w ⊙ mask)ᵀ + b, and the same products over absolute
    values (for rel's conditioning floor): |y|, |dx|, |dw| bounds."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y = x64 @ (w64 * mask.double()).t()
    if b64 is not None:
        y = y + b64
    y.backward(dy.double())
    ax, aw, ady = x64.detach().abs(), (w64.detach() * mask.double()).abs(), dy.double().abs()
    mags = (ax @ aw.t(), ady @ aw, (ady.t() @ ax) * mask.double())
    return (y.detach(), x64.grad, w64.grad, b64.grad if b64 is not None else None), mags


@settings(max_examples=T.examples(12), deadline=None)
@given(dtype=st.sampled_from(sorted(TOL)), batch=st.integers(1, 160), in_f=st.integers(8, 130),
       out_f=st.integers(1, 140), kind=st.sampled_from(["micro", "random", "empty", "full"]),
       bias=st.booleans(), tile=st.sampled_from([(32, 1), (1, 32), (32, 32)]),
       dx_micro=st.sampled_from(["dense", "auto", "32x1"]), seed=st.integers(0, 2**31))
@example(dtype="float32", batch=65, in_f=8, out_f=1, kind="micro", bias=False, tile=(32, 1),
         dx_micro="dense", seed=0)   # one masked tf32 dot product: 7.2e-4 (session 3)
def test_sparse_weight_linear_forward_and_gradients(dtype, batch, in_f, out_f, kind, bias, tile,
                                                    dx_micro, seed):
    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(batch, in_f, device="cuda").to(dt).requires_grad_()
    w = torch.randn(out_f, in_f, device="cuda").to(dt).requires_grad_()
    b = torch.randn(out_f, device="cuda").to(dt).requires_grad_() if bias else None
    mask = weight_mask(kind, out_f, in_f, 0.3)
    y = sparse_weight_linear(x, w, mask, b, dx_micro_tile=dx_micro, sddmm_tile=tile)
    dy = torch.randn(batch, out_f, device="cuda").to(dt)
    y.backward(dy)
    (y64, dx64, dw64, db64), (y_mag, dx_mag, dw_mag) = reference(x, w, b, mask, dy)
    assert y.dtype == dt and y.shape == (batch, out_f)
    # all-zero references need exact zeros (rel = |got| / 1e-30)
    check(y, y64, dtype, y_mag, in_f)
    check(x.grad, dx64, dtype, dx_mag, out_f)
    assert torch.all(w.grad[~mask] == 0), "weight gradient off the mask is not exactly 0"
    check(w.grad, dw64, dtype, dw_mag, batch)
    if bias:
        check(b.grad, db64, dtype)


@settings(max_examples=T.examples(10), deadline=None)
@given(dtype=st.sampled_from(sorted(TOL)), batch=st.integers(1, 200), in_f=st.integers(8, 130),
       out_f=st.integers(1, 100), zeros=st.sampled_from(["relu", "tokens", "features", "none"]),
       bias=st.booleans(), seed=st.integers(0, 2**31))
def test_sparse_input_linear_forward_and_gradients(dtype, batch, in_f, out_f, zeros, bias, seed):
    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    h = torch.randn(batch, in_f, device="cuda")
    if zeros == "relu":
        h = torch.relu(h - 1.2)  # ~88% zeros
    elif zeros == "tokens":
        h[torch.rand(batch, device="cuda") < 0.7] = 0
    elif zeros == "features":
        h[:, torch.rand(in_f, device="cuda") < 0.7] = 0
    x = h.to(dt).requires_grad_()
    w = torch.randn(out_f, in_f, device="cuda").to(dt).requires_grad_()
    b = torch.randn(out_f, device="cuda").to(dt).requires_grad_() if bias else None
    y = sparse_input_linear(x, w, b)
    dy = torch.randn(batch, out_f, device="cuda").to(dt)
    y.backward(dy)
    ones = torch.ones_like(w, dtype=torch.bool)
    (y64, dx64, dw64, db64), (y_mag, dx_mag, dw_mag) = reference(x, w, b, ones, dy)
    if torch.linalg.norm(y64) > 0:
        check(y, y64, dtype, y_mag, in_f)
    check(x.grad, dx64, dtype, dx_mag, out_f)
    if torch.linalg.norm(dw64) > 0:
        check(w.grad, dw64, dtype, dw_mag, batch)
    else:
        assert torch.all(w.grad == 0)
    if bias:
        check(b.grad, db64, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_training_steps_with_a_new_mask_every_step(dtype):
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    layer = pitgen.nn.SparseLinear(96, 72, device="cuda", dtype=dt)
    ref = torch.nn.Linear(96, 72, device="cuda", dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        mask = torch.rand(72, 96, device="cuda") < 0.5
        layer.set_mask(mask)
        x = torch.randn(50, 96, device="cuda")
        target = torch.randn(50, 72, device="cuda")
        loss = torch.nn.functional.mse_loss(layer(x.to(dt)).float(), target)
        opt.zero_grad()
        loss.backward()
        assert torch.all(layer.weight.grad[~mask] == 0)
        before = layer.weight.detach().clone()
        opt.step()
        assert torch.equal(layer.weight.detach()[~mask], before[~mask])  # masked weights frozen
        y_ref = x.double() @ (ref.weight * mask.double()).t() + ref.bias
        ref_loss = torch.nn.functional.mse_loss(y_ref, target.double())
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 10 * TOL[dtype]
    check(layer.weight, ref.weight.detach(), dtype, factor=10)


def test_sparse_input_module_and_prune():
    torch.manual_seed(1)
    layer = pitgen.ops.linear.SparseLinear(64, 48, device="cuda", dtype=torch.float16,
                                         sparse_input=True)
    x = torch.relu(torch.randn(3, 10, 64, device="cuda") - 1).half()
    y = layer(x)
    assert y.shape == (3, 10, 48)
    want = x.double() @ layer.weight.double().t() + layer.bias.double()
    check(y, want, "float16")
    dense = pitgen.ops.linear.SparseLinear(64, 48, device="cuda")
    mask = dense.prune_(0.75)
    assert mask.dtype == torch.bool and abs(mask.float().mean().item() - 0.25) < 0.02
    kept = dense.weight.abs()[mask].min()
    assert kept >= dense.weight.abs()[~mask].max()
    tiled = dense.prune_(0.5, tile=(16, 1))
    assert torch.equal(tiled, tiled[::16].repeat_interleave(16, 0))
    partial = dense.prune_(0.5, tile=(5, 1))  # 48 rows: the last tile holds 3
    assert torch.equal(partial, partial[::5].repeat_interleave(5, 0)[:48])
    with pytest.raises(pitgen.ShapeError):
        dense.prune_(0.5, tile=(0, 1))
    with pytest.raises(pitgen.PlanError):
        dense.prune_(1.5)


def test_state_dict_round_trips_with_nn_linear():
    sparse = pitgen.ops.linear.SparseLinear(40, 24, device="cuda")
    dense = torch.nn.Linear(40, 24, device="cuda")
    assert set(sparse.state_dict()) == set(dense.state_dict()) == {"weight", "bias"}
    dense.load_state_dict(sparse.state_dict())
    assert torch.equal(dense.weight, sparse.weight)
    fresh = torch.nn.Linear(40, 24, device="cuda")
    sparse.load_state_dict(fresh.state_dict())
    assert torch.equal(sparse.weight, fresh.weight) and torch.equal(sparse.bias, fresh.bias)
    x = torch.randn(7, 40, device="cuda")
    check(sparse(x), fresh(x).double(), "float32")  # all-True mask: the dense layer (tf32)


def test_a_pruned_layer_reloads_pruned():
    torch.manual_seed(2)
    layer = pitgen.ops.linear.SparseLinear(777, 1000, device="cuda", dtype=torch.float16)
    mask = layer.prune_(0.9, tile=(32, 1))  # 1000 rows: the last tile holds 8
    assert abs(mask.float().mean().item() - 0.1) < 0.02
    state = layer.state_dict()
    assert torch.equal(state["weight_mask"], mask)
    again = pitgen.ops.linear.SparseLinear(777, 1000, device="cuda", dtype=torch.float16)
    again.load_state_dict(state)
    assert torch.equal(again.weight_mask, mask)
    x = torch.randn(5, 777, device="cuda", dtype=torch.float16)
    check(again(x), layer(x).double(), "float16")
    with pytest.raises(RuntimeError, match="weight_mask"):  # a dense layer cannot hold the mask
        torch.nn.Linear(777, 1000).load_state_dict(state)


def test_an_input_of_another_dtype_is_named():
    layer = pitgen.ops.linear.SparseLinear(64, 32, device="cuda", dtype=torch.float16)
    with pytest.raises(pitgen.ShapeError, match="x has dtype float32; expected float16"):
        layer(torch.randn(4, 64, device="cuda"))


def test_weight_sparse_step_has_no_host_sync():
    x = torch.randn(256, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.randn(96, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(96, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn(256, 96, device="cuda", dtype=torch.float16)
    masks = [torch.rand(96, 128, device="cuda") < 0.3 for _ in range(2)]
    sparse_weight_linear(x, w, masks[0], b, dx_micro_tile="32x1").backward(dy)  # compile first
    torch.cuda.set_sync_debug_mode("error")
    try:
        sparse_weight_linear(x, w, masks[1], b, dx_micro_tile="32x1").backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.all(w.grad[~(masks[0] | masks[1])] == 0)


def test_bad_inputs_raise_pitgen_errors():
    x = torch.randn(8, 32, device="cuda", dtype=torch.float16)
    w = torch.randn(16, 32, device="cuda", dtype=torch.float16)
    mask = torch.ones(16, 32, device="cuda", dtype=torch.bool)
    with pytest.raises(pitgen.ShapeError, match="mask"):
        sparse_weight_linear(x, w, mask.t())
    with pytest.raises(pitgen.ShapeError, match="x has dtype float16; expected float32"):
        sparse_weight_linear(x, w.float(), mask)  # the weight's dtype is the layer's
    with pytest.raises(pitgen.ShapeError, match="x has shape"):
        sparse_input_linear(x, w[:, :16])  # the layer's in_features are the weight's
    with pytest.raises(pitgen.ShapeError, match="bias"):
        sparse_weight_linear(x, w, mask, torch.zeros(15, device="cuda", dtype=torch.float16))
    with pytest.raises(pitgen.DeviceError):
        sparse_input_linear(x.cpu(), w)
    layer = pitgen.ops.linear.SparseLinear(32, 16, device="cuda")
    with pytest.raises(pitgen.ShapeError, match="mask"):
        layer.set_mask(torch.ones(16, 31, device="cuda", dtype=torch.bool))
