"""CPU tests of the formats x schedules tuner: search space, budgeted search (with an injected
timing function), cache keys and the on-disk cache, expression recognition of format kernels,
and the ``pitgen tune`` command line's validation."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import pitgen
from pitgen.graph import tune as T
from pitgen.cli import load_graph_arg, main
from pitgen.graph.jit import FormatKernel, graph_form

ROOT = Path(__file__).resolve().parents[1]
SPMM = "Y[i,f] += A[i,j] * X[j,f]"
SDDMM = "E[i,j] += U[i,f] * V[j,f]"

SCHEDULES = {"csr": [{"group": 8}, {"group": 16}, {"group": 32}],
             "ell": [{"group": 8}, {"group": 32}],
             "bsr": [{"threads": 128}, {"threads": 256}],
             "hyb": [{"groups": [4] * 7}, {"groups": [8] * 7}]}


def stats(rows=1000, nnz=8000, mean=8.0, mx=40, std=5.0, empty=0.0, cols=None):
    return T.GraphStats(rows, cols or rows, nnz, mean, mx, std, empty)


def space(st=None, formats=T.FORMATS, op="spmm"):
    return T.Space(op, 64, "float16", st or stats(), list(formats),
                   lambda f: SCHEDULES[f], lambda f: SCHEDULES[f][0])


class FakeClock:
    """Each measured trial advances the clock by its fake kernel time (seconds)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_measure(clock, ms_of, cost_s=0.1, fail=lambda c: None):
    seen = []

    def measure(c):
        seen.append(c)
        clock.t += cost_s
        why = fail(c)
        if why:
            return T.Trial.of(c, "failed", reason=why)
        return T.Trial.of(c, "ok", ms=ms_of(c), convert_ms=0.5)
    measure.seen = seen
    return measure


def hyb_ms(c):
    """hyb fastest at c=2, k=4, schedule groups of 8; the rest slower."""
    base = {"csr": 1.0, "ell": 3.0, "bsr": 5.0}.get(c.fmt)
    if base is None:
        base = 0.8 + 0.05 * abs(c.params["c"] - 2) + 0.05 * abs(c.params["k"] - 4)
    return base - (0.1 if c.schedule in ({"group": 32}, {"groups": [8] * 7}) else 0.0)


# -- statistics, buckets, keys -----------------------------------------------------------------

def test_stats_from_lengths_and_dict():
    s = T.GraphStats.from_lengths([0, 2, 4, 6], cols=9)
    assert (s.rows, s.cols, s.nnz, s.max) == (4, 9, 12, 6)
    assert s.mean == 3.0 and s.empty == 0.25 and abs(s.std - np.std([0, 2, 4, 6])) < 1e-12
    d = {"rows": 4, "cols": 9, "nnz": 12, "mean_row": 3.0, "max_row": 6,  # DeviceCSR.row_stats
         "std_row": s.std, "empty_fraction": 0.25}
    assert T.GraphStats.from_dict(d) == s
    with pytest.raises(pitgen.PlanError, match="lack 'nnz'"):
        T.GraphStats.from_dict({"rows": 1, "cols": 1})
    assert T.GraphStats.from_lengths([], cols=3).nnz == 0


def test_similar_graphs_share_a_bucket_different_ones_do_not():
    a = stats(rows=100_000, nnz=1_000_000, mean=10.0, mx=3000, std=40.0)
    b = stats(rows=103_000, nnz=1_040_000, mean=10.1, mx=3100, std=41.0)
    assert T.stats_bucket(a) == T.stats_bucket(b)
    for other in (stats(rows=200_000, nnz=1_000_000, mean=5.0, mx=3000, std=40.0),
                  stats(rows=100_000, nnz=1_000_000, mean=10.0, mx=300, std=40.0),
                  stats(rows=100_000, nnz=1_000_000, mean=10.0, mx=3000, std=2.0),
                  stats(rows=100_000, nnz=1_000_000, mean=10.0, mx=3000, std=40.0, empty=0.5)):
        assert T.stats_bucket(a) != T.stats_bucket(other)
    k1 = T.tune_key("spmm", 64, "float16", "H100", a, ["hyb", "csr"])
    assert k1 == T.tune_key("spmm", 64, "float16", "H100", b, ["csr", "hyb"])
    for changed in (T.tune_key("sddmm", 64, "float16", "H100", a, ["csr", "hyb"]),
                    T.tune_key("spmm", 128, "float16", "H100", a, ["csr", "hyb"]),
                    T.tune_key("spmm", 64, "float32", "H100", a, ["csr", "hyb"]),
                    T.tune_key("spmm", 64, "float16", "H200", a, ["csr", "hyb"]),
                    T.tune_key("spmm", 64, "float16", "H100", a, ["csr"])):
        assert T.cache_path(changed) != T.cache_path(k1)
    assert T.stats_bucket(stats(rows=0, nnz=0, mean=0.0, mx=0, std=0.0))["cv"] == 0


