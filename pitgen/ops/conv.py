"""Convolution over sparse input channels: ``Y[n,f,y,x] += X[n,c,y+r,x+s] * W[f,c,r,s]``.

The rule engine says the channel axis c is a reduction axis and permutation invariant (SRead:
its slices may be gathered in any order), while y and x, coupled to r and s in the window
``y+r``, are not. ReLU activations have whole channels of zeros that change every call; a
micro-tile is one channel over the whole batch (extent 1 along c, all of n, y and x), so a
channel is *active* when any sample holds a non-zero in it (the common case: per-sample lists
would make every CTA of a batch run a different k loop for little gain). Per call, on the GPU,
with no host synchronisation (templates ``conv_index.cu.j2`` and ``conv.cu.j2``):

1. **index** (``pit_conv_index``): one pass over X in 16-byte loads flags the active channels;
   the last CTA compacts them into ``ids`` (increasing) and ``count`` on the device;
2. **gather** (``pit_conv_gather``): Xc [N, H + 2 ph, W + 2 pw, cp] (NHWC, the active channels
   in index order, contiguous, ``cp`` = count rounded up to GRAIN = 8 with zero channels; the
   zero padding written out as a halo, so the GEMM reads any tap unchecked) and Wc [F, R*S, cp];
3. **compute** (``pit_conv_gemm``): an implicit GEMM over Xc: k runs over pieces (r, s, 8 active
   channels), R*S*cp/8 of them read from the device; Y written in X's memory format.

Buffers are sized for every channel active (C); the halo and weight gathers' CTAs past the
device's count exit, the NCHW gather's CTAs stride over this call's work.
Why gather a copy: with Xc dense and channel-contiguous every GEMM load is a 16-byte cp.async
(2-byte strided gathers inside the GEMM would repeat for each of the R*S taps), and at 10%
density the copy moves a tenth of X. From NCHW it reads only the active planes; from
channels_last it reads X at sector granularity, close to all of it (docs/conv.md).

Backward (``pitgen::sparse_conv2d``'s autograd): dX and dW by cuDNN (``torch.nn.grad``), db a
sum. dX is dense whatever X's channels (a transposed convolution), and dW's columns of zero
channels come out as exact zeros; a dW over the active channels alone is not built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import cache, lower
from ..errors import PlanError, ShapeError
from ..limits import GRID_Y_MAX, INT32_MAX
from ..operands import check_device, on_operand_device, raw_key, validated
from ..opspec import OpSpec, Permutation
from ..runtime import TorchLaunch, device_arch, device_sms, stream_counters
from . import lazy_torch_classes
from .library import needs_grad, ops, tracing

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EXPRS", "CONV_INDEX", "CONV", "ConvPlan", "plan_conv", "channel_index",
           "sparse_conv2d", "dense_crossover"]

#: The expression of each supported stride: the channel axis c must be invariant in it.
EXPRS = {1: "Y[n,f,y,x] += X[n,c,y+r,x+s] * W[f,c,r,s]",
         2: "Y[n,f,y,x] += X[n,c,2*y+r,2*x+s] * W[f,c,r,s]"}
DTYPES = ("float16", "bfloat16")
LAYOUTS = ("nchw", "nhwc")
#: Channels per gathered micro-tile (a 16-byte piece of the GEMM's k sequence); the gathered
#: channel count cp is padded to a multiple: 7 active channels multiply as 8, not as a k-tile.
GRAIN = 8
#: Channels per CTA of the NCHW gather.
GROUP = 32
#: k-depth of the GEMM's step: mma.sync's 32 (4 pieces), wgmma's 64 (8: one 128-byte row).
BK = {False: 32, True: 64}
INDEX_THREADS = 256
#: Vectors of X per warp of the NCHW index (the template's SEGMENT: 8 per lane).
INDEX_SEGMENT = 256
#: CTAs' work in the gather kernel (the template's PIX and TILE_P).
PIX, TILE_P = 32, 128
#: The channels_last index (:func:`index_pixels`): pixels each thread reads of its column of
#: channels, and the fewest and most pixels per CTA
INDEX_ROWS_PER_THREAD, INDEX_PIX_MIN, INDEX_PIX_MAX = 16, 32, 512
#: The NCHW gather's grid: CTAs per SM (8 fit: 256 threads, 9 KB of shared memory each).
GATHER_CTAS_PER_SM = 8
BM, STAGES = 128, 4
#: The wgmma kernel's stage bytes per CTA: two CTAs per SM (4 stages at 64 filters, 3 at 128).
WGMMA_STAGES_BYTES = 100 * 1024
#: Shared memory of an sm_90 SM.
SM_SMEM = 228 * 1024
#: Largest kernel extent (R, S) accepted.
MAX_KERNEL = 7

#: The gather and the GEMM's k loop take X's and W's channels in index order (SRead along c);
#: the window axes r and s, which the rules leave fixed, are walked in place.
GATHERS = tuple(Permutation(f"channels of {operand}, stride {stride}", expr, "reduction",
                            operand, only=("c",))
                for stride, expr in EXPRS.items() for operand in ("X", "W"))
CONV_INDEX = OpSpec(
    "conv_index", "conv_index.cu.j2",
    {"pit_conv_index": "PiiiiiiPPPP", "pit_conv_gather": "PiiiiiiPPPiiPiiiiiiiP"},
    GATHERS, DTYPES)
CONV = OpSpec(
    "conv", "conv.cu.j2",
    {"pit_conv_gemm": "PPPPP" + "i" * 17},
    GATHERS, DTYPES)


@dataclass(frozen=True)
class IndexConfig:
    """Index and gather kernels of one dtype and input memory layout."""

    dtype: str
    layout: str

    def context(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "layout": self.layout, "grain": GRAIN, "group": GROUP}


@dataclass(frozen=True)
class GemmConfig:
    """The implicit GEMM of one dtype and CTA width (filters per CTA), on mma.sync (4 warps) or,
    with ``wgmma`` (sm_90a), two warpgroups multiplying 64-deep k-steps (conv_sm90.cu.j2) with
    as many stages as let two CTAs share an SM."""

    dtype: str
    bn: int
    wgmma: bool = False

    @property
    def stages(self) -> int:
        return (WGMMA_STAGES_BYTES // ((BM + self.bn) * 2 * BK[True])) if self.wgmma else STAGES

    @property
    def threads(self) -> int:
        return 256 if self.wgmma else 128

    def context(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "bm": BM, "bn": self.bn, "grain": GRAIN, "bk": BK[self.wgmma],
                "stages": self.stages, "wgmma": self.wgmma, "threads": self.threads,
                "min_blocks": self.ctas_per_sm}

    @property
    def ctas_per_sm(self) -> int:
        """CTAs of the wgmma kernel that share an SM: its shared memory (and 1 KB the driver
        reserves per CTA) within an SM's 228 KB; registers allow three at 64 filters (85 per
        thread), two at 128 (a 64 x 128 accumulator takes 64)."""
        return max(1, min(3 if self.bn <= 64 else 2, SM_SMEM // (self.smem + 1024)))

    @property
    def smem(self) -> int:
        if self.wgmma:   # 128-byte tile rows, 1024-byte aligned stages (the slack for that)
            return self.stages * (BM + self.bn) * 2 * BK[True] + 1024
        return STAGES * (BM + self.bn) * (BK[False] + 8) * 2


@dataclass(frozen=True)
class ConvPlan:
    """What one convolution shape runs: kernels, stride, padding and output size."""

    index: IndexConfig
    gemm: GemmConfig
    stride: tuple[int, int]
    padding: tuple[int, int]
    kernel: tuple[int, int]


def _pair(name: str, v: Any) -> tuple[int, int]:
    """An int or a pair of ints, as nn.Conv2d takes them; PlanError otherwise."""
    pair = (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list)) else ()
    if len(pair) != 2 or any(not isinstance(a, int) or isinstance(a, bool) for a in pair):
        raise PlanError(f"sparse_conv2d: {name} must be an int or a pair of ints, got {v!r}")
    return pair[0], pair[1]


def channel_axis(stride: int) -> str:
    """The axis the gather permutes for ``stride``, from the rule engine (once per process):
    c, invariant in that stride's expression (RuleError otherwise)."""
    axes = {CONV.derive()[f"channels of {operand}, stride {stride}"] for operand in ("X", "W")}
    (axis,) = axes.pop()
    return axis


