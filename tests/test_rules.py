"""Rule engine tests: verdicts for the operators PIT targets, the symbolic check agreeing with
the structural rule, and random operators checked numerically with NumPy."""
import json
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pitgen
from pitgen import rules as rules_mod
from pitgen.expr import EPILOGUES, parse
from pitgen.rules import analyse

SPATIAL = ("SRead", "SWrite")
REDUCTION = ("SRead",)


def verdicts(text: str) -> dict[str, tuple[str, bool, tuple[str, ...]]]:
    return {a: (r.role, r.invariant, r.needs) for a, r in analyse(text).axes.items()}


# -- verdicts --------------------------------------------------------------------------------------

def test_matmul():
    assert verdicts("C[m,n] += A[m,k] * B[k,n]") == {
        "m": ("spatial", True, SPATIAL), "n": ("spatial", True, SPATIAL),
        "k": ("reduction", True, REDUCTION)}


def test_conv():
    v = verdicts("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    assert v == {
        "n": ("spatial", True, SPATIAL), "f": ("spatial", True, SPATIAL),
        "y": ("spatial", False, ()), "x": ("spatial", False, ()),
        "c": ("reduction", True, REDUCTION),
        "r": ("reduction", False, ()), "s": ("reduction", False, ())}


@pytest.mark.parametrize("text", [
    "C[m,n] += A[m,k] * B[n,k]",          # transposed B
    "C[b,m,n] += A[b,m,k] * B[b,k,n]",    # batched
    "Y[e,t,n] += X[e,t,k] * W[e,k,n]",    # mixture of experts
    "S[i,j] += Q[i,d] * K[j,d]",          # SDDMM
    "C[m,n] += A[m,k] * A[n,k]",          # Gram: one tensor read twice
    "C[m,n] += A[m,k] * A[k,n]",          # square: one tensor read twice
    "C[m] += A[m,m]",                      # diagonal: both dimensions follow m
    "C[m,n] += A[m,k] * B[k,k,n]",         # diagonal on a reduction axis
    "C[m] += A[m,1]",                      # a constant index involves no axis
])
def test_all_axes_invariant(text):
    op = parse(text)
    v = verdicts(text)
    assert v == {**{a: ("spatial", True, SPATIAL) for a in op.spatial_axes},
                 **{a: ("reduction", True, REDUCTION) for a in op.reduction_axes}}


@pytest.mark.parametrize("reducer", ["max", "min"])
def test_max_min_reductions_are_invariant(reducer):
    assert verdicts(f"C[m] {reducer}= A[m,k] * B[k]") == {
        "m": ("spatial", True, SPATIAL), "k": ("reduction", True, REDUCTION)}


@pytest.mark.parametrize("fn", sorted(EPILOGUES))
def test_elementwise(fn):
    assert verdicts(f"C[m,n] = {fn}(A[m,n] * B[n])") == {
        "m": ("spatial", True, SPATIAL), "n": ("spatial", True, SPATIAL)}


@pytest.mark.parametrize("text, axis, why", [
    ("C[m] = A[2*m]", "m", "scaled by 2"),
    ("C[m] += A[m-1]", "m", "shifted by -1"),
    ("C[m] += A[m,k+3]", "k", "shifted by 3"),   # a sum over k+3 is a relabelling, but no gather
    ("C[m] += A[m,2-k]", "k", "scaled by -1"),    # mirrored: likewise
    ("C[m,n] = A[m+n]", "n", "coupled to m"),
    ("C[m] += A[m,k] * B[2*k+m]", "k", "coupled to m"),
])
def test_non_bare_indices_are_not_invariant(text, axis, why):
    rule = analyse(text).axes[axis]
    assert not rule.invariant and rule.needs == ()
    assert why in rule.reason
    assert "not invariant" in rule.symbolic


def test_symbolic_outcome_is_recorded():
    r = analyse("C[m,n] += A[m,k] * B[k,n]")
    assert "rotation (1 2 0) of k and swap (1 0 2) of k" in r.axes["k"].symbolic
    assert r.axes["k"].symbolic.endswith("leave C unchanged")
    assert r.axes["m"].symbolic.endswith("leave C permuted the same way along m")
    y = analyse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]").axes["y"].symbolic
    assert y.startswith("under the rotation (1 2 0) of y, O[") and y.endswith("not invariant")


