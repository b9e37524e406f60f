"""CPU tests of dynamic sparse attention: the rule derivation, plan decisions, the NumPy block
index, the gathered-key / dense-row decision against a row-by-row statement of its rule, the
float64 reference, the mask generators, rendering, and nvcc compilation of every variant
(D 64/128 x fp16/bf16), each for sm_80 or sm_90a (what Hopper builds) so that both archs meet
every D and every dtype."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitgen import testing as T
from pitgen import reference as R
import pitgen
from pitgen.ops import attention as A
from pitgen import compiler

ARCHS = ("sm_80", "sm_90a")

def test_derivation_uses_the_rules():
    # the axes the kernels permute come from the rule engine
    assert A.ATTENTION.derive() == {"query blocks": ("b", "h", "i"), "key blocks": ("j",)}
    # A key axis inside index arithmetic would not be invariant: the same check refuses it.
    with pytest.raises(pitgen.RuleError):
        pitgen.analyse("O[i,d] += P[i,j] * V[j+i,d]").require_invariant("j")


def test_plan_decisions():
    p = A.plan_attention(2, 12, 1000, 4096, 128, "bfloat16", (12, 1000, 4096))
    assert (p.bm, p.bn, p.warps) == (64, 64, 4)
    assert (p.n_qb, p.n_kb, p.slices) == (16, 64, 12)
    assert p.mask_strides == (0, 1)
    assert p.index_grid() == (8, 16, 12) and p.dq_grid(False) == (24, 16, 1)
    # the parts of dense-row tiles first (16 blocks x 4 rows / 64 = 1 tile x 8 parts), then
    # the 16 query blocks
    assert (p.dense_tiles, p.dense_split) == (1, 8) and p.forward_grid() == (24, 24, 1)
    assert p.dense_workspace == 24 * 1 * 8 * 64 * 130
    assert A.plan_attention(1, 1, 64, 100, 64, "float16", (64, 100)).forward_grid() == (1, 3, 1)
    assert p.gather_cap == A.GATHER_MAX * 64
    # 2 stages of K, V and the mask tile (rows of BN + 16 bytes); the list
    assert p.smem == 2 * 2 * 64 * 128 * 2 + 2 * 64 * 80 + 4 * 64 <= 227 * 1024
    assert A.plan_attention(3, 2, 5, 7, 64, "float16", (3, 2, 5, 7)).mask_strides == (2, 1)
    assert A.plan_attention(3, 2, 5, 7, 64, "float16", (5, 7)).mask_strides == (0, 0)
    assert A.plan_attention(3, 2, 5, 7, 64, "float16", (5, 7)).slices == 1


@pytest.mark.parametrize("args, match", [
    ((1, 1, 8, 8, 96, "float16", (8, 8)), "head dim"),
    ((1, 1, 8, 8, 64, "float32", (8, 8)), "dtype"),
    ((1, 1, 8, 8, 64, "float16", (8,)), "mask has shape"),
    ((1, 2, 8, 8, 64, "float16", (3, 8, 8)), "mask has shape"),
    ((1, 2, 8, 8, 64, "float16", (2, 8, 9)), "mask has shape"),
    ((70000, 70000, 8, 8, 64, "float16", (8, 8)), "grid limit"),
    ((300, 300, 8, 8, 64, "float16", (300, 300, 8, 8)), "mask slices = 90000"),
    ((1, 1, 64 * 65536, 8, 64, "float16", (64 * 65536, 8)), "65536 query blocks"),
])
def test_plan_refuses_clearly(args, match):
    with pytest.raises(pitgen.ShapeError, match=match):
        A.plan_attention(*args)


def _index_by_loops(mask: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """Element-by-element statement of the index: any / all over the in-range block elements."""
    m = mask.reshape(-1, *mask.shape[-2:])
    sq, sk = m.shape[1:]
    nq, nk = -(-sq // bm), -(-sk // bn)
    states = np.zeros((m.shape[0], nq, nk), np.uint8)
    for s in range(m.shape[0]):
        for qb in range(nq):
            for kb in range(nk):
                blk = m[s, qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
                if blk.any():
                    states[s, qb, kb] = A.FULL if blk.all() else A.PARTIAL
    return states


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 150), sk=st.integers(1, 150), lead=st.sampled_from([(), (2,), (2, 3)]),
       tile=st.sampled_from([(1, 1), (16, 16), (1, 64), (64, 64), (128, 128)]),
       density=st.floats(0, 1), seed=st.integers(0, 1000))
def test_block_index_reference(sq, sk, lead, tile, density, seed):
    rng = np.random.default_rng(seed)
    mask = np.stack([T.tile_mask(rng, sq, sk, tile, density)
                     for _ in range(int(np.prod(lead, dtype=int)))]).reshape(*lead, sq, sk)
    states = R.block_index_reference(mask)
    assert states.dtype == np.uint8
    np.testing.assert_array_equal(states, _index_by_loops(mask, A.BM, A.BN))


def test_block_index_flags_full_and_partial_blocks():
    m = np.zeros((70, 130), bool)
    m[:64, :64] = True          # full block (0, 0)
    m[3, 70] = True             # partial block (0, 1)
    m[64:, 128:] = True         # the edge block (1, 2): full over its in-range 6x2 elements
    assert R.block_index_reference(m).tolist() == [[[A.FULL, A.PARTIAL, A.EMPTY],
                                                    [A.EMPTY, A.EMPTY, A.FULL]]]


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 300), sk=st.integers(1, 300), lead=st.sampled_from([(), (2,), (2, 3)]),
       block=st.sampled_from([(64, 64), (128, 128), (64, 192)]), density=st.floats(0, 1),
       seed=st.integers(0, 1000))
def test_block_layout_mask_and_its_states(sq, sk, lead, block, density, seed):
    """A layout's mask attends exactly its blocks, and every 64 x 64 block of it is FULL or
    EMPTY: what the layout index writes without reading a mask."""
    rng = np.random.default_rng(seed)
    lay = rng.random((*lead, -(-sq // block[0]), -(-sk // block[1]))) < density
    mask = R.block_layout_mask(lay, block, sq, sk)
    assert mask.shape == (*lead, sq, sk)
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    np.testing.assert_array_equal(mask, lay[..., i // block[0], j // block[1]])
    states = R.block_index_reference(mask).reshape(*lead, -(-sq // 64), -(-sk // 64))
    rq, rk = block[0] // 64, block[1] // 64
    want = lay[..., np.arange(states.shape[-2]) // rq, :][..., np.arange(states.shape[-1]) // rk]
    np.testing.assert_array_equal(states, np.where(want, A.FULL, A.EMPTY))


@pytest.mark.parametrize("size, match", [(96, "multiples of 64"), ((64,), "a pair"),
                                         (0, "positive"), (True, "block_size"),
                                         ((128, 64.0), "block_size")])
def test_block_size_refused_clearly(size, match):
    with pytest.raises(pitgen.ShapeError, match=match):
        A._block_size(size)
    assert A._block_size(128) == (128, 128) and A._block_size((64, 192)) == (64, 192)


def test_layout_shape_stands_for_its_mask():
    """A block layout plans as the mask it stands for: its leading dims broadcast as a mask's
    (the slices and strides of the state map), its last two are the block counts."""
    shape = A._layout_shape((2, 1, 2, 3), 2, 4, 200, 300, (128, 128))
    assert shape == (2, 1, 200, 300)
    plan = A.plan_attention(2, 4, 200, 300, 64, "float16", shape)
    assert (plan.slices, plan.mask_strides) == (2, (1, 0))
    assert A._layout_shape((4, 7), 1, 2, 256, 448, (64, 64)) == (256, 448)
    for bad in ((2, 2), (3, 2, 3), (1, 1, 1, 2, 3), (3,)):
        with pytest.raises(pitgen.ShapeError, match=r"block_mask has shape .* expected \[2, 3\]"):
            A._layout_shape(bad, 2, 4, 200, 300, (128, 128))


@settings(max_examples=25, deadline=None)
@given(n_qb=st.integers(1, 300), n_kb=st.integers(1, 600), slices=st.integers(1, 3),
       density=st.floats(0, 1), seed=st.integers(0, 1000))
def test_block_order_reference_puts_longest_rows_first(n_qb, n_kb, slices, density, seed):
    rng = np.random.default_rng(seed)
    # rows of different lengths: each row its own density
    states = (rng.random((slices, n_qb, n_kb)) < density * rng.random((slices, n_qb, 1)))
    states = states.astype(np.uint8) * rng.integers(1, 3, states.shape).astype(np.uint8)
    order = R.block_order_reference(states)
    assert order.dtype == np.int32 and order.shape == (slices, n_qb)
    counts = (states != A.EMPTY).sum(-1)
    for s in range(slices):
        assert sorted(order[s]) == list(range(n_qb))              # a permutation
        bins = R.count_bins(counts[s, order[s]], n_kb)
        keys = list(zip(-bins, order[s]))
        assert keys == sorted(keys)                # longest first, ties in block order
        if n_kb < A.ORDER_BINS:
            assert (bins == counts[s, order[s]]).all()            # exact classes


def _key_index_by_loops(mask: np.ndarray, gather_max: int) -> dict:
    """The rule of docs/attention.md stated row by row and block by block: dense rows (allowing
    every key), if at most DENSE_ROWS_MAX, leave their query block when its work over the other
    rows is smaller; each key
    block's state over the rows that stay; its allowed columns gathered when few."""
    m = np.asarray(mask, bool).reshape(-1, *np.shape(mask)[-2:])
    slices, sq, sk = m.shape
    bm = bn = 64
    nq, nk = -(-sq // bm), -(-sk // bn)

    def decide(s, qb, rows):
        states, cols, work_v, work_g = [], [], 0, 0
        for kb in range(nk):
            blk = m[s][rows][:, kb * bn:min((kb + 1) * bn, sk)]
            allowed = [kb * bn + j for j in range(blk.shape[1]) if blk[:, j].any()]
            if not allowed:
                state = A.EMPTY
            elif blk.all():
                state = A.FULL
            elif len(allowed) <= gather_max:
                state = A.GATHERED
            else:
                state = A.PARTIAL
            states.append(state)
            cols.append(allowed if state == A.GATHERED else [])
            work_v += state in (A.FULL, A.PARTIAL)
            work_g += len(cols[-1])
        return states, cols, work_v + -(-work_g // 64)

    out = {name: [] for name in ("states", "keys", "bits", "drows")}
    for s in range(slices):
        drows = []
        for qb in range(nq):
            rows = list(range(qb * bm, min((qb + 1) * bm, sq)))
            dense = [r for r in rows if m[s, r].all()]
            rest = [r for r in rows if r not in dense]
            states, cols, work = decide(s, qb, rows)
            if 0 < len(dense) <= A.DENSE_ROWS_MAX and decide(s, qb, rest)[2] < work:
                states, cols, _ = decide(s, qb, rest)
                drows += dense
            else:
                rest = rows
            keys = [j for c in cols for j in c]
            out["states"].append(states)
            out["keys"].append(keys)
            out["bits"].append([sum(1 << (r - qb * bm) for r in rest if m[s, r, j])
                                for j in keys])
        out["drows"].append(drows)
    return out


MASKS = ("tile", "longformer", "bigbird", "causal", "full_rows", "granular")


def _mask(rng: np.random.Generator, kind: str, sq: int, sk: int, density: float) -> np.ndarray:
    if kind == "longformer":
        return T.longformer_mask(sq, sk, 24, T.random_global_tokens(rng, min(sq, sk), 3))
    if kind == "bigbird":
        return T.bigbird_mask(rng, sq, sk, 16, T.random_global_tokens(rng, min(sq, sk), 2), 5)
    if kind == "causal":
        return np.tril(np.ones((sq, sk), bool))
    if kind == "full_rows":   # some rows allow every key, the rest sparse
        m = T.tile_mask(rng, sq, sk, (1, 1), density * 0.1)
        m[rng.random(sq) < (0.05 if density < 0.5 else 0.2)] = True
        return m
    if kind == "granular":
        return T.granular_mask(rng, (sq, sk), str(rng.choice(T.MASK_KINDS)), (16, 16), density)
    return T.tile_mask(rng, sq, sk, (1, int(rng.choice([1, 8, 64]))), density)


@settings(max_examples=40, deadline=None)
@given(sq=st.integers(1, 200), sk=st.integers(1, 260), lead=st.sampled_from([(), (2,)]),
       kind=st.sampled_from(MASKS), density=st.floats(0, 1), gather_max=st.sampled_from([4, 16]),
       seed=st.integers(0, 1000))
def test_key_index_reference_follows_the_rule(sq, sk, lead, kind, density, gather_max, seed):
    rng = np.random.default_rng(seed)
    mask = np.stack([_mask(rng, kind, sq, sk, density)
                     for _ in range(int(np.prod(lead, dtype=int)))]).reshape(*lead, sq, sk)
    ref = R.key_index_reference(mask, gather_max)
    spec = _key_index_by_loops(mask, gather_max)
    s, nq, nk = ref.states.shape
    assert ref.states.tolist() == np.reshape(spec["states"], (s, nq, nk)).tolist()
    np.testing.assert_array_equal(ref.blocks, R.block_index_reference(mask))
    for i, j in np.ndindex(s, nq):
        n = ref.counts[i, j]
        assert ref.keys[i, j, :n].tolist() == spec["keys"][i * nq + j]
        assert [int(b) for b in ref.bits[i, j, :n]] == spec["bits"][i * nq + j]
        assert (ref.keys[i, j, n:] == -1).all() and (ref.bits[i, j, n:] == 0).all()
    for i in range(s):
        assert ref.drows[i, :ref.dcount[i]].tolist() == spec["drows"][i]
        assert (ref.drows[i, ref.dcount[i]:] == -1).all()
        moved = [qb * 64 + r for qb in range(nq) for r in range(64) if int(ref.dense[i, qb]) >> r & 1]
        assert moved == spec["drows"][i]
    np.testing.assert_array_equal(ref.order, R.block_order_reference(ref.states, ref.counts))


def test_key_index_moves_global_rows_and_gathers_global_keys():
    sq = sk = 512
    mask = T.longformer_mask(sq, sk, 64, np.array([100, 300]))
    ref = R.key_index_reference(mask)
    assert ref.drows[0, :ref.dcount[0]].tolist() == [100, 300]     # the global rows move out
    # rows 0..63: the band (reaching key 95) and the global keys 100, 300; key 300 is alone in
    # its block, so gathered
    assert ref.states[0, 0].tolist() == [A.PARTIAL, A.PARTIAL, A.EMPTY, A.EMPTY, A.GATHERED,
                                         A.EMPTY, A.EMPTY, A.EMPTY]
    assert ref.keys[0, 0, :ref.counts[0, 0]].tolist() == [300]
    assert int(ref.bits[0, 0, 0]) == 2 ** 64 - 1                  # every row of the block
    # rows 64..127 lose row 100, which made every block of theirs non-empty
    assert ref.dense[0, 1] == 1 << (100 - 64) and ref.blocks[0, 1].tolist() == [A.PARTIAL] * 8
    assert ref.states[0, 1].tolist() == [A.PARTIAL, A.PARTIAL, A.PARTIAL, A.EMPTY, A.GATHERED,
                                         A.EMPTY, A.EMPTY, A.EMPTY]
    # a full mask: every row allows every key, but more than DENSE_ROWS_MAX per block: they stay
    full = R.key_index_reference(np.ones((100, 70), bool))
    assert full.dcount.tolist() == [0] and (full.states == A.FULL).all()
    few = np.zeros((100, 300), bool)
    few[[3, 5, 70], :] = True      # 2 in block 0, 1 in block 1: they leave
    assert R.key_index_reference(few).drows[0, :3].tolist() == [3, 5, 70]
    # causal: moving the last row would not make its block cheaper, so it stays
    causal = R.key_index_reference(np.tril(np.ones((200, 200), bool)))
    assert causal.dcount.tolist() == [0] and (causal.dense == 0).all()


def test_count_bins_scale_long_rows_onto_the_classes():
    assert R.count_bins(np.array([0, 5, 255]), 255).tolist() == [0, 5, 255]
    assert R.count_bins(np.array([0, 5, 256, 1000, 2000]), 1000).tolist() == [0, 1, 65, 255, 255]


def test_shared_memory_bounds_the_key_length():
    plan = A.plan_attention(1, 1, 64, 8192, 64, "float16", (64, 8192))
    assert plan.smem == 2 * A.STAGES[64] * 64 * 64 * 2 + A.STAGES[64] * 64 * 80 + 4 * 128
    with pytest.raises(pitgen.ShapeError, match="Sk=.* keys"):
        A.plan_attention(1, 1, 64, 4_000_000, 64, "float16", (64, 4_000_000))


VARIANTS = [(d, dt) for d in A.HEAD_DIMS for dt in A.ATTENTION.dtypes]


def _source(d: int, dtype: str, arch: str = "sm_80", fused: bool = False) -> str:
    plan = A.plan_attention(1, 1, 100, 130, d, dtype, (100, 130), 0, arch)
    return A.ATTENTION.source(replace(plan, fused=fused).context())


#: variants compiled as the one-launch forward's module instead (its bodies are the plain
#: kernels' own): one mma.sync, one wgmma
FUSED_VARIANTS = ((64, "float16"), (128, "bfloat16"))


#: The Hopper forward (wgmma products) for both widths of its PV product and both dtypes.
WGMMA_VARIANTS = ((64, "float16"), (128, "bfloat16"))


def test_hopper_plan_multiplies_on_wgmma():
    """On sm_90 the forward's products are wgmma instructions over K/V tiles in its layout
    (aligned stages: 1 KiB of slack; at D=128 unpadded mask rows, so that three CTAs share an
    SM); the backward keeps mma.sync."""
    plan = A.plan_attention(1, 1, 100, 130, 128, "bfloat16", (100, 130), 0, "sm_90")
    base = A.plan_attention(1, 1, 100, 130, 128, "bfloat16", (100, 130))
    unpadded = plan.stages * plan.bm * (A.MASK_ROW - A.BN)
    assert (plan.mask_row, base.mask_row) == (A.BN, A.MASK_ROW)
    assert plan.wgmma and not base.wgmma and plan.smem == base.smem + 1024 - unpadded
    assert (plan.min_blocks, base.min_blocks) == (A.MIN_BLOCKS_WGMMA[128], A.MIN_BLOCKS[128])
    src = A.ATTENTION.source(plan.context())
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in src
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src
    assert "wgmma.mma_async" not in A.ATTENTION.source(base.context())
    assert "wgmma.mma_async" not in A.ATTENTION_BWD.source(plan.backward_context())


@pytest.mark.parametrize("d", (64, 128))
def test_hopper_forward_loads_its_block_tiles_by_tma(d):
    """On sm_90a the forward takes K's and V's TMA maps first and one thread issues a block's
    boxes (D / 64 per operand) on its stage's barrier; gathered tiles keep their cp.async rows.
    The one-launch module and the sm_80 forward keep cp.async for every tile."""
    plan = A.plan_attention(1, 2, 300, 333, d, "float16", (300, 333), 0, "sm_90")
    assert plan.tma and plan.forward_kernel(True) == "pit_attention_tma_vec"
    src = A.ATTENTION.source(plan.context())
    head = src.split("\npit_attention_tma_vec(")[1].split(")\n{")[0]
    assert head.startswith("const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap")
    assert src.count("sm90::tma_load_3d(") == 2 and "c < D / 64" in src
    assert "load_gathered(" in src.split("auto load_tile_g")[1].split("};")[0]
    sm80 = A.plan_attention(1, 2, 300, 333, d, "float16", (300, 333))
    assert sm80.forward_kernel(False) == "pit_attention"
    for other in (replace(plan, fused=True), sm80):
        assert not other.tma and "tma_load_3d(sK" not in A.ATTENTION.source(other.context())


def test_forward_waits_for_the_index_it_is_launched_behind():
    """On sm_90 the forward is a programmatic dependent launch (runtime's cuLaunchKernelEx):
    its grid is launched while the index pass completes, so its first statement waits for the
    index's writes; the sm_80 forward is launched plainly. The driver's structs as cuda.h lays
    them out."""
    import ctypes
    from pitgen import runtime
    assert ctypes.sizeof(runtime._LaunchConfig) == 56 and runtime._LaunchConfig.stream.offset == 32
    assert ctypes.sizeof(runtime._LaunchAttribute) == 72
    assert runtime._LaunchAttribute.value.offset == 8
    plan = A.plan_attention(1, 1, 100, 130, 64, "float16", (100, 130), 0, "sm_90")
    src = A.ATTENTION.source(plan.context())
    assert "griddepcontrol.wait" in src.split("wait_for_prior_grid() {")[1].split("}")[0]
    for name in ("pit_attention_tma", "pit_attention_tma_vec"):
        body = src.split(f"\n{name}(")[1].split(")\n{", 1)[1]
        code = [ln.strip() for ln in body.splitlines()
                if ln.strip() and not ln.strip().startswith("//")]
        assert code[0] == "sm90::wait_for_prior_grid();", name
    base = A.plan_attention(1, 1, 100, 130, 64, "float16", (100, 130))
    assert "griddepcontrol" not in A.ATTENTION.source(base.context())


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("wgmma", (False, True))
def test_forward_ctas_fit_shared_memory(d, wgmma):
    """The CTAs per SM a forward plan budgets registers for fit an SM's shared memory at every
    length: unpadded mask rows where padded ones would not fit them, fewer CTAs where neither
    does (long key lists)."""
    for s in (64, 4096, 16384, 65536):
        plan = A.AttentionPlan(1, 1, s, s, d, "float16", 1, 1, wgmma=wgmma)
        per_cta = plan.smem + plan.static_smem + A.CTA_SMEM_RESERVED
        assert plan.min_blocks * per_cta <= A.SM_SMEM, (s, plan.min_blocks, per_cta)
        assert plan.mask_row in (A.BN, A.MASK_ROW)
        if plan.mask_row == A.BN:   # only where the padding would cost a CTA
            padded = plan.smem + plan.stages * plan.bm * (A.MASK_ROW - A.BN)
            assert plan.min_blocks * (padded + plan.static_smem + A.CTA_SMEM_RESERVED) > A.SM_SMEM
        src = A.ATTENTION.source(plan.context())
        assert f"constexpr int MROW = {plan.mask_row};" in src
    want = (A.MIN_BLOCKS_WGMMA if wgmma else A.MIN_BLOCKS)[d]
    long = A.AttentionPlan(1, 1, 65536, 65536, d, "float16", 1, 1, wgmma=wgmma)
    if wgmma and d == 128:   # a 4 KiB block list: not even unpadded rows fit three
        assert long.min_blocks < want and long.mask_row == A.MASK_ROW
    else:
        assert long.min_blocks == want


def test_render_names_the_kernels():
    src = _source(128, "bfloat16")
    assert src == _source(128, "bfloat16")
    fused = _source(128, "bfloat16", fused=True)
    hopper = _source(128, "bfloat16", "sm_90")   # the forward's K/V by TMA: other names
    names = {n: fused if "fused" in n else hopper if "tma" in n else src
             for n in A.ATTENTION.kernels}
    for name, text in names.items():   # each forward in its own module, not in the others
        assert f"\n{name}(" in text
        if name.startswith("pit_attention"):
            assert not any(f"\n{name}(" in t for t in (src, fused, hopper) if t is not text)
    assert "constexpr int D = 128;" in src and "__nv_bfloat16" in src
    # the prepared signatures match the kernels' parameter counts
    for name, sig in A.ATTENTION.kernels.items():
        params = names[name].split(f"\n{name}(")[1].split(")\n{")[0]
        assert params.count(",") + 1 == len(sig), name


def test_small_masked_problems_run_in_one_launch():
    """fused_grid: the index CTAs and the forward's fit FUSED_MAX_CTAS (the one-launch
    forward, a module of its own), else None (two launches)."""
    from pitgen import lower
    small = A.plan_attention(1, 2, 128, 128, 64, "float16", (128, 128))
    (ix, iy, iz), (ax, ay, _) = small.index_grid(), small.forward_grid()
    assert small.fused_grid() == (ix * iy * iz + ax * ay, 1, 1)
    assert ix * iy * iz + ax * ay <= lower.FUSED_MAX_CTAS
    assert A.plan_attention(1, 12, 4096, 4096, 64, "float16", (4096, 4096)).fused_grid() is None


def test_layout_index_arguments_follow_its_parameters():
    """``_layout_args``: after the layout, its blocks, nKB, the arrays it writes (by name, as the
    kernel's parameters name them) and nQB, one per parameter of the signature."""
    plan = A.plan_attention(2, 3, 200, 300, 64, "float16", (3, 200, 300))
    blocks = A._layout_blocks(plan, np.zeros((3, 2, 3)), (128, 128))
    assert blocks == (2, 3, 2, 2)
    arrays = [1000 + i for i in range(len(A.INDEX_ARRAYS))]
    at = dict(zip(A.INDEX_ARRAYS, arrays))
    args = A._layout_args(plan, blocks, arrays)
    assert args == (2, 3, 2, 2, plan.n_kb, at["states"], at["blocks"], at["order"],
                    at["counts"], at["dense"], at["drows"], at["dcount"], at["work"],
                    at["cols"], plan.n_qb)
    assert len(args) + 1 == len(A.ATTENTION.kernels["pit_attn_layout_index"])
    src = _source(64, "float16")
    params = src.split("\npit_attn_layout_index(")[1].split(")\n{")[0]
    names = [p.split()[-1].lstrip("*") for p in params.replace("\n", " ").split(",")]
    assert names[6:15] == ["states", "blocks", "order", "gcount", "dense", "drows", "dcount",
                           "work", "done"]


def test_small_layout_problems_run_in_one_launch():
    """fused_layout_grid: a CTA per layout slice and the forward's CTAs within
    FUSED_MAX_CTAS (pit_attention_fused_layout), else None (the layout index, then the
    forward)."""
    from pitgen import lower
    small = A.plan_attention(2, 3, 200, 300, 64, "float16", (2, 1, 200, 300))
    ax, ay, _ = small.forward_grid()
    assert small.fused_layout_grid() == (small.slices + ax * ay, 1, 1) == (2 + ax * ay, 1, 1)
    assert small.slices + ax * ay <= lower.FUSED_MAX_CTAS
    big = A.plan_attention(1, 12, 4096, 4096, 64, "float16", (4096, 4096))
    assert big.fused_layout_grid() is None


def _archs(d: int, dtype: str, source: str) -> tuple[str, ...]:
    """A checkerboard over D x dtype; both archs for arch-dependent code."""
    if "__CUDA_ARCH__" in source:
        return ARCHS
    return (ARCHS[(A.HEAD_DIMS.index(d) + A.ATTENTION.dtypes.index(dtype)) % 2],)


def nvcc_jobs(pool, archs=ARCHS) -> list[Future]:
    """Every variant's compile for its archs (submitted at collection by conftest)."""
    sources = {v: _source(*v, fused=v == FUSED_VARIANTS[0]) for v in VARIANTS}
    hopper = [pool.submit(compiler.compile_source,
                          _source(*v, "sm_90", fused=v == FUSED_VARIANTS[1]), "sm_90a")
              for v in WGMMA_VARIANTS if "sm_90a" in archs]
    return [pool.submit(compiler.compile_source, src, arch) for v, src in sources.items()
            for arch in _archs(*v, src) if arch in archs] + hopper + _backward_jobs(pool, archs)


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(arch, nvcc):
    cubins = [job.result() for job in nvcc_jobs(nvcc, [arch])]
    assert all(c[:4] == b"\x7fELF" for c in cubins)


# -- the backward kernels (pitgen/ops/attention.py ATTENTION_BWD) ------------------------------

BACKWARD_VARIANTS = {"sm_80": (64, "float16"), "sm_90a": (128, "bfloat16")}


def _backward_source(d: int, dtype: str) -> str:
    plan = A.plan_attention(1, 4, 100, 130, d, dtype, (100, 130), 2)
    return A.ATTENTION_BWD.source(plan.backward_context())


def test_render_names_the_backward_kernels():
    src = _backward_source(64, "float16")
    for name, sig in A.ATTENTION_BWD.kernels.items():
        assert f"\n{name}(" in src, name
        params = src.split(f"\n{name}(")[1].split(")\n{")[0]
        assert params.count(",") + 1 == len(sig), name
    assert "constexpr int D = 64;" in src and "__half" in src


def _backward_jobs(pool, archs=ARCHS) -> list[Future]:
    """The backward variants' compiles: one per arch (the template has no layout variants)."""
    return [pool.submit(compiler.compile_source, _backward_source(*BACKWARD_VARIANTS[arch]), arch)
            for arch in archs]


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_backward_variant_compiles(arch, nvcc):
    cubins = [job.result() for job in _backward_jobs(nvcc, [arch])]
    assert cubins and all(c[:4] == b"\x7fELF" for c in cubins)


def test_bigbird_mask_and_the_benchmark_masks_work():
    rng = np.random.default_rng(4)
    m = T.bigbird_mask(rng, 300, 260, 32, np.array([5]), 7)
    assert m[5].all() and m[:, 5].all()                                  # the global token
    i, j = np.indices(m.shape)
    assert m[np.abs(i - j) <= 16].all()                                  # the band
    for r0 in range(0, 300, 64):   # each block of rows shares >= 7 random keys (+ the global)
        assert m[r0:r0 + 64].all(axis=0).sum() >= 7
    from pitgen.bench import attention as BA
    masks = BA.masks(np.random.default_rng(0))
    bigbird = masks[BA.BIGBIRD]
    assert 0.11 < bigbird.mean() < 0.13                                  # ~12% of the pairs
    work = BA.index_work(R.key_index_reference(bigbird))
    # nearly every 64x64 block is touched, but the work is dense rows' tile + gathered tiles +
    # the band's blocks: about a sixth of the blocks
    assert (R.block_index_reference(bigbird) != A.EMPTY).mean() > 0.95
    assert work["dense_rows"] == 16 and work["gathered_tiles"] > 0 and work["work_share"] < 0.2
    assert BA.cases(list(masks))[-1] == (BA.BIGBIRD, 128)