@cache.lru("conv.plans", maxsize=1024)
def plan_conv(dtype: str, layout: str, shape: tuple[int, int, int, int],
              weight: tuple[int, int, int, int], stride: Any = 1, padding: Any = 0,
              dilation: Any = 1, groups: int = 1, arch: str = "sm_80") -> ConvPlan:
    """Check what the kernels run and choose them: fp16/bf16; groups 1; dilation 1; stride 1
    or 2 (each with its expression's rules); padding 0 .. kernel-1; kernels up to 7x7; an
    output of at least one pixel. ``shape`` is X's [N, C, H, W], ``weight`` W's [F, C, R, S];
    on an ``arch`` in ``lower.WGMMA_ARCHS`` the GEMM multiplies on wgmma."""
    CONV.check_dtype(dtype)
    if layout not in LAYOUTS:
        raise PlanError(f"sparse_conv2d: layout must be one of {LAYOUTS}, got {layout!r}")
    if groups != 1:
        raise PlanError(f"sparse_conv2d supports groups=1 only, got groups={groups}")
    if _pair("dilation", dilation) != (1, 1):
        raise PlanError(f"sparse_conv2d supports dilation 1 only, got {dilation!r}")
    sh, sw = _pair("stride", stride)
    if sh != sw or sh not in EXPRS:
        raise PlanError(f"sparse_conv2d supports stride 1 or 2 (the same along both axes), "
                        f"got {(sh, sw)}")
    ph, pw = _pair("padding", padding)
    N, C, H, W = shape
    F, Cw, R, S = weight
    if Cw != C:
        raise ShapeError(f"weight has {Cw} input channels, x has {C}")
    if not (1 <= R <= MAX_KERNEL and 1 <= S <= MAX_KERNEL):
        raise PlanError(f"sparse_conv2d supports kernels of 1 to {MAX_KERNEL} along each axis, "
                        f"got {R}x{S}")
    if not (0 <= ph < R and 0 <= pw < S):
        raise PlanError(f"sparse_conv2d: padding {(ph, pw)} must be in [0, kernel) for a "
                        f"{R}x{S} kernel")
    if H + 2 * ph < R or W + 2 * pw < S:
        raise ShapeError(f"x of {H}x{W} padded by {(ph, pw)} is smaller than the {R}x{S} kernel")
    if min(F, C) < 1:
        raise ShapeError(f"sparse_conv2d needs at least one channel and filter, got C={C}, F={F}")
    channel_axis(sh)
    gemm = GemmConfig(dtype, 64 if F <= 64 else 128, wgmma=arch in lower.WGMMA_ARCHS)
    return ConvPlan(IndexConfig(dtype, layout), gemm, (sh, sw), (ph, pw), (R, S))


