"""GPU tests of the sparse-channel convolution (pitgen.ops.conv): the channel index equals the
NumPy list on drawn inputs (0%, 50%, 90% and 100% zero channels, a channel alive in one sample
only, -0.0); the convolution matches the float64 reference on drawn shapes that are not
multiples of any tile (1x1 and 3x3, stride 1 and 2, padding, bias, NCHW and channels_last, fp16
and bf16) with its output poisoned and its workspace flooded with NaN first, on both GEMMs (wgmma
and, with it turned off, mma.sync on a Hopper GPU); repeated calls with
other channels and other shapes on one stream (the index leaves its flags zero); no host sync;
SparseConv2d in every mode and training; opcheck; the backward (cuDNN's) against conv2d's, dW
of the zero channels exactly zero."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import lower
from pitgen import testing as T
from pitgen.ops import conv as cv
from pitgen.reference import active_channels_reference, conv2d_reference

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")

GPU_SETTINGS = settings(max_examples=T.examples(25), deadline=None)
#: relative-norm error of an fp16/bf16 output against float64 (fp32 accumulation)
TOL = 1e-2
SPARSITY = (0.0, 0.5, 0.9, 1.0)


def activations(rng, shape, sparsity, dtype, channels_last):
    """ReLU-like X [N, C, H, W]: ``sparsity`` of the channels zero in every sample, the others
    non-negative with zeros scattered; one zero channel made alive in one sample only and one
    filled with -0.0 (both decided by the index's rule). Returns (tensor, float64 copy)."""
    N, C, H, W = shape
    x = np.maximum(rng.standard_normal(shape), 0.0)
    dead = rng.permutation(C)[:int(round(sparsity * C))]
    x[:, dead] = 0.0
    if len(dead) >= 2 and sparsity < 1.0:
        x[:, dead[0]] = -0.0
        x[rng.integers(N), dead[1], rng.integers(H), rng.integers(W)] = 1.5
    t = torch.from_numpy(x.astype(np.float32)).to("cuda", getattr(torch, dtype))
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last)
    return t, t.double().cpu().numpy()


def flood(*numels, dtype=torch.float16):
    """Fill and free blocks of these sizes, so that the caching allocator hands NaN-filled
    memory to the next allocations of those sizes (the op's Xc and Wc workspace): a slot the
    gather leaves unwritten then shows as NaN in the output."""
    blocks = [torch.full((n,), float("nan"), dtype=dtype, device="cuda") for n in numels]
    del blocks


@contextlib.contextmanager
def mainloop(name: str):
    """The calls inside run the GEMM on ``name`` ("mma_sync": Hopper's wgmma turned off, so
    both kernels run on a Hopper GPU)."""
    with pytest.MonkeyPatch.context() as mp:
        if name == "mma_sync":
            mp.setattr(lower, "WGMMA_ARCHS", ())
        cv.plan_conv.cache_clear()
        try:
            yield
        finally:
            cv.plan_conv.cache_clear()


