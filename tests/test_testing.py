"""pitgen.testing: the strategies draw what they claim (granularity, shape bounds, valid CSR,
parseable expressions with the stated rules), and assert_close catches one wrong element, a NaN
and an unwritten (poisoned) element while passing the rounding noise of each dtype."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings

from pitgen import analyse, parse
from pitgen import testing as T


def _find(strategy, condition):
    """An example satisfying ``condition`` exists (found without shrinking it: only existence
    matters here)."""
    quick = settings(phases=[Phase.generate], database=None, max_examples=2000)
    return find(strategy, condition, settings=quick)


# -- masks --------------------------------------------------------------------------------------

def _set_in_whole_units(mask: np.ndarray, tile: tuple[int, int]) -> bool:
    """Every tile of the grid aligned at 0 (cut at the edges) is all set or all clear."""
    rows, cols = mask.shape
    for r in range(0, rows, tile[0]):
        for c in range(0, cols, tile[1]):
            unit = mask[r:r + tile[0], c:c + tile[1]]
            if unit.any() and not unit.all():
                return False
    return True


@given(T.masks(max_side=150))
def test_masks_come_in_whole_units_of_their_kind(m):
    a = m.array
    assert a.dtype == np.bool_ and a.ndim == 2 and 1 <= min(a.shape) and max(a.shape) <= 150
    assert m.kind in T.MASK_KINDS
    tile = {"element": (1, 1), "row": (1, a.shape[1]), "col": (a.shape[0], 1)}.get(m.kind, m.tile)
    assert m.tile == tile or m.kind in ("empty", "full")
    if m.kind == "micro":
        assert m.tile in T.MICRO_TILES and 1 in m.tile
    if m.kind == "block":
        assert m.tile in T.BLOCK_TILES and min(m.tile) > 1
    if m.kind == "empty":
        assert not a.any()
    if m.kind == "full":
        assert a.all()
    assert _set_in_whole_units(a, m.tile)


@given(T.masks((37, 200), kinds=["micro"], micro_tiles=[(1, 64)], densities=[0.5]))
def test_masks_keep_a_fixed_shape_and_the_kinds_asked_for(m):
    assert m.array.shape == (37, 200) and (m.kind, m.tile, m.density) == ("micro", (1, 64), 0.5)


@pytest.mark.parametrize("shape, tile, density", [((4096, 4096), (128, 128), 0.1),
                                                  ((130, 70), (32, 1), 0.5), ((64, 64), (1, 1), 0.0),
                                                  ((100, 200), (1, 64), 1.0), ((37, 5), (16, 16), 0.3)])
def test_exact_tile_masks_hold_the_density_asked_for(shape, tile, density):
    """A benchmark cell's mask holds round(density x tiles) tiles, chosen from the same draw as
    the Bernoulli mask (whose count varies: 118 of 1,024 blocks at 10% in one run), so masks
    drawn after it from the same generator do not change."""
    grid = (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    exact = T.tile_mask(a, *shape, tile, density, exact=True)
    bernoulli = T.tile_mask(b, *shape, tile, density)
    assert exact.shape == bernoulli.shape == shape and _set_in_whole_units(exact, tile)
    assert exact[::tile[0], ::tile[1]].sum() == round(density * grid[0] * grid[1])
    assert a.random() == b.random()


@pytest.mark.parametrize("kind", T.MASK_KINDS)
def test_every_granularity_is_drawn_with_edges_off_the_tile_grid(kind):
    def ragged(m):
        return m.kind == kind and (m.array.shape[0] % m.tile[0] or m.array.shape[1] % m.tile[1])
    if kind in ("empty", "full", "row", "col", "element"):  # tiles that always fit the shape
        _find(T.masks(), lambda m: m.kind == kind)
    else:
        _find(T.masks(), ragged)


def test_micro_tiles_run_along_either_dimension():
    _find(T.masks(kinds=["micro"]), lambda m: m.tile[0] == 1 and m.array.any())
    _find(T.masks(kinds=["micro"]), lambda m: m.tile[1] == 1 and m.array.any())


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown mask kinds"):
        T.masks(kinds=["diagonal"])
    with pytest.raises(ValueError, match="unknown mask kind"):
        T.granular_mask(np.random.default_rng(0), (4, 4), "diagonal")
    with pytest.raises(ValueError, match="unknown CSR kinds"):
        T.csr_matrices(kinds=["coo"])
    with pytest.raises(ValueError, match="unknown expression kinds"):
        T.expressions(kinds=["gather"])


# -- CSR matrices -------------------------------------------------------------------------------

@given(T.csr_matrices(max_rows=30, max_cols=40))
def test_csr_matrices_are_valid(csr):
    csr.validate()
    rows, cols = csr.shape
    assert 0 <= rows <= 30 and 0 <= cols <= 40
    assert csr.indptr.dtype == csr.indices.dtype == np.int32
    assert csr.data.dtype == np.float64 and np.isfinite(csr.data).all() and (csr.data != 0).all()


@given(T.csr_matrices(values=False, kinds=["random"]))
def test_csr_patterns_carry_no_values(csr):
    assert csr.data is None


@pytest.mark.parametrize("kind", T.CSR_KINDS)
def test_random_csr_kinds(kind):
    rng = np.random.default_rng(0)
    csr = T.random_csr(rng, (0, 5) if kind == "empty" else (60, 1 if kind == "one_col" else 80),
                       kind, 0.05)
    lengths = csr.row_lengths()
    if kind == "empty":
        assert csr.shape == (0, 5) and csr.nnz == 0
    elif kind == "nnz0":
        assert csr.nnz == 0
    elif kind == "one_col":
        assert csr.shape[1] == 1
    elif kind == "empty_rows":
        assert (lengths == 0).sum() >= 15
    elif kind == "dense_row":
        assert lengths.max() == 80
    elif kind == "long_rows":
        assert (lengths == 80).sum() >= 3
    elif kind == "power_law":
        assert lengths.max() >= 5 * lengths.mean() > 0    # hubs far above the mean
    csr.validate()


def test_csr_strategy_draws_empty_rows_and_empty_shapes():
    _find(T.csr_matrices(), lambda c: c.nnz and (c.row_lengths() == 0).any())
    _find(T.csr_matrices(), lambda c: 0 in c.shape)


# -- expressions and shapes ----------------------------------------------------------------------

@given(T.expressions())
def test_expressions_parse_with_the_stated_axes(e):
    op = parse(e.text)
    assert set(op.reduction_axes) == e.reduction
    assert e.fixed <= set(op.axes)
    if e.kind in ("matmul", "batched"):
        assert len(op.inputs) == 2 and len(op.axes) == (3 if e.kind == "matmul" else 4)
    if e.kind == "conv":
        assert any("+" in str(i) for i in op.inputs[0].indices)
    if e.kind == "elementwise":
        assert op.reducer == "none"


@settings(max_examples=15)
@given(T.expressions())
def test_expressions_have_the_stated_rules(e):
    rules = analyse(e.text)
    assert {a for a, r in rules.axes.items() if not r.invariant} == e.fixed


@pytest.mark.parametrize("kind", T.EXPRESSION_KINDS)
def test_every_expression_kind_is_drawn(kind):
    _find(T.expressions(), lambda e: e.kind == kind)


def test_matmul_operands_come_in_any_order_and_transposition():
    def first_holds_output_row(e) -> bool:
        op = parse(e.text)
        return op.output.axes[0] in op.inputs[0].axes

    matmuls = T.expressions(kinds=["matmul"])
    _find(matmuls, first_holds_output_row)
    _find(matmuls, lambda e: not first_holds_output_row(e))
    _find(matmuls, lambda e: parse(e.text).inputs[0].axes[0] in e.reduction)
    _find(matmuls, lambda e: parse(e.text).inputs[1].axes[1] in e.reduction)


@given(T.shapes(3, max_side=40))
def test_shapes_stay_in_bounds(shape):
    assert len(shape) == 3 and all(1 <= s <= 40 for s in shape)


def test_extents_reach_tile_multiples_and_odd_sizes():
    _find(T.extents(), lambda n: n % 64 == 0)
    _find(T.extents(), lambda n: n % 16 and n > 64)


# -- assert_close and poison ----------------------------------------------------------------------

def _round_bits(x: np.ndarray, mantissa: int) -> np.ndarray:
    """float32 values rounded to ``mantissa`` explicit bits, to nearest (tf32: 10, bf16: 7)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - mantissa
    half = (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)
    return (((bits + half) >> drop) << drop).astype(np.uint32).view(np.float32)