def out_size(plan: ConvPlan, h: int, w: int) -> tuple[int, int]:
    """Output height and width (the formula of torch's conv2d, dilation 1)."""
    (sh, sw), (ph, pw), (R, S) = plan.stride, plan.padding, plan.kernel
    return (h + 2 * ph - R) // sh + 1, (w + 2 * pw - S) // sw + 1


def layout_of(x: Any) -> str:
    """``nchw`` for a contiguous X, ``nhwc`` for a channels_last one (ambiguous shapes: nchw);
    ShapeError for any other strides (the caller makes X one of the two)."""
    import torch
    if x.is_contiguous():
        return "nchw"
    if x.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    raise ShapeError(f"x has strides {tuple(x.stride())}: pass a contiguous (NCHW) or "
                     f"channels_last tensor")


def vector_width(layout: str, C: int, HW: int, ptr: int) -> int:
    """Elements per load of the index pass along X's contiguous run (a plane's H*W in NCHW, a
    pixel's C in NHWC): the largest of 8, 4, 2, 1 that divides it and the pointer's alignment."""
    run = HW if layout == "nchw" else C
    for v in (8, 4, 2):
        if run % v == 0 and ptr % (2 * v) == 0:
            return v
    return 1


#: H100 rates behind :func:`dense_crossover`, from ``pitgen bench conv`` (docs/bench/conv.md,
#: batch 32, fp16, NCHW): the copy rate; cuDNN's dense rate on the 3 x 3 layers; the index
#: pass's read of X (0.030 ms for 51 MB); the implicit GEMM's share of cuDNN's rate per GEMM
#: (the slope of its time over the active fraction at 56 x 56 x 256 -> 64, 3 x 3: mma.sync
#: 0.41 on the H100; wgmma 0.77 on an H200, where mma.sync measured 0.45); and the fixed time
#: of the three launches and their tails.
COPY_BYTES_PER_S = 2.5e12
DENSE_FLOPS_PER_S = 4.0e14
#: by X's layout: channels_last reads every pixel's channels whole (0.030 ms for 51 MB on an
#: H200 since session 24's pixels per CTA, index_pixels; 0.054 before)
INDEX_BYTES_PER_S = {"nchw": 1.7e12, "nhwc": 1.7e12}
SPARSE_EFFICIENCY = {False: 0.4, True: 0.75}   # by GemmConfig.wgmma
SPARSE_FIXED_S = 25e-6


