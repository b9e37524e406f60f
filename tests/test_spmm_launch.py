"""The SpMM launch closure (``pitgen.graph.kernels.spmm``) on the CPU: a fake module records
each driver launch, so that the per-call addresses, the closures' memo per call signature and
the empty shapes are checked without a GPU (the GPU tests check the numbers)."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from pitgen import operands  # noqa: E402
from pitgen.graph import kernels as K  # noqa: E402
from pitgen.graph.device import DeviceMatrix  # noqa: E402


class FakeModule:
    def __init__(self) -> None:
        self.calls: list = []

    def bind(self, name, grid, block, smem=0):
        return lambda stream, *args: self.calls.append((name, grid, stream, args))


class FakeLaunch(contextlib.nullcontext):
    stream = 7

    def __enter__(self):
        return self


@pytest.fixture
def fake(monkeypatch):
    mod = FakeModule()
    monkeypatch.setattr(type(K.SPMM), "module", lambda self, ctx: mod)
    monkeypatch.setattr(K, "check_tensor", lambda *a, **k: None)   # CPU tensors stand in
    monkeypatch.setattr(K, "TorchLaunch", FakeLaunch)
    # call signatures keyed as on a GPU: device 0, tracing off
    monkeypatch.setattr(operands, "_PLAIN", [torch.Tensor, lambda: 0, lambda: False])
    return mod


def csr() -> DeviceMatrix:
    b = {"indptr": torch.tensor([0, 1, 1, 3], dtype=torch.int32),
         "indices": torch.tensor([0, 2, 3], dtype=torch.int32),
         "values": torch.tensor([1.0, 2.0, 3.0])}
    return DeviceMatrix("csr", {}, (3, 4), 3, "float32", b, None)


def test_each_call_launches_with_its_own_addresses(fake):
    m = csr()
    for _ in range(2):   # the second call: the memoised closure, new tensors
        x = torch.randn(4, 8)
        y = K.spmm(m, x)
        name, grid, stream, args = fake.calls[-1]
        assert (name, stream, y.shape) == ("pit_spmm", 7, (3, 8))
        assert args == (m.buffers["indptr"].data_ptr(), m.buffers["indices"].data_ptr(),
                        m.buffers["values"].data_ptr(), 0, x.data_ptr(), y.data_ptr(),
                        3, 4, 3, 0, 8)
    out = torch.empty(3, 8)
    assert K.spmm(m, torch.randn(4, 8), out=out) is out
    assert fake.calls[-1][3][5] == out.data_ptr()
    assert len(fake.calls) == 3 and len(m.launches) == 2   # without out, with out


def test_empty_shapes_launch_nothing(fake):
    m = csr()
    assert K.spmm(m, torch.randn(4, 0)).shape == (3, 0)
    out = torch.empty(3, 0)
    assert K.spmm(m, torch.randn(4, 0), out=out) is out
    assert fake.calls == []