def test_disagreement_fails_loudly(monkeypatch):
    structural = rules_mod._structural

    def wrong(op, axis):
        rule = structural(op, axis)
        return rules_mod.AxisRule(rule.axis, rule.role, not rule.invariant, rule.needs, rule.reason)

    monkeypatch.setattr(rules_mod, "_structural", wrong)
    pitgen.cache.clear()  # analyse remembers verdicts per expression
    try:
        with pytest.raises(pitgen.RuleError, match="internal inconsistency.*axis m.*bug in pitgen"):
            analyse("C[m,n] += A[m,k] * B[k,n]")
    finally:
        pitgen.cache.clear()


def test_analyse_conv_is_fast():
    """A guard against a pathological rule derivation (seconds of sympy), not a benchmark: this
    process's CPU time, which other processes' load does not stretch (wall time under 12 busy
    test workers passed a second)."""
    pitgen.cache.clear()
    start = time.process_time()
    analyse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    assert time.process_time() - start < 1.0


# -- Rules API -------------------------------------------------------------------------------------

def test_require_invariant():
    r = analyse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    assert r.require_invariant("c") is r.axes["c"]
    assert r.invariant_axes() == ("n", "f", "c")
    with pytest.raises(pitgen.RuleError, match="axis y .* is not permutation invariant: "
                                               "I indexes dimension 2 by r \\+ y"):
        r.require_invariant("y")
    with pytest.raises(pitgen.RuleError, match="'z' is not an axis"):
        r.require_invariant("z")


def test_to_json_schema():
    doc = json.loads(json.dumps(analyse("C[m] max= A[m,k]").to_json()))
    assert doc["expression"] == "C[m] max= A[m,k]"
    assert list(doc["axes"]) == ["m", "k"]
    for rule in doc["axes"].values():
        assert set(rule) == {"role", "invariant", "needs", "reason"}
    assert doc["axes"]["k"] == {"role": "reduction", "invariant": True, "needs": ["SRead"],
                                "reason": analyse("C[m] max= A[m,k]").axes["k"].reason}


def test_explain_reads_as_a_derivation():
    text = analyse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]").explain()
    assert "reducer: sum (commutative and associative" in text
    assert "y: spatial axis, NOT invariant; needs nothing" in text
    assert "uses: O dim 2 bare; I dim 2 in r + y (not bare)" in text
    assert "c: reduction axis, invariant; needs SRead" in text
    assert "symbolic check: rotation (1 2 0) of c and swap (1 0 2) of c" in text
    diag = analyse("C[m] = relu(A[m,m])").explain()
    assert "reducer: none" in diag and "uses: C dim 0 bare; A dim 0 bare; A dim 1 bare" in diag


# -- NumPy evaluator -------------------------------------------------------------------------------

def evaluate(op, arrays, extents):
    """Reference output of ``op``; ``arrays[i]`` is what ``op.inputs[i]`` reads."""
    letters = {a: chr(ord("a") + i) for i, a in enumerate(op.axes)}
    views = [op.view(acc, arr, extents) for acc, arr in zip(op.inputs, arrays)]
    if op.reducer in ("sum", "none"):
        spec = ",".join("".join(letters[a] for a in acc.axes) for acc in op.inputs)
        out = np.einsum(f"{spec}->{''.join(letters[a] for a in op.spatial_axes)}", *views)
    else:
        full = np.ones([extents[a] for a in op.axes])
        for acc, v in zip(op.inputs, views):
            order = sorted(range(len(acc.axes)), key=lambda i: op.axes.index(acc.axes[i]))
            full = full * v.transpose(order).reshape(
                [extents[a] if a in acc.axes else 1 for a in op.axes])
        reduce = np.max if op.reducer == "max" else np.min
        out = reduce(full, axis=tuple(range(len(op.spatial_axes), len(op.axes))))
    return EPILOGUES[op.epilogue](out) if op.epilogue else out


def random_arrays(op, extents, rng):
    """One array per tensor, just large enough for every access of it; one entry per access."""
    shapes: dict[str, list[int]] = {}
    for acc in op.inputs:
        reach = [int(e.subs({s: (extents[s.name] - 1 if e.coeff(s) > 0 else 0)
                             for s in e.free_symbols})) + 1 for e in acc.indices]
        old = shapes.get(acc.tensor, reach)
        shapes[acc.tensor] = [max(a, b) for a, b in zip(old, reach)]
    tensors = {t: rng.standard_normal(s) for t, s in shapes.items()}
    return [tensors[acc.tensor] for acc in op.inputs]