# -- search space ------------------------------------------------------------------------------

def test_param_space_default_first_and_complete():
    st = stats(mean=6.0)
    assert T.default_params("hyb", st) == {"c": 1, "k": 4}      # ceil(log2 6) + 1
    assert T.default_params("hyb", stats(mean=1000.0))["k"] == 6
    assert T.default_params("hyb", stats(mean=0.5))["k"] == 2
    assert T.default_params("ell", st) == {"width": 40}
    hyb = T.param_space("hyb", st)
    assert hyb[0] == {"c": 1, "k": 4} and len(hyb) == 20
    assert {(p["c"], p["k"]) for p in hyb} == {(c, k) for c in (1, 2, 4, 8) for k in range(2, 7)}
    assert [p["block"] for p in T.param_space("bsr", st)] == [16, 8, 32]
    assert T.param_space("csr", st) == [{}]
    with pytest.raises(pitgen.PlanError, match="unknown format 'coo'"):
        T.default_params("coo", st)


def test_padding_filters():
    skewed = stats(rows=10_000, nnz=80_000, mx=5000)
    assert "pads" in T.infeasible("ell", {"width": 5000}, skewed)
    assert T.infeasible("ell", {"width": 12}, stats(rows=10_000, nnz=80_000, mx=12)) is None
    assert T.infeasible("ell", {"width": 50}, stats(rows=100, nnz=200, mx=50)) is None  # tiny
    big = stats(rows=200_000, nnz=100_000_000)
    assert "one non-zero per block" in T.infeasible("bsr", {"block": 8}, big)
    assert T.infeasible("bsr", {"block": 32}, stats()) is None
    assert T.infeasible("hyb", {"c": 8, "k": 6}, big) is None


def test_space_validates():
    with pytest.raises(pitgen.PlanError, match="unknown format"):
        space(formats=["csr", "coo"])
    with pytest.raises(pitgen.PlanError, match="unknown graph operator"):
        space(op="gemm")
    sp = space(formats=["hyb", "csr", "hyb"])
    assert sp.formats == ["csr", "hyb"]
    assert sp.size() == 3 + 20 * 2


# -- budgeted search ---------------------------------------------------------------------------

def test_defaults_of_every_format_come_first():
    clock = FakeClock()
    m = fake_measure(clock, hyb_ms)
    heard = []
    trials = T.Search(space(), m, budget_s=0.35, clock=clock,
                      progress=lambda t, s: heard.append((t, s))).run()
    assert [(t.fmt, t.phase) for t in trials] == [
        ("csr", "default"), ("ell", "default"), ("bsr", "default"), ("hyb", "default")]
    assert all(t.schedule == SCHEDULES[t.fmt][0] for t in trials)
    # progress hears of every measured trial, in order, with the time spent so far
    assert [t for t, _ in heard] == [t for t in trials if t.status != "skipped"]
    assert [s for _, s in heard] == sorted(s for _, s in heard) and heard[-1][1] > 0


def test_budget_zero_still_runs_the_first_trial():
    clock = FakeClock()
    trials = T.Search(space(), fake_measure(clock, hyb_ms), budget_s=0.0, clock=clock).run()
    assert [(t.fmt, t.status) for t in trials] == [("csr", "ok")]
    res = T.result_of(space(), trials, 0.0, "dev")
    assert res.fmt == "csr" and res.speedup == 1.0


def test_full_search_finds_the_optimum_and_never_repeats():
    clock = FakeClock()
    sp = space()
    m = fake_measure(clock, hyb_ms)
    search = T.Search(sp, m, budget_s=1e9, clock=clock)
    trials = search.run()
    idents = [c.ident for c in m.seen]
    assert len(idents) == len(set(idents))
    res = T.result_of(sp, trials, clock.t, "dev")
    assert (res.fmt, res.params, res.schedule) == ("hyb", {"c": 2, "k": 4}, {"groups": [8] * 7})
    assert res.ms == pytest.approx(0.7) and res.csr_ms == 1.0
    assert res.speedup == pytest.approx(1.0 / 0.7)
    phases = [t.phase for t in trials]
    assert phases == sorted(phases, key=["default", "params", "schedule"].index)
    # schedules are tried with each format's best parameters only
    assert all(t.params == {"c": 2, "k": 4} for t in trials
               if t.fmt == "hyb" and t.phase == "schedule")
    assert res.trials == len(trials) == len(m.seen)


