"""CPU test of the sparse-channel convolution's host side (pitgen.ops.conv.launch and
index_launch) against an emulated device: each kernel is replaced by a NumPy model of its
contract, stated from the template's parameters (what it reads and writes through the raw
pointers it is given, which parts of the grid it expects), run on CPU tensors' memory. A wrong
argument order, stride, grid size, buffer size or shared-memory size fails here, before any GPU
run; the kernels' own code is checked on the GPU (tests/test_gpu_conv.py)."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen.ops import conv as cv
from pitgen.reference import active_channels_reference, conv2d_reference

torch = pytest.importorskip("torch")


#: Multiprocessors of the emulated device: few, so that the NCHW gather's grid strides.
SMS = 2

#: (address, bytes) of every tensor the host side allocated or was given, while emulating
ALLOCATIONS: list[tuple[int, int]] = []


def memory(ptr: int, count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` at host address ``ptr`` (a CPU tensor's data), writable;
    AssertionError unless they lie inside one allocation (as a kernel's accesses must)."""
    dt = np.dtype(dtype)
    assert ptr, "a null pointer where the kernel reads or writes"
    nbytes = count * dt.itemsize
    assert any(a <= ptr and ptr + nbytes <= a + n for a, n in ALLOCATIONS), \
        f"{nbytes} bytes at {ptr:#x} run outside every allocation"
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dt)


def strided(ptr: int, shape: tuple, strides: tuple, dtype) -> np.ndarray:
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    base = memory(ptr, span, dtype)
    item = np.dtype(dtype).itemsize
    return np.lib.stride_tricks.as_strided(base, shape, tuple(s * item for s in strides))


def nonzero(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7FFF) != 0   # -0.0 is zero


