"""make_plan: candidates, their mask statistics and cost, the choice, and the plan's JSON."""
import importlib
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pitgen
from pitgen import parse
from pitgen import testing as T
from pitgen.errors import PlanError, RuleError
from pitgen.lower import PRODUCTS_EXTENTS, PRODUCTS_SLOTS_PER_ROW, rows_block
from pitgen.planner import (DENSE_MARGIN, Candidate, Plan, batch_axes, candidate_specs,
                            list_candidates, load_profile, make_plan, parse_tile)


MATMUL = "C[m,n] += A[m,k] * B[k,n]"
CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"


def micro_mask(shape=(1024, 1024), tile=(32, 1), density=0.05, seed=0):
    return T.tile_mask(np.random.default_rng(seed), *shape, tile, density)


def find(plan, kind, shape, axis=None):
    return next(c for c in plan.candidates
                if c.kind == kind and c.shape == tuple(shape) and c.axis == axis)


def test_done_when_32x1_micro_tiles_at_95_percent_sparsity():
    mask = micro_mask()
    plan = make_plan(parse(MATMUL), "A", mask=mask)
    assert find(plan, "micro", (32, 1), "k").waste == 0.0
    assert plan.choice.kind != "dense"
    assert (plan.choice.kind, plan.choice.axis, plan.choice.shape) == ("micro", "k", (32, 1))
    assert plan.compute_tile == {"m": 32, "n": 64, "k": 32}
    assert find(plan, "dense", (64, 32)).waste == pytest.approx(1 / mask.mean() - 1)


def test_all_ones_chooses_dense_and_no_mask_is_dense():
    assert make_plan(MATMUL, "A", mask=np.ones((1024, 1024), bool)).choice.kind == "dense"
    assert make_plan(MATMUL, "A", mask=np.ones((100, 300), np.float32)).choice.kind == "dense"
    plan = make_plan(MATMUL, "A")
    assert (plan.choice.kind, plan.masked) == ("dense", False)
    assert all(c.waste == 0.0 for c in plan.candidates)


@settings(max_examples=25, deadline=None)
@given(expr_sparse=st.sampled_from([(MATMUL, "A"), (MATMUL, "B"), ("C[m] max= A[m,k]", "A"),
                                    ("C[m,n] = relu(A[m,n])", "A"), ("S[i,j] += Q[i,d] * K[j,d]", "K")]),
       rows=st.integers(32, 600), cols=st.integers(32, 600), data=st.data())
def test_all_ones_is_dense_for_tensor_core_tiles(expr_sparse, rows, cols, data):
    op = parse(expr_sparse[0])
    tile = {a: data.draw(st.sampled_from([16, 32, 64, 128])) for a in op.axes}
    plan = make_plan(op, expr_sparse[1], mask=np.ones((rows, cols), bool), tile=tile)
    assert plan.choice.kind == "dense", plan.table()


def test_all_zero_mask():
    plan = make_plan(MATMUL, "A", mask=np.zeros((1024, 1024)))
    dense = find(plan, "dense", (64, 32))
    assert dense.waste is None and dense.dense_tiles == 512
    assert plan.choice.kind != "dense" and plan.choice.dense_tiles == 0
    assert plan.choice.waste == 0.0 and dense.to_json()["waste"] is None


def test_candidates_of_each_operator():
    kinds = lambda cs: sorted({(c.kind, c.axis) for c in cs}, key=str)  # noqa: E731
    assert kinds(list_candidates(MATMUL, "A")) == [
        ("block", None), ("dense", None), ("micro", "k"), ("micro", "m")]
    cs = list_candidates(MATMUL, "A")
    assert len(cs) == 4 + 4 + 16 + 1
    assert find_in(cs, "micro", "k", (32, 1)) and find_in(cs, "micro", "m", (1, 64))
    # batch axes (in every access) get extent 1 and are never a micro axis
    assert batch_axes(parse("C[b,m,n] += A[b,m,k] * B[b,k,n]")) == ("b",)
    cs = list_candidates("C[b,m,n] += A[b,m,k] * B[b,k,n]", "A")
    assert all(c.shape[0] == 1 for c in cs) and {c.axis for c in cs} == {None, "m", "k"}
    assert find_in(cs, "micro", "k", (1, 32, 1))
    cs = list_candidates("Y[e,t,n] += X[e,t,k] * W[e,k,n]", "W")
    assert {c.axis for c in cs} == {None, "k", "n"} and all(c.shape[0] == 1 for c in cs)
    # conv: y, x, r, s are coupled, so only n, c (I) and f, c (W) can be micro axes
    assert {c.axis for c in list_candidates(CONV, "I")} == {None, "n", "c"}
    assert {c.axis for c in list_candidates(CONV, "W")} == {None, "f", "c"}
    # a single input has no batch axis; a reduction over k can still tile m
    assert batch_axes(parse("C[m] max= A[m,k]")) == ()
    assert find_in(list_candidates("C[m,n] = sigmoid(A[m,n])", "A"), "block", None, (64, 16))


