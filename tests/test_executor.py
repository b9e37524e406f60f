"""execute(plan) must equal evaluate() for every operator, mask granularity and candidate:
this is the CPU proof of the steps (index, SRead, dense tiles, SWrite, skipped = value at
S = 0) that the generated kernels implement."""

import numpy as np
import pytest
import sympy
from hypothesis import given, settings, strategies as st

from pitgen import analyse, parse
from pitgen.errors import ShapeError
from pitgen.executor import evaluate, execute
from pitgen.planner import Candidate, make_plan


CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"
#: (expression, sparse operand, max extent per axis: small where the axis count is high)
OPERATORS = [
    ("C[m,n] += A[m,k] * B[k,n]", "A", 70),
    ("C[m,n] += A[m,k] * B[k,n]", "B", 70),
    ("C[m,n] += A[m,k] * B[n,k]", "A", 40),
    ("C[m,n] += A[m,k] * B[n,k]", "B", 40),
    ("C[b,m,n] += A[b,m,k] * B[b,k,n]", "A", 12),
    ("Y[e,t,n] += X[e,t,k] * W[e,k,n]", "X", 12),
    ("Y[e,t,n] += X[e,t,k] * W[e,k,n]", "W", 12),
    ("S[i,j] += Q[i,d] * K[j,d]", "Q", 40),
    ("S[i,j] += Q[i,d] * K[j,d]", "K", 40),
    (CONV, "W", 5),
    (CONV, "I", 5),
    ("C[m] max= A[m,k]", "A", 70),
    ("C[m] min= A[m,k]", "A", 70),
    ("C[m,n] = relu(A[m,n])", "A", 70),
    ("C[m,n] = sigmoid(A[m,n])", "A", 70),
    ("C[m,n] = A[m,n] * B[m,n]", "A", 40),
]
IDS = [f"{e.split('[')[0]}:{e}:{s}" for e, s, _ in OPERATORS]


def shape_of(acc, ext):
    syms = {sympy.Symbol(a, integer=True): ext[a] - 1 for a in ext}
    return tuple(int(e.subs(syms)) + 1 for e in acc.indices)


