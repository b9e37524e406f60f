"""scripts/ncu_summary.py on a small export in the form of ncu's source page (CSV)."""
import gzip
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NS = runpy.run_path(str(ROOT / "scripts" / "ncu_summary.py"))

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared",'
          '"L1 Wavefronts Shared Excessive","L2 Theoretical Sectors Global Excessive",'
          '"stall_long_sb","stall_short_sb","stall_barrier","stall_long_sb (Not Issued)"')
ROWS = [
    ('0x7f0000000100', 'HGMMA.64x64x16.F32 R24, gdesc[UR8].tnspB, R24', 30, 1000, 0, 0, 5, 0, 0, 9),
    ('0x7f0000000110', '@!P5 LDGSTS.E.BYPASS.128 desc[UR14][R24.64], [R43]', 10, 3000, 2500, 800,
     10, 0, 0, 0),
    ('0x7f0000000120', 'LDGSTS.E.BYPASS.128 desc[UR14][R26.64], [R39]', 0, 1000, 500, 200, 0, 0, 0, 0),
    ('0x7f0000000130', '@P0 BRA 0x7f0000000100', 60, 0, 0, 0, 0, 10, 50, 0),
]


def export(rows=ROWS, kernels=("pit_gemm_sm90", "pit_build_index")):
    text = []
    for name in kernels:
        text.append(f'"Kernel Name","{name}",')
        text.append(HEADER)
        text += [",".join(f'"{v:,}"' if isinstance(v, int) else f'"{v}"' for v in row) for row in rows]
    return "\n".join(text) + "\n"


def test_parse_reads_every_kernel_and_its_counters():
    kernels = NS["parse"](export())
    assert [k.name for k in kernels] == ["pit_gemm_sm90", "pit_build_index"]
    lines = kernels[0].lines
    assert len(lines) == 4
    assert [ln.opcode for ln in lines] == ["HGMMA", "LDGSTS", "LDGSTS", "BRA"]
    assert lines[1].mnemonic == "LDGSTS.E.BYPASS.128"   # the predicate dropped
    assert lines[1].get("L1 Wavefronts Shared Excessive") == 2500   # "2,500" read as a number
    assert lines[3].address == 0x7f0000000130
    assert lines[1].marks("LDGSTS") and not lines[1].marks("LDG") and not lines[1].marks("STS")


def test_summary_totals_per_opcode_top_lines_and_windows():
    report = NS["summary"](NS["parse"](export())[0], top=3, window=2)
    assert "100 stall samples, 5,000 shared wavefronts (3,000 excess), 1,000 L2 sectors" in report
    ldgsts = next(ln for ln in report.splitlines() if ln.startswith("LDGSTS"))
    assert ldgsts.split() == ["LDGSTS", "10.0%", "4,000", "3,000", "1,000"]
    top = [ln for ln in report.splitlines() if "@P0 BRA" in ln]
    assert len(top) == 1 and " 60.0% " in top[0]
    assert top[0].endswith("barrier 50, short_sb 10")   # its two largest stall reasons
    assert "(Not Issued)" not in report and "long_sb 9" not in report
    windows = report.split("landmark opcodes\n")[1].splitlines()
    assert windows[0].split()[2:] == ["40.0%", "HGMMA", "LDGSTS"]
    assert windows[1].split()[2] == "60.0%"


def test_main_reads_gzip_and_refuses_a_file_without_kernels(tmp_path, capsys):
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(export(kernels=("k",)))
    assert NS["main"]([str(path), "--top", "2"]) == 0
    assert capsys.readouterr().out.startswith("== k: 4 instructions")
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing profiled\n")
    assert NS["main"]([str(empty)]) == 1
    assert "no kernel" in capsys.readouterr().out
