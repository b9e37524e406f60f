"""The error contract: every public function refuses a bad argument with a PitgenError naming it,
and the command line answers every input with one line and an exit status, never a traceback.
First each case the issue listed, then a fuzz test over random expressions, arrays (every
dtype, odd shapes, NaN/inf, huge sizes described without allocating), paths and options that
accepts success or a PitgenError and nothing else, each input bounded in time.

The fuzz loop runs ``PITGEN_FUZZ_INPUTS`` inputs (default 10,000: a few seconds)."""
from __future__ import annotations

import os
import signal
import string
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, strategies as st

import pitgen
from pitgen import cache
from pitgen.cli import main
from pitgen.emit import Request, emit
from pitgen.graph import formats as F

MATMUL = "C[m,n] += A[m,k] * B[k,n]"
FUZZ_INPUTS = int(os.environ.get("PITGEN_FUZZ_INPUTS", "6000"))
#: Seconds any one input may take: more is a hang.
INPUT_SECONDS = 10


class Hang(BaseException):
    """An input that took longer than INPUT_SECONDS (a BaseException: no handler swallows it)."""


@contextmanager
def bounded(seconds: float, what: str) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"{what} took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn: Callable[[], Any], what: str) -> str:
    """'ok' or the PitgenError's class; anything else fails the test, naming the input."""
    with bounded(INPUT_SECONDS, what):
        try:
            fn()
        except pitgen.PitgenError as e:
            return type(e).__name__
        except Hang:
            raise
        except BaseException as e:  # noqa: BLE001 - the contract under test
            raise AssertionError(f"{what}: raised {type(e).__name__}: {str(e)[:300]}") from e
    return "ok"


# -- the cases the issue listed ------------------------------------------------------------------

def _csr():
    return F.CSR.from_dense(np.eye(4))


LISTED: dict[str, tuple[Callable[[], Any], type, str]] = {
    "5000 nested parentheses": (
        lambda: pitgen.parse("C[m] += A[" + "(" * 5000 + "m" + ")" * 5000 + ",k] * B[k]"),
        pitgen.ExpressionError, "nested"),
    "analyse(123)": (lambda: pitgen.analyse(123), pitgen.ExpressionError, "got int"),
    "plan(shape=(2**40,)*2) beyond int64": (
        lambda: pitgen.plan(MATMUL, "A", shape=(2**40,) * 2), pitgen.PlanError, "int64"),
    "plan(micro_tile=5)": (lambda: pitgen.plan(MATMUL, "A", micro_tile=5), pitgen.PlanError,
                           "micro_tile"),
    "plan(shape=(512.9, 512))": (lambda: pitgen.plan(MATMUL, "A", shape=(512.9, 512)),
                                 pitgen.PlanError, "must be an integer, got 512.9"),
    "plan(tile=(64, 64, 2.5))": (lambda: pitgen.plan(MATMUL, "A", tile=(64, 64, 2.5)),
                                 pitgen.PlanError, "must be an integer"),
    "tile 99999999999x64x32": (lambda: pitgen.plan(MATMUL, "A", tile="99999999999x64x32"),
                               pitgen.PlanError, "at most 2147483647"),
    "structured mask": (lambda: pitgen.plan(MATMUL, "A", mask=np.zeros((4, 4), [("a", "i4")])),
                        pitgen.PlanError, "dtype"),
    "string mask": (lambda: pitgen.plan(MATMUL, "A", mask=np.array([["a", "b"], ["c", "d"]])),
                    pitgen.PlanError, "dtype <U1"),
    "datetime mask": (lambda: pitgen.plan(MATMUL, "A", mask=np.zeros((4, 4), "datetime64[s]")),
                      pitgen.PlanError, "datetime64"),
    "complex mask": (lambda: pitgen.plan(MATMUL, "A", mask=np.ones((4, 4), complex)),
                     pitgen.PlanError, "complex128"),
    "complex operand": (lambda: pitgen.evaluate(MATMUL, {"A": np.ones((2, 2), complex),
                                                         "B": np.ones((2, 2))}),
                        pitgen.ShapeError, "complex128"),
    "uint64 CSR indices beyond int64": (
        lambda: F.CSR((2, 2), np.array([0, 1, 2], np.uint64), np.array([0, 2**63], np.uint64)),
        pitgen.ShapeError, "beyond int64"),
    "Hyb(k=64)": (lambda: F.Hyb.from_csr(_csr(), 1, 64), pitgen.ShapeError, "k"),
    "ELL width 2.5": (lambda: F.ELL.from_csr(_csr(), 2.5), pitgen.ShapeError, "ELL width"),
    "BSR block 2.5": (lambda: F.BSR.from_csr(_csr(), 2.5), pitgen.ShapeError, "block"),
    "ELL width 2**40 (memory)": (lambda: F.ELL.from_csr(_csr(), 2**40), pitgen.ShapeError,
                                 "GiB"),
    "CSR shape (2.5, 2)": (lambda: F.CSR((2.5, 2), [0, 1, 2], [0, 1]), pitgen.ShapeError,
                           "integer"),
    "load_graph of a directory": (lambda: F.load_graph("/"), pitgen.FileError,
                                  "cannot read graph"),
    "execute(3)": (lambda: pitgen.execute(3), pitgen.PlanError, "Plan"),
}