def active(count_ptr: int, C: int) -> tuple[int, int]:
    ca = int(np.clip(memory(count_ptr, 1, np.int32)[0], 0, C))
    return ca, -(-ca // cv.GRAIN) * cv.GRAIN


class Device:
    """The three kernels' contracts in NumPy, with the launch geometry each one expects."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.launches: list[str] = []

    def launch(self, name, grid, block, stream, *args, smem=0):
        self.launches.append(name)
        getattr(self, name)(grid, block, smem, *args)

    def bind(self, name, grid, block, smem=0):
        if 0 in grid:   # as runtime.Module.bind: an empty grid launches nothing
            return lambda stream, *args: None
        return lambda stream, *args: self.launch(name, grid, block, stream, *args, smem=smem)

    def pit_conv_index(self, grid, block, smem, x, N, C, HW, vec, per_plane, pix, flags, done,
                       ids, count):
        assert block == (cv.INDEX_THREADS, 1, 1) and smem == 0
        run = HW if self.cfg.layout == "nchw" else C
        assert run % vec == 0 and x % (2 * vec) == 0, "vector loads would be misaligned"
        # NCHW: a warp per plane of at least INDEX_SEGMENT vectors, else per INDEX_SEGMENT
        # vectors of the flat X; channels_last: a CTA per PIX pixels
        warps = cv.INDEX_THREADS // 32
        if self.cfg.layout == "nhwc":
            assert pix == cv.index_pixels(N * HW, C, vec, SMS)
            per, items = pix, N * HW
        elif HW // vec >= cv.INDEX_SEGMENT:
            assert per_plane == 1
            per, items = warps, N * C
        else:
            assert per_plane == 0
            per, items = warps * cv.INDEX_SEGMENT, N * C * HW // vec
        assert grid[0] == -(-items // per) and grid[1:] == (1, 1)
        f = memory(flags, C, np.int32)
        assert not f.any() and memory(done, 1, np.int32)[0] == 0, "flags not left zero"
        bits = memory(x, N * C * HW, np.uint16)
        alive = nonzero(bits.reshape(N, C, HW)).any(axis=(0, 2)) if self.cfg.layout == "nchw" \
            else nonzero(bits.reshape(N * HW, C)).any(axis=0)
        got = np.flatnonzero(alive).astype(np.int32)
        memory(ids, C, np.int32)[:len(got)] = got
        memory(count, 1, np.int32)[0] = len(got)

    def pit_conv_gather(self, grid, block, smem, x, N, C, H, W, ph, pw, ids, count, xc, x_blocks,
                        h_blocks, w, F, R, S, sw_f, sw_c, sw_r, sw_s, wc):
        assert block == (cv.INDEX_THREADS, 1, 1) and smem == 0
        HW = H * W
        cmax = -(-C // cv.GRAIN) * cv.GRAIN
        want = (min(-(-cmax // cv.GROUP) * N * -(-HW // cv.TILE_P), cv.GATHER_CTAS_PER_SM * SMS)
                if self.cfg.layout == "nchw" else -(-N * HW // cv.PIX))
        assert x_blocks == want
        ca, cp = active(count, C)
        Hp, Wp = H + 2 * ph, W + 2 * pw
        assert h_blocks * cv.INDEX_THREADS * 8 >= N * (Hp * Wp - HW) * cp, "halo not covered"
        assert (grid[0] - x_blocks - h_blocks) * cv.INDEX_THREADS * 8 >= F * R * S * cp, "W not covered"
        chan = memory(ids, C, np.int32)[:ca]
        assert ((chan >= 0) & (chan < C)).all()
        xs = memory(x, N * C * HW, np.float16)
        X = xs.reshape(N, C, H, W) if self.cfg.layout == "nchw" else \
            xs.reshape(N, H, W, C).transpose(0, 3, 1, 2)
        out = memory(xc, N * Hp * Wp * cp, np.float16).reshape(N, Hp, Wp, cp)
        out[...] = 0   # the halo and the padding channels
        out[:, ph:ph + H, pw:pw + W, :ca] = X[:, chan].transpose(0, 2, 3, 1)
        span = sum((n - 1) * st for n, st in zip((F, C, R, S), (sw_f, sw_c, sw_r, sw_s))) + 1
        assert span == F * C * R * S, "W's strides do not describe a dense tensor"
        Wt = strided(w, (F, C, R, S), (sw_f, sw_c, sw_r, sw_s), np.float16)
        wout = memory(wc, F * R * S * cp, np.float16).reshape(F, R, S, cp)
        wout[...] = 0
        wout[..., :ca] = Wt[:, chan].transpose(0, 2, 3, 1)

    def pit_conv_gemm(self, grid, block, smem, xc, wc, count, bias, y, N, C, H, W, F, R, S, P,
                      Q, sh, sw, ph, pw, so_n, so_f, so_p, so_q):
        cfg = self.cfg
        assert block == (cfg.threads, 1, 1) and smem == cfg.smem
        assert grid == (-(-N * P * Q // cv.BM), -(-F // cfg.bn), 1)
        ca, cp = active(count, C)
        Hp, Wp = H + 2 * ph, W + 2 * pw   # Xc's halo is the padding: every window lies in it
        assert (P - 1) * sh + R <= Hp and (Q - 1) * sw + S <= Wp
        pad = memory(xc, N * Hp * Wp * cp, np.float16).reshape(N, Hp, Wp, cp).astype(np.float64)
        Wc = memory(wc, F * R * S * cp, np.float16).reshape(F, R, S, cp).astype(np.float64)
        acc = np.zeros((N, P, Q, F))
        for r in range(R):
            for s in range(S):
                win = pad[:, r:r + sh * P:sh, s:s + sw * Q:sw][:, :P, :Q]
                acc += win @ Wc[:, r, s].T
        if bias:
            acc += memory(bias, F, np.float16).astype(np.float64)
        span = sum((n - 1) * st for n, st in zip((N, F, P, Q), (so_n, so_f, so_p, so_q))) + 1
        assert span == N * F * P * Q, "Y's strides do not describe a dense tensor"
        out = strided(y, (N, F, P, Q), (so_n, so_f, so_p, so_q), np.float16)
        out[...] = acc.transpose(0, 3, 1, 2)


class _Spec:
    """An OpSpec whose modules are emulated devices (everything else is the real one's)."""

    def __init__(self, real, devices):
        self.real, self.devices = real, devices

    def module(self, cfg):
        return self.devices.setdefault(cfg, Device(cfg))

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Launch:
    stream = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _recorded(make):
    def alloc(*args, **kwargs):
        t = make(*args, **kwargs)
        track(t)
        return t
    return alloc


def track(*tensors) -> None:
    for t in tensors:
        if t is not None:
            ALLOCATIONS.append((t.data_ptr(), t.untyped_storage().nbytes()))


@contextmanager
def emulated(monkeypatch, arch="sm_80"):
    devices: dict = {}
    monkeypatch.setattr(cv, "device_arch", lambda: arch)   # the GEMM variant of this device
    monkeypatch.setattr(cv, "device_sms", lambda: SMS)
    ALLOCATIONS.clear()
    for name in ("empty", "zeros"):
        monkeypatch.setattr(torch, name, _recorded(getattr(torch, name)))
    monkeypatch.setattr(cv, "CONV_INDEX", _Spec(cv.CONV_INDEX, devices))
    monkeypatch.setattr(cv, "CONV", _Spec(cv.CONV, devices))
    monkeypatch.setattr(cv, "TorchLaunch", _Launch)
    monkeypatch.setattr(cv, "_FLAGS", {})
    monkeypatch.setattr(cv, "_LAUNCHES", {})   # no launch closure of real modules, or of another test's
    yield devices


def activations(rng, shape, sparsity, channels_last):
    x = np.maximum(rng.standard_normal(shape), 0.0).astype(np.float16)
    dead = rng.permutation(shape[1])[:int(round(sparsity * shape[1]))]
    x[:, dead] = 0
    if len(dead):
        x[:, dead[0]] = -0.0
    t = torch.from_numpy(x)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 3), C=st.integers(1, 70),   # planes past 2048 elements: a warp per plane
       H=st.one_of(st.integers(3, 9), st.integers(46, 50)), W=st.one_of(st.integers(3, 9), st.integers(46, 50)),
       F=st.integers(1, 140), R=st.sampled_from([1, 3]), S=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]),
       pad=st.tuples(st.integers(0, 1), st.integers(0, 1)), sparsity=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       channels_last=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       arch=st.sampled_from(["sm_80", "sm_90"]))
