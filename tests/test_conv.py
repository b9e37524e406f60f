"""CPU tests of the sparse-channel convolution (pitgen.ops.conv): the rules it relies on (c
invariant, the window axes not), planning and its refusals, the auto crossover, the index's
vector width, every template variant rendered and compiled with nvcc for sm_80 and sm_90a, the
ops' fake implementations (shapes, dtypes, memory formats) and backward, bad input raising
pitgen errors, and the float64 references."""
from __future__ import annotations

import functools
from concurrent.futures import Future

import numpy as np
import pytest

from pitgen import compiler
from pitgen.errors import DeviceError, PlanError, ShapeError
from pitgen.ops import conv as cv
from pitgen.reference import active_channels_reference, conv2d_reference
from pitgen.rules import analyse

ARCHS = ("sm_80", "sm_90a")
VARIANTS = [(cv.CONV_INDEX, cv.IndexConfig(d, lay)) for d in cv.DTYPES for lay in cv.LAYOUTS] + \
    [(cv.CONV, cv.GemmConfig(d, bn)) for d in cv.DTYPES for bn in (64, 128)]
RESNET = (32, 256, 56, 56), (64, 256, 3, 3)


def test_the_gathers_move_the_channels_as_the_rules_derive():
    want = {f"channels of {o}, stride {s}": ("c",) for s in (1, 2) for o in ("X", "W")}
    assert cv.CONV.derive() == cv.CONV_INDEX.derive() == want


@pytest.mark.parametrize("stride", [1, 2])
def test_channel_axis_is_the_invariant_reduction_and_the_window_is_not(stride):
    rules = analyse(cv.EXPRS[stride])
    assert cv.channel_axis(stride) == "c"
    assert rules.axes["c"].role == "reduction" and rules.axes["c"].invariant
    assert rules.axes["c"].needs == ("SRead",)
    for a in ("y", "x", "r", "s"):
        assert not rules.axes[a].invariant, a


def test_plan_picks_the_cta_width_from_the_filters():
    p = cv.plan_conv("float16", "nchw", *RESNET, 1, 1)
    assert p.gemm == cv.GemmConfig("float16", 64) and p.index == cv.IndexConfig("float16", "nchw")
    assert p.stride == (1, 1) and p.padding == (1, 1) and p.kernel == (3, 3)
    wide = cv.plan_conv("bfloat16", "nhwc", (8, 1024, 14, 14), (256, 1024, 1, 1), (2, 2), 0)
    assert wide.gemm.bn == 128 and wide.stride == (2, 2) and wide.padding == (0, 0)
    assert cv.out_size(p, 56, 56) == (56, 56)
    assert cv.out_size(wide, 14, 14) == (7, 7)
    assert cv.out_size(cv.plan_conv("float16", "nchw", (1, 3, 7, 8), (2, 3, 3, 3), 2, 1), 7, 8) \
        == (4, 4)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"groups": 2}, PlanError, "groups=1"),
    ({"dilation": 2}, PlanError, "dilation 1"),
    ({"dilation": (1, 2)}, PlanError, "dilation 1"),
    ({"stride": 3}, PlanError, "stride 1 or 2"),
    ({"stride": (1, 2)}, PlanError, "stride 1 or 2"),
    ({"stride": "1"}, PlanError, "stride must be an int or a pair"),
    ({"padding": 3}, PlanError, r"padding \(3, 3\) must be in \[0, kernel\)"),
    ({"padding": -1}, PlanError, "padding"),
    ({"padding": (1, 2, 3)}, PlanError, "pair of ints"),
    ({"weight": (64, 128, 3, 3)}, ShapeError, "weight has 128 input channels, x has 256"),
    ({"weight": (64, 256, 9, 9)}, PlanError, "kernels of 1 to 7"),
    ({"dtype": "float32"}, ShapeError, "dtype float32 is not supported by conv"),
    ({"layout": "chwn"}, PlanError, "layout must be one of"),
    ({"shape": (2, 256, 1, 1), "padding": 0}, ShapeError, "smaller than the 3x3 kernel"),
])
def test_plan_refuses_what_the_kernels_do_not_run(kwargs, error, match):
    args = {"dtype": "float16", "layout": "nchw", "shape": RESNET[0], "weight": RESNET[1],
            "stride": 1, "padding": 1, "dilation": 1, "groups": 1, **kwargs}
    with pytest.raises(error, match=match):
        cv.plan_conv(args["dtype"], args["layout"], args["shape"], args["weight"], args["stride"],
                     args["padding"], args["dilation"], args["groups"])


