"""CPU tests of lowering, rendering and compilation: every template variant renders and compiles
with nvcc (no GPU or driver needed), each for sm_80 or sm_90a (what an sm_90 device builds) so
that both archs meet every pair of dtype, kind and layout, and arch-dependent ones for both; the
wgmma variants for sm_90a; the compile cache behaves."""
from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import re
import subprocess
from concurrent.futures import Future

import pytest

import pitgen
from pitgen import compiler
from pitgen import lower as lower_mod
from pitgen.lower import INDEX_VECTOR_LOADS, Layout, Schedule, fuse, gemm_form, geometry, lower
from pitgen.ops.matmul import MATMUL


def render(spec) -> str:
    return MATMUL.source(spec.context())

ARCHS = ("sm_80", "sm_90a")  # an sm_90 device compiles every module for sm_90a
FORMS = {"AB": ("C[m,n] += A[m,k] * B[k,n]", "A"), "AtB": ("C[m,n] += A[k,m] * B[k,n]", "A"),
         "ABt": ("C[m,n] += A[m,k] * B[n,k]", "A"), "sparseB": ("C[m,n] += A[m,k] * B[k,n]", "B")}
KINDS = ("dense", "block", "micro_k", "micro_m", "micro_m_short")  # rows: one k-tile / several


def _layout(op, form, M, N, K) -> Layout:
    """Row-major user tensors of the given extents, seen in the normalised problem."""
    ext = {form.m_axis: M, form.n_axis: N, form.k_axis: K}
    strides = {}
    for acc in (op.output, *op.inputs):
        shape = [ext[a] for a in acc.axes]
        strides[acc.tensor] = (shape[1], 1)
    a, b, c = strides[form.sparse], strides[form.dense], strides[form.out]
    return Layout(ext[form.m_axis], ext[form.n_axis], ext[form.k_axis],
                  (a[form.a_dims[0]], a[form.a_dims[1]]), (b[form.b_dims[0]], b[form.b_dims[1]]),
                  (c[form.c_dims[0]], c[form.c_dims[1]]))


def variant(dtype: str, form_name: str, kind: str, odd: bool, accumulate: bool = False,
            fused: bool = False):
    expr, sparse = FORMS[form_name]
    op = pitgen.parse(expr)
    f = gemm_form(op, sparse)
    M, N, K = (203, 101, 333) if odd else (256, 128, 512)
    shape = [0, 0]
    axis = None
    if kind == "block":
        shape[f.a_dims[0]], shape[f.a_dims[1]] = 32, 64
    elif kind == "micro_k":
        shape[f.a_dims[0]], shape[f.a_dims[1]], axis = 64, 1, f.k_axis
    elif kind.startswith("micro_m"):
        shape[f.a_dims[0]], axis = 1, f.m_axis
        shape[f.a_dims[1]] = 32 if kind == "micro_m_short" else 1024
    mk = kind.split("_")[0] if kind != "micro_k" and not kind.startswith("micro_m") else "micro"
    lay = _layout(op, f, M, N, K)
    spec = lower(op, sparse, mk, axis, tuple(shape) if mk != "dense" else (), dtype, lay,
                 accumulate=accumulate)
    if fused:
        spec = fuse(spec, geometry(spec, lay))
        assert spec.fused, (dtype, form_name, kind)
    return spec


DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = (("AB", False), ("AtB", True), ("ABt", False), ("sparseB", True))  # odd: unaligned
VARIANTS = [(d, f, k, odd) for d in DTYPES for k in KINDS for f, odd in LAYOUTS]
#: variants compiled with the one-launch kernel as well (each kind it applies to, each dtype;
#: one layout whose m-tiles are whole, one whose are not)
FUSED = {("float16", "AB", "micro_k", False), ("bfloat16", "sparseB", "block", True),
         ("float32", "ABt", "micro_k", False), ("float32", "AB", "block", False)}


def test_variants_cover_every_mode_and_copy_width():
    specs = [variant(*v) for v in VARIANTS]
    g = [s.gemm for s in specs]
    assert {x.a_mode for x in g} == {"box", "packed", "rows"}
    rows = [x for x in g if x.a_mode == "rows"]
    assert {x.c_pair for x in rows} == {True, False} == {x.c_mfast for x in rows}
    assert {x.b_smem_ncontig for x in rows} == {True, False} and {x.a_vec for x in rows} >= {1, 8}
    assert {x.a_vec for x in g} >= {1, 4, 8} and {x.b_vec for x in g} >= {1, 4, 8}
    assert {x.a_smem_kcontig for x in g} == {True, False} == {x.b_smem_ncontig for x in g}
    assert {s.index.strategy for s in specs if s.index and s.index.kind == "micro"} == {
        "thread", "warp", "vector"}