def find_in(cands, kind, axis, shape):
    return any(c.kind == kind and c.axis == axis and c.shape == shape for c in cands)


def test_shapes_are_clipped_and_deduplicated():
    plan = make_plan(CONV, "W", mask=np.ones((8, 6, 3, 3)))
    shapes = [(c.kind, c.axis, c.shape) for c in plan.candidates]
    assert len(shapes) == len(set(shapes))
    assert all(c.shape[2:] == (3, 3) for c in plan.candidates)
    assert find(plan, "micro", (8, 1, 3, 3), "c")


def test_compute_tile_follows_the_choice():
    op, mask = parse(MATMUL), micro_mask((256, 256))
    tile = {"m": 64, "n": 64, "k": 32}
    assert make_plan(op, "A", mask=mask, micro_tile="32x1").compute_tile == {**tile, "m": 32}
    assert make_plan(op, "A", mask=mask, micro_tile=(1, 64)).compute_tile == {**tile, "k": 64}
    plan = make_plan(op, "A", mask=mask, micro_tile=[64, 32])
    assert plan.choice.kind == "block" and plan.compute_tile == {**tile, "m": 64, "k": 32}
    assert make_plan(op, "A", mask=mask, micro_tile="dense").compute_tile == tile
    plan = make_plan(op, "A", mask=mask, micro_tile=(48, 1), tile="16x16x8")
    assert plan.choice.shape == (48, 1) and plan.compute_tile == {"m": 48, "n": 16, "k": 8}
    assert plan.choice in plan.candidates


def test_micro_tile_along_non_invariant_axis_is_a_rule_error():
    with pytest.raises(RuleError, match=r"indexed by r \+ y.*y: I indexes dimension 2"):
        make_plan(CONV, "I", mask=np.ones((2, 16, 20, 20)), micro_tile=(2, 16, 1, 16))
    with pytest.raises(RuleError, match="axis y of .* is not permutation invariant"):
        make_plan(CONV, "I", micro_tile=Candidate("micro", "y", (2, 16, 1, 16), 0, None, 0, 0.0))
    with pytest.raises(RuleError, match="axis r"):
        make_plan(CONV, "W", micro_tile="16x16x1x3")


def test_micro_tile_that_is_no_candidate():
    with pytest.raises(PlanError, match="has 3 extents but A\\[m,k\\] has rank 2"):
        make_plan(MATMUL, "A", micro_tile=(32, 1, 1))
    with pytest.raises(PlanError, match="ambiguous"):
        make_plan(MATMUL, "A", micro_tile=(1, 1))
    with pytest.raises(PlanError, match="expected 'auto', 'dense' or a shape"):
        make_plan(MATMUL, "A", micro_tile="thin")
    with pytest.raises(PlanError, match="positive"):
        make_plan(MATMUL, "A", micro_tile=(0, 1))
    plan = make_plan(MATMUL, "A", micro_tile=Candidate("micro", "m", (1, 1), 0, None, 0, 0.0))
    assert (plan.choice.kind, plan.choice.axis) == ("micro", "m")


def test_mask_and_operand_errors():
    with pytest.raises(PlanError, match=r"mask has shape \(32,\) \(rank 1\) but A\[m,k\] has rank 2"):
        make_plan(MATMUL, "A", mask=np.ones(32))
    with pytest.raises(PlanError, match=r"mask has shape \(32, 16\) but A has shape \(32, 32\)"):
        make_plan(MATMUL, "A", mask=np.ones((32, 16)), shape=(32, 32))
    with pytest.raises(PlanError, match="'D' is not an input .*operands: A, B"):
        make_plan(MATMUL, "D", mask=np.ones((4, 4)))
    with pytest.raises(PlanError, match="operands: A, B"):
        make_plan(MATMUL, "C")
    with pytest.raises(PlanError, match="read 2 times"):
        make_plan("C[m,n] += A[m,k] * A[k,n]", "A")
    with pytest.raises(PlanError, match="empty dimension"):
        make_plan(MATMUL, "A", mask=np.ones((0, 4)))


