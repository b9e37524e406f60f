"""CPU checks of ``pitgen emit`` (no GPU): generated/ is exactly what ``pitgen emit --catalogue``
writes today; every emitted source compiles with nvcc alone (for sm_80 or sm_90: each arch
meets both dtypes and every kind; the Hopper kernels for sm_90a), the headers are C, and the
example links; sm_90a kernels run the wgmma kernel where TMA can map the operands; the run-time
variant choice never runs a variant that lowering would refuse for those operands; impossible
requests exit 1 (refused by the library) or 2 (bad options) before anything is written."""
from __future__ import annotations

import random
import shlex
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

import pitgen
from pitgen import emit
from pitgen.cli import main
from pitgen.compiler import find_nvcc
from pitgen.lower import DTYPES, GemmSpec, gemm_form, lower

GENERATED = Path(__file__).resolve().parents[1] / "generated"
EXPR = emit.CATALOGUE_EXPR
CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"
ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    try:
        return find_nvcc()
    except pitgen.CompileError:
        return None


NVCC = _nvcc()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("pit_*") if p.suffix in (".cu", ".h")}


# -- the catalogue ---------------------------------------------------------------------------------

def test_generated_is_the_catalogue(tmp_path):
    assert main(["emit", "--catalogue", str(tmp_path)]) == 0
    new, old = _files(tmp_path), _files(GENERATED)
    assert len(new) == 2 * len(emit.CATALOGUE)
    missing = sorted(new.keys() - old.keys())
    extra = sorted(old.keys() - new.keys())
    changed = sorted(n for n in new.keys() & old.keys() if new[n] != old[n])
    assert not (missing or extra or changed), (
        f"generated/ is not what `pitgen emit --catalogue generated` writes: missing {missing}, "
        f"not in the catalogue {extra}, changed {changed}")


def test_example_runs_every_catalogue_kernel():
    source = (GENERATED / "example" / "example.cu").read_text()
    for name in (p.stem for p in GENERATED.glob("pit_*.h")):
        assert f'#include "{name}.h"' in source and f"KERNEL({name})" in source, name