def _gemm(rng, m=96, k=300, n=80):
    return rng.standard_normal((m, k)), rng.standard_normal((k, n))


def test_rounding_noise_of_every_dtype_passes():
    rng = np.random.default_rng(0)
    a, b = _gemm(rng)
    # float32 on CUDA cores: float32 products and sums
    T.assert_close(a.astype(np.float32) @ b.astype(np.float32), a.astype(np.float32).astype(float)
                   @ b.astype(np.float32).astype(float), "float32")
    # tf32: the kernel rounds float32 operands to 10 mantissa bits; the reference does not
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    T.assert_close(_round_bits(a32, 10) @ _round_bits(b32, 10), a32.astype(float) @ b32, "tf32")
    # float16 / bfloat16: operands already in the dtype, float32 sums, the output rounded
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    out = (a16.astype(np.float32) @ b16.astype(np.float32)).astype(np.float16)
    T.assert_close(out, a16.astype(float) @ b16.astype(float), "float16")
    T.assert_close(out, a16.astype(float) @ b16.astype(float), np.float16)
    abf, bbf = _round_bits(a32, 7), _round_bits(b32, 7)
    T.assert_close(_round_bits(abf @ bbf, 7), abf.astype(float) @ bbf, "bfloat16")
    # one tf32 product per element (an SDDMM with D = 1): nothing averages the rounding out
    q, k = a32[:, :1], b32[:1].T
    T.assert_close(_round_bits(q, 10) @ _round_bits(k, 10).T, q.astype(float) @ k.T, "tf32")


