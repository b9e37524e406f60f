"""Parser tests: every syntax form, every refusal (with its column), extents and views."""
import numpy as np
import pytest
import sympy

import pitgen
from pitgen.expr import parse


def sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True)


# -- syntax forms ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, reducer, axes, inputs", [
    ("C[m,n] += A[m,k] * B[k,n]", "sum", ("m", "n", "k"), ["A[m,k]", "B[k,n]"]),
    ("C[m] max= A[m,k]", "max", ("m", "k"), ["A[m,k]"]),
    ("C[m] min= A[m,k]", "min", ("m", "k"), ["A[m,k]"]),
    ("C[m,n] += A[m,k] * B[n,k]", "sum", ("m", "n", "k"), ["A[m,k]", "B[n,k]"]),
    ("C[b,m,n] += A[b,m,k] * B[b,k,n]", "sum", ("b", "m", "n", "k"), ["A[b,m,k]", "B[b,k,n]"]),
    ("Y[e,t,n] += X[e,t,k] * W[e,k,n]", "sum", ("e", "t", "n", "k"), ["X[e,t,k]", "W[e,k,n]"]),
    ("S[i,j] += Q[i,d] * K[j,d]", "sum", ("i", "j", "d"), ["Q[i,d]", "K[j,d]"]),
    ("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]", "sum", ("n", "f", "y", "x", "c", "r", "s"),
     ["I[n,c,r + y,s + x]", "W[f,c,r,s]"]),
])
def test_reductions(text, reducer, axes, inputs):
    op = parse(text)
    assert op.text == text
    assert op.reducer == reducer and op.epilogue is None
    assert op.axes == axes
    assert [str(a) for a in op.inputs] == inputs
    assert op.spatial_axes == tuple(str(e) for e in op.output.indices)
    assert op.reduction_axes == axes[len(op.spatial_axes):]


def test_elementwise_epilogue():
    op = parse("C[m,n] = relu(A[m,n])")
    assert (op.reducer, op.epilogue, op.axes, op.reduction_axes) == ("none", "relu", ("m", "n"), ())


def test_affine_indices_are_sympy_expressions():
    op = parse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
    i = op.access("I")
    assert i.indices[2] == sym("y") + sym("r")
    assert i.dims_of("y") == (2,) and i.bare_dim("y") is None and i.bare_dim("c") == 1
    assert i.axes == ("n", "c", "r", "y", "s", "x")  # within one index: by name
    assert parse("C[m] += A[(m+1)*2-3]").inputs[0].indices[0] == 2 * sym("m") - 1


def test_whitespace_and_names():
    op = parse("  out_1[ i ,j]+=lhs[i,kk]*rhs[kk , j]  ")
    assert op.text == "out_1[ i ,j]+=lhs[i,kk]*rhs[kk , j]"
    assert op.input_names == ("lhs", "rhs") and op.axes == ("i", "j", "kk")


def test_diagonal_and_repeated_tensor():
    assert parse("C[m] += A[m,m]").inputs[0].dims_of("m") == (0, 1)
    op = parse("C[m,n] += A[m,k] * A[k,n]")
    assert op.input_names == ("A",) and len(op.inputs) == 2


def test_accessors():
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    assert op.access("C") is op.output and op.access("B") is op.inputs[1]
    assert [a.tensor for a in op.accesses_of("k")] == ["A", "B"]
    with pytest.raises(pitgen.ExpressionError, match="does not appear"):
        op.access("Z")


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, column, message", [
    ("C[m,n += A[m,k] * B[k,n]", 2, "unbalanced bracket '\\[' is never closed"),
    ("C[m,n] += A[m,k]] * B[k,n]", 17, "unbalanced bracket '\\]'"),
    ("C[m] = relu(A[m]", 12, "unbalanced bracket '\\(' is never closed"),
    ("C[m,z] += A[m,k] * B[k,n]", 5, "output axis z appears on no input"),
    ("C[m,n] = foo(A[m,n])", 10, "unknown function 'foo'"),
    ("C[m] += A[m] * foo(B[m])", 16, "unknown function 'foo'"),
    ("C[m] += A[m] * relu(B[m])", 16, "only allowed around the whole right-hand side"),
    ("C[m,n] += A[m,k] * A[k]", 20, "tensor A used with rank 2 and rank 1"),
    ("C[m] += A[m*k]", 11, "not affine"),
    ("C[m] += A[m*m]", 11, "not affine"),
    ("", 1, "empty expression"),
    ("   ", 1, "empty expression"),
    ("C[m,n] += relu(A[m,k] * B[k,n])", 11, "not a valid sum"),
    ("C[m] max= exp(A[m,k])", 11, "not a valid max"),
    ("C[m] = A[m,k]", 6, "axis k appears only on the right of '='"),
    ("C[m+1] += A[m]", 3, "must be a single axis name"),
    ("C[m,m] += A[m]", 5, "output axis m repeated"),
    ("C[m] += C[m]", 1, "also read on the right-hand side"),
    ("C[m] A[m]", 6, "expected '\\+=', 'max=', 'min=' or '='"),
    ("C[m] += A[m] B[m]", 14, "unexpected 'B'"),
    ("C[m] += A[m] *", 15, "expected a tensor access"),
    ("C[m] += A[]", 11, "expected an index, found '\\]'"),
    ("C[m] += A[m]$", 13, "unexpected character '\\$'"),
])
def test_bad_expressions(text, column, message):
    with pytest.raises(pitgen.ExpressionError, match=message) as info:
        parse(text)
    assert info.value.column == column
    if text.strip():
        assert str(info.value).splitlines()[-1] == "  " + " " * (column - 1) + "^"


