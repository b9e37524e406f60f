"""Tests of the benchmark harness (pitgen.bench): tables, CSV, JSON, geometric means, floors,
the peer suite's derived columns and targets, the graph benchmark's planning and report, the
command line and its refusal without a GPU (CPU); the timer and the ceilings (GPU)."""
from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from pitgen.bench import (Ceilings, Progress, fmt, fmt_e, fmt_x, geomean, main, md_table, plot,
                          ratio, write_csv, write_json)
from pitgen.bench import conv, graphs, matmul, peers, rgcn, suite

ROOT = Path(__file__).resolve().parents[1]


# -- the matmul benchmark's floor ---------------------------------------------------------------

def test_matmul_traffic_by_granularity():
    """HBM and gathered bytes of A (4096 x 4096) @ B (4096 x 1024), fp16, by unit shape."""
    m = k = 4096
    n, e = 1024, 2
    whole = (m * k + k * n + m * n) * e
    # 32 x 1 micro-tiles: each non-zero one pulls one B row of N through L2
    assert matmul.traffic(1000, 900, (32, 1), m, k, n, e) == (
        1000 * 32 * e + 900 * n * e + m * n * e, 1000 * n * e)
    # dense in 32 x 64 blocks: every block row re-reads all of B
    blocks = (m // 32) * (k // 64)
    assert matmul.traffic(blocks, k // 64, (32, 64), m, k, n, e) == (whole, (m // 32) * k * n * e)
    # rows (1 x 64): shared between rows, each active k-tile of B gathered once, never past B
    assert matmul.traffic(5000, 10, (1, 64), m, k, n, e)[1] == 10 * 64 * n * e
    assert matmul.traffic(m * k // 64, k // 64, (1, 64), m, k, n, e) == (whole, k * n * e)
    # units larger than A are clipped to it; nothing non-zero: B and A untouched, C written
    assert matmul.traffic(1, 1, (8192, 8192), 100, 50, 10, e) == ((100 * 50 + 50 * 10 + 1000) * e,
                                                                   50 * 10 * e)
    assert matmul.traffic(0, 0, (32, 1), m, k, n, e) == (m * n * e, 0)



def test_matmul_floor_judges_the_chosen_plan():
    """A dense choice is judged against dense cuBLAS; a micro-tile choice against its own
    units (here 64x1 units over a 32x1 mask: twice the rows per unit, half the units' B rows)."""
    mask = np.zeros((256, 128), dtype=bool)
    mask[:32, 5] = True                        # one 32x1 unit
    mask[64:96, 7] = True                      # another, in the same 64-row stripe as none
    assert matmul.floor(mask, 64, 2, "dense", (64, 32), 0.2, 1e9, 1e9) == {"tensor": 0.2}
    f32 = matmul.floor(mask, 64, 2, "micro", (32, 1), 1.0, 1e6, 1e6)
    f64 = matmul.floor(mask, 64, 2, "micro", (64, 1), 1.0, 1e6, 1e6)
    assert f32["tensor"] == pytest.approx(2 / (8 * 128)) and f64["tensor"] == pytest.approx(
        2 / (4 * 128))
    assert f32["gather"] == f64["gather"] == pytest.approx(2 * 64 * 2 / 1e6)
    assert f32["hbm"] == pytest.approx((2 * 32 * 2 + 2 * 64 * 2 + 256 * 64 * 2) / 1e6)


def nvcc_jobs(pool):
    """The gather probe (pitgen/bench/probe.py) for sm_80 and sm_90a, at a slab width each."""
    from pitgen import compiler
    from pitgen.bench.probe import LOADS, PROBE
    return [pool.submit(compiler.compile_source, PROBE.source({"piece": piece, "loads": LOADS}),
                        arch) for piece, arch in ((256, "sm_80"), (128, "sm_90a"))]


@pytest.mark.nvcc
def test_gather_probe_compiles(nvcc):
    assert all(len(job.result()) > 1000 for job in nvcc_jobs(nvcc))

# -- report ------------------------------------------------------------------------------------

def test_number_formats():
    assert fmt(None) == "-" and fmt(float("nan")) == "NaN" and fmt("csr") == "csr"
    assert fmt(1.23456) == "1.235" and fmt(0.5, 1) == "0.5" and fmt(0.0) == "0.000"
    assert fmt(2e-5, 4) == "2.0e-05"  # would print 0.0000
    assert fmt_x(1.234) == "1.23x" and fmt_x(None) == "-"
    assert fmt_e(3.21e-4) == "3.2e-04" and fmt_e(None) == "-"


def test_ratio_and_geomean():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
    assert geomean([1.0, 4.0, None]) == pytest.approx(2.0)
    assert geomean([2.0, 0.0, -1.0, math.inf, math.nan]) == pytest.approx(2.0)
    assert geomean([]) is None and geomean([None, 0.0]) is None


def test_md_table_escapes_cells():
    lines = md_table(["a", "b"], [[1, "x|y"], ["two\nlines", None]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | x\\|y |", "| two lines | None |"]


def test_csv_lead_columns_first(tmp_path):
    path = tmp_path / "r.csv"
    write_csv([{"z": 1, "system": "dense", "a": 2}, {"system": "stk", "note": "n"}], path,
              lead=("system", "missing", "z"))
    head, first, second = path.read_text().splitlines()
    assert head == "system,z,a,note" and first == "dense,1,2," and second == "stk,,,n"


def test_json_writes_what_json_cannot_hold_as_text(tmp_path):
    write_json(tmp_path / "r.json", {"out": tmp_path, "x": 1.5})
    assert json.loads((tmp_path / "r.json").read_text()) == {"out": str(tmp_path), "x": 1.5}


def test_progress_goes_to_stderr(capsys):
    p = Progress(2, width=4)
    p.step("first")
    p.step("second")
    out, err = capsys.readouterr()
    assert out == "" and "[....] 1/2 first" in err and "[##..] 2/2 second" in err


def test_plot_without_matplotlib_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    note = plot(tmp_path / "p.png", lambda plt: pytest.fail("drawn without matplotlib"))
    assert "p.png not drawn: matplotlib is not installed" in note
    assert not (tmp_path / "p.png").exists()


def test_plot_saves_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot(tmp_path / "p.png", lambda plt: plt.subplots()[0]) is None
    assert (tmp_path / "p.png").stat().st_size > 0


# -- floors ------------------------------------------------------------------------------------

def test_ceilings_turn_bytes_into_floors():
    c = Ceilings(copy_bytes_per_ms=3e9, matmul_tflops={"float16": 700.04})
    assert c.copy_ms(6e9) == pytest.approx(2.0)
    assert c.to_json() == {"copy_gb_s": 3000.0, "matmul_tflops": {"float16": 700.0}}


def test_floor_bytes_of_the_graph_kernels():
    # SpMM, 3 rows, 4 cols, 5 nnz, F=2, fp16: indptr 16 + indices 20 + values 10 + X 16 + Y 12
    assert graphs.floor_bytes("spmm", 3, 4, 5, 2, 2) == 16 + 20 + 10 + 16 + 12
    assert graphs.floor_bytes("sddmm", 3, 4, 5, 2, 2) == 16 + 20 + 2 * 7 * 2 + 10


def test_training_step_bytes():
    from pitgen.bench.training import step_bytes

    assert step_bytes(2, 3, 4, False) == 2 * (3 * 6 + 3 * 12 + 3 * 8)
    assert step_bytes(2, 3, 4, True) == step_bytes(2, 3, 4, False) + 3 * 12


def test_moe_routing_is_seeded_and_skewed():
    from pitgen.bench.moe import routing

    ids = routing(4096, 64, 0)
    assert ids.shape == (4096, 1) and ids.min() >= 0 and ids.max() < 64
    assert (ids == routing(4096, 64, 0)).all()
    counts = sorted(((ids == e).sum() for e in range(64)), reverse=True)
    assert counts[0] > 10 * counts[31]  # Zipf-like: the busiest expert dwarfs the median one
    two = routing(4096, 64, 0, topk=2)
    assert two.shape == (4096, 2) and (two[:, 0] != two[:, 1]).all()  # distinct experts
    counts = sorted(((two == e).sum() for e in range(64)), reverse=True)
    assert counts[0] > 5 * counts[31]


def test_moe_loop_peer_matches_the_reference_for_top2():
    """The peer every row is checked against computes the layer (top-2: pairs to tokens)."""
    torch = pytest.importorskip("torch")
    from pitgen.bench.moe import loop_peer, routing
    from pitgen.reference import moe_reference

    rng = np.random.default_rng(1)
    T, H, F, E = 40, 8, 16, 5
    x, w1, w2 = rng.standard_normal((T, H)), rng.standard_normal((E, H, F)), rng.standard_normal((E, F, H))
    b1, b2, gates = rng.standard_normal((E, F)), rng.standard_normal((E, H)), rng.random((T, 2))
    ids = routing(T, E, 3, topk=2)
    t = torch.from_numpy
    got = loop_peer(t(x), t(ids), t(gates), t(w1), t(w2), t(b1), t(b2)).numpy()
    want = moe_reference(x, ids, gates, w1, w2, b1, b2, activation="gelu")
    assert np.abs(got - want).max() < 1e-9 * np.abs(want).max()


# -- graph benchmark: planning and report ------------------------------------------------------

def test_graph_cases_and_budgets():
    full = graphs.cases(False)
    assert len(full) == 6 * 5 + 3 and full[0] == ("citeseer", 32) and full[-1] == ("reddit", 128)
    assert graphs.cases(True) == [(g, f) for g in graphs.QUICK_GRAPHS for f in graphs.QUICK_FEATS]
    assert graphs.case_budget(10, None) == 0.25 and graphs.case_budget(10**8, None) == 0.75
    assert graphs.case_budget(10, 3.0) == 3.0


def test_graph_warm_sources_render():
    from pitgen.graph.tune import FORMATS
    from pitgen.render import render_template

    jobs = graphs.warm_sources()
    assert {t for t, _ in jobs} == {"spmm.cu.j2", "graph_sddmm.cu.j2"}
    assert {c["fmt"] for _, c in jobs} == set(FORMATS)
    assert all("pit_" in render_template(t, **c) for t, c in jobs[:: max(1, len(jobs) // 8)])


def test_graph_report(tmp_path):
    row = {"graph": "cora", "nodes": 2708, "nnz": 10556, "op": "spmm", "dtype": "float16",
           "feat": 64, "flop": 1, "floor_ms": 0.001, "choice": "hyb", "params": {"c": 1, "k": 3},
           "schedule": {"groups": [8] * 7, "vec": 8, "threads": 256}, "tune_s": 0.5,
           "trials": 4, "convert_ms": 1.0, "pitgen_ms": 0.01, "csr_ms": 0.1, "peer_ms": 0.02,
           "rel_err": 3e-4, "csr_rel_err": 3e-4, "ok": True, "speedup": 2.0, "csr_speedup": 0.2,
           "pitgen_wall_ms": 0.02, "peer_wall_ms": 0.03, "wall_speedup": 1.5,
           "auto_choice": "csr", "auto_params": {}, "auto_source": "model", "plan_ms": 2.5,
           "auto_schedule": {"group": 8, "vec": 8, "threads": 256, "unroll": 8},
           "auto_ms": 0.04, "auto_wall_ms": 0.05, "auto_speedup": 0.5, "auto_rel_err": 3e-4}
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "13.0", "date": "now",
            "copy_gb_s": 2976.0, "repeats": 10, "elapsed_s": 100.0}
    graphs.write(tmp_path, [row, {**row, "feat": 128, "speedup": 0.5, "ok": False}], meta,
                 ["reddit spmm float16 F=128"], ["a note"])
    md = (tmp_path / "graphs.md").read_text()
    # auto (model) vs peer 0.50x, model / tuned 0.25x, max plan ms, then tuned vs peer
    assert "NVIDIA H100 80GB HBM3" in md and \
        "| spmm | float16 | 2 | 0.50x | 0.25x | 2.5 | 1.00x | 1.50x |" in md
    assert "| 0.0400 | 0.50x | csr() g8 v8 t256 u8 | 2.5 |" in md
    assert "| 0.0200 (0.0300) |" in md and "| 0.0100 (0.0200) |" in md
    assert "**missed**" in md and "MISMATCH" in md and "hyb(c=1,k=3) g8 v8 t256" in md
    assert "skipped (time budget --budget): reddit spmm float16 F=128" in md
    doc = json.loads((tmp_path / "graphs.json").read_text())
    assert doc["summary"][0]["all_correct"] is False and len(doc["rows"]) == 2


def test_rgcn_report(tmp_path):
    timing = {"gpu_ms": 0.1, "wall_ms": 0.2, "rel_err": 1e-3}
    row = {"graph": "aifb", "nodes": 8285, "edges": 57880, "relations": 90, "dtype": "float16",
           "feat": 32, "choice": "transform-first", "exact_choice": "transform-first",
           "compact": {"transform-first": 10, "aggregate-first": 12}, "flop": 1,
           "model_ms": {"transform-first": 0.25, "aggregate-first": 0.125},
           "pitgen": {"auto": timing, "transform-first": timing, "aggregate-first": timing},
           "peers": {"torch loop": {"gpu_ms": 0.5, "wall_ms": 2.0, "rel_err": 1e-3},
                     "torch typed": {"note": "not run: fp32 refused"}},
           "best_peer_ms": 0.5, "ok": True, "speedup": 5.0, "wall_speedup": 10.0}
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "13.0", "date": "now",
            "repeats": 10, "elapsed_s": 1.0}
    rgcn.write(tmp_path, [row, {**row, "graph": "am", "speedup": 0.8, "ok": False}], meta)
    md = (tmp_path / "rgcn.md").read_text()
    assert "| float16 | 2 | 2.00x | 10.00x | >= 2.0x | **met** | NO |" in md
    assert "not run: fp32 refused" in md and "**WRONG**" in md and "| 0.250 / 0.125 |" in md
    assert "rgcn" in suite.PARTS and rgcn.flop(10, 4, 2, 3) == 2 * 4 * 2 * 3 + 2 * 10 * 2


def test_conv_report(tmp_path):
    def row(shape, sparsity, ratio, auto_ratio, ok=True):
        t = {"gpu_ms": 0.1, "wall_ms": 0.2, "rel_err": 1e-3}
        return {"shape": shape, "x": [32, 256, 56, 56], "weight": [64, 256, 3, 3],
                "padding": 1, "sparsity": sparsity, "dtype": "float16", "density": 1 - sparsity,
                "cudnn": {"nchw": t, "channels_last": t}, "cudnn_best": "channels_last",
                "cudnn_ms": 0.1, "pitgen": {"nchw": t, "channels_last": t}, "pitgen_best": "nchw",
                "pitgen_ms": 0.1 * ratio, "index_ms": {"nchw": 0.02, "channels_last": 0.03},
                "compute_ms": 0.1 * ratio - 0.02, "ratio": ratio, "auto_ratio": auto_ratio,
                "wall_ratio": 1.0, "floor_flops_ms": 0.01, "floor_bytes_ms": 0.02,
                "floor_ms": 0.02, "auto": {**t, "path": "dense"}, "ok": ok}
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13", "cuda": "13.0", "date": "now",
            "repeats": 10, "elapsed_s": 1.0}
    rows = [row("56x56 3x3", 0.9, 0.3, 1.2), row("56x56 3x3", 0.0, 1.5, 1.02),
            row("14x14 1x1", 0.9, 0.5, 1.0, ok=False), row("14x14 1x1", 0.0, 1.5, 1.1)]
    conv.write(tmp_path, rows, meta)
    md = (tmp_path / "conv.md").read_text()
    assert "| pitgen / cuDNN, 56x56 3x3 at 90% | 0.30x | <= 0.35x | **met** |" in md
    assert "| auto / cuDNN at 0%, geomean of shapes | 1.06x | <= 1.05x | **missed** |" in md
    assert "| every result correct | NO |" in md and "**WRONG**" in md
    assert "| 56x56 3x3 | 90% | 10% | 0.0300 (0.200) nchw | 0.0200 |" in md
    doc = json.loads((tmp_path / "conv.json").read_text())
    assert doc["summary"]["met_90"] is True and len(doc["rows"]) == 4
    assert abs(doc["summary"]["ratio_90_geomean"] - (0.3 * 0.5) ** 0.5) < 1e-12
    assert "conv" in suite.PARTS


# -- peer suite: derived columns, targets, files -----------------------------------------------

def _micro_cell(sparsity: float = 90.0, auto_ms: float = 0.02) -> list[dict]:
    base = {"workload": "micro", "size": 4096, "granularity": "32x1", "sparsity": sparsity,
            "density": 0.1, "dtype": "float16", "rel_err": 1e-4}
    times = {"dense": {"compute_ms": 0.2}, "cusparse": {"conv_ms": 0.5, "compute_ms": 0.5},
             "bsr": {"conv_ms": 0.03, "compute_ms": 0.05},
             "stk": {"conv_ms": 0.1, "compute_ms": 0.1},
             "pitgen-auto": {"conv_ms": 0.005, "compute_ms": 0.01, "call_ms": auto_ms},
             "pitgen-tile": {"conv_ms": 0.005, "compute_ms": 0.02, "call_ms": 0.03}}
    return [{**base, "system": s, "status": "ok", **t} for s, t in times.items()]


def test_derive_totals_speedups_and_best_peer():
    rows = _micro_cell()
    peers.derive({"micro": rows})
    by = {r["system"]: r for r in rows}
    assert by["cusparse"]["total_ms"] == pytest.approx(1.0)  # conversion + compute
    assert by["pitgen-auto"]["total_ms"] == 0.02  # pitgen: its whole call
    assert by["pitgen-auto"]["vs_base"] == pytest.approx(10.0)
    assert by["pitgen-auto"]["best_peer"] == "bsr"
    assert by["pitgen-auto"]["vs_peer"] == pytest.approx(0.08 / 0.02)
    assert by["pitgen-auto"]["ideal_ms"] == pytest.approx(0.02)  # density x dense


def test_targets_judge_every_cell():
    rows = _micro_cell() + _micro_cell(sparsity=99.0, auto_ms=0.05)
    peers.derive({"micro": rows})
    t = {x["target"].split(" (")[0]: x for x in peers.micro_targets(rows)}
    three = t["3x faster than the fastest sparse peer"]
    assert [c["met"] for c in three["cells"]["auto"]] == [True, False]
    assert three["verdicts"]["auto"] == "NOT reached (1 of 2 cells miss)"
    ten = t["10x faster than cuSPARSE"]
    assert ten["verdicts"]["auto"] == "reached (all 2 cells)"


def test_wrong_rows_are_never_a_peer():
    rows = _micro_cell()
    rows[3]["status"] = "wrong"  # stk
    rows[2]["status"] = "wrong"  # bsr
    peers.derive({"micro": rows})
    assert {r["system"]: r for r in rows}["pitgen-auto"]["best_peer"] == "cusparse"


def test_replot_writes_every_file_without_a_gpu(tmp_path):
    doc = {"meta": {"device": "test GPU", "mode": "quick"}, "params": {"repeats": 10},
           "notes": ["a note"], "results": {"micro": _micro_cell() + _micro_cell(99.0)}}
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    assert main(["peers", "--replot", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "## Targets" in summary and "- a note" in summary and "test GPU" in summary
    assert "| 4096 | 32x1 | 90% | 0.2000 | torch BSR (Triton) 0.0800 |" in summary
    assert "| 32x1 | 99% | pitgen auto |" in (tmp_path / "micro.md").read_text()
    assert (tmp_path / "micro.csv").read_text().startswith("workload,size,granularity,sparsity")


# -- command line ------------------------------------------------------------------------------

def test_arguments_and_defaults():
    args = suite.parser().parse_args([])
    assert args.parts == [] and not args.quick and args.out == "pitgen-bench"
    args = suite.parser().parse_args(["graphs", "peers", "--quick", "--workloads", "moe,micro",
                                      "--sparsity", "0,90", "--granularity", "32x1"])
    assert args.parts == ["graphs", "peers"] and args.quick
    assert args.workloads == ["micro", "moe"]  # run order, not the order given
    assert args.sparsity == ["0", "90"] and args.granularity == ["32x1"]


@pytest.mark.parametrize("argv, match", [
    (["bogus"], "unknown part(s) bogus"),
    (["peers", "--workloads", "micro,nope"], "unknown workload(s) ['nope']"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--budget", "-1"], "--budget must be positive"),
    (["matmul", "--granularity", "32y1"], "expected ROWSxCOLS"),
    (["moe", "--experts", "many"], "--experts: numbers"),
])
def test_bad_arguments_exit_2(capsys, argv, match):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "matmul" in capsys.readouterr().out


def test_refuses_without_torch(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    assert main(["attention"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("pitgen: error: pitgen bench needs a CUDA GPU: torch is not installed")
    assert "Traceback" not in err and out == ""


def test_refuses_without_a_cuda_device(capsys, monkeypatch):
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert main(["--quick"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_no_sys_path_edits_in_scripts_or_tests():
    edit = "sys." + "path"
    offenders = [str(p.relative_to(ROOT)) for folder in ("scripts", "tests")
                 for p in (ROOT / folder).glob("*.py") if edit in p.read_text()]
    assert offenders == []


# -- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_timer_times_a_small_op(monkeypatch):
    import statistics

    import torch

    from pitgen.bench import Timer, timing

    timer = Timer(repeats=5)
    a = torch.randn(1024, 1024, device="cuda")
    ms = timer(lambda: a @ a)
    assert 0 < ms < 100
    rounds = []   # (calls, ms per call) of each host_ms round that both() asked for

    def recorded(fn, calls, **kw):
        rounds.append((calls, host_ms(fn, calls, **kw)))
        return rounds[-1][1]

    host_ms = timing.host_ms
    monkeypatch.setattr(timing, "host_ms", recorded)
    t = timer.both(lambda: a @ a, calls=5)
    assert t.gpu_ms > 0 and t.wall_ms > 0
    # five calls take far less than WALL_MIN_MS: the wall time is the median of WALL_ROUNDS
    # longer rounds, sized by the five calls' pace (whatever a lent host's noise made it)
    (five, pace), *longer = rounds
    assert five == 5 and 5 * pace < timing.WALL_MIN_MS
    want = min(timing.MAX_WALL_CALLS, max(5, math.ceil(timing.WALL_MIN_MS / max(pace, 1e-4))))
    assert [c for c, _ in longer] == [want] * timing.WALL_ROUNDS
    assert t.wall_ms == statistics.median(w for _, w in longer)
    seen = []
    timer(lambda x: seen.append(x), inputs=[(1,), (2,), (3,)], repeats=4, warmup=0)
    assert seen == [1, 2, 3, 1]  # rotation among the input sets


@pytest.mark.gpu
def test_ceilings_are_plausible():
    from pitgen.bench import Timer, measure_ceilings

    c = measure_ceilings(Timer(repeats=3), copy_mib=256, matmul_n=4096)
    assert 1e8 < c.copy_bytes_per_ms < 2e10  # 100 GB/s .. 20 TB/s, reads + writes
    assert all(1 < v < 10_000 for v in c.matmul_tflops.values())


@pytest.mark.gpu
def test_read_probe_streams_an_operand_no_faster_than_a_copy_moves_bytes():
    """``read_ms``, the index pass's floor in ``pitgen bench matmul``: one read of A, at most
    the copy's bytes per ms (a copy reads and writes), and refused for rows it cannot read."""
    import torch

    from pitgen.bench import Timer, measure_ceilings
    from pitgen.bench.probe import read_ms

    timer = Timer(repeats=3)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    ms = read_ms(timer, a)
    copy = measure_ceilings(timer, copy_mib=64, matmul_n=256).copy_bytes_per_ms
    assert 0 < ms and 1e8 < a.nbytes / ms < 1.5 * copy
    with pytest.raises(ValueError, match="contiguous"):
        read_ms(timer, a[:, :100])


@pytest.mark.gpu
def test_gather_probe_rate_is_plausible_and_refuses_rows_it_cannot_read():
    """``gather_rate``, the gather floor of ``pitgen bench matmul``: a rate between 0.1 and 50
    TB/s for B's rows in 256-byte slabs, and a clear refusal of pieces or rows it cannot read."""
    import torch

    from pitgen.bench import Timer
    from pitgen.bench.probe import gather_rate

    timer = Timer(repeats=3)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    assert 1e8 < gather_rate(timer, b, 8 * 4096) < 5e10
    with pytest.raises(ValueError, match="multiple of 16"):
        gather_rate(timer, b, 1024, piece=24)
    with pytest.raises(ValueError, match="aligned rows"):
        gather_rate(timer, b[:, 1:], 1024)


def test_dynamic_report_judges_gpu_time_and_names_refusals(tmp_path):
    """pitgen bench dynamic's tables: the speed-up summary against the target, both pitgen
    variants and the peers per case, conversions with their refusals and ratios."""
    from pitgen.bench import dynamic

    t = lambda g, w: {"gpu_ms": g, "wall_ms": w}   # noqa: E731
    dyn = {"graph": "cora", "dtype": "float32", "rows": 2708, "edges": 8376, "err": 6e-8,
           "ok": True, "best_peer_ms": 0.13, "speedup": 2.6, "wall_speedup": 0.5,
           "csr_speedup": 2.5, "csr_wall_speedup": 0.4, "sorted_speedup": 1.4,
           "systems": {"pitgen": {**t(0.05, 0.4), "choice": ["hyb", {"c": 1, "k": 3}, {}]},
                       "pitgen CSR": {**t(0.052, 0.5), "choice": ["hyb", {"c": 1, "k": 3}, {}]},
                       "pitgen sorted": {**t(0.09, 0.45), "choice": ["hyb", {"c": 1}, {}]},
                       "torch coo.to_sparse_csr": t(0.25, 0.25),
                       "torch sort + csr": t(0.13, 0.2)}}
    conv = {"graph": "cora", "dtype": "float32", "rows": 2708, "nnz": 10556,
            "hyb": {"c": 1, "k": 3}, "convert": {"hyb": t(0.2, 0.25), "hyb no sync": t(0.02, 0.15),
                                                 "ell": {"note": "not run: 6.9 GiB"},
                                                 "bsr": t(0.1, 0.2)},
            "hyb_kernel_ms": 0.025, "spmm": t(0.0125, 0.03), "hyb_ratio": 16.0,
            "hyb_nosync_ratio": 1.6, "hyb_kernel_ratio": 2.0, "hyb_wall_ratio": 8.3}
    meta = {"device": "NVIDIA H200", "torch": "2.11", "cuda": "13.0", "date": "now",
            "repeats": 20}
    dynamic.write(tmp_path, [conv], [dyn], meta)
    md = (tmp_path / "dynamic.md").read_text()
    assert "| float32 | 1 | 2.60x | 0.50x | >= 1.3x | **met** | yes |" in md
    assert "| 2.60x | 0.50x | 2.50x (0.40x) | 1.40x | hyb {'c': 1, 'k': 3} | 6.0e-08 |" in md
    assert "not run: 6.9 GiB" in md and "| 16.00x | 1.60x | 2.00x | 8.30x |" in md
    assert "float32: hyb / SpMM geomean 16.00x, no sync 1.60x, kernels only 2.00x" in md
    doc = json.loads((tmp_path / "dynamic.json").read_text())
    assert doc["summary"][0]["met"] is True and doc["hyb_nosync_ratio_geomean"]["float32"] == 1.6


def test_attention_layout_rows_follow_their_masks():
    """The attention benchmark's block_mask rows come right after the mask they stand for and
    give pitgen exactly that mask's blocks; a mask not made of whole blocks has no layout."""
    from pitgen import reference as R
    from pitgen.bench import attention

    mask_set = attention.masks(np.random.default_rng(0))
    rows = attention.cases(list(mask_set))
    for name, (source, block) in attention.LAYOUTS.items():
        assert rows.index((name, attention.D)) == rows.index((source, attention.D)) + 1
        layout = attention.layout_of(mask_set[source], block)
        assert layout.shape == (attention.S // block, attention.S // block)
        np.testing.assert_array_equal(
            R.block_layout_mask(layout, block, attention.S, attention.S), mask_set[source])
    with pytest.raises(ValueError, match="whole 128 x 128 blocks"):
        attention.layout_of(mask_set[attention.BIGBIRD], 128)


def test_moe_training_table_has_every_row_and_its_floor():
    from pitgen.bench.moe import training_table
    base = dict(E=8, topk=2, floor_ms=0.5)
    rows = [dict(base, impl="pitgen moe_ffn (check=False)", dtype="float16", ms=1.0, host_ms=1.5,
                 vs_floor=2.0, speedup_vs_grouped_mm=3.0, rel_err_vs_loop=1e-3),
            dict(base, impl="torch._grouped_mm", dtype="bfloat16", error="RuntimeError: no grad")]
    text = training_table(rows, {"device": "NVIDIA H200", "repeats": 20})
    assert text.startswith("# MoE expert layer, training step (NVIDIA H200)")
    lines = [line for line in text.splitlines() if line.startswith("| 8 | 2 |")]
    assert len(lines) == 2 and "| 1.000 |" in lines[0] and "| 3.00x |" in lines[0]
    assert "failed" in lines[1] and "no grad" in lines[1]