def test_launch_drives_the_kernels_as_their_contracts_expect(N, C, H, W, F, R, S, stride, pad,
                                                             sparsity, channels_last, bias, seed,
                                                             arch):
    pad = (min(pad[0], R - 1), min(pad[1], S - 1))
    rng = np.random.default_rng(seed)
    x = activations(rng, (N, C, H, W), sparsity, channels_last)
    w = torch.from_numpy(rng.standard_normal((F, C, R, S)).astype(np.float16))
    w = w.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if seed % 2 else w  # any strides
    b = torch.from_numpy(rng.standard_normal(F).astype(np.float16)) if bias else None
    with pytest.MonkeyPatch.context() as mp, emulated(mp, arch) as devices:
        track(x, w, b)
        y, count = cv.launch(x, w, b, (stride, stride), pad)
        ids, count2 = cv.index_launch(x)
    layout = cv.layout_of(x)
    assert y.is_contiguous(memory_format=torch.channels_last if layout == "nhwc"
                           else torch.contiguous_format)
    want_ids = active_channels_reference(x.double().numpy())
    assert int(count) == int(count2) == len(want_ids)
    assert ids[:int(count)].tolist() == want_ids.tolist()
    want = conv2d_reference(x.double().numpy(), w.double().numpy(),
                            None if b is None else b.double().numpy(), (stride, stride), pad)
    got = y.double().numpy()
    assert np.abs(got - want).max() <= 1e-2 * (np.abs(want).max() + 1), "wrong result"
    names = [n for d in devices.values() for n in d.launches]
    assert sorted(names) == ["pit_conv_gather", "pit_conv_gemm", "pit_conv_index",
                             "pit_conv_index"]


def test_an_empty_batch_launches_nothing(monkeypatch):
    with emulated(monkeypatch) as devices:
        y, count = cv.launch(torch.zeros(0, 5, 4, 4, dtype=torch.float16),
                             torch.zeros(3, 5, 3, 3, dtype=torch.float16), None, (1, 1), (1, 1))
        ids, count2 = cv.index_launch(torch.zeros(0, 5, 4, 4, dtype=torch.float16))
    assert y.shape == (0, 3, 4, 4) and int(count) == int(count2) == 0 and not devices


def test_out_must_fit(monkeypatch):
    x = torch.zeros(1, 4, 5, 5, dtype=torch.float16)
    w = torch.zeros(2, 4, 3, 3, dtype=torch.float16)
    with emulated(monkeypatch):
        track(x, w)
        with pytest.raises(cv.ShapeError, match="out must be"):
            cv.launch(x, w, None, (1, 1), (1, 1), out=torch.empty(1, 2, 4, 4, dtype=torch.float16))
        out = torch.full((1, 2, 5, 5), float("nan"), dtype=torch.float16)
        track(out)
        assert cv.launch(x, w, None, (1, 1), (1, 1), out=out)[0] is out
    assert not out.isnan().any()


def test_x_too_large_for_int32_indices_is_refused():
    """The index's last CTA addresses up to a segment per warp past X: its bound leaves room."""
    x = torch.empty((1, 1, 1, 2**31 - 100), dtype=torch.float16, device="meta")
    with pytest.raises(cv.ShapeError, match="int32"):
        cv._check_x(x, device=False)
    assert cv._check_x(torch.empty((1, 1, 1, 2**30), dtype=torch.float16, device="meta"),
                       device=False) == "float16"