def test_not_a_string():
    with pytest.raises(pitgen.ExpressionError, match="as a string"):
        parse(None)


def test_expression_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse("C[m] = A[m,k]")


# -- extents and views -----------------------------------------------------------------------------

CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"


def test_extents_matmul_and_conv():
    assert parse("C[m,n] += A[m,k] * B[k,n]").extents({"A": (4, 5), "B": (5, 6)}) == {
        "m": 4, "k": 5, "n": 6}
    ext = parse(CONV).extents({"I": (2, 3, 10, 12), "W": (4, 3, 3, 5)})
    assert ext == {"n": 2, "c": 3, "f": 4, "r": 3, "s": 5, "y": 8, "x": 8}


def test_extents_scaled_index():
    # 2*m+1 must stay inside 7 elements: m in 0..2 reaches index 5; m = 3 would reach 7.
    assert parse("C[m] += A[2*m+1]").extents({"A": (7,)}) == {"m": 3}


@pytest.mark.parametrize("shapes, message", [
    ({"A": (4, 5), "B": (6, 7)}, "axis k has extent 5 elsewhere but 6"),
    ({"A": (4, 5, 1), "B": (5, 6)}, "rank 3"),
    ({"A": (4, 5)}, "cannot infer the extent of axes \\['n'\\]"),
])
def test_extents_errors(shapes, message):
    with pytest.raises(pitgen.ShapeError, match=message):
        parse("C[m,n] += A[m,k] * B[k,n]").extents(shapes)


def test_extents_input_too_small_for_affine_index():
    with pytest.raises(pitgen.ShapeError, match="too small"):
        parse(CONV).extents({"I": (1, 1, 2, 9), "W": (1, 1, 3, 3)})


def test_view_of_affine_access_is_the_sliding_window():
    op = parse(CONV)
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((2, 3, 6, 7))
    ext = op.extents({"I": inp.shape, "W": (4, 3, 3, 2)})
    v = op.view(op.access("I"), inp, ext)  # axes n, c, r, y, s, x
    assert v.shape == (2, 3, 3, 4, 2, 6)
    for n, c, r, y, s, x in [(0, 0, 0, 0, 0, 0), (1, 2, 2, 3, 1, 5), (1, 1, 1, 2, 0, 3)]:
        assert v[n, c, r, y, s, x] == inp[n, c, y + r, x + s]
    assert not v.flags.writeable


def test_view_of_diagonal_scaled_and_mirrored_accesses():
    a = np.arange(25.0).reshape(5, 5)
    op = parse("C[m] += A[m,m]")
    np.testing.assert_array_equal(op.view(op.inputs[0], a, {"m": 5}), np.diag(a))
    op = parse("C[m] += A[2*m+1,4-m]")
    np.testing.assert_array_equal(op.view(op.inputs[0], a, {"m": 2}), [a[1, 4], a[3, 3]])


def test_view_bounds_and_rank_errors():
    op = parse(CONV)
    ext = {"n": 1, "c": 1, "f": 1, "y": 4, "x": 4, "r": 3, "s": 3}
    with pytest.raises(pitgen.ShapeError,
                       match=r"dimension 2 has size 5 but index r \+ y reaches \[0, 5\]"):
        op.view(op.access("I"), np.zeros((1, 1, 5, 6)), ext)
    with pytest.raises(pitgen.ShapeError, match="rank 3, expected 4"):
        op.view(op.access("I"), np.zeros((1, 6, 6)), ext)
    op = parse("C[m] += A[m-1]")
    with pytest.raises(pitgen.ShapeError, match=r"reaches \[-1, 1\]"):
        op.view(op.inputs[0], np.zeros(3), {"m": 3})
