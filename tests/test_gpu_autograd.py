"""GPU tests of pitgen's backward passes (marker ``gpu``) against float64 torch autograd: SDDMM
(dense and CSR layouts: dQ, dK; empty and full masks, odd shapes, every dtype), the MoE FFN
(dx, dgates, dw1, dw2, db1, db2; top-1/top-2, empty experts, every activation, every dtype),
the MoE module's router gradient; and the clear error of ops that have no backward."""
from __future__ import annotations

import numpy as np
import pytest

import pitgen
import pitgen.nn
from pitgen.errors import BackwardError
from pitgen.ops.moe import ACTIVATIONS, moe_ffn
from pitgen.ops.sddmm import sddmm
from pitgen.testing import assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: float32 runs tf32 tensor cores (MoE: two chained GEMMs, the activation between)
TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 5e-3}


def check(got, want, dtype: str, what: str, mag=None, k: int = 1) -> None:
    assert got is not None, f"{what}: no gradient"
    assert_close(got, want, "tf32" if dtype == "float32" else dtype, tol=TOL[dtype],
                 magnitude=mag, k=k, what=what)


# -- SDDMM ---------------------------------------------------------------------------------------

def _mask(rng, M, N, pattern, tile):
    if pattern == "empty":
        return np.zeros((M, N), bool)
    if pattern == "full":
        return np.ones((M, N), bool)
    th, tw = tile
    grid = rng.random((-(-M // th), -(-N // tw))) < 0.3
    return np.kron(grid, np.ones(tile, bool))[:M, :N] & (rng.random((M, N)) < 0.8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tile", [(32, 1), (1, 32), (16, 16)])
@pytest.mark.parametrize("pattern", ["tiles", "empty", "full"])
@pytest.mark.parametrize("shape", [(97, 130, 40), (64, 64, 64), (1, 33, 8)])
def test_sddmm_backward_matches_float64(dtype, tile, pattern, shape):
    M, N, D = shape
    rng = np.random.default_rng(M * 31 + N + D)
    q = torch.randn(M, D, device="cuda", dtype=DT[dtype], requires_grad=True)
    k = torch.randn(N, D, device="cuda", dtype=DT[dtype], requires_grad=True)
    mask = torch.tensor(_mask(rng, M, N, pattern, tile), device="cuda")
    ds = torch.randn(M, N, device="cuda", dtype=DT[dtype])
    s = sddmm(q, k, mask, tile=tile, scale=0.5, layout=torch.strided)
    assert s.shape == (M, N) and s.dtype == DT[dtype] and s.requires_grad
    s.backward(ds)

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    m64 = mask.double()
    want = 0.5 * (q64 @ k64.t()) * m64
    want.backward(ds.double())
    if pattern == "empty":
        assert torch.count_nonzero(s) == 0
        assert torch.count_nonzero(q.grad) == 0 and torch.count_nonzero(k.grad) == 0
        return
    dsm = (ds.double() * m64).abs()
    check(s, want.detach(), dtype, "S", mag=0.5 * (q64.detach().abs() @ k64.detach().abs().t()) * m64, k=D)
    check(q.grad, q64.grad, dtype, "dQ", mag=0.5 * dsm @ k64.detach().abs(), k=N)
    check(k.grad, k64.grad, dtype, "dK", mag=0.5 * dsm.t() @ q64.detach().abs(), k=M)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_sddmm_csr_layout_values_and_gradient(dtype):
    M, N, D = 75, 140, 32
    rng = np.random.default_rng(5)
    q = torch.randn(M, D, device="cuda", dtype=DT[dtype], requires_grad=True)
    k = torch.randn(N, D, device="cuda", dtype=DT[dtype])
    mask = torch.tensor(rng.random((M, N)) < 0.2, device="cuda")
    dense = sddmm(q, k, mask, tile=(32, 1), layout=torch.strided)
    csr = sddmm(q, k, mask, tile=(32, 1), layout=torch.sparse_csr)
    assert csr.layout == torch.sparse_csr and csr.shape == (M, N)
    assert csr.values().numel() == int(mask.sum())
    assert torch.equal(csr.to_dense(), dense)  # the same kernel, the same values
    w = torch.randn(csr.values().shape, device="cuda", dtype=DT[dtype])
    (csr.values() * w).sum().backward()
    q64 = q.detach().double().requires_grad_()
    s64 = (q64 @ k.double().t())[mask]
    (s64 * w.double()).sum().backward()
    check(q.grad, q64.grad, dtype, "dQ through CSR values")


def test_sddmm_without_a_differentiable_layout_refuses_grad():
    q = torch.randn(64, 16, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn(48, 16, device="cuda", dtype=torch.float16)
    mask = torch.rand(64, 48, device="cuda") < 0.3
    with pytest.raises(BackwardError, match="pitgen::sddmm_tiles"):
        sddmm(q, k, mask)
    with pytest.raises(BackwardError, match="pitgen::sddmm_out"):
        sddmm(q, k, mask, out=torch.empty(64, 48, device="cuda", dtype=torch.float16))
    with torch.no_grad():
        assert sddmm(q, k, mask).to_dense().shape == (64, 48)
    assert sddmm(q.detach(), k, mask).to_dense().shape == (64, 48)


# -- MoE -----------------------------------------------------------------------------------------

def _act64(name, h):
    fn = torch.nn.functional
    return {"gelu": lambda v: fn.gelu(v, approximate="tanh"), "silu": fn.silu, "relu": fn.relu,
            "identity": lambda v: v}[name](h)


def moe_reference64(x, ids, gates, w1, w2, b1, b2, act):
    """float64 autograd reference: every expert over every token, weighted by the gates that
    route the token to it (0 elsewhere)."""
    leaves = [None if t is None else t.detach().double().requires_grad_()
              for t in (x, gates, w1, w2, b1, b2)]
    x64, g64, w164, w264, b164, b264 = leaves
    y = torch.zeros_like(x64)
    for e in range(w1.shape[0]):
        ge = (g64 * (ids == e).double()).sum(1, keepdim=True)
        h = x64 @ w164[e] + (b164[e] if b164 is not None else 0)
        o = _act64(act, h) @ w264[e] + (b264[e] if b264 is not None else 0)
        y = y + ge * o
    return y, leaves


def _moe_inputs(T, topk, E, H, F, dtype, bias, routing, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "dtype": DT[dtype]}
    x = torch.randn(T, H, generator=g, **kw)
    w1 = torch.randn(E, H, F, generator=g, **kw) / H ** 0.5
    w2 = torch.randn(E, F, H, generator=g, **kw) / F ** 0.5
    b1 = torch.randn(E, F, generator=g, **kw) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g, **kw) * 0.1 if bias else None
    gates = torch.rand(T, topk, generator=g, device="cuda") + 0.1
    if routing == "one":  # every pair to the last expert: the others are empty
        ids = torch.full((T, topk), E - 1, device="cuda", dtype=torch.int64)
    else:  # distinct experts per token (as top-k gives)
        ids = torch.rand(T, E, generator=g, device="cuda").argsort(1)[:, :topk].contiguous()
    leaves = [x, gates, w1, w2, b1, b2]
    for t in leaves:
        if t is not None:
            t.requires_grad_()
    return x, ids, gates, w1, w2, b1, b2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("T,topk,E,H,F", [(1, 1, 3, 8, 16), (37, 2, 4, 40, 56), (130, 2, 8, 64, 128),
                                          (300, 1, 2, 32, 24)])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_moe_backward_matches_float64(dtype, T, topk, E, H, F, act):
    bias = (T + E) % 2 == 0
    x, ids, gates, w1, w2, b1, b2 = _moe_inputs(T, topk, E, H, F, dtype, bias, "uniform", T + E)
    _grads_match(x, ids, gates, w1, w2, b1, b2, act, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_moe_backward_with_empty_experts(dtype):
    x, ids, gates, w1, w2, b1, b2 = _moe_inputs(70, 2, 6, 32, 48, dtype, True, "one", 3)
    _grads_match(x, ids, gates, w1, w2, b1, b2, "silu", dtype)
    for t in (w1, w2, b1, b2):  # experts 0..E-2 get no token: exactly zero gradient
        assert torch.count_nonzero(t.grad[:-1]) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_moe_backward_walked_tile_by_tile(monkeypatch, dtype):
    """The kernels' backward in chunks of one tile (moe_wgrad's operands gathered chunk by
    chunk), not in the one chunk every other case here takes."""
    from pitgen.ops import moe

    monkeypatch.setattr(moe, "BACKWARD_CHUNK_BYTES", 1)
    x, ids, gates, w1, w2, b1, b2 = _moe_inputs(130, 2, 8, 64, 128, dtype, True, "uniform", 5)
    _grads_match(x, ids, gates, w1, w2, b1, b2, "gelu", dtype)


def _grads_match(x, ids, gates, w1, w2, b1, b2, act, dtype):
    dy = torch.randn_like(x)
    y = moe_ffn(x, ids, gates, w1, w2, b1, b2, activation=act)
    y.backward(dy)
    want, leaves = moe_reference64(x, ids, gates, w1, w2, b1, b2, act)
    want.backward(dy.double())
    check(y, want.detach(), dtype, "y")
    for name, got, ref in zip(("dx", "dgates", "dw1", "dw2", "db1", "db2"),
                              (x, gates, w1, w2, b1, b2), leaves):
        if got is None:
            continue
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        check(got.grad, ref.grad, dtype, name)


def test_moe_module_trains_router_and_experts():
    torch.manual_seed(0)
    layer = pitgen.nn.MoE(64, 128, 4, topk=2, device="cuda", dtype=torch.float32)
    x = torch.randn(50, 64, device="cuda", requires_grad=True)
    layer(x).square().sum().backward()
    params = dict(layer.named_parameters())
    for name in ("router.weight", "w1", "w2", "b1", "b2"):
        assert params[name].grad is not None and torch.isfinite(params[name].grad).all(), name
    assert params["router.weight"].grad.abs().sum() > 0  # through the gates
    # the router's gradient against the float64 reference of the whole block
    ref = {n: p.detach().double().requires_grad_() for n, p in params.items()}
    x64 = x.detach().double()
    probs = torch.softmax(x64 @ ref["router.weight"].t(), -1)
    g, ids = probs.topk(2, -1)
    y = torch.zeros_like(x64)
    for e in range(4):
        ge = (g * (ids == e).double()).sum(1, keepdim=True)
        y = y + ge * (_act64("gelu", x64 @ ref["w1"][e] + ref["b1"][e]) @ ref["w2"][e] + ref["b2"][e])
    y.square().sum().backward()
    for name in ("router.weight", "w1", "w2"):
        check(params[name].grad, ref[name].grad, "float32", name)


# -- ops without a backward ------------------------------------------------------------------------

def test_jit_matmul_refuses_inputs_that_require_grad():
    kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16",
                          micro_tile=(32, 1))
    a = torch.randn(64, 96, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(96, 40, device="cuda", dtype=torch.float16)
    with pytest.raises(BackwardError, match="pitgen::matmul"):
        kern(a, b)
    with pytest.raises(BackwardError, match="SparseKernel"):
        kern(a, b, out=torch.empty(64, 40, device="cuda", dtype=torch.float16))
    with torch.no_grad():
        c = kern(a, b)
    assert_close(c, a.detach().double() @ b.double(), "float16")
    assert not c.requires_grad