def test_magnitude_floor_admits_cancelling_results():
    """A product that cancels to far below its terms: held to its own size, its terms' rounding
    noise fails; held to the terms' size (magnitude / sqrt(k)), it passes and a wrong result
    still fails."""
    rng = np.random.default_rng(1)
    a, x = rng.standard_normal((64, 512)), rng.standard_normal((512, 4))
    mag = np.abs(a) @ np.abs(x)
    ref = 1e-4 * (a @ x)
    noisy = ref + 5e-4 * mag / np.sqrt(512) * rng.standard_normal(ref.shape)
    with pytest.raises(AssertionError, match="relative error"):
        T.assert_close(noisy, ref, "float16")
    T.assert_close(noisy, ref, "float16", magnitude=mag, k=512)
    with pytest.raises(AssertionError, match="relative error"):
        T.assert_close(ref + 0.1 * mag / np.sqrt(512), ref, "float16", magnitude=mag, k=512)


def test_one_wrong_element_fails_where_the_norm_would_hide_it():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((512, 512))
    got = ref.copy()
    got[300, 17] += 3.0     # ||error|| / ||ref|| = 3 / 512: inside float16's 1e-2
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < T.TOLERANCES["float16"]
    with pytest.raises(AssertionError, match=r"1 of 262144 elements off .* worst at \(300, 17\)"):
        T.assert_close(got, ref, "float16")


def test_nan_never_passes():
    ref = np.ones((8, 8))
    got = ref.copy()
    got[2, 5] = np.nan
    with pytest.raises(AssertionError, match=r"1 of 64 elements are NaN, first at \(2, 5\)"):
        T.assert_close(got, ref, "float16", tol=1e9)
    with pytest.raises(AssertionError, match="infinite"):
        T.assert_close(np.full((2, 2), np.inf), ref[:2, :2], "float32")
    with pytest.raises(ValueError, match="reference is not finite"):
        T.assert_close(ref, got, "float32")


def test_unwritten_elements_of_a_poisoned_output_show():
    ref = np.arange(12.0).reshape(3, 4)
    out = T.poison(np.empty((3, 4), np.float32))
    out[:, :3] = ref[:, :3]                  # a kernel that forgets the last column
    with pytest.raises(AssertionError, match=r"3 of 12 elements are NaN, first at \(0, 3\)"):
        T.assert_close(out, ref, "float32")
    ids = T.poison(np.empty(5, np.int32))
    assert (ids == np.iinfo(np.int32).min).all()
    ids[:4] = [3, 1, 4, 1]
    with pytest.raises(AssertionError, match=r"1 of 5 elements differ, first at \(4,\)"):
        T.assert_close(ids, np.array([3, 1, 4, 1, 5]), "int32")
    T.assert_close(ids[:4], np.array([3, 1, 4, 1]), np.int32)


def test_poison_values():
    assert np.isnan(T.poison(np.zeros(3, np.float16))).all()
    assert (T.poison(np.zeros(3, np.uint8)) == 255).all()
    assert (T.poison(np.zeros(3, np.int64)) == np.iinfo(np.int64).min).all()
    with pytest.raises(TypeError, match="bool"):
        T.poison(np.zeros(3, bool))
    with pytest.raises(TypeError, match="NumPy array"):
        T.poison([1.0, 2.0])


def test_zero_reference_needs_exact_zeros_and_shapes_must_match():
    T.assert_close(np.zeros((3, 3)), np.zeros((3, 3)), "bfloat16")
    with pytest.raises(AssertionError, match=r"reference is zero but 1 elements are not"):
        T.assert_close(np.eye(3)[0:1] * 1e-30, np.zeros((1, 3)), "bfloat16")
    with pytest.raises(AssertionError, match=r"shape \(3, 2\) != reference shape \(2, 3\)"):
        T.assert_close(np.zeros((3, 2)), np.zeros((2, 3)), "float32")
    with pytest.raises(ValueError, match="no bound for dtype 'float8'"):
        T.assert_close(np.zeros(2), np.zeros(2), "float8")