def tiled_mask(rng, shape, tile, p):
    """Random mask constant on tiles of ``tile`` (edge tiles clipped)."""
    grid = rng.random(tuple(-(-n // t) for n, t in zip(shape, tile))) < p
    for d, t in enumerate(tile):
        grid = np.repeat(grid, t, axis=d)
    return grid[tuple(slice(0, n) for n in shape)]


@st.composite
def problems(draw, expr, sparse, top):
    """Arrays for ``expr`` with a mask on ``sparse`` of a drawn granularity, and a candidate."""
    op = parse(expr)
    ext = {a: draw(st.integers(1, top), label=a) for a in op.axes}
    if expr == CONV:
        ext.update(r=draw(st.integers(1, 3)), s=draw(st.integers(1, 3)), n=draw(st.integers(1, 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    dtype = draw(st.sampled_from([np.float32, np.float16]), label="dtype")
    arrays = {}
    for acc in op.inputs:
        arrays[acc.tensor] = rng.standard_normal(shape_of(acc, ext)).astype(dtype)
    s_shape = arrays[sparse].shape
    acc = op.access(sparse)
    kind = draw(st.sampled_from(["micro", "block", "dense", "auto"]), label="kind")
    tile = {a: draw(st.integers(1, 9), label=f"tile {a}") for a in op.axes}
    cand = None
    if kind == "micro":
        rules = analyse(op)
        axes = [a for a in acc.axes if acc.bare_dim(a) is not None and rules.axes[a].invariant]
        axis = draw(st.sampled_from(axes), label="micro axis")
        shp = [draw(st.integers(1, n + 2)) for n in s_shape]
        shp[acc.bare_dim(axis)] = 1
        cand = Candidate("micro", axis, tuple(shp), 0, None, 0, 0.0)
    elif kind == "block":
        cand = Candidate("block", None, tuple(draw(st.integers(1, n + 2)) for n in s_shape),
                         0, None, 0, 0.0)
    gran = draw(st.sampled_from(["element", "row", "column", "block", "own", "zeros", "ones"]),
                label="mask")
    p = draw(st.sampled_from([0.05, 0.3, 0.7]), label="density")
    if gran == "zeros":
        mask = np.zeros(s_shape, bool)
    elif gran == "ones":
        mask = np.ones(s_shape, bool)
    else:
        if gran == "element":
            mtile = (1,) * len(s_shape)
        elif gran in ("row", "column"):
            d = len(s_shape) - 1 if gran == "row" else 0
            mtile = tuple(n if i == d else 1 for i, n in enumerate(s_shape))
        elif gran == "own" and cand is not None:
            mtile = cand.shape
        else:
            mtile = tuple(draw(st.integers(1, n)) for n in s_shape)
        mask = tiled_mask(rng, s_shape, mtile, p)
    arrays[sparse] = np.where(mask, arrays[sparse], 0).astype(dtype)
    want = cand if cand is not None else ("dense" if kind == "dense" else None)
    plan = make_plan(op, sparse, mask=mask, tile=tile, micro_tile=want)
    return op, arrays, plan


def arrays_ext(op, arrays):
    return op.extents({t: a.shape for t, a in arrays.items()})


def rel_err(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.parametrize("expr,sparse,top", OPERATORS, ids=IDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_execute_equals_evaluate(expr, sparse, top, data):
    op, arrays, plan = data.draw(problems(expr, sparse, top))
    ref = evaluate(op, arrays)
    got = execute(plan, **arrays)
    assert got.shape == ref.shape == tuple(arrays_ext(op, arrays)[a] for a in op.output.axes)
    # both compute in float64 from the same (float32/float16) values: only summation order differs
    assert rel_err(got, ref) <= 1e-9, (plan.choice, plan.compute_tile)


@pytest.mark.parametrize("expr,sparse,top", OPERATORS, ids=IDS)
def test_every_listed_candidate_executes_exactly(expr, sparse, top):
    """Each standard candidate (clipped to the operand) on a 30%-dense element mask."""
    op = parse(expr)
    ext = {a: min(top, 37) for a in op.axes}
    if expr == CONV:
        ext.update(r=3, s=2, n=2)
    rng = np.random.default_rng(7)
    arrays = {acc.tensor: rng.standard_normal(shape_of(acc, ext)) for acc in op.inputs}
    arrays[sparse] *= rng.random(arrays[sparse].shape) < 0.3
    ref = evaluate(op, arrays)
    plan = make_plan(op, sparse, mask=arrays[sparse] != 0, tile={a: 8 for a in op.axes})
    for cand in plan.candidates:
        one = make_plan(op, sparse, mask=arrays[sparse] != 0, tile={a: 8 for a in op.axes},
                        micro_tile=cand)
        assert one.choice == cand
        assert rel_err(execute(one, **arrays), ref) <= 1e-12, cand


def test_evaluate_matches_closed_forms():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    np.testing.assert_allclose(evaluate(parse("C[m,n] += A[m,k] * B[k,n]"), {"A": A, "B": B}), A @ B)
    np.testing.assert_allclose(evaluate(parse("C[m,n] += A[m,k] * B[n,k]"), {"A": A, "B": B.T}), A @ B)
    np.testing.assert_array_equal(evaluate(parse("C[m] max= A[m,k]"), {"A": A}), A.max(1))
    np.testing.assert_array_equal(evaluate(parse("C[m] min= A[m,k]"), {"A": A}), A.min(1))
    np.testing.assert_allclose(evaluate(parse("C[m,n] = sigmoid(A[m,n])"), {"A": A}), 1 / (1 + np.exp(-A)))
    np.testing.assert_array_equal(evaluate(parse("C[m,n] = relu(A[m,n])"), {"A": A}), np.maximum(A, 0))
    I, W = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 2))
    O = np.zeros((2, 4, 4, 4))
    for n, f, y, x in np.ndindex(O.shape):
        O[n, f, y, x] = np.sum(I[n, :, y:y + 3, x:x + 2] * W[f])
    np.testing.assert_allclose(evaluate(parse(CONV), {"I": I, "W": W}), O)
    X = rng.standard_normal((3, 4, 5)).astype(np.float16)
    W2 = rng.standard_normal((3, 5, 2)).astype(np.float16)
    got = evaluate(parse("Y[e,t,n] += X[e,t,k] * W[e,k,n]"), {"X": X, "W": W2})
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.einsum("etk,ekn->etn", X.astype(float), W2.astype(float)))


def test_skipped_tiles_contribute_value_at_zero():
    """max over a row whose only non-zeros are negative is 0 (skipped zeros), and sigmoid of a
    skipped element is 0.5."""
    A = np.zeros((4, 6))
    A[1, 2] = -3.0
    A[2] = -1.0
    A[3, :] = np.arange(1, 7)
    cands = [Candidate("micro", "k", (1, 1), 0, None, 0, 0.0),
             Candidate("micro", "k", (4, 1), 0, None, 0, 0.0),
             Candidate("micro", "m", (1, 6), 0, None, 0, 0.0),
             Candidate("block", None, (2, 3), 0, None, 0, 0.0)]
    for expr, want in [("C[m] max= A[m,k]", [0, 0, -1, 6]), ("C[m] min= A[m,k]", [0, -3, -1, 1])]:
        for cand in cands:
            plan = make_plan(parse(expr), "A", mask=A != 0, micro_tile=cand, tile="2x2")
            np.testing.assert_array_equal(execute(plan, A=A), want)
    op = parse("C[m,n] = sigmoid(A[m,n])")
    got = execute(make_plan(op, "A", mask=A != 0, micro_tile=(1, 2)), A=A)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-A)))
    assert got[0, 0] == 0.5


def test_execute_never_pads_or_writes_inputs():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((33, 17)) * (rng.random((33, 17)) < 0.2)
    B = rng.standard_normal((17, 5))
    A0, B0 = A.copy(), B.copy()
    A.flags.writeable = B.flags.writeable = False
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    got = execute(make_plan(op, "A", mask=A != 0, micro_tile="16x1"), A=A, B=B)
    np.testing.assert_allclose(got, A0 @ B0)
    np.testing.assert_array_equal(A, A0)


def test_execute_missing_array():
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    plan = make_plan(op, "A", mask=np.ones((4, 4)))
    with pytest.raises(ShapeError, match="missing input arrays \\['B'\\]"):
        execute(plan, A=np.ones((4, 4)))
