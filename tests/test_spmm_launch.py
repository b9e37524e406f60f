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
    monkeypatch.setattr(operands, "_PLAIN", [torch.Tensor, lambda: 0, lambda: False, torch.device])
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


def test_hyb_closure_keys_its_module_by_a_hashable_context(fake, monkeypatch):
    """A hyb layout's closure: its context (buckets as tuples) hashes, so the module lookup
    needs no repr; one launch covers every bucket and the empty rows (pieces: c == 1)."""
    seen = []
    monkeypatch.setattr(type(K.SPMM), "module",
                        lambda self, ctx: seen.append(hash(tuple(sorted(ctx.items())))) or fake)
    monkeypatch.setattr(K, "stream_counters",   # the cut rows' counters, on the CPU here
                        lambda by, stream, n, dev: torch.zeros(max(n, 1), dtype=torch.int32))
    z = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    bufs = {"brow_row": z(4), "cols": z(12), "vals": torch.zeros(12), "table": z(16),
            "ws_index": z(1), "cut_index": z(1), "cut_info": z(1), "empty_rows": z(2),
            "fix_rows": z(1)}
    info = {"widths": [1, 2, 4], "atomic": [False, False, True], "bucket_rows": [2, 1, 1],
            "brows": 4, "slots": 12, "ws_rows": 0, "cut_rows": 1, "partial_rows": 2,
            "empty_rows": 2, "fix_rows": 0, "exact": True}
    for exact in (True, False):   # exact host numbers, or bounds (sync=False conversions)
        m = DeviceMatrix("hyb", {"k": 2, "c": 1}, (6, 6), 7, "float32", bufs, None,
                         {**info, "exact": exact})
        x = torch.randn(6, 8)
        y = K.spmm(m, x)
        assert y.shape == (6, 8)
        name, grid, stream, args = fake.calls[-1]
        assert (name, stream) == ("pit_spmm", 7) and grid[0] >= 1
        assert args[4] == x.data_ptr() and args[5] == y.data_ptr()
    assert len(seen) == 2