def dense_crossover(shape: tuple[int, int, int, int], weight: tuple[int, int, int, int],
                    out_hw: tuple[int, int], wgmma: bool = False, layout: str = "nchw") -> float:
    """The active-channel fraction below which the sparse path is predicted faster than cuDNN:
    the index reads X once (INDEX_BYTES_PER_S of its layout) after SPARSE_FIXED_S of launches,
    the gather moves the active part (twice its bytes; from channels_last it reads all of X, at
    sector granularity) at the copy rate, and the GEMM (``wgmma`` or mma.sync) runs the active
    FLOPs at its SPARSE_EFFICIENCY of cuDNN's dense rate. NCHW with mma.sync,
    fitted on an H100: at 56 x 56 x 256 -> 64, 3 x 3 it is 0.08 (measured: 0.07), at
    28 x 28 x 512 -> 128 0.17 (measured 0.33); wgmma: 0.13 and 0.28 (measured on an H200 0.21
    and 0.71: the H100 rates are conservative there); channels_last with wgmma: 0 and 0.22 (on
    an H200 at 10% active channels the sparse path takes 0.92x cuDNN's time at 56 x 56 and 0.50x
    at 28 x 28: conservative too); 1 x 1 layers read more than they compute and never go
    sparse."""
    N, C, H, W = shape
    F, _, R, S = weight
    x_bytes = 2.0 * N * C * H * W
    flops = 2.0 * N * out_hw[0] * out_hw[1] * F * C * R * S
    dense = flops / DENSE_FLOPS_PER_S
    fixed = SPARSE_FIXED_S + x_bytes / INDEX_BYTES_PER_S[layout]
    moved = 2 * x_bytes
    if layout == "nhwc":   # the gather reads X whole, writes the active part
        fixed += x_bytes / COPY_BYTES_PER_S
        moved = x_bytes
    per_density = moved / COPY_BYTES_PER_S + flops / (DENSE_FLOPS_PER_S * SPARSE_EFFICIENCY[wgmma])
    return max(0.0, min(1.0, (dense - fixed) / per_density))


# -- GPU ----------------------------------------------------------------------------------------

#: device index -> runtime.stream_counters cache of int32 [1 + C] (done counter, channel flags)
#: that the index kernel leaves zero (per device: the default stream's handle is 0 on every one)
_FLAGS = cache.memo("conv.flags")


def _check_x(x: Any, device: bool = True) -> str:
    """X's dtype, after checking its type, dtype, rank, size and (``device``) device."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"x: expected a torch tensor, got {type(x).__name__}")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise ShapeError(f"x has dtype {dtype}; sparse_conv2d runs {' or '.join(DTYPES)}")
    if x.dim() != 4:
        raise ShapeError(f"x has {x.dim()} dims {tuple(x.shape)}; expected 4 [N, C, H, W]")
    if x.numel() >= INT32_MAX - INDEX_THREADS // 32 * INDEX_SEGMENT:   # the index's last CTA too
        raise ShapeError(f"x has {x.numel()} elements; the kernels' indices are int32")
    if device:
        check_device("x", x)
    return dtype


def index_per_plane(HW: int, vec: int) -> bool:
    """Whether the NCHW index runs a warp per plane (planes of at least INDEX_SEGMENT vectors:
    it skips known channels and stops at a non-zero) rather than flat segments of X."""
    return HW // vec >= INDEX_SEGMENT


def index_pixels(pixels: int, C: int, vec: int, sms: int) -> int:
    """The channels_last index's pixels per CTA. Its threads split into columns of ``vec``
    channels (at most INDEX_THREADS) and rows of pixels; a CTA's fixed work (reading its
    channels' flags, writing the ones it found) is paid once, so each thread reads
    INDEX_ROWS_PER_THREAD pixels (a power of two within [INDEX_PIX_MIN, INDEX_PIX_MAX]), halved
    while the grid would leave SMs idle. Measured on an H200 (session 24, 90% zero channels):
    56x56x256 x 32 30 us at 128 pixels (65 at 32), 28x28x512 24 at 64 (28), 14x14x1024 18.5 at
    32, 56x56x256 x 8 17 at 128 (43 at 32), 56x56x64 x 1 6.8 at 32."""
    rows = INDEX_THREADS // min(max(C // vec, 1), INDEX_THREADS)
    pix = min(max(INDEX_ROWS_PER_THREAD * rows, INDEX_PIX_MIN), INDEX_PIX_MAX)
    pix = 1 << (pix.bit_length() - 1)
    while pix > INDEX_PIX_MIN and -(-pixels // pix) < sms:
        pix //= 2
    return pix


def _index_grid(layout: str, N: int, C: int, HW: int, vec: int, per_plane: bool,
                pix: int) -> int:
    """NCHW: a warp per plane (``per_plane``) or per INDEX_SEGMENT vectors of the flat X;
    channels_last: a CTA per ``pix`` pixels."""
    warps = INDEX_THREADS // 32
    if layout == "nhwc":
        return -(-N * HW // pix)
    return -(-N * C // warps) if per_plane else -(-(N * C * HW // vec) // (INDEX_SEGMENT * warps))


def _index_geometry(layout: str, x: Any) -> tuple[int, tuple[int, ...]]:
    """The index pass over X: its grid and its arguments between X and the flags (N, C, H*W,
    vector width, per plane, pixels per CTA); the vector width follows X's alignment."""
    N, C, H, W = x.shape
    vec = vector_width(layout, C, H * W, x.data_ptr())
    per_plane = index_per_plane(H * W, vec)
    pix = index_pixels(N * H * W, C, vec, device_sms())
    return (_index_grid(layout, N, C, H * W, vec, per_plane, pix),
            (N, C, H * W, vec, int(per_plane), pix))