def test_mma_sync_tiles_store_16_byte_chunks_where_the_layout_allows_and_wait_only_on_sm90():
    """The mma.sync tile kernel writes C' in 16-byte row chunks (a quad transpose) for 16-bit C'
    that is n-contiguous, 16-byte aligned, N a multiple of 8, not accumulated, and whose warps
    span a multiple of 32 columns; else in pairs or single elements. It waits for the index
    grid (a programmatic dependent launch) only where lowered for sm_90."""
    def mma(spec):
        g = spec.gemm
        return g if g.mainloop == "mma_sync" and g.a_mode in ("box", "packed") else None
    g = mma(variant("float16", "AB", "micro_k", False))
    assert g.c_vec and g.c_pair and not g.early
    assert not mma(variant("float16", "AB", "micro_k", False, accumulate=True)).c_vec
    assert not mma(variant("float16", "AB", "micro_k", True)).c_vec          # N = 101
    assert not mma(variant("float32", "AB", "micro_k", False)).c_vec         # 4-byte elements
    assert not mma(variant("bfloat16", "sparseB", "block", False)).c_vec     # C' m-contiguous
    compiled = [g for g in (mma(variant(*v)) for v in VARIANTS) if g is not None]
    assert {g.c_vec for g in compiled} == {True, False}   # the CPU nvcc matrix meets both stores
    for v in PACKED_SM90_VARIANTS:
        spec = packed_sm90_variant(*v)
        g = spec.gemm
        assert g.early and g.c_vec == (not v[2]) and (g.bn // g.wn) % 32 == 0, v
        src = render(spec)
        assert "griddepcontrol.wait" in src and ("quad_chunk(w[0]" in src) == g.c_vec, v
    assert "griddepcontrol.wait" not in render(variant("float16", "AB", "micro_k", False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_index_takes_vectors_only_where_its_template_fits(dtype):
    """The rows-mode index tests 1 x tk tiles in 16-byte vectors only where a tile is 4 to 32
    threads (a round of 256 threads then holds whole tiles and at most the CTA's 64); shorter
    and longer tiles keep a warp per tile, and k not contiguous (A stored k-major) a thread per
    tile."""
    size = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    for form_name in ("AB", "AtB"):
        expr, sparse = FORMS[form_name]
        op = pitgen.parse(expr)
        f = gemm_form(op, sparse)
        for tk in (8, 16, 32, 64, 128, 256, 512, 1024):
            shape = [0, 0]
            shape[f.a_dims[0]], shape[f.a_dims[1]] = 1, tk
            ix = lower(op, sparse, "micro", f.m_axis, tuple(shape), dtype,
                       _layout(op, f, 300, 128, 2048)).index
            tpt = tk * size // 16
            want = "thread" if form_name == "AtB" else "vector" if 4 <= tpt <= 32 else "warp"
            assert ix.strategy == want, (form_name, tk, ix.strategy)
            assert ix.per_block == {"vector": INDEX_VECTOR_LOADS * 256 // max(tpt, 1), "warp": 8,
                                    "thread": 256}[ix.strategy]


HOPPER_KINDS = ("dense", "block")
#: The wgmma variants: each dtype meets each kind and layout (a checkerboard, half of them).
HOPPER_VARIANTS = [(d, f, k) for i, d in enumerate(("float16", "bfloat16"))
                   for j, k in enumerate(HOPPER_KINDS) for n, f in enumerate(FORMS)
                   if (i + j + n) % 2 == 0]


def hopper_variant(dtype: str, form_name: str, kind: str, accumulate: bool = False,
                   pingpong: bool = False):
    expr, sparse = FORMS[form_name]
    op = pitgen.parse(expr)
    f = gemm_form(op, sparse)
    shape: tuple[int, ...] = ()
    if kind == "block":
        s = [0, 0]
        s[f.a_dims[0]], s[f.a_dims[1]] = 128, 128
        shape = tuple(s)
    saved = lower_mod.PINGPONG
    lower_mod.PINGPONG = "always" if pingpong else "never"
    try:
        return lower(op, sparse, kind, None, shape, dtype, _layout(op, f, 200, 520, 264),
                     accumulate=accumulate, arch="sm_90")
    finally:
        lower_mod.PINGPONG = saved


#: Packed micro-tiles along k as an sm_90 device plans them (lower.PACKED_SM90's schedule for
#: their m extent, which VARIANTS, lowered for sm_80, never meet): each m extent, each 16-bit
#: dtype, aligned and unaligned operands (scalar copies of B'); sm_90a only.
PACKED_SM90_VARIANTS = [(16, "float16", False), (32, "bfloat16", True), (32, "float16", False),
                        (64, "float16", True), (128, "bfloat16", False)]


def packed_sm90_variant(tm: int, dtype: str, odd: bool):
    op = pitgen.parse(FORMS["AB"][0])
    M, N, K = (203, 101, 333) if odd else (256, 512, 512)
    return lower(op, "A", "micro", "k", (tm, 1), dtype,
                 _layout(op, gemm_form(op, "A"), M, N, K), arch="sm_90")


#: The wgmma row-owner variants (A' k-contiguous): each dtype, B' n- and k-contiguous, k-tiles of
#: one stage and of two, accumulating or not.
HOPPER_ROWS_VARIANTS = [("float16", "AB", 64, False), ("bfloat16", "ABt", 128, True)]


def hopper_rows_variant(dtype: str, form_name: str, tk: int, accumulate: bool,
                        layout: Layout | None = None):
    expr, sparse = FORMS[form_name]
    op = pitgen.parse(expr)
    f = gemm_form(op, sparse)
    s = [0, 0]
    s[f.a_dims[0]], s[f.a_dims[1]] = 1, tk
    return lower(op, sparse, "micro", f.m_axis, tuple(s), dtype,
                 layout or _layout(op, f, 200, 520, 264), accumulate=accumulate, arch="sm_90")


def test_rows_plans_take_the_wgmma_row_owner_kernel_where_rows_can_be_gathered():
    """A producer warpgroup and two consumer warpgroups taking the steps in turn, BN 64, as many
    stages as fit beside the accumulator; a CTA per output tile (no persistent grid); mma.sync
    where A' rows cannot be gathered in 16-byte copies or the k-tile is not whole 64-deep
    stages."""
    for v in HOPPER_ROWS_VARIANTS:
        g = hopper_rows_variant(*v).gemm
        assert (g.a_mode, g.mainloop, g.threads, g.bn, g.bk, g.gather, g.tk) == (
            "rows", "wgmma", 384, 64, 64, 64, v[2])
        assert g.b_smem_ncontig == (v[1] == "AB") and g.c_vec == (not v[3])
    big = Layout(4096, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))
    spec = hopper_rows_variant("float16", "AB", 64, False, big)
    g = spec.gemm
    assert (g.bm, g.stages, spec.index.id_block) == (512, 4, 512)
    assert g.smem_bytes("float16") + lower_mod.ROWS_SM90_STATIC <= 227 * 1024
    assert geometry(spec, big, sms=132).grid == (64, 8)
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    keep = {  # rows plans that stay on mma.sync on the same device, and why
        "A' k-major": lower(pitgen.parse(FORMS["AtB"][0]), "A", "micro", "m", (64, 1), "float16",
                            Layout(256, 256, 256, (1, 256), (256, 1), (256, 1)), arch="sm_90"),
        "k-tiles of 32": lower(op, "A", "micro", "m", (1, 32), "float16", big, arch="sm_90"),
        "float32": lower(op, "A", "micro", "m", (1, 64), "float32", big, arch="sm_90"),
        "K not a multiple of 8": lower(op, "A", "micro", "m", (1, 64), "float16",
                                       Layout(256, 256, 260, (264, 1), (256, 1), (256, 1)),
                                       arch="sm_90"),
        "unaligned A'": lower(op, "A", "micro", "m", (1, 64), "float16",
                              Layout(256, 256, 256, (256, 1), (256, 1), (256, 1), align_a=8),
                              arch="sm_90"),
        "a tile override": lower(op, "A", "micro", "m", (1, 64), "float16", big, arch="sm_90",
                                 schedule=Schedule(bn=64, bk=32)),
    }
    assert {why: s.gemm.mainloop for why, s in keep.items()} == dict.fromkeys(keep, "mma_sync")
    assert lower(op, "A", "micro", "m", (1, 64), "float16", big, arch="sm_90",
                 schedule=Schedule(bm=256)).gemm.bm == 256


#: products-kernel variants (1 x tk micro-tiles along m, Schedule(rows="products")): B' n- and
#: k-contiguous, one k-tile per stage and two, accumulating or not, N odd (element stores);
#: each compiled for one arch (the kernel is the same mma.sync code on both), the first with a
#: tile of another warp count than the default's (BN, warps along m, n: 128 threads, while the
#: finishing pass keeps its own 256), so that lower.PRODUCTS_TILE stays free to tune
PRODUCTS_VARIANTS = [("float16", "AB", 64, False, 520), ("bfloat16", "ABt", 128, True, 301)]
PRODUCTS_ARCHS = ("sm_80", "sm_90a")
PRODUCTS_TILES = ((64, 1, 4), None)


def products_variant(dtype: str, form_name: str, tk: int, accumulate: bool, N: int = 520,
                     layout: Layout | None = None, arch: str = "sm_80",
                     tile: tuple[int, int, int] | None = None):
    expr, sparse = FORMS[form_name]
    op = pitgen.parse(expr)
    f = gemm_form(op, sparse)
    s = [0, 0]
    s[f.a_dims[0]], s[f.a_dims[1]] = 1, tk
    spec = lower(op, sparse, "micro", f.m_axis, tuple(s), dtype,
                 layout or _layout(op, f, 200, N, 264), accumulate=accumulate, arch=arch,
                 schedule=Schedule(rows="products"))
    if tile is None:
        return spec
    bn, wm, wn = tile
    return dataclasses.replace(spec, gemm=dataclasses.replace(spec.gemm, bn=bn, wm=wm, wn=wn))


def test_products_plans_where_rows_can_be_gathered():
    """Schedule(rows="products"): the products kernel on either arch (mma.sync: its work is
    bytes, not FLOPs) with persistent CTAs, a finishing CTA per row, an index listing each
    k-tile's rows in one list with the row table, no one-launch fusion and no atomics in the
    tile kernels; the row-owner kernel wherever the products kernel does not fit."""
    for v in PRODUCTS_VARIANTS:
        for arch in ("sm_80", "sm_90"):
            spec = products_variant(*v, arch=arch)
            g, ix = spec.gemm, spec.index
            assert (g.a_mode, g.mainloop, g.threads, g.bm, g.tk, g.bk) == (
                "products", "mma_sync", 256, 256, v[2], 64)
            assert (ix.strategy, ix.id_block, ix.row_table, ix.long_extent) == (
                "vector", 256, True, v[2])
            assert g.b_smem_ncontig == (v[1] == "AB") and g.c_vec == (v[4] % 8 == 0)
            geo = geometry(spec, _layout(pitgen.parse(FORMS[v[1]][0]),
                                         gemm_form(pitgen.parse(FORMS[v[1]][0]), "A"), 200, v[4], 264),
                           sms=132)
            assert geo.grid == (132 * lower_mod.PRODUCTS_CTAS_PER_SM, 1) and geo.finish == (200, 1)
            assert (geo.groups, geo.cap) == (-(-264 // v[2]), 256)
            assert not fuse(spec, geo).fused
            src = render(spec)
            assert "atomic" not in _tile_kernel(src) and "pit_gemm_finish" in src
    # a tile of 128 threads: the finishing pass keeps its own CTA (the launcher's block)
    src = render(products_variant(*PRODUCTS_VARIANTS[0], tile=PRODUCTS_TILES[0]))
    assert "THREADS = 128," in src
    assert f"FINISH_THREADS = {lower_mod.PRODUCTS_FINISH_THREADS};" in src
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    big = Layout(4096, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))
    prefer = Schedule(rows="products")
    owner = {  # where the row-owner kernel runs instead, and why
        "A' k-major": lower(pitgen.parse(FORMS["AtB"][0]), "A", "micro", "m", (64, 1), "float16",
                            Layout(256, 256, 256, (1, 256), (256, 1), (256, 1)), schedule=prefer),
        "k-tiles of 16": lower(op, "A", "micro", "m", (1, 16), "float16", big, schedule=prefer),
        "float32": lower(op, "A", "micro", "m", (1, 64), "float32", big, schedule=prefer),
        "K not a multiple of 8": lower(op, "A", "micro", "m", (1, 64), "float16",
                                       Layout(256, 256, 260, (264, 1), (256, 1), (256, 1)),
                                       schedule=prefer),
        "unaligned A'": lower(op, "A", "micro", "m", (1, 64), "float16",
                              Layout(256, 256, 256, (256, 1), (256, 1), (256, 1), align_a=8),
                              schedule=prefer),
        "more k-tiles than a CTA sums": lower(op, "A", "micro", "m", (1, 32), "float16",
                                              Layout(64, 64, 32 * 513, (32 * 513, 1), (64, 1),
                                                     (64, 1)), schedule=prefer),
        "no preference": lower(op, "A", "micro", "m", (1, 64), "float16", big),
    }
    assert {why: s.gemm.a_mode for why, s in owner.items()} == dict.fromkeys(owner, "rows")
    with pytest.raises(pitgen.PlanError, match="Schedule.rows is 'owner'"):
        lower(op, "A", "micro", "m", (1, 64), "float16", big, schedule=Schedule(rows="owner"))


def test_hopper_devices_get_wgmma_where_the_plan_allows():
    specs = [hopper_variant(*v) for v in HOPPER_VARIANTS]
    assert all(s.gemm.mainloop == "wgmma" and s.gemm.threads == 384 for s in specs)
    assert {s.gemm.a_smem_kcontig for s in specs} == {True, False} == {s.gemm.b_smem_ncontig for s in specs}
    assert all(s.gemm.smem_bytes(s.dtype) <= 227 * 1024 for s in specs)
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    lay = Layout(256, 256, 256, (256, 1), (256, 1), (256, 1))
    keep = {  # plans that stay on mma.sync on the same device, and why
        "float32": lower(op, "A", "dense", None, (), "float32", lay, arch="sm_90"),
        "packed micro-tiles": lower(op, "A", "micro", "k", (64, 1), "float16", lay, arch="sm_90"),
        "32-row blocks": lower(op, "A", "block", None, (32, 64), "float16", lay, arch="sm_90"),
        "k-blocks of 32": lower(op, "A", "block", None, (64, 32), "float16", lay, arch="sm_90"),
        "rows not 16-byte multiples": lower(op, "A", "dense", None, (), "float16",
                                           Layout(256, 256, 250, (250, 1), (256, 1), (256, 1)),
                                           arch="sm_90"),
        "unaligned base": lower(op, "A", "dense", None, (), "float16",
                                Layout(256, 256, 256, (256, 1), (256, 1), (256, 1), align_a=2),
                                arch="sm_90"),
        "sm_80": lower(op, "A", "dense", None, (), "float16", lay, arch="sm_80"),
        "schedule override": lower(op, "A", "dense", None, (), "float16", lay, arch="sm_90",
                                   schedule=Schedule(bn=64)),
    }
    assert {why: s.gemm.mainloop for why, s in keep.items()} == dict.fromkeys(keep, "mma_sync")


def test_packed_micro_tiles_take_the_hopper_schedule_on_sm_90():
    """Packed micro-tiles along k stay on mma.sync on sm_90 with lower.PACKED_SM90's schedule for
    their m extent (tuned there) in 16-bit types; sm_80 and fp32 keep the table of m extents, an override wins."""
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    lay = Layout(4096, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))

    def knobs(tm, dtype="float16", arch="sm_90", schedule=Schedule()):
        g = lower(op, "A", "micro", "k", (tm, 1), dtype, lay, schedule=schedule, arch=arch).gemm
        return g.mainloop, (g.bn, g.bk, g.wm, g.wn, g.stages)

    for tm in (16, 32, 64, 128):
        for dtype in ("float16", "bfloat16"):
            assert knobs(tm, dtype) == ("mma_sync", lower_mod.PACKED_SM90[tm])
        assert knobs(tm, arch="sm_80")[1] == lower_mod.SCHEDULES[tm]
        assert knobs(tm, "float32") == knobs(tm, "float32", arch="sm_80")
    assert knobs(64, schedule=Schedule(bn=256, wm=2, wn=4, stages=4))[1] == (256, 32, 2, 4, 4)


def test_block_plans_take_the_split_wgmma_tile_of_dense_plans():
    """Block plans and dense ones alike: 128 x 256 tiles split between two consumer warpgroups
    (ping-pong only where lower.PINGPONG asks for it)."""
    gemms = {kind: hopper_variant("float16", "AB", kind).gemm for kind in HOPPER_KINDS}
    assert {k: (g.bm, g.bn, g.mainloop, g.pingpong, g.threads) for k, g in gemms.items()} == \
        dict.fromkeys(HOPPER_KINDS, (128, 256, "wgmma", False, 384))


@pytest.mark.parametrize("pingpong", [True, False])
def test_either_consumer_schedule_fits_every_wgmma_plan(pingpong):
    """lower.PINGPONG forces a schedule (the GPU tests run both): ping-pong keeps each consumer's
    accumulators within 128 x 128, a split tile is shared by wm x wn consumers. The stages leave
    room for the static shared memory (block plans: the m-tile order, two ints per m-tile up to
    order_local; ptxas counts 2,304 bytes for 256 and 256 bytes without)."""
    for v in HOPPER_VARIANTS:
        g = hopper_variant(*v, pingpong=pingpong).gemm
        assert g.mainloop == "wgmma" and g.pingpong == pingpong and g.threads == 384
        assert g.bm * g.bn <= 128 * 128 * 2 ** (not g.pingpong) and g.bm == 64 * g.wm
        assert g.order_local == (lower_mod.ORDER_LOCAL if g.block_list else 0)
        assert g.smem_bytes(v[0]) + 8 * g.order_local + 256 <= lower_mod.WGMMA_SMEM


def test_wgmma_grid_is_persistent():
    spec = hopper_variant("float16", "AB", "dense")
    lay = Layout(4096, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))
    assert geometry(spec, lay, sms=132).grid == (132, 1)
    assert geometry(spec, Layout(100, 100, 64, (64, 1), (100, 1), (100, 1)), sms=132).grid == (1, 1)


def test_render_is_deterministic_and_names_the_plan():
    spec = variant("float16", "AB", "micro_k", False)
    src = render(spec)
    assert src == render(spec)
    assert "C[m,n] += A[m,k] * B[k,n]" in src and "micro along k" in src
    assert 'extern "C" __global__' in src and "pit_build_index" in src


def _tile_kernel(source: str) -> str:
    """The tile kernel's namespace of a rendered matmul module."""
    start = source.index("namespace pit_gemm {")
    return source[start:source.index("}  // namespace pit_gemm", start)]


def test_no_matmul_kernel_adds_with_atomics():
    """Every plan writes C once from its own tile: no fp32 (or any) atomics on data in the tile
    kernels, no workspace pass (the only atomics are int counters: the index build's, and the
    tile counter the wgmma kernel's CTAs draw their tiles from)."""
    sources = [src for src, _ in _compiles().values()] + list(_hopper_sources())
    scheduling = re.compile(r"atomic(Add|Exch)\(next_tile, ")
    assert all("atomic" not in scheduling.sub("", _tile_kernel(src)) for src in sources)
    assert any(scheduling.search(src) for src in _hopper_sources())
    assert not any("_finish" in src or "float* __restrict__ ws" in src for src in sources)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_lowering_owns_row_blocks(dtype):
    """Rows mode: the row-owner tile (BM rows from M, G gathered rows per step), a grid of exactly
    the output tiles, an index listing each k-tile's rows per row block, shared memory within the
    budget (fp16/bf16: two CTAs per H100 SM, 228 KiB with 1 KiB reserved per CTA)."""
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    for M, bm in ((1, 64), (64, 64), (65, 128), (200, 256), (4096, 512)):
        lay = Layout(M, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))
        spec = lower(op, "A", "micro", "m", (1, 64), dtype, lay)
        g, ix = spec.gemm, spec.index
        assert (g.a_mode, g.bm, g.gather, ix.id_block, ix.long_extent) == ("rows", bm, 64, bm, 64)
        assert g.bk == (32 if dtype == "float32" else 64)
        assert g.smem_bytes(dtype) <= 112 * 1024
        if dtype != "float32":
            assert 2 * (g.smem_bytes(dtype) + 1024) <= 228 * 1024
        geo = geometry(spec, lay)
        nrb, nkt = -(-M // bm), 4096 // 64
        assert geo.grid == (-(-4096 // g.bn), nrb)  # no k-tile axis, no upper bound
        assert (geo.groups, geo.cap, geo.tk, geo.index_grid[1]) == (nkt * nrb, bm, 64, nkt)
    odd = Layout(70, 45, 77, (77, 1), (45, 1), (45, 1))
    spec = lower(op, "A", "micro", "m", (1, 16), dtype, odd)
    assert spec.gemm.bk == 16 and spec.gemm.a_vec == 1
    lay40 = Layout(70, 48, 80, (80, 1), (48, 1), (48, 1))
    wide = lower(op, "A", "micro", "m", (1, 40), dtype, lay40)
    assert 40 % wide.gemm.a_vec == 0 and 80 % wide.gemm.a_vec == 0  # no copy straddles a k-tile
    covers = lower(op, "A", "micro", "m", (1, 512), dtype, odd)  # one k-tile covers K
    assert (covers.gemm.bm, covers.gemm.bk, geometry(covers, odd).groups) == \
        (128, 32 if dtype == "float32" else 64, 1)
    wide_n = lower(op, "A", "micro", "m", (1, 64), dtype, lay, schedule=Schedule(bn=128, bk=32))
    assert wide_n.gemm.bn == 128 and wide_n.gemm.bm == wide_n.index.id_block < 512  # BM gives way
    with pytest.raises(pitgen.PlanError, match="shared memory"):
        lower(op, "A", "micro", "m", (1, 64), dtype, odd, schedule=Schedule(bm=1024, stages=4))
    with pytest.raises(pitgen.PlanError, match="warps"):
        lower(op, "A", "micro", "m", (1, 64), dtype, odd, schedule=Schedule(bm=96))


def test_small_problems_run_in_one_launch():
    """fuse: packed micro-tiles and listed blocks on the mma.sync kernel get the one-launch
    kernel while index CTAs and output tiles fit FUSED_MAX_CTAS; rows mode, the wgmma
    kernels and dense plans keep their launches."""
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    small = Layout(128, 128, 128, (128, 1), (128, 1), (128, 1))
    big = Layout(4096, 4096, 4096, (4096, 1), (4096, 1), (4096, 1))
    for kind, shape in (("micro", (32, 1)), ("block", (32, 64)), ("block", (64, 64))):
        axis = "k" if kind == "micro" else None
        spec = lower(op, "A", kind, axis, shape, "float16", small)
        geo = geometry(spec, small)
        fused = fuse(spec, geo)
        ctas = geo.index_grid[0] * geo.index_grid[1] + geo.grid[0] * geo.grid[1]
        assert fused.fused and ctas <= lower_mod.FUSED_MAX_CTAS, (kind, shape)
        assert fused.gemm == spec.gemm and fused.index == spec.index
        assert "pit_gemm_fused" in render(fused) and "pit_gemm_fused" not in render(spec)
        spec = lower(op, "A", kind, axis, shape, "float16", big)
        assert not fuse(spec, geometry(spec, big)).fused
    for kind, axis, shape, arch in (("micro", "m", (1, 64), "sm_80"), ("dense", None, (), "sm_80"),
                                    ("block", None, (64, 64), "sm_90")):
        spec = lower(op, "A", kind, axis, shape, "float16", small, arch=arch)
        assert not fuse(spec, geometry(spec, small, sms=132)).fused, (kind, arch)


def test_lowering_refuses_what_it_cannot_run():
    op = pitgen.parse("C[m,n] += A[m,k] * B[k,n]")
    lay = Layout(64, 64, 64, (64, 1), (64, 1), (64, 1))
    with pytest.raises(pitgen.PlanError, match="mma"):
        lower(op, "A", "block", None, (48, 32), "float16", lay)
    with pytest.raises(pitgen.PlanError, match="dtype"):
        lower(op, "A", "dense", None, (), "float64", lay)
    with pytest.raises(pitgen.PlanError, match="overflow"):
        lower(op, "A", "dense", None, (), "float16", Layout(70000, 8, 40000, (40000, 1), (8, 1), (8, 1)))
    with pytest.raises(pitgen.PitgenError, match="no GPU kernel"):
        gemm_form(pitgen.parse("C[b,m,n] += A[b,m,k] * B[b,k,n]"), "A")
    with pytest.raises(pitgen.PlanError, match="not an input"):
        gemm_form(op, "Z")


def _archs(v: tuple, source: str) -> tuple[str, ...]:
    """A checkerboard over dtype x kind x layout: fixing any two, the third alternates archs, so
    each arch compiles every pair of them (every triple compiles once: compiling all for both
    archs takes twice the time, mostly in ptxas on the unaligned layouts' scalar copies).
    Sources with arch-dependent code compile for both."""
    if "__CUDA_ARCH__" in source:
        return ARCHS
    d, f, k, _ = v
    return (ARCHS[(DTYPES.index(d) + KINDS.index(k) + list(FORMS).index(f)) % 2],)


@functools.cache
def _compiles() -> dict[tuple, tuple[str, tuple[str, ...]]]:
    """Each variant's source (a third of them accumulating into C) and its archs."""
    out = {}
    for i, v in enumerate(VARIANTS):
        src = render(variant(*v, accumulate=(i % 3 == 0), fused=v in FUSED))
        out[v] = (src, _archs(v, src))
    return out


@functools.cache
def _hopper_sources() -> tuple[str, ...]:
    """Each wgmma variant's source (every other one accumulating into C; each kind in both
    consumer schedules, a dtype each), the row-owner ones and the packed micro-tiles' sm_90
    schedules; sm_90a only."""
    return tuple(render(hopper_variant(*v, accumulate=bool(i % 2), pingpong=(i // 4 + i // 2) % 2 == 0))
                 for i, v in enumerate(HOPPER_VARIANTS)) + tuple(
        render(hopper_rows_variant(*v)) for v in HOPPER_ROWS_VARIANTS) + tuple(
        render(packed_sm90_variant(*v)) for v in PACKED_SM90_VARIANTS)


def nvcc_jobs(pool, archs=ARCHS) -> list[Future]:
    """The compiles of every variant for ``archs`` (submitted at collection by conftest; the
    pool runs identical ones once)."""
    jobs = [pool.submit(compiler.compile_source, src, arch)
            for src, for_archs in _compiles().values() for arch in for_archs if arch in archs]
    if "sm_90a" in archs:
        jobs += [pool.submit(compiler.compile_source, src, "sm_90a") for src in _hopper_sources()]
    jobs += [pool.submit(compiler.compile_source, render(products_variant(*v, tile=t)), arch)
             for v, arch, t in zip(PRODUCTS_VARIANTS, PRODUCTS_ARCHS, PRODUCTS_TILES)
             if arch in archs]
    return jobs


def test_both_archs_meet_every_pair_of_dtype_kind_and_layout():
    archs_of = {v: archs for v, (_, archs) in _compiles().items()}
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for arch in ARCHS:
            met = {(v[a], v[b]) for v, archs in archs_of.items() if arch in archs}
            assert met == {(v[a], v[b]) for v in VARIANTS}, (arch, a, b)
    assert all(len(archs) == 1 for archs in archs_of.values())   # nothing is arch-dependent


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(arch, nvcc):
    cubins = [job.result() for job in nvcc_jobs(nvcc, [arch])]
    assert all(c[:4] == b"\x7fELF" for c in cubins)


@pytest.mark.nvcc
def test_cache_hit_needs_no_nvcc(nvcc, monkeypatch):
    from pitgen.bench.probe import PROBE   # a small real template (the variants compile in units)
    src, arch = PROBE.source({"piece": 256, "loads": 4}), "sm_90"
    first = nvcc.submit(compiler.compile_source, src, arch).result()  # compiled or cached

    def no_nvcc(*a, **k):
        raise AssertionError(f"nvcc ran on a cache hit: {a}")

    monkeypatch.setattr(subprocess, "run", no_nvcc)
    assert compiler.compile_source(src, arch) == first


def _compile_in_child(args):
    cache, src = args
    import os
    os.environ["PITGEN_CACHE"] = cache
    from pitgen import compiler as c
    return c.compile_source(src, "sm_90")


@pytest.mark.nvcc
def test_concurrent_compiles_of_one_kernel_agree(tmp_path):
    from pitgen.bench.probe import PROBE   # a small real template: the cache is what is tested
    src = PROBE.source({"piece": 256, "loads": 4})
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_compile_in_child, [(str(tmp_path), src)] * 2)
    assert a == b
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert not [p for p in tmp_path.iterdir() if ".cubin." in p.name]  # no temp files left


@pytest.mark.nvcc
def test_compile_error_is_a_pitgen_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PITGEN_CACHE", str(tmp_path))
    with pytest.raises(pitgen.CompileError, match="nvcc failed"):
        compiler.compile_source("this is not CUDA", "sm_90")


def test_opspec_renders_each_configuration_once(monkeypatch):
    """Operators ask their OpSpec for a module on every launch: a context seen before must come
    back without rendering, and contexts rendering to one source share one module. Module
    loading is faked (no GPU here); rendering is real."""
    from pitgen import cache, opspec, runtime
    from pitgen.graph.device import CONVERT

    renders, loads = [], []
    real_render = opspec.render_template

    def counting_render(name, **ctx):
        renders.append(name)
        return real_render(name, **ctx)

    class FakeModule:
        def __init__(self, cubin, signatures):
            loads.append(cubin)

    monkeypatch.setattr(opspec, "render_template", counting_render)
    monkeypatch.setattr(runtime, "Module", FakeModule)
    monkeypatch.setattr(runtime, "compile_source", lambda source, arch: source)
    monkeypatch.setattr(runtime, "device_arch", lambda: "sm_90")
    cache.clear()
    a = CONVERT.module({"dtype": "float32", "src_dtype": "float32"})
    b = CONVERT.module({"src_dtype": "float32", "dtype": "float32"})
    assert a is b and renders == ["convert.cu.j2"] and len(loads) == 1
    c = CONVERT.module({"dtype": "float16", "src_dtype": "float16"})
    assert c is not a and len(renders) == 2 and len(loads) == 2
    assert cache.inventory()["opspec.modules"] == 2 and cache.inventory()["runtime.modules"] == 2
    cache.clear()
    assert cache.inventory()["opspec.modules"] == 0