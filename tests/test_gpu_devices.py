"""GPU tests of the device guard (two or more GPUs; skipped with the reason otherwise): every
operator runs on its operands' own device whatever torch's current device is, as torch's own
ops do; loaded modules, launch closures and buffers are kept per device, so one call signature
alternating between devices stays right; operands on two devices are refused with a DeviceError
naming both; the current device is left as it was."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pitgen
from pitgen import testing as T
from pitgen.graph.device import DeviceCSR, to_format
from pitgen.graph.kernels import spmm
from pitgen.ops import attention as A
from pitgen.ops.conv import sparse_conv2d
from pitgen.ops.linear import sparse_weight_linear
from pitgen.ops.moe import moe_ffn
from pitgen.ops.sddmm import sddmm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tests need torch")


@pytest.fixture(scope="module", autouse=True)
def _two_devices():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"the device guard tests need two CUDA devices (this machine has {n})")


def _inputs(seed: int) -> dict:
    """Host (CPU) operands of every operator below, moved to a device by ``_on``."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def randn(*shape, dtype=torch.float16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    blocks = torch.from_numpy(T.tile_mask(rng, 256, 384, (128, 128), 0.5))
    return {
        "a32": randn(96, 160) * (torch.rand(96, 160, generator=g) < 0.3), "b32": randn(160, 72),
        "ablk": randn(256, 384) * blocks, "bblk": randn(384, 264),
        "x": randn(1024, 64), "ids": torch.randint(0, 8, (1024, 1), generator=g, dtype=torch.int32),
        "gates": torch.rand(1024, 1, generator=g), "w1": randn(8, 64, 96, scale=1 / 8),
        "w2": randn(8, 96, 64, scale=1 / 8),
        "q": randn(1, 2, 130, 64), "k": randn(1, 2, 130, 64), "v": randn(1, 2, 130, 64),
        "amask": torch.from_numpy(T.tile_mask(rng, 130, 130, (16, 16), 0.4)),
        "sq": randn(128, 64), "sk": randn(96, 64), "smask": torch.rand(128, 96, generator=g) < 0.1,
        "adj": randn(200, 150, dtype=torch.float32) * (torch.rand(200, 150, generator=g) < 0.05),
        "feats": randn(150, 32, dtype=torch.float32),
        "lx": randn(64, 128), "lw": randn(96, 128, scale=1 / 8),
        "lmask": torch.rand(96, 128, generator=g) < 0.3,
        "cx": torch.relu(randn(2, 32, 12, 12)), "cw": randn(16, 32, 3, 3, scale=1 / 8),
    }


def _on(inputs: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


def _operators(t: dict) -> dict:
    """name -> thunk computing that operator on the tensors ``t`` (all on one device), with
    every tensor result (backward included) in a tuple."""
    def matmul(a, b, micro):
        return (pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile=micro,
                               vendor_dense=False)(A=a, B=b),)

    def attention():
        q, k, v = (t[n].clone().requires_grad_() for n in "qkv")
        out = A.sparse_attention(q, k, v, t["amask"])
        out.float().sum().backward()
        return out, q.grad, k.grad, v.grad

    def linear():
        w = t["lw"].clone().requires_grad_()
        x = t["lx"].clone().requires_grad_()
        y = sparse_weight_linear(x, w, t["lmask"])
        y.float().sum().backward()
        return y, x.grad, w.grad

    def graph():
        csr = DeviceCSR.from_dense(t["adj"])
        return spmm(csr, t["feats"]), spmm(to_format(csr, "hyb"), t["feats"])

    return {
        "matmul 32x1": lambda: matmul(t["a32"], t["b32"], "32x1"),
        "matmul 128x128 blocks": lambda: matmul(t["ablk"], t["bblk"], "128x128"),
        "moe decode": lambda: (moe_ffn(t["x"][:64], t["ids"][:64], t["gates"][:64], t["w1"], t["w2"]),),
        "moe": lambda: (moe_ffn(t["x"], t["ids"], t["gates"], t["w1"], t["w2"]),),
        "attention fwd+bwd": attention,
        "sddmm": lambda: (sddmm(t["sq"], t["sk"], t["smask"]).to_dense(),),
        "graph spmm csr, hyb": graph,
        "sparse linear fwd+bwd": linear,
        "sparse conv2d": lambda: (sparse_conv2d(t["cx"], t["cw"], padding=1),),
    }


def _run(name: str, device: str, inputs: dict) -> tuple:
    out = _operators(_on(inputs, device))[name]()
    torch.cuda.synchronize(device)
    return out