@pytest.mark.parametrize("case", LISTED, ids=list(LISTED))
def test_listed_cases_raise_a_pitgen_error(case):
    fn, kind, match = LISTED[case]
    with pytest.raises(kind, match=match):
        with bounded(INPUT_SECONDS, case):
            fn()


def test_host_arrays_past_half_the_available_memory_are_refused(monkeypatch):
    """A format conversion that would fill more than half of the memory available is refused
    up front: an ELL of width 2**31 on a 4-row matrix (96 GiB) passed a bound of the whole
    physical memory on a 128 GiB host and then took minutes to fill."""
    from pitgen import checks

    monkeypatch.setattr(checks, "memory_bytes", lambda: 2**20)
    assert F.ELL.from_csr(_csr(), 2**10).width == 2**10          # 48 KiB: allowed
    with pytest.raises(pitgen.ShapeError, match="half of the 0.000977 GiB"):
        F.ELL.from_csr(_csr(), 2**15)                             # 1.5 MiB
    with pytest.raises(pitgen.ShapeError, match="half"):
        F.Hyb.from_csr(_csr(), 2**15, 2)


def test_listed_cases_that_now_succeed():
    """10,000 unary minus signs parse (counted, not recursed); a plan of 2^31 x 2^31 without a
    mask is costed in closed form; unsigned CSR indices are taken as int64; a huge affine
    coefficient costs the rule engine no memory."""
    op = pitgen.parse("C[m] += A[" + "-" * 10000 + "m,k] * B[k]")
    assert str(op.inputs[0].indices[0]) == "m"
    plan = pitgen.plan(MATMUL, "A", shape=(2**31,) * 2)
    assert plan.shape == (2**31, 2**31) and plan.choice.kind == "dense"
    csr = F.CSR((2, 2), np.array([0, 1, 2], np.uint64), np.array([0, 1], np.uint64))
    assert csr.indices.dtype == np.int64 and F.Hyb.from_csr(csr, 1, 2).to_dense()[1, 1] == 1
    with bounded(10, "analyse of a 10^9 coefficient"):
        rules = pitgen.analyse("C[m] += A[1000000000*m+k] * B[k]")
    assert rules.invariant_axes() == ()


def test_rules_refuse_too_many_sharing_axes_and_stay_linear_otherwise():
    axes = [f"a{i}" for i in range(10)]
    wide = f"C[{','.join(axes[:5])}] += A[{','.join(axes)}] * B[{','.join(axes[5:])}]"
    with pytest.raises(pitgen.RuleError, match="at most 8"):
        with bounded(10, "analyse of 10 axes"):
            pitgen.analyse(wide)
    chain = "C[a0] += " + " * ".join(f"T{i}[a{i},a{i + 1}]" for i in range(20))
    with bounded(10, "analyse of a 21-axis chain"):
        assert len(pitgen.analyse(chain).axes) == 21


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err


def test_cli_errors_are_one_line(capsys, tmp_path, monkeypatch):
    np.save(tmp_path / "struct.npy", np.zeros((4, 4), [("a", "i4")]))
    status, err = _cli(capsys, ["plan", MATMUL, "--sparse", "A", "--mask",
                                str(tmp_path / "struct.npy")])
    assert status == 1 and err.startswith("pitgen: error: mask of A has dtype")
    deep = "C[m] += A[" + "(" * 5000 + "m" + ")" * 5000 + ",k] * B[k]"
    assert _cli(capsys, ["rules", deep])[0] == 1
    assert _cli(capsys, ["rules", "C[m] += A[" + "-" * 10000 + "m,k] * B[k]"])[0] == 0
    status, err = _cli(capsys, ["emit", MATMUL, "--sparse", "A", "--micro-tile", "32x1",
                                "--tile", "99999999999x64x32", "--out", str(tmp_path / "o")])
    assert status == 1 and "2147483647" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, err = _cli(capsys, ["emit", MATMUL, "--sparse", "A", "--micro-tile", "32x1",
                                "--out", str(blocker / "sub")])
    assert status == 1 and "cannot write into" in err