def test_evaluator_matches_direct_formulas():
    rng = np.random.default_rng(1)
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    ext = op.extents({"A": a.shape, "B": b.shape})
    np.testing.assert_allclose(evaluate(op, [a, b], ext), a @ b)
    op = parse("C[m] max= A[m,k] * B[k]")
    b = rng.standard_normal(4)
    np.testing.assert_allclose(evaluate(op, [a, b], {"m": 3, "k": 4}), (a * b).max(axis=1))
    op = parse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    i, w = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((3, 2, 2, 3))
    ext = op.extents({"I": i.shape, "W": w.shape})
    want = np.zeros((1, 3, 4, 2))
    for f, y, x, c, r, s in np.ndindex(3, 4, 2, 2, 2, 3):
        want[0, f, y, x] += i[0, c, y + r, x + s] * w[f, c, r, s]
    np.testing.assert_allclose(evaluate(op, [i, w], ext), want)


def permuted(op, arrays, axis, perm):
    """Each access's array with ``perm`` applied along every dimension that ``axis`` indexes."""
    out = []
    for acc, arr in zip(op.inputs, arrays):
        for d in acc.dims_of(axis):
            arr = np.take(arr, [*perm, *range(len(perm), arr.shape[d])], axis=d)
        out.append(arr)
    return out


def test_conv_y_is_not_numerically_invariant():
    op = parse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    rng = np.random.default_rng(2)
    i, w = rng.standard_normal((1, 2, 6, 6)), rng.standard_normal((2, 2, 3, 3))
    ext = op.extents({"I": i.shape, "W": w.shape})
    perm = [1, 2, 3, 0]
    out = evaluate(op, [i, w], ext)
    assert not np.allclose(evaluate(op, permuted(op, [i, w], "y", perm), ext),
                           np.take(out, perm, axis=2))


# -- random operators ------------------------------------------------------------------------------

AXES = "ijkl"


@st.composite
def operators(draw):
    """(expression text, whether each axis is invariant by construction, extents)."""
    bare = st.sampled_from(AXES)
    pair = st.lists(st.sampled_from(AXES), min_size=2, max_size=2, unique=True)
    index = st.one_of(
        bare, bare, bare, bare,
        pair.map(lambda p: f"{p[0]}+{p[1]}"),
        bare.map(lambda a: f"2*{a}"), bare.map(lambda a: f"{a}+1"), bare.map(lambda a: f"3-{a}"),
        pair.map(lambda p: f"2*{p[0]}+{p[1]}"))
    accesses, ranks = [], {}
    for t in range(draw(st.integers(1, 3))):
        name = "ABD"[t]
        if t and draw(st.booleans()):
            name = "A"  # the same tensor read twice
        rank = ranks.setdefault(name, draw(st.integers(1, 3)))
        accesses.append((name, [draw(index) for _ in range(rank)]))
    used = sorted({c for _, idx in accesses for e in idx for c in e if c in AXES})
    out = draw(st.lists(st.sampled_from(used), min_size=1, unique=True))
    reduction = [a for a in used if a not in out]
    op = draw(st.sampled_from(["+=", "max=", "min="] + ([] if reduction else ["="])))
    rhs = " * ".join(f"{n}[{','.join(idx)}]" for n, idx in accesses)
    if op == "=" and draw(st.booleans()):
        rhs = f"{draw(st.sampled_from(sorted(EPILOGUES)))}({rhs})"
    invariant = {a: all(e == a for _, idx in accesses for e in idx if a in e) for a in used}
    extents = {a: draw(st.integers(2, 4)) for a in used}
    return f"C[{','.join(out)}] {op} {rhs}", invariant, extents


@given(operators(), st.randoms(use_true_random=False))
def test_random_operators(case, random):
    text, invariant, extents = case
    op = parse(text)
    rules = analyse(op)  # raises if the structural and symbolic checks disagree
    assert {a: r.invariant for a, r in rules.axes.items()} == invariant
    rng = np.random.default_rng(random.getrandbits(32))
    arrays = random_arrays(op, extents, rng)
    out = evaluate(op, arrays, extents)
    for axis in rules.invariant_axes():
        perm = list(range(extents[axis]))
        random.shuffle(perm)
        got = evaluate(op, permuted(op, arrays, axis, perm), extents)
        if axis in op.spatial_axes:
            want = np.take(out, perm, axis=op.spatial_axes.index(axis))
        else:
            want = out
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{text}: {axis}")
