"""CPU tests of the sparse-channel convolution that need torch (pitgen.ops.conv): the ops'
fake implementations (shapes, dtypes, memory formats) and backward, the module as a drop-in
``nn.Conv2d``, and bad input raising pitgen errors. Apart from tests/test_conv.py so that a
machine without torch still compiles every template variant there."""
from __future__ import annotations

import numpy as np
import pytest

from pitgen.errors import DeviceError, PlanError, ShapeError
from pitgen.ops import conv as cv

torch = pytest.importorskip("torch")


def test_ops_are_registered_with_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pitgen.ops.library import ops
    pit = ops()
    assert pit.sparse_conv2d.default._schema.name == "pitgen::sparse_conv2d"
    assert pit.conv_channels.default._schema.name == "pitgen::conv_channels"
    h, i32 = torch.float16, torch.int32
    with FakeTensorMode():
        x, w = torch.empty(3, 20, 9, 11, dtype=h), torch.empty(7, 20, 3, 3, dtype=h)
        y, count = pit.sparse_conv2d(x, w, torch.empty(7, dtype=h), [1, 1], [1, 1])
        assert y.shape == (3, 7, 9, 11) and y.dtype == h and y.is_contiguous()
        assert count.shape == (1,) and count.dtype == i32
        xl = x.to(memory_format=torch.channels_last)
        y, _ = pit.sparse_conv2d(xl, w, None, [2, 2], [0, 0])
        assert y.shape == (3, 7, 4, 5) and y.is_contiguous(memory_format=torch.channels_last)
        ids, count = pit.conv_channels(xl)
        assert ids.shape == (20,) and ids.dtype == i32 and count.shape == (1,)


def test_backward_is_registered_and_propagates_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pitgen.ops.library import ops
    pit = ops()
    with FakeTensorMode():
        x = torch.empty(2, 8, 9, 7, dtype=torch.float16).to(memory_format=torch.channels_last)
        x.requires_grad_()
        w = torch.empty(5, 8, 3, 3, dtype=torch.float16, requires_grad=True)
        b = torch.empty(5, dtype=torch.float16, requires_grad=True)
        y, count = pit.sparse_conv2d(x, w, b, [2, 2], [1, 1])
        assert y.requires_grad and not count.requires_grad and y.shape == (2, 5, 5, 4)
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == (5,)


def half(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((np.zeros((1, 2, 3, 3)), half(1, 2, 1, 1)), {}, ShapeError, "expected a torch tensor"),
    ((torch.zeros(1, 2, 3, 3), half(1, 2, 1, 1)), {}, ShapeError, "dtype float32"),
    ((half(2, 3, 3), half(1, 2, 1, 1)), {}, ShapeError, r"expected 4 \[N, C, H, W\]"),
    ((half(1, 2, 3, 3), torch.zeros(1, 2, 1, 1)), {}, ShapeError, "must match"),
    ((half(1, 2, 3, 3), half(1, 2, 1)), {}, ShapeError, r"expected 4 \[F, C, R, S\]"),
    ((half(1, 2, 3, 3), half(4, 2, 1, 1), half(3)), {}, ShapeError, r"bias must be \[4\]"),
    ((half(1, 2, 3, 3), half(4, 2, 1, 1)), {"groups": 2}, PlanError, "groups=1"),
    ((half(1, 2, 3, 3), half(4, 2, 1, 1)), {"dilation": 2}, PlanError, "dilation 1"),
    ((half(1, 2, 3, 3), half(4, 2, 1, 1)), {"stride": 4}, PlanError, "stride 1 or 2"),
    ((half(1, 2, 3, 3), half(4, 2, 1, 1)), {}, DeviceError, "x is on cpu"),
])
def test_bad_input_raises_pitgen_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cv.sparse_conv2d(*args, **kwargs)


def test_channel_index_checks_its_input():
    with pytest.raises(ShapeError, match="dtype float32"):
        cv.channel_index(torch.zeros(1, 2, 3, 3))
    with pytest.raises(DeviceError, match="x is on cpu"):
        cv.channel_index(half(1, 2, 3, 3))


def test_module_is_a_drop_in_conv2d():
    import pitgen.nn
    torch.manual_seed(0)
    dense = torch.nn.Conv2d(6, 5, 3, padding=1, bias=True)
    sparse = pitgen.nn.SparseConv2d(6, 5, 3, padding=1, bias=True)
    assert sparse.state_dict().keys() == dense.state_dict().keys()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 6, 7, 7)
    # a CPU float32 input is not pitgen's: "auto" runs torch's convolution, "sparse" refuses
    torch.testing.assert_close(sparse(x), dense(x))
    assert "mode='auto'" in repr(sparse)
    with pytest.raises(ShapeError, match="dtype float32"):
        pitgen.nn.SparseConv2d(6, 5, 3, mode="sparse")(x)
    with pytest.raises(PlanError, match="unknown SparseConv2d mode"):
        pitgen.nn.SparseConv2d(6, 5, 3, mode="fast")
    with pytest.raises(PlanError, match="probe_every"):
        pitgen.nn.SparseConv2d(6, 5, 3, probe_every=0)