def test_cli_npz_without_scipy_is_one_line(capsys, tmp_path, monkeypatch):
    path = tmp_path / "g.npz"
    np.savez(path, format=np.array("coo"), shape=np.array([2, 2]), row=np.array([0]),
             col=np.array([1]), data=np.array([1.0]))
    monkeypatch.setitem(sys.modules, "scipy", None)   # import scipy now fails
    monkeypatch.setitem(sys.modules, "scipy.sparse", None)
    status, err = _cli(capsys, ["tune", str(path), "--budget", "1"])
    assert status == 1 and "needs scipy" in err


@pytest.mark.parametrize("exc, status, text", [
    (MemoryError(), 1, "out of memory"), (RecursionError(), 1, "nested too deeply"),
    (PermissionError(13, "Permission denied", "/x"), 1, "Permission denied '/x'"),
    (ModuleNotFoundError("No module named 'scipy'", name="scipy"), 1, "scipy"),
    (TypeError("boom"), 3, "internal error"),
])
def test_cli_maps_every_exception_to_one_line(capsys, monkeypatch, exc, status, text):
    def boom(argv):
        raise exc

    monkeypatch.setattr("pitgen.cli._run", boom)
    got, err = _cli(capsys, ["rules", MATMUL])
    assert got == status and err.startswith("pitgen: error: ") and text in err
    assert err.count("\n") == 1


# -- names in emitted code -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["int", "for", "__x", "_Tile", "dim3", "threadIdx", "NULL",
                                  "INT32_MAX", "MMA_AB_TYPES", "GRID_STRIDE", "e", "stream",
                                  "pit_host", "cudaStream_t", "x" * 65])
@pytest.mark.parametrize("where", ["axis", "tensor"])
def test_emit_refuses_names_that_would_not_compile(name, where):
    expr = (f"C[m,{name}] += A[m,k] * B[k,{name}]" if where == "axis"
            else f"{name}[m,n] += A[m,k] * B[k,n]")
    with pytest.raises(pitgen.PlanError, match="rename it"):
        emit(Request(expr, "A", "32x1"))


# -- fuzz ----------------------------------------------------------------------------------------

_PIECES = ["C", "A", "B", "[", "]", "(", ")", ",", "*", "+", "-", "+=", "=", "max=", "m", "n",
           "k", "y+r", "2*m", "relu(", "0", "99999999999999999999", " ", "int", "__x", "$",
           "[m,k]", "A[m,k]", "B[k,n]", "C[m,n]", "*A[m,k]", "exp"]
_DTYPES = [np.bool_, np.int8, np.uint8, np.int32, np.uint64, np.float16, np.float32,
           np.float64, np.complex64, "U3", "S2", "datetime64[s]", "timedelta64[ms]", object,
           [("a", "i4"), ("b", "f4")]]
_SHAPES = [(), (0,), (4,), (4, 4), (0, 4), (3, 5), (4, 4, 2), (64, 64), (1, 1)]


def _array(rng: np.random.Generator) -> Any:
    dtype = _DTYPES[rng.integers(len(_DTYPES))]
    shape = _SHAPES[rng.integers(len(_SHAPES))]
    a = np.zeros(shape, dtype)
    if a.dtype.kind in "fc" and a.size:
        a.flat[rng.integers(a.size, size=3)] = [np.nan, np.inf, 1.0]
    elif a.dtype.kind in "iub" and a.size:
        a.flat[rng.integers(a.size, size=3)] = 1
    choice = rng.integers(6)
    return [a, a.tolist(), [[1, 0], [0]], 3.5, "mask", None][choice] if choice else a


def _value(rng: np.random.Generator) -> Any:
    """A random argument value: ints (huge, negative, bool), floats (NaN, inf), strings,
    sequences, dicts, None."""
    return [0, 1, -1, 2**31, 2**64, 2**1000, True, 2.5, 64.0, float("nan"), float("inf"), "",
            "32x1", "64x64x32", "auto", "dense", "x", "99999999999x1", (32, 1), [32, 1, 1],
            (0, 1), (2**40, 2**40), (32.0, 1.0), {"m": 2}, {"z": 1}, None, object(),
            b"bytes", np.int64(7), np.float32(3)][rng.integers(30)]


def _expression(rng: np.random.Generator) -> str:
    if rng.random() < 0.3:
        return MATMUL
    return "".join(rng.choice(_PIECES, size=rng.integers(1, 14)))


def _path(rng: np.random.Generator, tmp: str) -> str:
    return [os.path.join(tmp, "missing.npz"), tmp, "/", "/dev/null", os.path.join(tmp, "x.npy"),
            "", "\0bad", os.path.join(tmp, "g.npz")][rng.integers(8)]