@pytest.mark.parametrize("tile,msg", [
    ("64x64", "tile has 2 extents, expected 3 extents in axis order mxnxk"),
    ("64x0x32", "tile extent of n must be a positive integer"),
    ("axbxc", "expected 3 extents"),
    ([64, -1, 32], "tile extent of n"),
    ([64, 32.0, 32], "tile extent of n"),
    ({"q": 3}, "not axes of"),
])
def test_bad_tiles(tile, msg):
    with pytest.raises(PlanError, match=msg):
        make_plan(MATMUL, "A", tile=tile)


def test_tile_forms():
    op = parse(MATMUL)
    assert parse_tile(op, None) == {"m": 64, "n": 64, "k": 32}
    assert parse_tile(op, "16x32x8") == parse_tile(op, (16, 32, 8)) == {"m": 16, "n": 32, "k": 8}
    assert parse_tile(op, {"k": 64}) == {"m": 64, "n": 64, "k": 64}
    assert parse_tile(parse("C[b,m,n] += A[b,m,k] * B[b,k,n]"), None) == {
        "b": 1, "m": 64, "n": 64, "k": 32}
    assert make_plan(op, "A", tile="16x32x8").tile == {"m": 16, "n": 32, "k": 8}


def brute_stats(mask, cand, chunk):
    """nonzero, covered elements, dense tiles and elements computed in them by looping over
    tiles (of a matmul's A). Micro-tiles along m pack per row block of the row-owner kernel, and
    their elements computed are their own."""
    d = {"m": 0, "k": 1, None: None}[cand.axis]
    shape = mask.shape
    run = rows_block(shape[0]) if cand.axis == "m" else None
    grid = [range(0, n, t) for n, t in zip(shape, cand.shape)]
    nonzero = covered = 0
    per_group = {}
    for corner in np.ndindex(*(len(g) for g in grid)):
        box = tuple(slice(g[c], g[c] + t) for g, c, t in zip(grid, corner, cand.shape))
        if mask[box].any():
            nonzero += 1
            covered += mask[box].size
            group = tuple(c for i, c in enumerate(corner) if i != d) + (
                (corner[d] // run,) if run else ())
            per_group[group] = per_group.get(group, 0) + 1
    if cand.kind != "micro":
        return nonzero, covered, nonzero, covered
    tiles = sum(-(-n // chunk) for n in per_group.values())
    return nonzero, covered, tiles, covered if run else tiles * math.prod(cand.shape) * chunk


#: Every element of S computed costs 1: a candidate's cost is then its work count.
UNIT_PROFILE = {"device": "unit costs", "measured": False, "index_ns_per_element": 0.0,
                "kinds": {k: {"fixed_ns": 0.0, "ns_per_element": 1.0}
                          for k in ("dense", "block", "micro-reduction", "micro-spatial")}}


def nearest_measured(kind: dict, shape: tuple) -> dict:
    """The rates of the measured shape the planner must price ``shape`` by: its own, else the
    measured one whose extents are nearest (sum of log ratios), the slowest on a tie."""
    shapes = kind.get("shapes", {})
    if not shapes:
        return {}
    ranked = sorted(shapes, key=lambda name: (
        round(sum(abs(math.log(int(d) / t)) for d, t in zip(name.split("x"), shape)), 9),
        -shapes[name]["ns_per_element"]))
    own = "x".join(map(str, shape))
    return shapes[own] if own in shapes else shapes[ranked[0]]


@settings(max_examples=25, deadline=None)
@given(drawn=T.masks(max_side=70, densities=(0.02, 0.2, 0.7)), tk=st.integers(1, 40))
def test_statistics_match_brute_force(drawn, tk):
    check_statistics(drawn.array, tk)


@settings(max_examples=8, deadline=None)
@given(drawn=T.masks(st.tuples(st.integers(513, 1200), st.integers(1, 48)),
                     kinds=("micro", "element", "row", "empty"), densities=(0.005, 0.05, 0.5)),
       tk=st.integers(1, 40))
def test_statistics_match_brute_force_across_row_blocks(drawn, tk):
    """S taller than one row block of the row-owner kernel (512 rows): micro-tiles along m
    pack within each block, ragged last block included."""
    check_statistics(drawn.array, tk)


def check_statistics(mask, tk):
    m, k = mask.shape
    plan = make_plan(MATMUL, "A", mask=mask, tile={"k": tk})
    nnz = int(mask.sum())
    prof = plan.profile
    outputs = m * prof.get("width", 4096)   # C's elements: A's rows times B's width
    for c in plan.candidates:
        if c.kind == "dense":
            tiles = math.ceil(m / c.shape[0]) * math.ceil(k / c.shape[1])
            assert c.dense_tiles == tiles
            dense = prof["kinds"]["dense"]
            zeros = 1 - nnz / (m * k)
            assert c.cost == pytest.approx(
                tiles * dense["fixed_ns"] + outputs * dense.get("out_ns_per_element", 0.0)
                + m * k * dense["ns_per_element"] * (1 - dense.get("zeros_discount", 0.0) * zeros))
            assert c.waste == ((m * k - nnz) / nnz if nnz else None)
            continue
        chunk = min(tk, k) if c.axis == "k" else min(64, m)
        nonzero, covered, tiles, elements = brute_stats(mask, c, chunk)
        assert (c.nonzero, c.dense_tiles) == (nonzero, tiles), c
        assert c.waste == pytest.approx((covered - nnz) / nnz if nnz else 0.0)
        key = {"block": "block", "k": "micro-reduction", "m": "micro-spatial"}[c.axis or c.kind]
        kind = {**prof["kinds"][key], **nearest_measured(prof["kinds"][key], c.shape)}
        index = kind.get("index_ns_per_element", prof["index_ns_per_element"])
        want = (tiles * kind["fixed_ns"] + elements * kind["ns_per_element"]
                + prof.get("index_fixed_ns", 0.0)
                + m * k * (index + kind.get("walk_ns_per_element", 0.0))
                + outputs * kind.get("out_ns_per_element", 0.0))
        products = prof["kinds"][key].get("products")
        if products and c.axis == "m" and nonzero <= m * PRODUCTS_SLOTS_PER_ROW \
                and c.shape[1] in PRODUCTS_EXTENTS:
            want = min(want, prof.get("index_fixed_ns", 0.0) + elements * products["ns_per_element"]
                       + m * k * (index + products["walk_ns_per_element"])
                       + outputs * products.get("out_ns_per_element", 0.0))
        assert c.cost == pytest.approx(want)
    costs = [c.cost for c in plan.candidates]
    dense = next(c for c in plan.candidates if c.kind == "dense")
    best = plan.candidates[0]
    assert costs == sorted(costs)
    assert plan.choice is (best if best.cost <= (1 - DENSE_MARGIN) * dense.cost else dense)


def test_rows_steps_are_counted_per_row_block():
    """Micro-tiles along m are the row-owner kernel's: each row block's active rows of a k-tile
    take whole steps of 64, so 1,100 rows (blocks of 512, 512 and 76) with one active row per
    block in a k-tile take three steps where packing all 1,100 together would take one; the
    counts without a mask (all ones) follow the same blocks; elements are the micro-tiles'."""
    mask = np.zeros((1100, 256), bool)
    mask[[3, 600, 1099], :64] = True           # k-tile 0: one row in each block
    mask[:130, 64:128] = True                  # k-tile 1: 130 rows of block 0: three steps
    plan = make_plan(MATMUL, "A", mask=mask, micro_tile="1x64", profile=UNIT_PROFILE)
    assert (plan.choice.nonzero, plan.choice.dense_tiles) == (133, 6)
    assert plan.choice.cost == 133 * 64
    full = make_plan(MATMUL, "A", shape=(1100, 256), micro_tile="1x64", profile=UNIT_PROFILE)
    ones = make_plan(MATMUL, "A", mask=np.ones((1100, 256), bool), micro_tile="1x64",
                     profile=UNIT_PROFILE)
    assert full.choice.dense_tiles == ones.choice.dense_tiles == 4 * (8 + 8 + 2)
    # along k nothing changes: 32 x 1 micro-tiles pack within the whole k axis
    k = make_plan(MATMUL, "A", mask=mask, micro_tile="32x1", profile=UNIT_PROFILE).choice
    assert k.dense_tiles == sum(-(-int(mask[r:r + 32].any(0).sum()) // 32)
                                for r in range(0, 1100, 32))


def test_coverage_counts_plan_like_the_mask():
    """Counts made elsewhere (the GPU planner) give the same plan as the mask itself."""
    mask = micro_mask((96, 160), (32, 1), 0.1) | (np.random.default_rng(1).random((96, 160)) < 0.002)
    tile = {"m": 64, "n": 64, "k": 16}
    specs = candidate_specs(MATMUL, "A", mask.shape, tile)
    assert specs[-1] == ("dense", None, (64, 16)) and len(specs) == len(set(specs))
    counts = {}
    for kind, axis, shape in specs:
        c = Candidate(kind, axis, shape, 0, None, 0, 0.0)
        chunk = 16 if axis == "k" else 64
        nonzero, covered, tiles, _ = brute_stats(mask, c, chunk)
        counts[(kind, axis, shape)] = (nonzero, tiles if kind != "dense" else 2 * 10, covered)
    from_counts = make_plan(MATMUL, "A", tile=tile, shape=mask.shape,
                            coverage={"counts": counts, "nnz": int(mask.sum())})
    from_mask = make_plan(MATMUL, "A", mask=mask, tile=tile)
    assert from_counts.masked and from_counts.choice == from_mask.choice
    assert from_counts.candidates == from_mask.candidates
    with pytest.raises(PlanError, match="lack candidates"):
        make_plan(MATMUL, "A", shape=mask.shape, coverage={"counts": {}, "nnz": 0})
    with pytest.raises(PlanError, match="need the operand's shape"):
        make_plan(MATMUL, "A", coverage={"counts": counts, "nnz": 0})


def test_profile_loading(tmp_path, monkeypatch):
    prof = load_profile("analytic")
    assert prof["device"] == "analytic placeholder (no GPU measured)" and prof["measured"] is False
    k = prof["kinds"]
    assert k["dense"]["ns_per_element"] < k["block"]["ns_per_element"] \
        < k["micro-reduction"]["ns_per_element"] < k["micro-spatial"]["ns_per_element"]
    shipped = load_profile()  # the measured profile shipped with the package wins
    assert shipped["measured"] is True and "NVIDIA" in shipped["device"]
    # a profile that makes dense nearly free must choose dense even at 95% sparsity
    cheap = json.loads(json.dumps(prof))
    cheap["kinds"]["dense"] = {"fixed_ns": 0, "ns_per_element": 1e-9}
    path = tmp_path / "cheap.json"
    path.write_text(json.dumps(cheap))
    assert make_plan(MATMUL, "A", mask=micro_mask((256, 256)), profile=str(path)).choice.kind == "dense"
    assert make_plan(MATMUL, "A", mask=micro_mask((256, 256)), profile=cheap).choice.kind == "dense"
    with pytest.raises(PlanError, match="kinds.block.fixed_ns"):
        load_profile({**prof, "kinds": {**prof["kinds"], "block": {"ns_per_element": 1}}})
    with pytest.raises(PlanError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    # a measured profile next to the analytic one is preferred
    plan_mod = importlib.import_module("pitgen.planner")  # `pitgen.plan` is also make_plan
    measured = {**prof, "device": "NVIDIA H100 80GB HBM3", "measured": True}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    monkeypatch.setattr(plan_mod.resources, "files", lambda pkg: tmp_path)
    assert load_profile()["device"] == "NVIDIA H100 80GB HBM3"
    assert make_plan(MATMUL, "A").to_json()["profile"] == "NVIDIA H100 80GB HBM3"


def test_rows_of_at_most_one_micro_tile_are_priced_on_the_products_kernel():
    """1 x 64 micro-tiles along m at 99% and 90% (0.16 and 1.6 per row of S, 16 k-tiles): the
    cheaper of the row-owner and the products kernel's fit, and the matmul API then asks
    lowering for the products kernel; at 70% (4.8 per row, more products than the kernel has
    slots) only the row-owner kernel's fit, and the row-owner kernel runs."""
    prof = load_profile()
    spatial = prof["kinds"]["micro-spatial"]
    p, fit = spatial["products"], {**spatial, **spatial["shapes"]["1x64"]}
    rng = np.random.default_rng(5)
    kern = pitgen.compile(MATMUL, sparse="A", dtype="float16")
    for density, products in ((0.01, True), (0.1, True), (0.3, False)):
        mask = np.repeat(rng.random((1024, 16)) < density, 64, axis=1)
        plan = make_plan(MATMUL, "A", mask=mask, profile=prof)
        c = next(c for c in plan.candidates if c.label == "micro 1x64 along m")
        elements, total = c.nonzero * 64, mask.size
        launch, outputs = prof.get("index_fixed_ns", 0.0), 1024 * prof.get("width", 4096)
        owner = (launch + c.dense_tiles * fit["fixed_ns"] + elements * fit["ns_per_element"]
                 + total * (fit["index_ns_per_element"] + fit["walk_ns_per_element"])
                 + outputs * fit.get("out_ns_per_element", 0.0))
        cheaper = launch + elements * p["ns_per_element"] + total * (
            fit["index_ns_per_element"] + p["walk_ns_per_element"]) + outputs * p.get(
            "out_ns_per_element", 0.0)
        assert (c.nonzero <= 1024 * PRODUCTS_SLOTS_PER_ROW) == products
        assert c.cost == pytest.approx(min(owner, cheaper) if products else owner)
        chosen = replace(plan, choice=c)
        assert kern._schedule(chosen).rows == ("products" if products else None)
    with pytest.raises(PlanError, match=r"kinds.micro-spatial.products.ns_per_element"):
        load_profile({**prof, "kinds": {**prof["kinds"], "micro-spatial": {
            **spatial, "products": {"walk_ns_per_element": 0.0}}}})


def test_a_measured_shape_and_a_kinds_index_override_the_kind_fit():
    """One kind may run on two mainloops (blocks of 32 x 32 on mma.sync, 128 x 128 on wgmma) and
    its index cost differently from another kind's: a shape's own entry and a kind's own index
    price replace the kind's fit and the profile's index; a shape no kernel was timed at takes
    the rates of the measured one nearest in its extents, the slower on a tie."""
    mask = micro_mask((512, 512), (128, 128), 0.05)
    prof = json.loads(json.dumps(load_profile("analytic")))
    unit = {c.label: c.cost for c in make_plan(MATMUL, "A", mask=mask,
                                               profile=UNIT_PROFILE).candidates}
    base = {c.label: c.cost for c in make_plan(MATMUL, "A", mask=mask, profile=prof).candidates}
    block = prof["kinds"]["block"]
    zero = {"fixed_ns": 0.0, "ns_per_element": 0.0, "walk_ns_per_element": 0.0,
            "index_ns_per_element": 0.0}
    block["shapes"] = {"128x128": zero, "32x32": {**zero, "ns_per_element": 5.0}}
    prof["kinds"]["micro-reduction"]["index_ns_per_element"] = 1.0
    plan = make_plan(MATMUL, "A", mask=mask, profile=prof)
    cost = {c.label: c.cost for c in plan.candidates}
    assert plan.choice.cost == 0.0 and cost["block 128x128"] == 0.0
    assert cost["block 128x64"] == 0.0   # nearest 128x128 (log 2 away; 32x32 is log 8)
    assert cost["block 32x64"] == pytest.approx(5.0 * unit["block 32x64"])   # 32x32's rates
    assert cost["block 64x64"] == pytest.approx(5.0 * unit["block 64x64"])   # a tie: the slower
    micro = next(c for c in plan.candidates if c.kind == "micro" and c.axis == "k")
    assert cost[micro.label] == pytest.approx(
        base[micro.label] + 512 * 512 * (1.0 - prof["index_ns_per_element"]))
    with pytest.raises(PlanError, match=r"kinds.block.shapes.128x128.ns_per_element"):
        block["shapes"]["128x128"]["ns_per_element"] = -1
        load_profile(prof)
    with pytest.raises(PlanError, match=r"kinds.block.shapes.32 by 32 \(a tile shape"):
        block["shapes"] = {"32 by 32": zero}
        load_profile(prof)
    with pytest.raises(PlanError, match=r"kinds.block.shapes"):
        block["shapes"] = [1]
        load_profile(prof)


def test_to_json_schema_and_table():
    plan = make_plan(MATMUL, "A", mask=micro_mask((1024, 1024)))
    assert isinstance(plan, Plan)
    doc = json.loads(json.dumps(plan.to_json()))
    assert set(doc) == {"expression", "sparse", "shape", "masked", "tile", "compute_tile",
                        "profile", "choice", "candidates"}
    assert (doc["expression"], doc["sparse"], doc["shape"], doc["masked"]) == (MATMUL, "A", [1024, 1024], True)
    assert doc["tile"] == {"m": 64, "n": 64, "k": 32}
    assert doc["profile"] == load_profile()["device"]
    for c in [doc["choice"], *doc["candidates"]]:
        assert set(c) == {"kind", "axis", "shape", "nonzero", "waste", "cost", "dense_tiles"}
        assert c["kind"] in ("micro", "block", "dense")
        assert (c["axis"] is None) == (c["kind"] != "micro")
        assert isinstance(c["shape"], list) and isinstance(c["nonzero"], int)
    assert doc["choice"] == doc["candidates"][0] == {**doc["choice"], "kind": "micro", "axis": "k",
                                                      "shape": [32, 1], "waste": 0.0}
    table = plan.table()
    assert table.startswith(f"plan for {MATMUL}\n")
    assert "choice: micro 32x1 along k; compute tile m=32 n=64 k=32" in table
    star = [line for line in table.splitlines() if line.startswith("*")]
    assert len(star) == 1 and "micro  k" in star[0] and "32x1" in star[0]
    assert len(table.splitlines()) == 6 + len(plan.candidates)


def test_large_mask_plans_fast():
    import time
    mask = micro_mask((4096, 4096))
    start = time.perf_counter()
    plan = make_plan(MATMUL, "A", mask=mask)
    assert time.perf_counter() - start < 3.0
    assert (plan.choice.kind, plan.choice.shape) == ("micro", (32, 1))


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 80), N=st.integers(1, 80), K=st.integers(1, 80),
       dtype=st.sampled_from(["float16", "float32"]), arch=st.sampled_from(["sm_80", "sm_90"]),
       gran=st.sampled_from(T.MASK_KINDS), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       seed=st.integers(0, 2**31 - 1))
def test_auto_lowers_on_every_shape_and_mask(M, N, K, dtype, arch, gran, density, seed):
    """What SparseKernel does with an 'auto' plan: its choice, then the other candidates (dense
    among them) until lowering accepts one; decode-sized M, tiny K and empty operands included."""
    from pitgen.lower import Layout, lower_first
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    rng = np.random.default_rng(seed)
    mask = T.granular_mask(rng, (M, K), gran, (32, 1), density)
    plan = make_plan(op, "A", mask=mask)
    order = [plan.choice] + [c for c in plan.candidates if c != plan.choice]
    assert any(c.kind == "dense" for c in order)
    lay = Layout(M, N, K, (K, 1), (N, 1), (N, 1), 2, 2, 2)
    i, spec = lower_first(op, "A", [(c.kind, c.axis, c.shape) for c in order], dtype, lay,
                          arch=arch)
    assert spec.plan_kind == order[i].kind


def test_clipped_micro_tiles_and_blocks_lower_to_the_next_kernel_extent():
    from pitgen.lower import Layout, lower
    op = parse("C[m,n] += A[m,k] * B[k,n]")
    lay = Layout(15, 64, 8, (8, 1), (64, 1), (64, 1))
    assert lower(op, "A", "micro", "k", (15, 1), "float16", lay).gemm.bm == 16
    spec = lower(op, "A", "block", None, (15, 8), "float16", lay)
    assert (spec.gemm.bm, spec.index.block_cols) == (16, 16)
    with pytest.raises(PlanError, match="mma"):  # not clipped: a 15-row tile has no kernel
        lower(op, "A", "micro", "k", (15, 1), "float16", Layout(64, 64, 64, (64, 1), (64, 1), (64, 1)))


def test_width_scales_the_kernels_not_the_index():
    """A product's width (N) scales every kernel term of a candidate's cost, never the index
    pass (its launch and its read of S): costs are affine in the width, dense's proportional."""
    mask = micro_mask((1024, 1024), (32, 64), 0.1)
    prof = load_profile()
    costs = {w: {c.label: c.cost for c in make_plan(MATMUL, "A", mask=mask, width=w).candidates}
             for w in (1024, 2048, 3072, prof.get("width", 4096))}
    default = {c.label: c.cost for c in make_plan(MATMUL, "A", mask=mask).candidates}
    assert costs[prof.get("width", 4096)] == pytest.approx(default)
    for bad in (0, -3, 2.5, True, "768"):
        with pytest.raises(PlanError, match="width must be a positive integer"):
            make_plan(MATMUL, "A", mask=mask, width=bad)
    for c in make_plan(MATMUL, "A", mask=mask).candidates:
        label = c.label
        assert costs[1024][label] + costs[3072][label] == pytest.approx(2 * costs[2048][label])
        index = costs[1024][label] - (costs[2048][label] - costs[1024][label])   # at width 0
        if c.kind == "dense":
            assert index == pytest.approx(0.0, abs=1e-6)
            continue
        key = {"block": "block", "k": "micro-reduction", "m": "micro-spatial"}[c.axis or c.kind]
        kind = {**prof["kinds"][key], **nearest_measured(prof["kinds"][key], c.shape)}
        want = prof.get("index_fixed_ns", 0.0) + mask.size * kind.get(
            "index_ns_per_element", prof["index_ns_per_element"])
        products = prof["kinds"][key].get("products")
        if not (products and c.axis == "m" and c.shape[1] in PRODUCTS_EXTENTS
                and c.nonzero <= 1024 * PRODUCTS_SLOTS_PER_ROW):
            assert index == pytest.approx(want, rel=1e-6), label


@pytest.mark.parametrize("pad, width, dense", [(128, 768, True), (128, 3072, True),
                                               (512, 768, True), (512, 3072, False)])
def test_bert_padding_plans_by_its_own_width(pad, width, dense):
    """BERT-base's linear layers on a batch of 32 padded sequences (docs/bench/seqlen.md, H200):
    at 15% valid tokens of 128 the layers are small enough that dense cuBLAS (12 and 32 us) beats
    any sparse plan, whose index launch alone is priced; at 512 the 768 -> 3072 layer's block
    plan is 1.6x faster, and the 768 -> 768 layer's 8% slower (35.4 us against 32.6: each of its
    blocks' tiles runs 6 k-steps, so C's stores weigh 5.3 times what they do at k = 4096).
    Planned at a 4096-wide product's prices, the 128-token cells chose blocks 2.6x and 1.9x
    slower than dense; priced without C's stores, the 512-token 768 -> 768 cell chose blocks."""
    rng = np.random.default_rng(7)
    for p in (128, 512):   # the benchmark's draws, in its order
        lengths = np.clip(np.ceil(np.exp(rng.normal(math.log(p / 6), 0.9, size=32))), 1, p)
        if p == pad:
            break
    valid = (np.arange(pad)[None, :] < lengths[:, None]).reshape(-1)
    plan = make_plan("Y[t,n] += X[t,k] * W[k,n]", "X", mask=np.repeat(valid[:, None], 768, 1),
                     width=width)
    assert (plan.choice.kind == "dense") == dense, plan.table()


def test_auto_takes_a_sparse_plan_only_for_more_than_the_margin():
    """``auto`` runs dense unless the cheapest sparse plan is priced at least DENSE_MARGIN
    under it (a sparse plan's fit errs by more than dense's: 8192^2 1x1 at 99%, 32x1 priced 5%
    under cuBLAS ran 2-3% over it); explicit requests and the candidates' order are untouched."""
    mask = micro_mask((2048, 2048), (128, 128), 0.1)
    prof = json.loads(json.dumps(load_profile()))
    base = make_plan(MATMUL, "A", mask=mask, profile=prof)
    best = base.candidates[0]
    assert best.kind == "block"
    dense = next(c for c in base.candidates if c.kind == "dense")
    for ratio, want in ((1 - DENSE_MARGIN / 2, "dense"), (1 - 2 * DENSE_MARGIN, "block")):
        # scale dense's prices so that the best block plan costs `ratio` of dense
        d = prof["kinds"]["dense"]
        p2 = {**prof, "kinds": {**prof["kinds"], "dense": {
            **d, "ns_per_element": d["ns_per_element"] * best.cost / ratio / dense.cost,
            "out_ns_per_element": d.get("out_ns_per_element", 0.0) * best.cost / ratio
            / dense.cost}}}
        plan = make_plan(MATMUL, "A", mask=mask, profile=p2)
        assert plan.candidates[0].kind == "block" and plan.choice.kind == want, plan.table()
        assert ("under the 4% margin" in plan.table()) == (want == "dense")
        assert make_plan(MATMUL, "A", mask=mask, profile=p2, micro_tile=best.shape).choice.kind \
            == "block"


def test_a_short_product_pays_for_its_output_and_dense_for_less_on_zeros():
    """C's elements are priced per element written (S's rows times B's width), not per element of
    S: at k = 1024 a 4096-row product writes as much as at k = 4096; dense saves
    ``zeros_discount`` of its element time in proportion to S's zeros."""
    prof = json.loads(json.dumps(load_profile("analytic")))
    for kind in prof["kinds"].values():
        kind.update(fixed_ns=0.0, ns_per_element=0.0, walk_ns_per_element=0.0,
                    out_ns_per_element=1.0)
    prof.update(index_ns_per_element=0.0, index_fixed_ns=0.0)
    for k in (256, 1024):
        mask = micro_mask((512, k), (32, 1), 0.1)
        costs = {c.kind: c.cost for c in make_plan(MATMUL, "A", mask=mask, profile=prof,
                                                   width=300).candidates}
        assert set(costs.values()) == {512 * 300}, costs
    prof["kinds"]["dense"].update(ns_per_element=1.0, out_ns_per_element=0.0,
                                  zeros_discount=0.2)
    mask = np.zeros((64, 64), bool)
    mask[:16] = True   # 75% zeros
    dense = next(c for c in make_plan(MATMUL, "A", mask=mask, profile=prof).candidates
                 if c.kind == "dense")
    assert dense.cost == pytest.approx(64 * 64 * (1 - 0.2 * 0.75))
    for bad in (1.0, -0.1, "0.1"):
        prof["kinds"]["dense"]["zeros_discount"] = bad
        with pytest.raises(PlanError, match="zeros_discount"):
            load_profile(prof)