def test_schedule_phases_are_prefetched_before_their_trials():
    """A measure with prefetch() hears of each format's schedule phase (its best parameters,
    the schedules not yet measured) before the phase's first trial, and never once the budget
    is spent."""
    clock = FakeClock()
    m = fake_measure(clock, hyb_ms)
    heard = []
    m.prefetch = lambda cands: heard.append((len(m.seen), list(cands)))
    trials = T.Search(space(), m, budget_s=1e9, clock=clock).run()
    assert {cands[0].fmt for _, cands in heard} == set(T.FORMATS)
    for before, cands in heard:
        fmt, params = cands[0].fmt, cands[0].params
        best = min((t for t in trials[:before] if t.fmt == fmt and t.status == "ok"),
                   key=lambda t: t.ms)
        assert all((c.fmt, c.params, c.phase) == (fmt, params, "schedule") for c in cands)
        assert params == best.params
        # none measured before the call; every one of them measured after it
        assert not {c.ident for c in cands} & {c.ident for c in m.seen[:before]}
        assert {c.ident for c in cands} <= {c.ident for c in m.seen[before:]}
    # spent budget: the schedule phase is neither measured nor prefetched
    clock, heard = FakeClock(), []
    m = fake_measure(clock, hyb_ms)
    m.prefetch = lambda cands: heard.append(cands)
    trials = T.Search(space(), m, budget_s=0.35, clock=clock).run()
    assert heard == [] and all(t.phase != "schedule" for t in trials)


def test_budget_stops_refinements():
    clock = FakeClock()
    m = fake_measure(clock, hyb_ms, cost_s=1.0)
    trials = T.Search(space(), m, budget_s=6.0, clock=clock).run()
    assert len(trials) == 6          # trials start at t = 0..5 s
    assert [t.phase for t in trials[4:]] == ["params", "params"]
    # the fastest format after the defaults (hyb) is refined first
    assert trials[4].fmt == "hyb"


def test_failures_and_skips_are_logged_not_fatal():
    clock = FakeClock()
    skewed = stats(rows=10_000, nnz=80_000, mx=5000)
    fail = lambda c: "ShapeError: bsr block too large" if c.fmt == "bsr" else None  # noqa: E731
    m = fake_measure(clock, hyb_ms, fail=fail)
    trials = T.Search(space(skewed), m, budget_s=1e9, clock=clock).run()
    by = {(t.fmt, t.status) for t in trials}
    assert ("ell", "skipped") in by and ("bsr", "failed") in by
    assert not any(c.fmt == "ell" for c in m.seen)            # skipped before converting
    assert not any(t.fmt == "bsr" and t.phase == "schedule" for t in trials)
    res = T.result_of(space(skewed), trials, 1.0, "dev")
    assert res.fmt == "hyb" and res.trials == len(m.seen)
    assert "ShapeError" in json.dumps(res.to_json())


def test_all_failed_is_a_plan_error():
    clock = FakeClock()
    m = fake_measure(clock, hyb_ms, fail=lambda c: "DeviceError: no GPU")
    trials = T.Search(space(formats=["csr"]), m, budget_s=10, clock=clock).run()
    with pytest.raises(pitgen.PlanError, match="no format could run spmm.*no GPU"):
        T.result_of(space(formats=["csr"]), trials, 0.1, "dev")


# -- on-disk cache -----------------------------------------------------------------------------

@pytest.fixture
def tune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PITGEN_TUNE_CACHE", str(tmp_path / "tune"))
    return tmp_path / "tune"


def _result():
    clock = FakeClock()
    sp = space()
    trials = T.Search(sp, fake_measure(clock, hyb_ms), budget_s=3.0, clock=clock).run()
    return T.result_of(sp, trials, clock.t, "NVIDIA H100 80GB HBM3")


def test_cache_round_trip(tune_cache):
    res = _result()
    st = stats()
    key = T.tune_key("spmm", 64, "float16", res.device, st, T.FORMATS)
    assert T.load(key) is None
    path = T.store(key, res)
    assert path.parent == tune_cache and path.suffix == ".json"
    assert [p.name for p in tune_cache.iterdir()] == [path.name]       # no temporary left
    back = T.load(key)
    assert back.from_cache and not res.from_cache
    back.from_cache = False
    assert back.to_json() == res.to_json()
    got = T.lookup(st, "spmm", 64, "float16", device=res.device)
    assert got is not None and (got.fmt, got.params, got.schedule) == (res.fmt, res.params,
                                                                        res.schedule)
    assert T.lookup(st, "spmm", 64, "float16", device="other GPU") is None
    assert T.lookup(st, "spmm", 64, "float16", formats=["csr"], device=res.device) is None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_key", "missing_field",
                                    "unknown_format", "nan_time", "infinite_time", "text_time"])