def test_dense_crossover_is_a_fraction_that_favours_compute_heavy_shapes():
    heavy = cv.dense_crossover(*RESNET, (56, 56))
    light = cv.dense_crossover((32, 1024, 14, 14), (256, 1024, 1, 1), (14, 14))
    assert 0.0 < light < heavy < 1.0
    # a layer whose FLOPs cost less than reading X once never goes sparse
    assert cv.dense_crossover((32, 1024, 14, 14), (1, 1024, 1, 1), (14, 14)) == 0.0


@pytest.mark.parametrize("layout, C, HW, ptr, want", [
    ("nchw", 256, 3136, 256, 8), ("nchw", 1024, 196, 256, 4), ("nchw", 512, 49, 256, 1),
    ("nchw", 3, 30, 256, 2), ("nhwc", 256, 49, 256, 8), ("nhwc", 12, 49, 256, 4),
    ("nhwc", 256, 49, 8, 4), ("nhwc", 7, 49, 256, 1)])
def test_index_vector_width_divides_the_run_and_the_alignment(layout, C, HW, ptr, want):
    assert cv.vector_width(layout, C, HW, ptr) == want


@functools.cache
def _sources() -> tuple[str, ...]:
    return tuple(spec.source(cfg.context()) for spec, cfg in VARIANTS)


def nvcc_jobs(pool, archs=ARCHS) -> list[Future]:
    """Every variant's compile for ``archs`` (submitted at collection by conftest)."""
    return [pool.submit(compiler.compile_source, src, arch) for src in _sources()
            for arch in archs]


def test_variants_render_distinct_sources_with_their_kernels():
    srcs = _sources()
    assert len(set(srcs)) == len(VARIANTS)
    for (spec, cfg), src in zip(VARIANTS, srcs):
        for kernel in spec.kernels:
            assert f"{kernel}(" in src, (cfg, kernel)
        assert ("__nv_bfloat16 elem_t" in src) == (cfg.dtype == "bfloat16")


def test_kernel_signatures_match_the_templates_parameters():
    """Each OpSpec signature has one letter per kernel parameter: P for pointers, i for ints."""
    import re
    for (spec, cfg), src in zip(VARIANTS, _sources()):
        for kernel, sig in spec.kernels.items():
            params = re.search(rf"\b{kernel}\(([^)]*)\)", src).group(1).split(",")
            kinds = "".join("P" if "*" in p else "i" for p in params)
            assert kinds == sig, (kernel, kinds, sig)


def test_generated_code_range_checks_every_channel_id():
    index_src = cv.CONV_INDEX.source(cv.IndexConfig("float16", "nchw").context())
    assert "c >= 0 && c < C ? c : -1" in index_src          # channel_of: ids never trusted
    gemm_src = cv.CONV.source(cv.GemmConfig("float16", 64).context())
    assert "min(max(*count, 0), C)" in gemm_src              # the device count is clamped


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(arch, nvcc):
    cubins = [job.result() for job in nvcc_jobs(nvcc, [arch])]
    assert len(cubins) == len(VARIANTS) and all(c[:4] == b"\x7fELF" for c in cubins)


def test_references_match_a_direct_sum():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 6))
    x[:, 1] = 0.0
    w, b = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    y = conv2d_reference(x, w, b, (2, 2), (1, 1))
    assert y.shape == (2, 4, 3, 3)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = b[None, :, None, None] + np.array(
        [[[[np.sum(xp[n, :, 2 * p:2 * p + 3, 2 * q:2 * q + 3] * w[f]) for q in range(3)]
           for p in range(3)] for f in range(4)] for n in range(2)])
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    x[1, 0, 4, 5] = -0.0
    x[:, 0] = 0.0
    x[1, 2, 0, 0] = np.nan
    assert active_channels_reference(x).tolist() == [2]


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