@st.composite
def problems(draw):
    R, S = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3]))   # non-square too
    stride = draw(st.sampled_from([1, 2]))
    pad = (draw(st.sampled_from(sorted({0, R // 2}))), draw(st.sampled_from(sorted({0, S // 2}))))
    H = draw(st.integers(max(1, R - 2 * pad[0]), 13))
    W = draw(st.integers(max(1, S - 2 * pad[1]), 13))
    return {"N": draw(st.integers(1, 3)), "C": draw(st.integers(1, 80)), "H": H, "W": W,
            "F": draw(st.integers(1, 150)), "R": R, "S": S, "stride": stride, "pad": pad,
            "sparsity": draw(st.sampled_from(SPARSITY)), "bias": draw(st.booleans()),
            "dtype": draw(st.sampled_from(cv.DTYPES)), "channels_last": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**31 - 1))}


@GPU_SETTINGS
@given(N=st.integers(1, 4), C=st.integers(1, 300),   # planes past 2048 elements: a warp per plane
       H=st.one_of(st.integers(1, 9), st.integers(40, 70)), W=st.one_of(st.integers(1, 9), st.integers(40, 70)),
       sparsity=st.sampled_from(SPARSITY), dtype=st.sampled_from(cv.DTYPES),
       channels_last=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_index_equals_the_numpy_channel_list(N, C, H, W, sparsity, dtype, channels_last, seed):
    rng = np.random.default_rng(seed)
    x, x64 = activations(rng, (N, C, H, W), sparsity, dtype, channels_last)
    ids, count = cv.channel_index(x)
    want = active_channels_reference(x64)
    n = int(count.item())
    assert n == len(want)
    np.testing.assert_array_equal(ids[:n].cpu().numpy(), want)


@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
@GPU_SETTINGS
@given(p=problems())
def test_conv_matches_the_float64_reference(loop, p):
    with mainloop(loop):
        _check_conv(p)


def _check_conv(p):
    rng = np.random.default_rng(p["seed"])
    N, C, H, W, F, R, S = p["N"], p["C"], p["H"], p["W"], p["F"], p["R"], p["S"]
    tdt = getattr(torch, p["dtype"])
    x, x64 = activations(rng, (N, C, H, W), p["sparsity"], p["dtype"], p["channels_last"])
    w = torch.from_numpy(rng.standard_normal((F, C, R, S)).astype(np.float32) / np.sqrt(C * R * S))
    w = w.to("cuda", tdt)
    b = torch.from_numpy(rng.standard_normal(F).astype(np.float32)).to("cuda", tdt) \
        if p["bias"] else None
    stride, pad = (p["stride"],) * 2, p["pad"]
    plan = cv.plan_conv(p["dtype"], cv.layout_of(x), tuple(x.shape), tuple(w.shape), stride, pad)
    P, Q = cv.out_size(plan, H, W)
    fmt = torch.channels_last if p["channels_last"] and cv.layout_of(x) == "nhwc" \
        else torch.contiguous_format
    out = T.poison(torch.empty((N, F, P, Q), dtype=tdt, device="cuda", memory_format=fmt))
    cmax = -(-C // cv.GRAIN) * cv.GRAIN
    xc_pixels = N * (H + 2 * pad[0]) * (W + 2 * pad[1])   # Xc with its zero halo
    flood((xc_pixels + F * R * S) * cmax, dtype=tdt)   # the size of launch's workspace
    y, count = cv.launch(x, w, b, stride, pad, out=out)
    assert y is out
    want = conv2d_reference(x64, w.double().cpu().numpy(), None if b is None else
                            b.double().cpu().numpy(), stride, pad)
    T.assert_close(y, want, p["dtype"], tol=TOL)
    assert int(count.item()) == len(active_channels_reference(x64))
    # the public function: same result, in x's memory format
    y2 = cv.sparse_conv2d(x, w, b, stride=stride, padding=pad)
    assert y2.is_contiguous(memory_format=fmt)
    T.assert_close(y2, want, p["dtype"], tol=TOL)


@pytest.mark.parametrize("loop", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape, weight, pad", [
    ((4, 256, 56, 56), (64, 256, 3, 3), 1),     # ResNet-50 stage shapes, fewer samples
    ((2, 512, 28, 28), (128, 512, 3, 3), 1),
    ((2, 1024, 14, 14), (256, 1024, 1, 1), 0)])
def test_resnet_shapes_at_90_percent(shape, weight, pad, channels_last, loop):
    rng = np.random.default_rng(7)
    x, x64 = activations(rng, shape, 0.9, "float16", channels_last)
    w = (torch.randn(*weight, device="cuda") / np.sqrt(np.prod(weight[1:]))).half()
    with mainloop(loop):
        y = cv.sparse_conv2d(x, w, padding=pad)
    ref = torch.nn.functional.conv2d(x.float(), w.float(), padding=pad)
    T.assert_close(y, ref.double().cpu().numpy(), "float16", tol=TOL)


def test_calls_in_a_row_change_channels_and_shapes_on_one_stream():
    """Each call's flags start zero: the previous call's index left them so."""
    rng = np.random.default_rng(1)
    for shape, sparsity in (((2, 64, 9, 9), 0.9), ((2, 64, 9, 9), 0.0), ((3, 200, 5, 7), 0.5),
                            ((2, 64, 9, 9), 1.0), ((1, 33, 4, 4), 0.9), ((2, 16, 48, 48), 0.9),
                            ((2, 16, 48, 48), 0.0)):
        for channels_last in (False, True):
            x, x64 = activations(rng, shape, sparsity, "float16", channels_last)
            ids, count = cv.channel_index(x)
            want = active_channels_reference(x64)
            assert ids[:int(count.item())].cpu().numpy().tolist() == want.tolist()
            w = torch.randn(5, shape[1], 3, 3, device="cuda").half()
            y = cv.sparse_conv2d(x, w, padding=1)
            T.assert_close(y, conv2d_reference(x64, w.double().cpu().numpy(), None, (1, 1),
                                               (1, 1)), "float16", tol=TOL)


def test_all_zero_input_gives_the_bias_and_an_empty_batch_nothing():
    x = torch.zeros(2, 40, 6, 6, device="cuda", dtype=torch.float16)
    w = torch.randn(9, 40, 3, 3, device="cuda").half()
    b = torch.randn(9, device="cuda").half()
    y = cv.sparse_conv2d(x, w, b, padding=1)
    torch.testing.assert_close(y, b[None, :, None, None].expand_as(y))
    ids, count = cv.channel_index(x)
    assert int(count.item()) == 0
    e = cv.sparse_conv2d(x[:0], w, b, padding=1)
    assert e.shape == (0, 9, 6, 6)
    assert int(cv.channel_index(x[:0])[1].item()) == 0


def test_other_strides_are_copied_to_nchw():
    rng = np.random.default_rng(2)
    x, x64 = activations(rng, (2, 16, 8, 10), 0.5, "float16", False)
    xt = x.transpose(2, 3)     # neither NCHW- nor channels_last-contiguous
    w = torch.randn(4, 16, 3, 3, device="cuda").half()
    y = cv.sparse_conv2d(xt, w, padding=1)
    T.assert_close(y, conv2d_reference(x64.transpose(0, 1, 3, 2), w.double().cpu().numpy(), None,
                                       (1, 1), (1, 1)), "float16", tol=TOL)


def test_no_host_sync_after_the_first_call():
    rng = np.random.default_rng(3)
    x, _ = activations(rng, (2, 64, 10, 10), 0.9, "float16", True)
    w = torch.randn(32, 64, 3, 3, device="cuda").half()
    cv.sparse_conv2d(x, w, padding=1)   # compiles, loads, allocates the stream's flags
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            cv.sparse_conv2d(x, w, padding=1)
            cv.channel_index(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_module_modes_match_conv2d_and_auto_follows_the_density(monkeypatch):
    import pitgen.nn
    torch.manual_seed(0)
    dense = torch.nn.Conv2d(64, 32, 3, padding=1).cuda().half()
    rng = np.random.default_rng(4)
    for mode in ("auto", "sparse", "dense"):
        m = pitgen.nn.SparseConv2d(64, 32, 3, padding=1, mode=mode).cuda().half()
        m.load_state_dict(dense.state_dict())
        with torch.no_grad():
            for sparsity in (0.9, 0.9, 0.0, 0.0, 0.9):
                x, _ = activations(rng, (2, 64, 12, 12), sparsity, "float16", False)
                torch.testing.assert_close(m(x), dense(x), rtol=2e-2, atol=2e-2)
                torch.cuda.synchronize()
    auto = pitgen.nn.SparseConv2d(64, 32, 3, padding=1, density_limit=0.5).cuda().half()
    with torch.no_grad():
        x, _ = activations(rng, (2, 64, 12, 12), 0.0, "float16", False)
        auto(x)
        torch.cuda.synchronize()
        auto(x)                  # reads the first call's count: dense from now on
        assert auto._density == 1.0
        calls = []
        orig = cv._conv_count
        monkeypatch.setattr(cv, "_conv_count", lambda *a: calls.append(1) or orig(*a))
        auto(x)
        assert not calls
        auto.density_limit = 1.0   # every density is at most the limit: pitgen again
        auto(x)
        assert calls
        # a layer this small has no density at which the index pays: cuDNN from the first call
        small = pitgen.nn.SparseConv2d(64, 32, 3, padding=1).cuda().half()
        assert small._limit(x) == 0.0
        calls.clear()
        small.load_state_dict(dense.state_dict())
        torch.testing.assert_close(small(x), dense(x), rtol=2e-2, atol=2e-2)
        assert not calls and small._density is None
    trained = pitgen.nn.SparseConv2d(64, 32, 3, padding=1, mode="sparse").cuda().half()
    trained.load_state_dict(dense.state_dict())
    trained(x).float().sum().backward()
    dense(x).float().sum().backward()
    torch.testing.assert_close(trained.weight.grad, dense.weight.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(trained.bias.grad, dense.bias.grad, rtol=2e-2, atol=2e-2)


def test_opcheck():
    rng = np.random.default_rng(5)
    x, _ = activations(rng, (2, 24, 7, 9), 0.5, "float16", True)
    w = torch.randn(10, 24, 3, 3, device="cuda").half()
    b = torch.randn(10, device="cuda").half()
    from pitgen.ops.library import ops
    pit = ops()
    torch.library.opcheck(pit.sparse_conv2d.default, (x, w, b, [1, 1], [1, 1]))
    torch.library.opcheck(pit.sparse_conv2d.default,
                          (x.clone().requires_grad_(), w.clone().requires_grad_(),
                           b.clone().requires_grad_(), [1, 1], [1, 1]))
    torch.library.opcheck(pit.sparse_conv2d.default, (x.contiguous(), w, None, [2, 2], [0, 0]))
    # ids past count are undefined: no run-to-run comparison
    torch.library.opcheck(pit.conv_channels.default, (x,),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stride, pad, R", [(1, 1, 3), (2, 0, 1), (2, 1, 3)])
def test_backward_matches_conv2d(channels_last, stride, pad, R):
    rng = np.random.default_rng(6)
    x0, _ = activations(rng, (2, 20, 9, 10), 0.5, "float16", channels_last)
    w0 = torch.randn(12, 20, R, R, device="cuda").half() / 10
    b0 = torch.randn(12, device="cuda").half()
    dy = torch.randn(cv.sparse_conv2d(x0, w0, b0, stride, pad).shape, device="cuda").half()
    grads = []
    for conv in (cv.sparse_conv2d, torch.nn.functional.conv2d):
        x, w, b = (t.detach().clone().requires_grad_() for t in (x0, w0, b0))
        y = conv(x, w, b, stride, pad)
        y.backward(dy)
        grads.append((y, x.grad, w.grad, b.grad))
    for got, want, what in zip(grads[0], grads[1], ("y", "dx", "dw", "db")):
        T.assert_close(got.detach(), want.detach().double().cpu().numpy(), "float16", tol=TOL,
                       what=what)
    active = active_channels_reference(x0.double().cpu().numpy())
    dead = sorted(set(range(20)) - set(active.tolist()))
    assert not grads[0][2][:, dead].any()   # dW of the zero channels: exact zeros