NAMES = list(_operators({}))


@pytest.mark.parametrize("name", NAMES)
def test_operators_run_on_their_operands_device(name):
    """Current device 0, operands on cuda:1: results on cuda:1, equal to the same call on
    cuda:0 (the same kernels: bit-identical but for float atomics' order); the current device
    is still 0 afterwards, and a second round trip over both devices gives the same again (each
    device keeps its own modules and launch closures)."""
    inputs = _inputs(0)
    torch.cuda.set_device(0)
    ref = [r.cpu() for r in _run(name, "cuda:0", inputs)]
    for device in ("cuda:1", "cuda:0", "cuda:1"):
        got = _run(name, device, inputs)
        assert torch.cuda.current_device() == 0
        for r, w in zip(got, ref):
            assert r.device == torch.device(device)
            assert torch.isfinite(r.float()).all()
            torch.testing.assert_close(r.cpu().float(), w.float(), rtol=2e-3, atol=2e-3)


def test_current_device_one_with_operands_on_zero():
    inputs = _inputs(1)
    ref = [r.cpu() for r in _run("matmul 128x128 blocks", "cuda:0", inputs)]
    with torch.cuda.device(1):
        for name in ("matmul 128x128 blocks", "moe", "attention fwd+bwd"):
            got = _run(name, "cuda:0", inputs)
            assert torch.cuda.current_device() == 1 and all(r.device.index == 0 for r in got)
        got = _run("matmul 128x128 blocks", "cuda:0", inputs)
    torch.testing.assert_close(got[0].cpu(), ref[0])


def test_a_worker_thread_runs_on_the_operands_device():
    """From a new thread (its PyCUDA context stack left empty: test_gpu_threads.in_thread)."""
    from test_gpu_threads import in_thread

    inputs = _inputs(2)
    names = ("matmul 32x1", "moe", "sddmm")
    want = {n: [r.cpu() for r in _run(n, "cuda:0", inputs)] for n in names}
    got = in_thread(lambda: {n: [r.cpu() for r in _run(n, "cuda:1", inputs)] for n in names})
    for n, w in want.items():
        for r, x in zip(got[n], w):
            torch.testing.assert_close(r.float(), x.float(), rtol=2e-3, atol=2e-3)


MIXED = {
    "matmul": lambda d0, d1: pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A",
                                            micro_tile="32x1")(A=d1["a32"], B=d0["b32"]),
    "moe": lambda d0, d1: moe_ffn(d1["x"], d1["ids"], d1["gates"], d0["w1"], d1["w2"]),
    "attention": lambda d0, d1: A.sparse_attention(d1["q"], d0["k"], d1["v"], d1["amask"]),
    "sddmm": lambda d0, d1: sddmm(d1["sq"], d0["sk"], d1["smask"]),
    "spmm": lambda d0, d1: spmm(DeviceCSR.from_dense(d1["adj"]), d0["feats"]),
}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_operands_on_two_devices_are_refused(name):
    inputs = _inputs(3)
    d0, d1 = _on(inputs, "cuda:0"), _on(inputs, "cuda:1")
    with pytest.raises(pitgen.DeviceError) as e:
        MIXED[name](d0, d1)
    assert "cuda:0" in str(e.value) and "cuda:1" in str(e.value)
    assert torch.cuda.current_device() == 0


FIRST_USE_ON_DEVICE_ONE = """
import torch, pitgen
torch.cuda.set_device(1)
a = torch.randn(96, 160, device="cuda", dtype=torch.float16)
b = torch.randn(160, 72, device="cuda", dtype=torch.float16)
k = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile="32x1", vendor_dense=False)
c1 = k(A=a, B=b)                          # pitgen's first use: PyCUDA starts while cuda:1 is current
assert torch.cuda.current_device() == 1 and c1.device.index == 1
c1 = (c1 + torch.ones_like(c1)).cpu()     # torch's own ops still run on cuda:1
c0 = k(A=a.to(0), B=b.to(0))
assert c0.device.index == 0 and torch.cuda.current_device() == 1
torch.testing.assert_close(c0.cpu() + 1, c1)
print("done")
"""


def test_first_use_with_another_current_device():
    """A process that makes cuda:1 current before pitgen's first call: PyCUDA's start (which
    pushes the first device's context) leaves torch on cuda:1, and the process exits cleanly."""
    r = subprocess.run([sys.executable, "-c", FIRST_USE_ON_DEVICE_ONE], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
    assert "PyCUDA ERROR" not in r.stderr