def test_broken_cache_entry_is_ignored_with_a_warning(tune_cache, damage):
    res = _result()
    key = T.tune_key("spmm", 64, "float16", res.device, stats(), T.FORMATS)
    path = T.store(key, res)
    text = path.read_text()
    doc = json.loads(text)
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\xff\x00not json")
    elif damage == "wrong_key":
        doc["key"]["feat"] = 128
        path.write_text(json.dumps(doc))
    elif damage == "missing_field":
        del doc["result"]["schedule"]
        path.write_text(json.dumps(doc))
    else:
        field, value = {"unknown_format": ("fmt", "coo"), "nan_time": ("ms", float("nan")),
                        "infinite_time": ("ms", float("inf")), "text_time": ("ms", "fast")}[damage]
        doc["result"][field] = value
        path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="ignoring broken entry"):
        assert T.load(key) is None
    T.store(key, res)                                   # the next search overwrites it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert T.load(key).fmt == res.fmt


# -- format kernels: expressions -----------------------------------------------------------------

def test_graph_forms():
    f = graph_form(pitgen.parse(SPMM), "A")
    assert (f.op, f.inputs, f.dense) == ("spmm", ("A", "X"), ("X",))
    f = graph_form(pitgen.parse("Y[i,f] += X[j,f] * A[i,j]"), "A")
    assert (f.op, f.inputs, f.dense) == ("spmm", ("X", "A"), ("X",))
    f = graph_form(pitgen.parse(SDDMM), "E")
    assert (f.op, f.inputs, f.dense) == ("sddmm", ("U", "V"), ("U", "V"))
    f = graph_form(pitgen.parse("E[i,j] += V[j,f] * U[i,f]"), "E")
    assert f.dense == ("U", "V")


@pytest.mark.parametrize("expr,sparse,match", [
    ("Y[i,f] += A[j,i] * X[j,f]", "A", "SpMM must read"),
    ("Y[i,f] += A[i,j] * X[f,j]", "A", "SpMM must read"),
    ("E[i,j] += U[i,f] * V[f,j]", "E", "SDDMM must read"),
    ("Y[i,f] += A[i,j] * X[j,f]", "Z", "neither an input nor the output"),
    ("Y[i,f] max= A[i,j] * X[j,f]", "A", "not a sum of products"),
    ("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]", "I", "two distinct bare axes"),
    ("Y[i,f] += A[i,j] * X[j,f]", "Y", "SDDMM must read"),
])
def test_graph_form_refusals(expr, sparse, match):
    with pytest.raises(pitgen.PlanError, match=match):
        graph_form(pitgen.parse(expr), sparse)


def test_rules_are_consulted(monkeypatch):
    """A non-invariant verdict from the rule engine reaches the caller as RuleError."""
    import pitgen.graph.jit as gk

    real = gk.analyse

    def no_j(op):
        rules = real(op)  # shared by every caller: build a new one, never mutate it
        j = dataclasses.replace(rules.axes["j"], invariant=False, reason="test")
        return dataclasses.replace(rules, axes={**rules.axes, "j": j})
    monkeypatch.setattr(gk, "analyse", no_j)
    for expr, sparse in ((SPMM, "A"), (SDDMM, "E")):
        with pytest.raises(pitgen.RuleError, match="axis j .* not permutation invariant"):
            graph_form(pitgen.parse(expr), sparse)


def test_compile_dispatches_on_format():
    k = pitgen.compile(SPMM, sparse="A", format="hyb", dtype="float32")
    assert isinstance(k, FormatKernel) and k.op == "spmm" and k.format == "hyb"
    k = pitgen.compile(SDDMM, sparse="E", format="auto")
    assert isinstance(k, FormatKernel) and k.op == "sddmm"
    assert isinstance(pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile="32x1"),
                      pitgen.SparseKernel)
    with pytest.raises(pitgen.PlanError, match="unknown format 'dia'"):
        pitgen.compile(SPMM, sparse="A", format="dia")
    assert pitgen.compile(SPMM, sparse="A", format="coo").format == "coo"   # an edge list's
    with pytest.raises(pitgen.PlanError, match="float32 or float16, not 'bfloat16'"):
        pitgen.compile(SPMM, sparse="A", format="csr", dtype="bfloat16")
    with pytest.raises(pitgen.PlanError, match="micro_tile="):
        pitgen.compile(SPMM, sparse="A", format="csr", micro_tile="32x1")
    with pytest.raises(pitgen.PlanError, match="explicit format"):
        FormatKernel(SPMM, "A", "auto", params={"c": 2})