def _run_index(cfg: IndexConfig, x: Tensor, stream: int, ids: Tensor, count: Tensor) -> None:
    """Launch the index pass of X (count zeroed by the caller when X is empty)."""
    grid, args = _index_geometry(cfg.layout, x)
    if grid == 0:
        return
    C = x.shape[1]
    flags = stream_counters(_FLAGS.setdefault(x.device.index, {}), stream, C + 1, x.device)
    CONV_INDEX.module(cfg).launch(
        "pit_conv_index", (grid, 1, 1), (INDEX_THREADS, 1, 1), stream, x.data_ptr(), *args,
        flags.data_ptr() + 4, flags.data_ptr(), ids.data_ptr(), count.data_ptr())


def index_launch(x: Tensor) -> tuple[Tensor, Tensor]:
    """The index pass alone on a validated X (the body of ``pitgen::conv_channels``)."""
    import torch
    layout = layout_of(x)
    cfg = IndexConfig(str(x.dtype).replace("torch.", ""), layout)
    C = x.shape[1]
    ids = torch.empty(C, dtype=torch.int32, device=x.device)
    count = torch.zeros(1, dtype=torch.int32, device=x.device) if x.numel() == 0 else \
        torch.empty(1, dtype=torch.int32, device=x.device)
    with TorchLaunch() as L:
        _run_index(cfg, x, L.stream, ids, count)
    return ids, count


@on_operand_device
def channel_index(x: Tensor) -> tuple[Tensor, Tensor]:
    """The active channels of X [N, C, H, W] (fp16/bf16, NCHW or channels_last), on the GPU
    with no host sync: ``(ids, count)``, int32 [C] and [1]; ``ids[:count]`` are the channels
    holding a non-zero in any sample, increasing; slots past count are undefined."""
    _check_x(x)
    if layout_of_or_none(x) is None:
        x = x.contiguous()
    return ops().conv_channels(x)


def layout_of_or_none(x: Any) -> str | None:
    """:func:`layout_of`, or None where x must first be copied to NCHW."""
    try:
        return layout_of(x)
    except ShapeError:
        return None