def _fuzz_input(rng: np.random.Generator, tmp: str) -> tuple[str, Callable[[], Any]]:
    """One random call of the public API, described for the failure report."""
    kind = rng.integers(12)
    if kind <= 2:
        text = _expression(rng)
        return f"parse({text!r})", lambda: pitgen.parse(text)
    if kind == 3:
        text = _expression(rng) if rng.random() < 0.5 else _value(rng)
        return f"analyse({text!r})", lambda: pitgen.analyse(text)
    if kind == 4:
        mask = _array(rng)
        return f"plan(mask={mask!r:.80})", lambda: pitgen.plan(MATMUL, "A", mask=mask)
    if kind == 5:
        arg = ["tile", "micro_tile", "shape", "profile", "sparse"][rng.integers(5)]
        value = _value(rng)
        kwargs = {arg: value} if arg != "sparse" else {}
        sparse = value if arg == "sparse" else "A"
        return f"plan({arg}={value!r:.80})", lambda: pitgen.plan(MATMUL, sparse, **kwargs)
    if kind == 6:
        a, b = _array(rng), _array(rng)
        return (f"evaluate(A={a!r:.60}, B={b!r:.60})",
                lambda: pitgen.evaluate(MATMUL, {"A": a, "B": b}))
    if kind == 7:
        shape, ip, ix = _value(rng), _array(rng), _array(rng)
        return f"CSR({shape!r}, {ip!r:.60}, {ix!r:.60})", lambda: F.CSR(shape, ip, ix)
    if kind == 8:
        fmt, v = ["ell", "bsr", "hyb"][rng.integers(3)], _value(rng)
        csr = _csr()
        call = {"ell": lambda: F.ELL.from_csr(csr, v), "bsr": lambda: F.BSR.from_csr(csr, v),
                "hyb": lambda: F.Hyb.from_csr(csr, v, 2)}[fmt]
        return f"{fmt}({v!r})", call
    if kind == 9:
        path = _path(rng, tmp)
        return f"load_graph({path!r})", lambda: F.load_graph(path)
    if kind == 10:
        a = _array(rng)
        return f"build_index({a!r:.80})", lambda: pitgen.build_index(
            a, MATMUL, "A", pitgen.plan(MATMUL, "A", micro_tile="32x1"))
    tile, micro = _value(rng), _value(rng)
    return (f"emit(tile={tile!r}, micro_tile={micro!r})",
            lambda: emit(Request(MATMUL, "A", micro, "float16", tile)))


def test_fuzz_public_api_success_or_pitgen_error(tmp_path):
    """FUZZ_INPUTS seeded random calls (the seed is in each failure's message)."""
    np.save(tmp_path / "x.npy", np.ones((4, 4)))
    np.savez(tmp_path / "g.npz", indptr=np.array([0, 1, 2]), indices=np.array([0, 1]),
             shape=np.array([2, 2]))
    seen: dict[str, int] = {}
    for seed in range(FUZZ_INPUTS):
        rng = np.random.default_rng(seed)
        what, call = _fuzz_input(rng, str(tmp_path))
        result = outcome(call, f"seed {seed}: {what}")
        seen[result] = seen.get(result, 0) + 1
    assert seen.get("ok") and len(seen) > 3, seen   # both sides of the contract were exercised


@given(st.text(alphabet=string.ascii_letters[:8] + "[](),*+-=_ 0123456789", max_size=60))
def test_hypothesis_expressions_parse_or_refuse(text):
    outcome(lambda: pitgen.analyse(text) if len(text) < 40 else pitgen.parse(text), repr(text))


@given(st.lists(st.sampled_from(["rules", "plan", "emit", "tune", "--json", "--sparse", "A",
                                 "--mask", "/", "--tile", "0x0x0", "--micro-tile", "nanx1",
                                 "--out", "/dev/null/x", "--budget", "nan", MATMUL, "--list",
                                 "synthetic:none", "--scale", "2"]), max_size=8))
def test_hypothesis_cli_never_prints_a_traceback(argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with bounded(INPUT_SECONDS, repr(argv)):
            status = main(argv)
    assert status in (0, 1, 2) and "Traceback" not in err.getvalue(), (argv, err.getvalue())
    cache.clear()


def test_dtypes_are_names_or_dtype_objects():
    """``compile(dtype=...)`` takes a NumPy (or torch) dtype as well as its name."""
    expr = "C[m,n] += A[m,k] * B[k,n]"
    assert pitgen.compile(expr, sparse="A", dtype=np.float32).dtype == "float32"
    assert pitgen.compile(expr, sparse="A", dtype=np.dtype("float16")).dtype == "float16"
    with pytest.raises(pitgen.PlanError, match="int8"):
        pitgen.compile(expr, sparse="A", dtype=np.int8)
    with pytest.raises(pitgen.PlanError, match="dtype"):
        pitgen.compile(expr, sparse="A", dtype=5)