def test_format_kernel_binds_operands_by_position_and_name():
    k = FormatKernel("Y[i,f] += X[j,f] * A[i,j]", "A", "csr", "float32")
    assert k._bind((1, 2), {}) == {"X": 1, "A": 2}
    assert k._bind((), {"A": 2, "X": 1}) == {"X": 1, "A": 2}
    for args, kw, match in (((1, 2, 3), {}, "takes 2 operands"), ((1,), {}, "missing operand"),
                            ((1,), {"X": 1}, "given twice"), ((1,), {"B": 1}, "unknown operand")):
        with pytest.raises(pitgen.ShapeError, match=match):
            k._bind(args, kw)


# -- command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["synthetic:nope"], "unknown synthetic graph 'nope'"),
    (["synthetic:cora", "--formats", "csr,coo"], "argument --formats: unknown format(s) 'coo'"),
    (["synthetic:cora", "--formats", ","], "argument --formats: no format given"),
    (["synthetic:cora", "--op", "gemm"], "argument --op: invalid choice: 'gemm'"),
    (["synthetic:cora", "--feat", "0"], "argument --feat: must be >= 1"),
    (["synthetic:cora", "--dtype", "bfloat16"], "argument --dtype: invalid choice: 'bfloat16'"),
    (["synthetic:cora", "--budget", "-1"], "argument --budget: must be > 0"),
    (["synthetic:cora", "--scale", "3"], "--scale must be in"),
    (["g.npz", "--scale", "0.5"], "--scale applies to synthetic:NAME graphs only"),
])
def test_cli_tune_bad_options_exit_2(capsys, argv, match):
    assert main(["tune", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: pitgen tune ") and match in err


@pytest.mark.parametrize("graph,match", [
    ("/no/such.npz", "cannot read graph '/no/such.npz'"),
    (str(ROOT / "README.md"), "cannot read graph"),
])
def test_cli_tune_unreadable_graph_exits_1(capsys, graph, match):
    assert main(["tune", graph]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("pitgen: error: ") and match in err


def test_cli_graph_sources(tmp_path):
    g = load_graph_arg("synthetic:cora", scale=0.1)
    assert g.shape == (271, 271) and g.nnz == 1056
    path = tmp_path / "g.npz"
    np.savez(path, indptr=g.indptr, indices=g.indices, shape=np.array(g.shape))
    back = load_graph_arg(str(path))
    assert np.array_equal(back.indices, g.indices) and back.shape == g.shape
    with pytest.raises(pitgen.PitgenError, match="synthetic:NAME graphs only"):
        load_graph_arg(str(path), scale=0.5)


def test_make_graphs_unique_matches_numpy():
    from pitgen.graphs import _unique

    x = np.random.default_rng(1).integers(0, 1000, 5000)
    assert np.array_equal(_unique(x), np.unique(x))
    assert _unique(np.zeros(0, np.int64)).size == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_an_unusable_time_never_wins_and_is_never_cached(tune_cache, bad):
    clock = FakeClock()
    measure = fake_measure(clock, lambda c: bad if c.fmt == "hyb" else 2.0 if c.fmt == "csr" else 3.0)
    trials = T.Search(space(), measure, budget_s=100, clock=clock).run()
    broken = [t for t in trials if t.fmt == "hyb"]
    assert broken and all(t.status == "failed" and "unusable time" in t.reason for t in broken)
    res = T.result_of(space(), trials, 1.0, "fake")
    assert res.fmt == "csr" and res.ms == 2.0
    nan_result = dataclasses.replace(res, ms=bad)
    key = T.tune_key("spmm", 64, "float16", "fake", stats(), T.FORMATS)
    with pytest.warns(RuntimeWarning, match="not storing"):
        assert T.store(key, nan_result) is None
    assert not tune_cache.exists() or not list(tune_cache.iterdir())


def test_an_unusable_tune_cache_is_skipped_with_a_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PITGEN_TUNE_CACHE", str(blocker / "tune"))
    key = T.tune_key("spmm", 64, "float16", "fake", stats(), T.FORMATS)
    with pytest.warns(RuntimeWarning, match="searching without it"):
        assert T.load(key) is None
    with pytest.warns(RuntimeWarning, match="cannot store"):
        assert T.store(key, _result()) is None


def test_cli_tune_refuses_a_nan_budget(capsys):
    assert main(["tune", "synthetic:cora", "--budget", "nan"]) == 2
    assert "finite" in capsys.readouterr().err
