"""Command-line tests, one section per subcommand, then what every subcommand shares: exit
statuses (0 done, 1 error while running, 2 usage error), --version, --help examples and a
closed pipe."""
import json
import subprocess
import sys
import types

import pytest

import pitgen
from pitgen.cli import main

CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"


# -- pitgen rules ----------------------------------------------------------------------------------

def rules_json(capsys, expr: str) -> dict:
    assert main(["rules", expr, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def test_rules_json_schema(capsys):
    doc = rules_json(capsys, "C[m,n] += A[m,k] * B[k,n]")
    assert set(doc) == {"expression", "axes"}
    assert doc["expression"] == "C[m,n] += A[m,k] * B[k,n]"
    assert list(doc["axes"]) == ["m", "n", "k"]
    for rule in doc["axes"].values():
        assert set(rule) == {"role", "invariant", "needs", "reason"}
        assert rule["role"] in ("spatial", "reduction")
        assert isinstance(rule["invariant"], bool) and isinstance(rule["reason"], str)
        assert set(rule["needs"]) <= {"SRead", "SWrite"}
    assert doc["axes"]["m"]["needs"] == ["SRead", "SWrite"]
    assert (doc["axes"]["k"]["role"], doc["axes"]["k"]["needs"]) == ("reduction", ["SRead"])


def test_rules_json_conv(capsys):
    axes = rules_json(capsys, CONV)["axes"]
    assert {a: r["invariant"] for a, r in axes.items()} == {
        "n": True, "f": True, "y": False, "x": False, "c": True, "r": False, "s": False}
    assert axes["y"]["needs"] == [] and "coupled to r" in axes["y"]["reason"]


def test_rules_explain_by_default(capsys):
    assert main(["rules", CONV]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"PIT rules for {CONV}\n")
    assert "y: spatial axis, NOT invariant" in out and "symbolic check:" in out


def test_rules_bad_expression_exits_1(capsys):
    assert main(["rules", "C[m,n] += relu(A[m,k] * B[k,n])", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pitgen: error: relu(...) under '+=' is not a valid sum")
    assert "(column 11)" in err


# -- pitgen plan -----------------------------------------------------------------------------------

def micro_32x1_mask(tmp_path, density=0.05, shape=(1024, 1024)):
    import numpy as np

    grid = np.random.default_rng(0).random((shape[0] // 32, shape[1])) < density
    path = tmp_path / "mask.npy"
    np.save(path, np.repeat(grid, 32, axis=0))
    return str(path)


def test_plan_json_finds_the_32x1_micro_tile(capsys, tmp_path):
    mask = micro_32x1_mask(tmp_path)
    assert main(["plan", "C[m,n] += A[m,k] * B[k,n]", "--sparse", "A", "--mask", mask,
                 "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)
    assert {"expression", "sparse", "tile", "profile", "choice", "candidates"} <= set(doc)
    assert (doc["sparse"], doc["shape"]) == ("A", [1024, 1024])
    assert doc["choice"]["kind"] == "micro" and doc["choice"]["axis"] == "k"
    assert doc["choice"]["shape"] == [32, 1] and doc["choice"]["waste"] == 0.0
    assert any(c["kind"] == "dense" for c in doc["candidates"])


def test_plan_width_prices_a_narrow_product(capsys, tmp_path):
    """The same 95%-sparse mask: a 4096-wide product runs 32x1 micro-tiles, a 64-wide one is
    too small for the index pass's launch to pay, so dense; a width below 1 is refused."""
    mask = micro_32x1_mask(tmp_path)
    choices = []
    for width in ("4096", "64"):
        assert main(["plan", "C[m,n] += A[m,k] * B[k,n]", "--sparse", "A", "--mask", mask,
                     "--json", "--width", width]) == 0
        choices.append(json.loads(capsys.readouterr().out)["choice"]["kind"])
    assert choices == ["micro", "dense"]
    assert main(["plan", "C[m,n] += A[m,k] * B[k,n]", "--sparse", "A", "--mask", mask,
                 "--width", "0"]) == 2
    assert "--width: must be >= 1, got 0" in capsys.readouterr().err


def test_plan_table_and_tile(capsys, tmp_path):
    import numpy as np

    path = tmp_path / "ones.npy"
    np.save(path, np.ones((256, 128), np.float32))
    assert main(["plan", "C[m,n] += A[m,k] * B[k,n]", "--sparse", "A",
                 "--mask", str(path), "--tile", "128x64x64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for C[m,n] += A[m,k] * B[k,n]\n")
    assert "tile m=128 n=64 k=64" in out and "choice: dense 128x64" in out


def test_plan_errors_exit_1(capsys, tmp_path):
    mask = micro_32x1_mask(tmp_path, shape=(64, 64))
    expr = "C[m,n] += A[m,k] * B[k,n]"
    assert main(["plan", expr, "--sparse", "D", "--mask", mask]) == 1
    assert "operands: A, B" in capsys.readouterr().err
    assert main(["plan", expr, "--sparse", "A", "--mask", mask, "--tile", "64x64"]) == 1
    assert "tile has 2 extents" in capsys.readouterr().err
    assert main(["plan", CONV, "--sparse", "I", "--mask", mask]) == 1
    err = capsys.readouterr().err
    assert "mask has shape (64, 64) (rank 2) but I[" in err and "has rank 4" in err
    assert main(["plan", expr, "--sparse", "A", "--mask", str(tmp_path / "no.npy")]) == 1
    assert "cannot read mask" in capsys.readouterr().err


def test_plan_takes_the_expression_positionally(capsys, tmp_path):
    mask = micro_32x1_mask(tmp_path, shape=(64, 64))
    assert main(["plan", "--expr", "C[m,n] += A[m,k] * B[k,n]", "--sparse", "A", "--mask", mask]) == 2
    assert "pitgen: error: unrecognized arguments: --expr" in capsys.readouterr().err


# -- pitgen bench ----------------------------------------------------------------------------------

def test_bench_forwards_its_arguments_unchanged(capsys, monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 3)
    monkeypatch.setitem(sys.modules, "pitgen.bench", fake)
    argv = ["--out", "x", "matmul", "--quick", "--help"]
    assert main(["bench", *argv]) == 3
    assert seen == [argv]


def test_bench_missing_exits_1(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pitgen.bench", None)  # import raises ModuleNotFoundError
    assert main(["bench", "--quick"]) == 1
    assert capsys.readouterr().err.startswith("pitgen: error: this pitgen has no benchmark suite")


# -- every subcommand ------------------------------------------------------------------------------

def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pitgen {pitgen.__version__}\n"


@pytest.mark.parametrize("command", ["rules", "plan", "emit", "tune"])
def test_help_shows_an_example(capsys, command):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pitgen {command} ") and f"\n  pitgen {command} " in out


@pytest.mark.parametrize("argv, match", [
    ([], "the following arguments are required: COMMAND"),
    (["rules"], "the following arguments are required: EXPR"),
    (["rules", "C[m] += A[m]", "--bad"], "unrecognized arguments: --bad"),
    (["emit", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["emit", "--list", "--compile"], "--compile needs files"),
])
def test_usage_errors_exit_2(capsys, argv, match):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: pitgen") and match in err


def test_closed_pipe_exits_quietly():
    """``pitgen rules EXPR | head -1``: the reader is gone before pitgen writes (closed here
    before the child is done importing); no traceback, status 141 as for a tool SIGPIPE ends."""
    proc = subprocess.Popen([sys.executable, "-m", "pitgen.cli", "rules", CONV, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert (proc.wait(timeout=60), err) == (141, b"")


def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    """pitgen cache info lists the three areas (files, bytes, folder); clear --only empties the
    chosen ones and leaves the others; an unknown area is a usage error (status 2)."""
    monkeypatch.setenv("PITGEN_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("PITGEN_TUNE_CACHE", raising=False)
    (tmp_path / "c" / "tune").mkdir(parents=True)
    (tmp_path / "c" / "graphs").mkdir()
    (tmp_path / "c" / "kernel-entry").write_bytes(b"x" * 10)
    (tmp_path / "c" / "tune" / "spmm-float16-64-ab.json").write_text("{}")
    (tmp_path / "c" / "graphs" / "cora-seed0.npz").write_bytes(b"y" * 5)
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {a: (u["files"], u["bytes"]) for a, u in info.items()} == \
        {"kernels": (1, 10), "tune": (1, 2), "graphs": (1, 5)}
    assert main(["cache", "clear", "--only", "tune"]) == 0
    assert "tune: removed 1 file(s)" in capsys.readouterr().out
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "kernels       1 file(s)" in out and "tune          0 file(s)" in out
    assert (tmp_path / "c" / "graphs" / "cora-seed0.npz").exists()
    assert main(["cache", "clear", "--only", "tune,nope"]) == 2
    assert "unknown area(s) 'nope'" in capsys.readouterr().err