def test_list_shows_the_catalogue(capsys):
    assert main(["emit", "--list"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(p.stem for p in GENERATED.glob("pit_*.cu"))
    assert any("micro 32x1 along k" in ln for ln in lines) and any("micro 1x64 along m" in ln for ln in lines)
    assert any("block 64x64" in ln for ln in lines) and {"float16", "bfloat16"} <= set(out.split())
    n = len(emit.CATALOGUE)
    assert err.count(f"] {n}/{n}") == 1  # the progress bar ends once
    assert sum("(wgmma), sm_90a" in ln for ln in lines) == 2


# -- one kernel ------------------------------------------------------------------------------------

def test_emit_writes_a_pair_that_its_own_command_rewrites(tmp_path, monkeypatch):
    expr = "C[m,n] += A[k,m] * B[k,n]"
    first = tmp_path / "first"
    assert main(["emit", expr, "--sparse", "A", "--dtype", "bfloat16", "--micro-tile", "1x32",
                 "--tile", "64,128,32", "--arch", "sm_90", "--out", str(first)]) == 0
    name = "pit_matmul_at_a_bf16_k1x32_t64x128x32_sm90"
    assert sorted(_files(first)) == [f"{name}.cu", f"{name}.h"]
    header = (first / f"{name}.h").read_text()
    source = (first / f"{name}.cu").read_text()
    for fact in (f"expression:  {expr}", "micro-tile 1x32 of A along k", "SRead", "bfloat16",
                 "arch:        sm_90", f"pitgen {pitgen.__version__}", "tile:        32x128x32"):
        assert fact in header and fact in source, fact
    for api in ("_workspace_size(int64_t m, int64_t n, int64_t k, size_t* bytes)",
                "_build_index(const void* A, int64_t m, int64_t n, int64_t k, void* workspace, "
                "size_t workspace_bytes, cudaStream_t stream)",
                "_run(const void* A, const void* B, void* C, int64_t m,", "_build_and_run(",
                "_error_message(void)"):
        assert f"cudaError_t {name}{api}" in header or f"char* {name}{api}" in header, api
    assert str(tmp_path) not in header + source and "/" not in header.split("--out", 1)[1].split()[0]
    command = next(ln for ln in header.splitlines() if "pitgen emit" in ln).lstrip(" *")
    again = tmp_path / "again"
    again.mkdir()
    monkeypatch.chdir(again)
    assert main(shlex.split(command)[1:]) == 0
    assert _files(again) == _files(first)


@pytest.mark.parametrize("req", emit.CATALOGUE, ids=lambda r: f"{r.dtype}:{r.micro_tile}:{r.arch}")
def test_each_variant_launches_with_its_own_tile(req):
    """The host code sizes each variant's grid, block and shared memory by that variant's
    kernel: a narrow variant with a narrower BN than the wide one's, launched on the wide one's
    grid, left C's columns unwritten (the k32x1 and 64x64 narrow variants, caught by the
    example on an H100)."""
    e = emit.emit(req)
    src = e.files[f"{e.name}.cu"]
    for v in e.variants:
        g = v.spec.gemm
        body = src.split(f"cudaError_t compute_{v.tag}(", 1)[1].split("\n}\n", 1)[0]
        assert f"constexpr int BN = {g.bn}, THREADS = {g.threads}, SMEM = {g.smem_bytes(req.dtype)};" in body
        ns = f"{e.name}_{v.tag}_module"
        module = src.split(f"namespace {ns} {{", 1)[1].split(f"}}  // namespace {ns}", 1)[0]
        assert f"constexpr int BM = {g.bm}, BN = {g.bn}," in module


def test_sm90a_kernels_run_wgmma_where_tma_maps_the_operands():
    """--arch sm_90a: the wide variant is the JIT path's wgmma kernel (TMA: rows a multiple of
    16 bytes, 16-byte aligned bases; 16-byte stores of C), the narrow one mma.sync; the host
    code encodes the tensor maps, sizes the persistent grid by the SM count and hands the index
    pass the buffer its last CTA writes the m-tile order to."""
    e = emit.emit(emit.Request(EXPR, "A", "128x128", "bfloat16", arch="sm_90a"))
    wide, narrow = e.variants
    assert (wide.spec.gemm.mainloop, narrow.spec.gemm.mainloop) == ("wgmma", "mma_sync")
    assert {(n.kind, n.what, n.value) for n in wide.needs} == {
        ("multiple", "N", 8), ("multiple", "K", 8), ("aligned", "a", 16), ("aligned", "b", 16),
        ("aligned", "c", 16)}
    src = e.files[f"{e.name}.cu"]
    for fact in ("cudaGetDriverEntryPointByVersion(\"cuTensorMapEncodeTiled\"", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
                 "cudaDevAttrMultiProcessorCount", "reinterpret_cast<int*>(ws + w.order));",
                 "__CUDA_ARCH_FEAT_SM90_ALL", "arch=compute_90a,code=sm_90a"):
        assert fact in src, fact
    # micro-tiles gather rows, which TMA cannot: an sm_90a file of them keeps to mma.sync
    micro = emit.emit(emit.Request(EXPR, "A", "32x1", arch="sm_90a"))
    assert {v.spec.gemm.mainloop for v in micro.variants} == {"mma_sync"}


REFUSALS = {
    "micro-tile along a non-invariant axis": ([CONV, "--sparse", "W", "--micro-tile", "16x16x1x3"],
                                              "axis r of"),
    "tile off the mma shape": ([EXPR, "--sparse", "A", "--micro-tile", "32x1", "--tile", "32x64x24"], "mma"),
    "micro-tile off the mma shape": ([EXPR, "--sparse", "A", "--micro-tile", "48x1"], "mma"),
    "n-tile the warps cannot split": ([EXPR, "--sparse", "A", "--micro-tile", "32x1", "--tile", "32x24x32"],
                                      "warps"),
    "tile over the arch's shared memory": ([EXPR, "--sparse", "A", "--micro-tile", "128x1", "--tile",
                                            "128x256x128", "--arch", "sm_86"], "shared memory"),
    "non-GEMM expression": (["y[m] += A[m,k] * x[k]", "--sparse", "A", "--micro-tile", "32x1"],
                            "no GPU kernel"),
    "no micro-tile": ([EXPR, "--sparse", "A", "--micro-tile", "auto"], "needs the micro-tile"),
    "unknown operand": ([EXPR, "--sparse", "D", "--micro-tile", "32x1"], "operands: A, B"),
    "name of the C API": (["C[m,n] += A[m,k] * stream[k,n]", "--sparse", "A", "--micro-tile", "32x1"],
                          "clash"),
}


@pytest.mark.parametrize("args, why", REFUSALS.values(), ids=REFUSALS.keys())
def test_impossible_requests_exit_1_and_write_nothing(tmp_path, capsys, args, why):
    out = tmp_path / "out"
    assert main(["emit", *args, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("pitgen: error: ")
    assert why in captured.err
    assert not out.exists()


BAD_OPTIONS = {
    "unknown arch": (["--arch", "sm_12"], "argument --arch: invalid choice: 'sm_12'"),
    "unknown dtype": (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
}


@pytest.mark.parametrize("args, why", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_exit_2_and_write_nothing(tmp_path, capsys, args, why):
    out = tmp_path / "out"
    assert main(["emit", EXPR, "--sparse", "A", "--micro-tile", "32x1", *args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: pitgen emit ") and why in captured.err
    assert not out.exists()


def test_catalogue_takes_no_kernel_options(tmp_path, capsys):
    assert main(["emit", "--catalogue", str(tmp_path / "c"), "--dtype", "float16"]) == 2
    assert "take no expression or kernel options" in capsys.readouterr().err
    assert main(["emit", EXPR, "--sparse", "A"]) == 2
    assert "--micro-tile, --out" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# -- the run-time variant choice -------------------------------------------------------------------

CHOICES = [*emit.CATALOGUE,
           emit.Request("C[m,n] += A[m,k] * B[k,n]", "A", "1x256", dtype="float32"),
           emit.Request("C[m,n] += A[k,m] * B[k,n]", "A", "64x1"),
           emit.Request("C[m,n] += A[m,k] * B[n,k]", "A", "64x64", dtype="bfloat16"),
           emit.Request("C[m,n] += A[m,k] * B[k,n]", "B", "32x1"),
           emit.Request("Y[j,i] += W[l,j] * X[i,l]", "X", "1x16")]


def _lowered(req: emit.Request, spec, ext: dict[str, int], align: dict[str, int]) -> GemmSpec:
    """What lowering chooses for these operands; a row kernel is compared with lowering's choice
    for K past the micro-tile (moved by a multiple of 64: its factors of two stay), where the
    micro-tile keeps its extent, as in the emitted kernel. An sm_90a kernel's mma.sync variant is
    compared with what lowering chooses for mma.sync (a device without wgmma)."""
    op = pitgen.parse(req.expr)
    form = gemm_form(op, req.sparse)
    tk = spec.plan_shape[form.a_dims[1]]
    if spec.gemm.a_mode == "rows" and ext["K"] <= tk:
        ext = {**ext, "K": ext["K"] + 64 * (tk // 64 + 1)}
    lay = emit._row_major(op, form, ext, (align["a"], align["b"], align["c"]))
    return lower(op, req.sparse, spec.plan_kind, spec.plan_axis, spec.plan_shape, req.dtype, lay,
                 arch=emit.LOWERING_ARCH.get(req.arch, "sm_80") if spec.gemm.mainloop == "wgmma"
                 else "sm_80").gemm


def _runs_as(got: GemmSpec, ref: GemmSpec) -> bool:
    """Whether kernel ``got`` is correct where lowering chose ``ref``: no wider copies or stores.
    A shared-memory orientation only matters for copies wider than one element (lowering may
    pick the other one for an extent of 1, where both strides are 1). A row kernel's row block
    (lowering takes a shorter one for a short M) and the stages its accumulator leaves room for
    are free: the kernel and its index share them, and any gives the same sums; so are the BN
    of a kernel that copies B' one element at a time and the stages that BN leaves room for, and
    whether it first waits for the grid before it (a no-op outside a dependent launch)."""
    free = {"a_vec": 0, "b_vec": 0, "c_pair": False, "c_mfast": False, "c_vec": False,
            "early": False}
    if got.c_vec and not ref.c_vec:
        return False
    if got.mainloop == "wgmma":  # any n-tile and ring depth is right: TMA zero-fills the edges
        free.update(bn=0, stages=0)
    if got.a_mode == "rows":
        free.update(bm=0, stages=0)
    if got.a_vec == 1:
        free["a_smem_kcontig"] = False
    if got.b_vec == 1:   # scalar copies of B' take a narrower BN (lower.SCALAR_CHUNKS)
        free.update(b_smem_ncontig=False, bn=0, stages=0)
    return (got.a_vec <= ref.a_vec and got.b_vec <= ref.b_vec and (ref.c_pair or not got.c_pair)
            and replace(got, **free) == replace(ref, **free))


@pytest.mark.parametrize("req", CHOICES, ids=lambda r: f"{r.expr}:{r.sparse}:{r.dtype}:{r.micro_tile}")
def test_run_time_choice_only_runs_what_lowering_allows(req):
    e = emit.emit(req)
    size = DTYPES[req.dtype]
    rng = random.Random(req.micro_tile)
    picked = set()
    for _ in range(300):
        ext = {x: rng.choice((rng.randint(1, 130), 8 * rng.randint(1, 40), 64 * rng.randint(1, 9)))
               for x in "MNK"}
        align = {t: rng.choice([a for a in (2, 4, 8, 16, 256) if a >= size]) for t in "abc"}
        v = e.pick(ext, align)
        picked.add(v.tag)
        got, ref = v.spec.gemm, _lowered(req, v.spec, ext, align)
        assert _runs_as(got, ref), (ext, align, got, ref)
    assert picked == {v.tag for v in e.variants}  # every variant is reachable


# -- compiling (nvcc, no GPU) ----------------------------------------------------------------------

def _catalogue_archs() -> dict[Path, str]:
    """generated/*.cu: the sm_80 kernels (sorted: bf16 then f16, three kinds each) alternately
    for sm_80 and sm_90, so each arch meets both dtypes and every kind at half the nvcc time of
    both archs for all; the Hopper kernels for sm_90a."""
    portable = sorted(p for p in GENERATED.glob("pit_*.cu") if not p.stem.endswith("_sm90a"))
    return {**{src: ARCHS[i % 2] for i, src in enumerate(portable)},
            **{src: "sm_90a" for src in sorted(GENERATED.glob("pit_*_sm90a.cu"))}}


def nvcc_jobs(pool) -> list[Future]:
    """generated/*.cu, each compiled alone into an object (submitted at collection by conftest)."""
    return [pool.submit(emit.compile_objects, (src,), (arch,), pool.tmp, 1)
            for src, arch in _catalogue_archs().items()]


@pytest.fixture(scope="module")
def objects(nvcc) -> list[Path]:
    return [obj for job in nvcc_jobs(nvcc) for obj in job.result()]


@pytest.mark.nvcc
def test_catalogue_compiles_for_sm80_and_sm90(objects):
    assert len(objects) == len(emit.CATALOGUE)
    archs = _catalogue_archs()
    assert sorted(a for a in archs.values() if a == "sm_90a") == ["sm_90a"] * 2
    for part in (3, 4):   # pit_matmul_a_<dtype>_<kind>_sm80.cu: each arch meets every one
        every = {src.name.split("_")[part] for src, a in archs.items() if a in ARCHS}
        for arch in ARCHS:
            assert {src.name.split("_")[part] for src, a in archs.items() if a == arch} == every
    cuobjdump = shutil.which("cuobjdump")
    for obj, arch in zip(objects, archs.values()) if cuobjdump else ():  # the arch's device code
        listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True,
                                 check=True).stdout
        assert arch in listing, listing


@pytest.mark.nvcc
def test_example_and_c_headers_build(objects, tmp_path):
    with ThreadPoolExecutor(2) as pool:
        link = pool.submit(subprocess.run, [
            NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DPITGEN_EXAMPLE_SM90A",
            "-I", str(GENERATED), "-o", str(tmp_path / "example"),
            str(GENERATED / "example" / "example.cu"), *map(str, objects)], capture_output=True, text=True)
        c_file = tmp_path / "headers.c"
        c_file.write_text("".join(f'#include "{p.name}"\n' for p in sorted(GENERATED.glob("pit_*.h")))
                          + "int main(void) { return 0; }\n")
        as_c = pool.submit(subprocess.run, [
            NVCC, "-x", "c", "-Xcompiler", "-std=c99,-Wall,-Werror", "-I", str(GENERATED), "-c",
            str(c_file), "-o", str(tmp_path / "headers.o")], capture_output=True, text=True)
        link, as_c = link.result(), as_c.result()
    assert link.returncode == 0, link.stderr[-3000:]
    assert (tmp_path / "example").stat().st_size > 0
    assert as_c.returncode == 0, as_c.stderr[-3000:]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("arch, flag, kernels", [
    ("sm_90", "-arch=sm_90", len(emit.CATALOGUE) - 2),           # the portable kernels
    ("sm_90a", "-gencode arch=compute_90a,code=sm_90a", len(emit.CATALOGUE))])  # and Hopper's
def test_example_makefile_builds_with_nvcc_alone(tmp_path, arch, flag, kernels):
    make = subprocess.run(["make", "-n", "-C", str(GENERATED / "example"), f"BUILD={tmp_path}", f"ARCH={arch}",
                           "NVCC=nvcc"],
                          capture_output=True, text=True, check=False)
    assert make.returncode == 0, make.stderr
    lines = [ln for ln in make.stdout.splitlines() if ln.startswith("nvcc ")]
    assert len(lines) == kernels + 1 and all(f"{flag} " in ln for ln in lines)
    assert ("-DPITGEN_EXAMPLE_SM90A" in lines[-1]) == (arch == "sm_90a")