def launch(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
           padding: tuple[int, int], out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Index, gather and GEMM on validated operands (the body of ``pitgen::sparse_conv2d``):
    Y and the device's active-channel count. ``out``: Y's buffer (the GPU tests poison it),
    of Y's shape and dtype in x's memory format; a new one when None. The launches are decided
    once per call signature (:class:`_ConvLaunch`)."""
    if bias is not None:
        bias = bias.contiguous()
    key = raw_key(x, weight, bias)
    run = validated(_LAUNCHES, None if key is None else (key, tuple(stride), tuple(padding)),
                    lambda: _ConvLaunch(x, weight, bias, tuple(stride), tuple(padding)))
    return run(x, weight, bias, out)


#: (raw_key of x, weight, bias; stride; padding) -> its _ConvLaunch
_LAUNCHES = cache.memo("conv.launches")


class _ConvLaunch:
    """The convolution's three launches for one call signature (shapes, strides, dtypes,
    alignment, device), decided once: the plan, the grids, the kernels bound to them and
    every argument that is not an address. A call allocates Y, the count and one work buffer
    (the channel ids, Xc with its halo and Wc, each 256-byte aligned) and makes three driver
    calls (issue 16's lean path; the op's dispatcher is skipped by eager calls with nothing to
    differentiate, :func:`_conv_count`)."""

    __slots__ = ("shape", "fmt", "C", "index", "gather", "gemm", "index_args",
                 "gather_args", "w_str", "gemm_args", "xc", "wc", "nbytes")

    def __init__(self, x: Any, weight: Any, bias: Any, stride: tuple[int, int],
                 padding: tuple[int, int]) -> None:
        import torch
        layout = layout_of(x)
        dtype = str(x.dtype).replace("torch.", "")
        plan = plan_conv(dtype, layout, tuple(x.shape), tuple(weight.shape), stride, padding,
                         arch=device_arch())
        N, C, H, W = x.shape
        F, _, R, S = weight.shape
        P, Q = out_size(plan, H, W)
        self.shape, self.C = (N, F, P, Q), C
        self.fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        if N * P * Q == 0:   # an empty batch (the plan refuses other empty outputs): no launch
            return
        if N * P * Q > INT32_MAX or -(-N * P * Q // BM) > INT32_MAX:
            raise ShapeError(f"{N * P * Q} output pixels overflow the GEMM's int32 rows")
        g = plan.gemm
        grid = (-(-N * P * Q // BM), -(-F // g.bn), 1)
        if grid[1] > GRID_Y_MAX:
            raise ShapeError(f"{F} filters need {grid[1]} CTA columns (at most {GRID_Y_MAX})")
        cmax = -(-C // GRAIN) * GRAIN
        ph, pw = plan.padding
        xc_pixels = N * (H + 2 * ph) * (W + 2 * pw)   # Xc holds the zero padding as a halo
        esize = x.element_size()
        # the work buffer: channel ids, then Xc, then Wc, each 256-byte aligned
        self.xc = -(-4 * C // 256) * 256
        self.wc = self.xc + -(-xc_pixels * cmax * esize // 256) * 256
        self.nbytes = self.wc + F * R * S * cmax * esize
        x_blocks = (min(-(-cmax // GROUP) * N * -(-H * W // TILE_P),
                        GATHER_CTAS_PER_SM * device_sms())
                    if layout == "nchw" else -(-N * H * W // PIX))
        h_blocks = -(-(xc_pixels - N * H * W) * (cmax // 8) // INDEX_THREADS)
        w_blocks = -(-F * R * S * (cmax // 8) // INDEX_THREADS)
        index_grid, self.index_args = _index_geometry(layout, x)   # the key holds x's alignment
        block = (INDEX_THREADS, 1, 1)
        self.index = CONV_INDEX.module(plan.index).bind("pit_conv_index", (index_grid, 1, 1), block)
        self.gather = CONV_INDEX.module(plan.index).bind(
            "pit_conv_gather", (x_blocks + h_blocks + w_blocks, 1, 1), block)
        self.gather_args = (N, C, H, W, ph, pw)
        self.w_str = (F, R, S, *weight.stride())
        self.gemm = CONV.module(g).bind("pit_conv_gemm", grid, (g.threads, 1, 1), g.smem)
        self.gemm_args = ((N, C, H, W, F, R, S, P, Q), (*plan.stride, ph, pw), (x_blocks, h_blocks))

    def __call__(self, x: Any, weight: Any, bias: Any, out: Any) -> tuple[Any, Any]:
        import torch
        N, F, P, Q = self.shape
        dev = x.device
        y = torch.empty(N, F, P, Q, dtype=x.dtype, device=dev, memory_format=self.fmt) \
            if out is None else out
        if out is not None and (tuple(y.shape) != self.shape or y.dtype != x.dtype
                                or not y.is_contiguous(memory_format=self.fmt)):
            raise ShapeError(f"out must be {self.shape} of {x.dtype} in x's memory format, got "
                             f"{tuple(y.shape)} of {y.dtype} with strides {tuple(y.stride())}")
        if y.numel() == 0:   # N == 0: the plan refuses every other empty output
            return y, torch.zeros(1, dtype=torch.int32, device=dev)
        count = torch.empty(1, dtype=torch.int32, device=dev)   # an output: its own tensor
        work = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        base, c, xp = work.data_ptr(), count.data_ptr(), x.data_ptr()
        xc, wc = base + self.xc, base + self.wc
        sizes, conv, blocks = self.gemm_args
        with TorchLaunch() as L:
            s = L.stream
            flags = stream_counters(_FLAGS.setdefault(dev.index, {}), s, self.C + 1, dev)
            fp = flags.data_ptr()
            self.index(s, xp, *self.index_args, fp + 4, fp, base, c)
            self.gather(s, xp, *self.gather_args, base, c, xc, *blocks, weight.data_ptr(),
                        *self.w_str, wc)
            self.gemm(s, xc, wc, c, bias.data_ptr() if bias is not None else 0, y.data_ptr(),
                      *sizes, *conv, *y.stride())
        return y, count


def _check_conv(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                groups: Any) -> ConvPlan:
    """Every operand and option checked (pitgen errors naming the problem: types, dtypes and
    shapes, then the plan, then devices); the plan."""
    import torch
    dtype = _check_x(x, device=False)
    if not isinstance(weight, torch.Tensor):
        raise ShapeError(f"weight: expected a torch tensor, got {type(weight).__name__}")
    if weight.dtype != x.dtype:
        raise ShapeError(f"weight has dtype {weight.dtype}, x {x.dtype}: they must match")
    if weight.dim() != 4:
        raise ShapeError(f"weight has {weight.dim()} dims {tuple(weight.shape)}; expected 4 "
                         f"[F, C, R, S]")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise ShapeError(f"bias: expected a torch tensor or None, got {type(bias).__name__}")
        if bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],):
            raise ShapeError(f"bias must be [{weight.shape[0]}] of {x.dtype}, got "
                             f"{tuple(bias.shape)} of {bias.dtype}")
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise PlanError(f"sparse_conv2d: groups must be an int, got {groups!r}")
    plan = plan_conv(dtype, layout_of_or_none(x) or "nchw", tuple(x.shape), tuple(weight.shape),
                     stride if isinstance(stride, int) else tuple(stride),
                     padding if isinstance(padding, int) else tuple(padding),
                     dilation if isinstance(dilation, int) else tuple(dilation), groups)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None:
            check_device(name, t)
    return plan


@on_operand_device
def sparse_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
                  padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv2d`` skipping X's all-zero channels, on the GPU, no host sync.

    x [N, C, H, W] float16/bfloat16, NCHW or channels_last (other strides are copied to NCHW);
    weight [F, C, R, S] (kernels up to 7x7), bias [F] or None, same dtype; stride 1 or 2;
    padding an int or pair in [0, kernel); dilation 1 and groups 1 (others: PlanError). The
    result is in x's memory format. A channel is skipped when it is zero in every sample (see
    :func:`channel_index`). Differentiable: dX, dW and db by cuDNN."""
    return _conv_count(x, weight, bias, stride, padding, dilation, groups)[0]


