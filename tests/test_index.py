"""build_index (the NumPy reference of the GPU's online index) against a brute-force loop."""
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pitgen import parse
from pitgen.errors import PlanError
from pitgen.index import TileIndex, build_index, tile_grid
from pitgen.planner import Candidate, make_plan

MATMUL = parse("C[m,n] += A[m,k] * B[k,n]")
BATCHED = parse("C[b,m,n] += A[b,m,k] * B[b,k,n]")
CONV = parse("O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]")
ELEMENTWISE = parse("C[m,n] = relu(A[m,n])")


def cand(kind, axis, shape):
    return Candidate(kind, axis, tuple(shape), 0, None, 0, 0.0)


def brute(mask, tile, dim):
    """counts and id sets by looping over every group and every position along ``dim``."""
    shape = mask.shape
    others = [d for d in range(mask.ndim) if d != dim]
    grid = tuple(-(-shape[d] // tile[d]) for d in others)
    n_list = -(-shape[dim] // tile[dim])
    counts, sets = np.zeros(grid, np.int32), {}
    for g in np.ndindex(grid):
        ids = set()
        for i in range(n_list):
            box = [slice(None)] * mask.ndim
            for gd, d in zip(g, others):
                box[d] = slice(gd * tile[d], (gd + 1) * tile[d])
            box[dim] = slice(i * tile[dim], (i + 1) * tile[dim])
            if mask[tuple(box)].any():
                ids.add(i)
        counts[g], sets[g] = len(ids), frozenset(ids)
    return counts, sets


def check(index: TileIndex, mask, tile, dim):
    counts, sets = brute(mask, tile, dim)
    assert index.dim == dim and index.tile == tuple(tile)
    assert index.counts.dtype == np.int32 and index.ids.dtype == np.int32
    np.testing.assert_array_equal(index.counts, counts)
    assert index.ids.shape == counts.shape + (-(-mask.shape[dim] // tile[dim]),)
    assert index.sets() == sets
    n = index.ids.shape[-1]
    pad = np.arange(n) >= index.counts[..., None]
    assert (index.ids[pad] == -1).all() and (index.ids[~pad] >= 0).all()
    assert index.nonzero == sum(len(s) for s in sets.values())


OPS = [(MATMUL, "A"), (MATMUL, "B"), (BATCHED, "A"), (CONV, "W"), (CONV, "I"), (ELEMENTWISE, "A")]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_index_matches_brute_force(data):
    op, sparse = data.draw(st.sampled_from(OPS))
    acc = op.access(sparse)
    shape = tuple(data.draw(st.integers(1, 11 if acc.rank > 2 else 40)) for _ in range(acc.rank))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    mask = rng.random(shape) < data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    if data.draw(st.booleans()):  # non-bool masks: non-zero means present
        mask = mask * rng.standard_normal(shape)
    bare = [a for a in acc.axes if acc.bare_dim(a) is not None]
    kind = data.draw(st.sampled_from(["micro", "block"]))
    tile = [data.draw(st.integers(1, n + 3)) for n in shape]
    if kind == "micro":
        axis = data.draw(st.sampled_from(bare))
        dim = acc.bare_dim(axis)
        tile[dim] = 1
    else:
        axis = None
        reds = [acc.bare_dim(a) for a in op.reduction_axes if acc.bare_dim(a) is not None]
        dim = reds[0] if reds else acc.rank - 1
    index = build_index(mask, op, sparse, cand(kind, axis, tile))
    clipped = [min(t, n) for t, n in zip(tile, shape)]
    check(index, mask != 0, clipped, dim)
    assert index.kind == kind and index.axis == axis and index.shape == shape


def test_edge_tiles_are_clipped():
    mask = np.zeros((70, 45), bool)
    mask[69, 44] = mask[0, 3] = mask[40, 3] = True
    index = build_index(mask, MATMUL, "A", cand("micro", "k", (32, 1)))
    assert index.counts.tolist() == [1, 1, 1]
    assert index.sets() == {(0,): {3}, (1,): {3}, (2,): {44}}
    assert index.group_box((2,)) == [(64, 70), (0, 45)]
    index = build_index(mask, MATMUL, "A", cand("block", None, (64, 16)))
    assert index.dim == 1  # A's reduction dimension k lists the blocks
    assert index.sets() == {(0,): {0}, (1,): {2}}
    assert index.group_box((1,)) == [(64, 70), (0, 45)]


def test_sets_ignore_order():
    rng = np.random.default_rng(1)
    mask = rng.random((64, 64)) < 0.2
    index = build_index(mask, MATMUL, "A", cand("micro", "k", (16, 1)))
    ids = index.ids.copy()
    for g in np.ndindex(index.counts.shape):
        ids[g][:index.counts[g]] = rng.permutation(ids[g][:index.counts[g]])
    shuffled = TileIndex(index.kind, index.axis, index.dim, index.shape, index.tile,
                         index.counts, ids)
    assert not np.array_equal(ids, index.ids)
    assert shuffled.sets() == index.sets()


def test_dense_index_is_one_full_group():
    index = build_index(np.zeros((5, 7)), MATMUL, "A", cand("dense", None, (64, 32)))
    assert (index.kind, index.tile, index.counts.tolist(), index.ids.tolist()) == (
        "dense", (5, 7), [1], [[0]])


def test_index_from_plan_uses_its_choice():
    mask = np.repeat(np.random.default_rng(0).random((64, 1024)) < 0.05, 32, axis=0)
    plan = make_plan(MATMUL, "A", mask=mask)
    index = build_index(mask, MATMUL, "A", plan)
    assert (index.kind, index.axis, index.tile) == ("micro", "k", (32, 1)) == (
        plan.choice.kind, plan.choice.axis, plan.choice.shape)
    assert index.nonzero == plan.choice.nonzero


def test_index_errors():
    with pytest.raises(PlanError, match=r"mask has shape \(4,\) \(rank 1\) but A\[m,k\] has rank 2"):
        build_index(np.ones(4), MATMUL, "A", cand("block", None, (2, 2)))
    with pytest.raises(PlanError, match="not 1 along k"):
        build_index(np.ones((4, 4)), MATMUL, "A", cand("micro", "k", (2, 2)))
    with pytest.raises(PlanError, match="operands: A, B"):
        build_index(np.ones((4, 4)), MATMUL, "C", cand("block", None, (2, 2)))


def test_tile_grid_cache_matches_uncached():
    rng = np.random.default_rng(2)
    mask = rng.random((100, 77)) < 0.01
    cache = {}
    for tile in [(16, 1), (32, 1), (1, 16), (64, 128), (16, 32), (128, 64), (3, 5), (6, 10)]:
        np.testing.assert_array_equal(tile_grid(mask, tile, cache), tile_grid(mask, tile))
        ref = brute(mask, tile, 0)[0] if tile[0] == 1 else None
        if ref is not None:
            np.testing.assert_array_equal(tile_grid(mask, tile).sum(0), ref)


def test_large_mask_is_fast():
    mask = np.random.default_rng(0).random((4096, 4096)) < 0.01
    start = time.perf_counter()
    index = build_index(mask, MATMUL, "A", cand("micro", "k", (32, 1)))
    elapsed = time.perf_counter() - start
    assert index.ids.shape == (128, 4096)
    assert elapsed < 3.0, elapsed