def test_torch_tensors_are_compared_through_float64():
    torch = pytest.importorskip("torch")
    ref = np.linspace(-1, 1, 64).reshape(8, 8)
    got = torch.tensor(ref, dtype=torch.bfloat16)
    T.assert_close(got, ref, got.dtype)
    T.assert_close(T.poison(torch.empty(8, 8))[:0], ref[:0], "float32")
    with pytest.raises(AssertionError, match="NaN"):
        T.assert_close(T.poison(torch.empty(8, 8)), ref, "float32")
    assert (T.poison(torch.empty(3, dtype=torch.int32)) == torch.iinfo(torch.int32).min).all()


def test_import_needs_neither_hypothesis_nor_torch():
    code = ("import sys; sys.modules['hypothesis'] = sys.modules['torch'] = None\n"
            "import pitgen.testing as T\n"
            "try:\n    T.masks()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "need Hypothesis: pip install hypothesis" in out.stdout


def test_references_are_reexported():
    from pitgen import reference
    assert T.reference is reference and callable(T.reference.attention_reference)


# -- the element-wise bound of a product (scale=) ---------------------------------------------------

def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 rounded to tf32 (10 mantissa bits), as tensor cores read it."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _kernel(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """What a sparse GEMM kernel returns: operands as the tensor cores read them, products
    accumulated in float32 over k-tiles of 32, the result rounded to the output type."""
    if dtype == "tf32":
        a, b = _tf32(a), _tf32(b)
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k0 in range(0, a.shape[1], 32):
        acc += a[:, k0:k0 + 32].astype(np.float32) @ b[k0:k0 + 32].astype(np.float32)
    return acc.astype(np.float16) if dtype == "float16" else acc


@pytest.mark.parametrize("dtype", ["float16", "tf32"])
@pytest.mark.parametrize("M, N, K, density", [(64, 64, 64, 1.0), (96, 48, 1024, 0.3),
                                              (32, 128, 4096, 0.1), (40, 24, 8, 1.0)])
def test_scaled_bound_passes_rounding_and_fails_one_dropped_term(dtype, M, N, K, density):
    rng = np.random.default_rng(M * N + K)
    store = np.float16 if dtype == "float16" else np.float32
    a = (rng.standard_normal((M, K)) * (rng.random((M, K)) < density)).astype(store)
    b = rng.standard_normal((K, N)).astype(store)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    scale = T.term_scale(lambda x, y: x @ y, a, b)
    T.assert_close(_kernel(a, b, dtype), ref, dtype, scale=scale)   # rounding passes
    nz = np.argwhere(a != 0)
    mags = np.abs(a[a != 0].astype(np.float64))
    i, k = nz[np.argsort(mags)[len(mags) // 2]]                      # a typical non-zero
    dropped = a.copy()
    dropped[i, k] = 0
    with pytest.raises(AssertionError, match="beyond the"):
        T.assert_close(_kernel(dropped, b, dtype), ref, dtype, scale=scale)
    wrong = _kernel(a, b, dtype).astype(np.float64)
    wrong[M // 2, N // 2] += 0.01 * np.sqrt(K) * max(1e-3, np.abs(ref).mean() / np.sqrt(K))
    with pytest.raises(AssertionError, match="1 of"):
        T.assert_close(wrong, ref, dtype, scale=scale)


def test_the_norm_bound_alone_misses_a_dropped_term_that_scale_catches():
    """Why the GPU product tests pass scale=: the relative-norm bound lets one dropped term of
    a large product through."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 512)).astype(np.float16)
    b = rng.standard_normal((512, 256)).astype(np.float16)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    dropped = a.copy()
    dropped[7, 11] = 0
    got = _kernel(dropped, b, "float16")
    T.assert_close(got, ref, "float16")                              # the norm bound passes it
    with pytest.raises(AssertionError):
        T.assert_close(got, ref, "float16", scale=T.term_scale(lambda x, y: x @ y, a, b))


def test_scaled_bound_refuses_nan_and_takes_zero_outputs():
    ref = np.zeros((4, 4))
    T.assert_close(np.zeros((4, 4), np.float16), ref, "float16", scale=np.zeros((4, 4)))
    with pytest.raises(AssertionError, match="NaN"):
        T.assert_close(T.poison(np.zeros((4, 4), np.float32)), ref, "float32", scale=ref)
