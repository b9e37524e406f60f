"""CPU tests of the sparse-channel convolution (pitgen.ops.conv): the rules it relies on (c
invariant, the window axes not), planning and its refusals, the auto crossover, the index's
vector width, every template variant rendered and compiled with nvcc (each layout and tile width
for sm_80 and for sm_90a), and the float64 references; tests/test_conv_torch.py has those that
need torch."""
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
#: the GEMM on wgmma, built for sm_90a only: each dtype and each CTA width once
WGMMA_VARIANTS = [(cv.CONV, cv.GemmConfig(d, bn, wgmma=True))
                  for d, bn in zip(cv.DTYPES, (64, 128))]
ALL = VARIANTS + WGMMA_VARIANTS
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


def test_hopper_plan_multiplies_on_wgmma_two_ctas_per_sm():
    p = cv.plan_conv("float16", "nchw", *RESNET, 1, 1, arch="sm_90")
    assert p.gemm == cv.GemmConfig("float16", 64, wgmma=True)
    assert not cv.plan_conv("float16", "nchw", *RESNET, 1, 1, arch="sm_80").gemm.wgmma
    for bn, stages in ((64, 4), (128, 3)):
        g = cv.GemmConfig("bfloat16", bn, wgmma=True)
        assert g.threads == 256 and g.stages == stages and g.ctas_per_sm == 2
        assert g.smem == stages * (cv.BM + bn) * 128 + 1024   # 128-byte rows, aligned stages
        ctx = g.context()
        assert ctx["wgmma"] and ctx["min_blocks"] == 2 and ctx["stages"] == stages


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
    """Fitted to docs/bench/conv.md (H100): at 56 x 56 the sparse path loses to cuDNN at 10%
    active channels (0.087 against 0.080 ms), at 28 x 28 it wins (0.060 against 0.105)."""
    wide = cv.dense_crossover(*RESNET, (56, 56))
    deep = cv.dense_crossover((32, 512, 28, 28), (128, 512, 3, 3), (28, 28))
    assert 0.0 < wide < 0.1 < deep < 1.0
    # the wgmma GEMM: at 56 x 56 the sparse path wins at 10% (0.062 against 0.072 ms, H200)
    wide_wgmma = cv.dense_crossover(*RESNET, (56, 56), wgmma=True)
    assert 0.1 < wide_wgmma < 0.2 and wide_wgmma < cv.dense_crossover(
        (32, 512, 28, 28), (128, 512, 3, 3), (28, 28), wgmma=True) < 1.0
    # channels_last: the index and the gather read all of X (0.067 against 0.073 ms at 56 x 56)
    assert cv.dense_crossover(*RESNET, (56, 56), wgmma=True, layout="nhwc") == 0.0
    assert 0.15 < cv.dense_crossover((32, 512, 28, 28), (128, 512, 3, 3), (28, 28), wgmma=True,
                                     layout="nhwc") < 0.3
    # a layer whose FLOPs cost less than reading X once never goes sparse
    assert cv.dense_crossover((32, 1024, 14, 14), (256, 1024, 1, 1), (14, 14)) == 0.0
    assert cv.dense_crossover((32, 1024, 14, 14), (1, 1024, 1, 1), (14, 14)) == 0.0


@pytest.mark.parametrize("layout, C, HW, ptr, want", [
    ("nchw", 256, 3136, 256, 8), ("nchw", 1024, 196, 256, 4), ("nchw", 512, 49, 256, 1),
    ("nchw", 3, 30, 256, 2), ("nhwc", 256, 49, 256, 8), ("nhwc", 12, 49, 256, 4),
    ("nhwc", 256, 49, 8, 4), ("nhwc", 7, 49, 256, 1)])
def test_index_vector_width_divides_the_run_and_the_alignment(layout, C, HW, ptr, want):
    assert cv.vector_width(layout, C, HW, ptr) == want


@functools.cache
def _sources() -> tuple[str, ...]:
    return tuple(spec.source(cfg.context()) for spec, cfg in ALL)


def _arch(i: int) -> str:
    """Variant i's architecture: the wgmma GEMMs sm_90a; the others' pairs alternate, so that
    each index layout and mma.sync tile width is compiled for both (one dtype each)."""
    return "sm_90a" if i >= len(VARIANTS) else ARCHS[(i // 2) % 2]


def nvcc_jobs(pool, archs=ARCHS) -> list[Future]:
    """Every variant's compile for its architecture among ``archs`` (submitted at collection
    by conftest)."""
    return [pool.submit(compiler.compile_source, src, _arch(i)) for i, src in enumerate(_sources())
            if _arch(i) in archs]


def test_variants_render_distinct_sources_with_their_kernels():
    srcs = _sources()
    assert len(set(srcs)) == len(ALL)
    for (spec, cfg), src in zip(ALL, srcs):
        for kernel in spec.kernels:
            assert f"{kernel}(" in src, (cfg, kernel)
        assert ("__nv_bfloat16 elem_t" in src) == (cfg.dtype == "bfloat16")


def test_kernel_signatures_match_the_templates_parameters():
    """Each OpSpec signature has one letter per kernel parameter: P for pointers, i for ints."""
    import re
    for (spec, cfg), src in zip(ALL, _sources()):
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
    hopper = len(WGMMA_VARIANTS) if arch == "sm_90a" else 0
    assert len(cubins) == len(VARIANTS) // 2 + hopper and all(c[:4] == b"\x7fELF" for c in cubins)
    met = {(spec.name, cfg.layout if spec is cv.CONV_INDEX else cfg.bn, _arch(i))
           for i, (spec, cfg) in enumerate(VARIANTS)}
    assert met == {(spec.name, kind, a) for spec, kinds in ((cv.CONV_INDEX, cv.LAYOUTS),
                                                            (cv.CONV, (64, 128)))
                   for kind in kinds for a in ARCHS}


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


def test_channels_last_index_pixels_per_cta():
    """The channels_last index's pixels per CTA: 16 pixel rows per thread (the optimum measured
    at 90% zero channels on an H200, docstring of index_pixels), a power of two within its
    bounds, halved while the grid would leave SMs idle."""
    assert cv.index_pixels(32 * 56 * 56, 256, 8, 132) == 128
    assert cv.index_pixels(32 * 28 * 28, 512, 8, 132) == 64
    assert cv.index_pixels(32 * 14 * 14, 1024, 8, 132) == 32
    assert cv.index_pixels(56 * 56, 64, 8, 132) == 32     # 98 CTAs at the minimum
    for pixels in (1, 100, 3136, 10**5, 10**7):
        for C, vec in ((8, 8), (64, 8), (256, 8), (4096, 8), (6, 2), (7, 1)):
            pix = cv.index_pixels(pixels, C, vec, 132)
            assert cv.INDEX_PIX_MIN <= pix <= cv.INDEX_PIX_MAX and pix & (pix - 1) == 0
            assert pix == cv.INDEX_PIX_MIN or -(-pixels // pix) >= 132