#: raw_key of the operands and the options -> their plan (validated once)
_CHECKED = cache.memo("conv.checked")


def _conv_count(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any,
                dilation: Any, groups: Any) -> tuple[Tensor, Tensor]:
    """:func:`sparse_conv2d`'s checks (memoised per operand signature and options: a steady
    state call skips them) and op: Y and the active-channel count (device)."""
    key = raw_key(x, weight, bias)
    if key is not None:
        key += (repr((stride, padding, dilation, groups)),)
    plan = validated(_CHECKED, key,
                     lambda: _check_conv(x, weight, bias, stride, padding, dilation, groups))
    if layout_of_or_none(x) is None:
        x = x.contiguous()
    if not tracing() and not needs_grad(x, weight, bias):
        # nothing to differentiate: the op's launches, without the dispatcher's host cost
        return launch(x, weight, bias, plan.stride, plan.padding)
    return ops().sparse_conv2d(x, weight, bias, list(plan.stride), list(plan.padding))


# -- torch module (built lazily: importing pitgen.ops.conv needs no torch) ---------------------

MODES = ("auto", "sparse", "dense")


def _build_module_class() -> Any:
    import torch
    from torch import nn

    class SparseConv2d(nn.Conv2d):
        """``nn.Conv2d`` (same parameters, state_dict and output) whose forward skips the
        input's all-zero channels (:func:`sparse_conv2d`).

        ``mode``: "sparse" always runs pitgen; "dense" always cuDNN; "auto" (default) chooses
        per call without a host sync: it runs pitgen while the active-channel fraction of an
        earlier call is below :func:`dense_crossover` (the first call, knowing nothing, runs
        pitgen, unless the crossover is 0: no density would pay), else cuDNN. Each pitgen call
        copies its device count to pinned host memory asynchronously; a later call reads it
        once its event has completed (never waits). On the cuDNN path one call in
        ``probe_every`` also runs the index pass alone (cheap when the input is dense: channels
        already found are not read again) to notice sparsity returning. While torch traces (torch.compile), "auto" runs pitgen.
        ``density_limit`` overrides the crossover. pitgen runs only what :func:`plan_conv`
        accepts (CUDA fp16/bf16, groups 1, dilation 1, stride 1 or 2, zero padding given as
        ints): anything else runs cuDNN in "auto" and raises in "sparse". Trains: the
        backward is cuDNN's either way."""

        def __init__(self, *args: Any, mode: str = "auto", density_limit: float | None = None,
                     probe_every: int = 32, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if mode not in MODES:
                raise PlanError(f"unknown SparseConv2d mode {mode!r}; choose one of {MODES}")
            if not isinstance(probe_every, int) or probe_every < 1:
                raise PlanError(f"probe_every must be a positive int, got {probe_every!r}")
            self.mode, self.density_limit, self.probe_every = mode, density_limit, probe_every
            self._density: float | None = None   # active fraction of the last call read back
            self._pending: tuple[Any, Any] | None = None   # (pinned count, event) in flight
            self._calls = 0
            self._host: Any = None   # pinned int32 [1], reused

        def _supported(self, x: Any) -> bool:
            """Whether pitgen runs this call (else cuDNN): CUDA fp16/bf16 x of 4 dims, zero
            padding given as ints, and a shape :func:`plan_conv` accepts."""
            if not (self.padding_mode == "zeros" and not isinstance(self.padding, str)
                    and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
                    and x.dim() == 4 and self.weight.dtype == x.dtype):
                return False
            try:
                plan_conv(str(x.dtype).replace("torch.", ""), "nchw", tuple(x.shape),
                          tuple(self.weight.shape), self.stride, self.padding, self.dilation,
                          self.groups)
            except (PlanError, ShapeError):
                return False
            return True

        def _poll(self) -> None:
            """Take the count of an earlier call if its copy has landed (no waiting)."""
            if self._pending is not None and self._pending[1].query():
                self._density = int(self._pending[0]) / max(self.in_channels, 1)
                self._pending = None

        def _record(self, count: Any) -> None:
            """Copy ``count`` to pinned host memory behind this call's work (unless a copy is
            still in flight); :meth:`_poll` reads it once done."""
            if self._pending is not None:
                return
            if self._host is None:
                self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._host.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self._host, event)

        def forward(self, x: Any) -> Any:
            if self.mode == "sparse":   # pitgen's errors name what it cannot run
                return sparse_conv2d(x, self.weight, self.bias, self.stride, self.padding,
                                     self.dilation, self.groups)
            if self.mode == "dense" or not self._supported(x):
                return super().forward(x)
            if torch.compiler.is_compiling():   # no Python state in a traced graph
                return sparse_conv2d(x, self.weight, self.bias, self.stride, self.padding)
            limit = self._limit(x)
            if limit <= 0.0:   # no density makes the sparse path pay: nothing to probe
                return super().forward(x)
            self._poll()
            self._calls += 1
            if self._density is not None and self._density > limit:
                if self._calls % self.probe_every == 0:
                    self._record(channel_index(x)[1])
                return super().forward(x)
            y, count = _conv_count(x, self.weight, self.bias, self.stride, self.padding,
                                   self.dilation, self.groups)
            self._record(count)
            return y

        def _limit(self, x: Any) -> float:
            """The active fraction above which cuDNN runs: density_limit, else the crossover."""
            if self.density_limit is not None:
                return self.density_limit
            (R, S), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
            H, W = x.shape[2:]
            out = ((H + 2 * ph - R) // sh + 1, (W + 2 * pw - S) // sw + 1)
            major, minor = torch.cuda.get_device_capability(x.device)
            return dense_crossover(tuple(x.shape), tuple(self.weight.shape), out,
                                   f"sm_{major}{minor}" in lower.WGMMA_ARCHS,
                                   layout_of_or_none(x) or "nchw")

        def extra_repr(self) -> str:
            return super().extra_repr() + f", mode={self.mode!r}"

    return SparseConv2d


__getattr__ = lazy_torch_classes(__name__, ("SparseConv2d",),
                                 lambda: {"SparseConv2d": _build_module_class()})
