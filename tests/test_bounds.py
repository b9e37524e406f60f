"""The element-wise bounds the GPU tests hold kernels to (pitgen.testing.assert_close with
``scale=`` and ``roundings=``), checked on the CPU with the references and scales those tests
use: for every family of GPU check, a NumPy model of the kernel (operands as the kernel reads
them, float32 sums, the partial results it stores and its output rounded to the dtype) passes,
and the same output with one element missing one typical product term fails. The element is
the one with the largest scale (the most terms: the loosest bound), the term its median one in
magnitude: the smallest change a dropped term, index or tile makes. Where pitgen's kernels
cannot drop a single term, the unit they can drop is the term: RGCN's SpMMs drop edges (A
times a row of XW; a single product inside XW is torch's batched matmul), attention drops keys
(P V loses a key and the row is renormalised)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from pitgen import reference as R
from pitgen import testing as T
from pitgen.graph.formats import CSR, Relational

#: the storage type of each bound's name
STORE = {"float32": np.float32, "tf32": np.float32, "float16": np.float16}


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to the type a kernel stores in, as float64 (bfloat16 and tf32: the
    mantissa rounded to nearest even, 7 and 10 bits)."""
    if dtype in ("bfloat16", "tf32"):
        bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
        drop = 16 if dtype == "bfloat16" else 13
        half = (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)
        return (((bits + half) >> drop) << drop).astype(np.uint32).view(np.float32).astype(float)
    return np.asarray(x).astype(STORE[dtype]).astype(np.float64)


def fp32_sum(a: np.ndarray, b: np.ndarray, chunk: int = 32) -> np.ndarray:
    """a @ b with float32 products summed in float32 over k-chunks (a tensor-core mainloop)."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(0, a.shape[1], chunk):
        acc += a[:, k:k + chunk].astype(np.float32) @ b[k:k + chunk].astype(np.float32)
    return acc.astype(np.float64)


@dataclass
class Case:
    """One GPU check: the kernel model's output, the float64 reference, the bound's dtype,
    scale and roundings, and ``terms(index)``: the terms the reference sums at one element
    (``drop``: instead, the output with a typical unit missing)."""
    got: np.ndarray
    want: np.ndarray
    dtype: str
    scale: np.ndarray
    roundings: int
    terms: Callable[[tuple[int, ...]], np.ndarray] | None
    drop: Callable[[], np.ndarray] | None = None


def gemm(rng, dtype: str, M=96, N=80, K=1024, density=0.3, accumulate=False,
         splits=1) -> Case:
    """test_gpu / test_gpu_hopper / test_gpu_threads / test_gpu_graphs: a sparse GEMM (float32
    on tf32 tensor cores), ``accumulate``: added to an output (test_accumulate_adds_to_out);
    ``splits`` > 1: cuBLAS reducing split-k partials in the dtype (roundings=1)."""
    store = "float32" if dtype == "tf32" else dtype
    a = stored(rng.standard_normal((M, K)) * (rng.random((M, K)) < density), store)
    b = stored(rng.standard_normal((K, N)), store)
    want = a @ b
    scale = T.term_scale(np.matmul, a, b)
    ka, kb = (stored(a, "tf32"), stored(b, "tf32")) if dtype == "tf32" else (a, b)
    step = -(-K // splits)
    acc = sum((stored(fp32_sum(ka[:, k:k + step], kb[k:k + step]), store) if splits > 1
               else fp32_sum(ka[:, k:k + step], kb[k:k + step]))
              for k in range(0, K, step))
    base = stored(rng.standard_normal((M, N)), store) if accumulate else np.zeros((M, N))
    if accumulate:
        want, acc = want + base, acc + base
        scale = np.sqrt(scale ** 2 + base ** 2)
    return Case(stored(acc, store), want, dtype, scale, int(splits > 1),
                lambda i: np.append(a[i[0]] * b[:, i[1]], base[i]))


def power_law_csr(rng, rows=300, cols=1200, dtype="float32") -> CSR:
    """test_gpu_formats' power-law pattern: one row dense across all columns, values in dtype."""
    csr = T.random_csr(rng, (rows, cols), "power_law", 0.05)
    dense = csr.to_dense()
    dense[rng.integers(rows)] = rng.standard_normal(cols)
    return CSR.from_dense(stored(dense, dtype))


def spmm(rng, dtype: str) -> Case:
    """test_gpu_formats / test_gpu_tune / test_gpu_threads: SpMM on CUDA cores, float32 sums."""
    a = power_law_csr(rng, dtype=dtype)
    x = stored(rng.standard_normal((a.shape[1], 64)), dtype)
    dense = a.to_dense()
    return Case(stored(fp32_sum(dense, x, 1), dtype), R.spmm_csr(a, x), dtype,
                T.term_scale(R.spmm_csr, a, x), 0, lambda i: dense[i[0]] * x[:, i[1]])


def sddmm(rng, dtype: str) -> Case:
    """test_gpu_formats / test_gpu_tune: SDDMM at the non-zeros (CSR order), feature width 512."""
    a = power_law_csr(rng, 120, 200, dtype)
    u = stored(rng.standard_normal((a.shape[0], 512)), dtype)
    v = stored(rng.standard_normal((a.shape[1], 512)), dtype)
    rows, cols = a.row_ids(), a.indices
    got = np.einsum("nf,nf->n", u[rows].astype(np.float32), v[cols].astype(np.float32))
    return Case(stored(got, dtype), R.sddmm_csr(a, u, v), dtype, T.term_scale(R.sddmm_csr, a, u, v),
                0, lambda i: u[rows[i[0]]] * v[cols[i[0]]])


def rgcn(rng, dtype: str, order: str) -> Case:
    """test_gpu_rgcn: transform-first stores XW in the dtype, aggregate-first H = C X and
    Z = H W (roundings 1 and 2); the SpMMs sum in float32."""
    store = "float32" if dtype == "tf32" else dtype
    g = Relational.from_relations([T.random_csr(rng, (40, 40), "random", 0.5) for _ in range(6)])
    graph = Relational(g.shape, g.rel, g.row, g.col, stored(g.values(), store))
    x = stored(rng.standard_normal((40, 64)), store)
    w = stored(rng.standard_normal((6, 64, 16)) / 8, store)
    kx, kw = (stored(x, "tf32"), stored(w, "tf32")) if dtype == "tf32" else (x, w)
    y = np.zeros((40, 16))
    for r in range(6):
        adj = graph.relation(r).to_dense()
        if order == "transform-first":
            y += fp32_sum(adj, stored(fp32_sum(kx, kw[r]), store), 1)
        else:
            y += stored(fp32_sum(stored(fp32_sum(adj, x, 1), store), kw[r]), store)
    vals = graph.values()

    def terms(i):   # one per edge: A[r,i,j] (X[j] @ W[r])[f]
        e = graph.row == i[0]
        return vals[e] * np.einsum("eg,eg->e", x[graph.col[e]], w[graph.rel[e], :, i[1]])
    return Case(stored(y, store), R.rgcn_reference(graph, x, w), dtype,
                T.term_scale(R.rgcn_reference, graph, x, w),
                {"transform-first": 1, "aggregate-first": 2}[order], terms)


def attention(rng, dtype: str) -> Case:
    """test_gpu_graphs' attention replay: P rounded to the dtype before P V (roundings=1)."""
    q, k, v = (stored(rng.standard_normal((1, 1, 320, 64)), dtype) for _ in range(3))
    mask = T.tile_mask(rng, 320, 320, (16, 16), 0.6)
    s = np.where(mask, (q @ k.swapaxes(-1, -2))[0, 0] / 8.0, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    got = stored(fp32_sum(stored(p, dtype), v[0, 0])[None, None], dtype)
    scale = T.attention_term_scale(q, k, v, mask)

    def drop():   # the row of the largest scale loses its key of median probability
        row = int(np.unravel_index(int(np.argmax(scale)), scale.shape)[2])
        keys = np.flatnonzero(mask[row])
        j = keys[np.argsort(p[row, keys])[len(keys) // 2]]
        bad = got.copy()
        bad[0, 0, row] = (got[0, 0, row] - p[row, j] * v[0, 0, j]) / (1 - p[row, j])
        return bad
    return Case(got, R.attention_reference(q, k, v, mask), dtype, scale, 1, None, drop)


def moe(rng, dtype: str) -> Case:
    """test_gpu_graphs' MoE replay: the activations stored in the dtype (roundings=1), fp32
    sums and gating."""
    tokens, H, F, E = 96, 64, 128, 6
    x = stored(rng.standard_normal((tokens, H)), dtype)
    w1, w2 = (stored(rng.standard_normal(s) / 8, dtype) for s in ((E, H, F), (E, F, H)))
    ids = rng.integers(0, E, (tokens, 2)).astype(np.int32)
    gates = rng.random((tokens, 2)).astype(np.float32).astype(np.float64)
    y = np.zeros((tokens, H))
    for t in range(tokens):
        for j in range(2):
            h = stored(R.activation_reference(fp32_sum(x[t:t + 1], w1[ids[t, j]]), "gelu"), dtype)
            y[t] += gates[t, j] * fp32_sum(h, w2[ids[t, j]])[0]

    def terms(i):
        t = i[0]
        return np.concatenate([gates[t, j] * R.activation_reference(x[t] @ w1[ids[t, j]], "gelu")
                               * w2[ids[t, j]][:, i[1]] for j in range(2)])
    return Case(stored(y, dtype), R.moe_reference(x, ids, gates, w1, w2), dtype,
                T.moe_term_scale(x, ids, gates, w1, w2), 1, terms)


def linear(rng, dtype: str, grad: str) -> Case:
    """test_gpu_training: y = x (w ⊙ mask)ᵀ + b (the product stored before + b: roundings=1),
    dx = dy (w ⊙ mask), dw = (dyᵀ x) ⊙ mask (SDDMM), db = Σ dy, float32 on tf32."""
    store = "float32" if dtype == "tf32" else dtype
    batch, in_f, out_f = 200, 130, 140
    x = stored(rng.standard_normal((batch, in_f)), store)
    w = stored(rng.standard_normal((out_f, in_f)) * (rng.random((out_f, in_f)) < 0.3), store)
    b = stored(rng.standard_normal(out_f), store)
    dy = stored(rng.standard_normal((batch, out_f)), store)

    def kernel(p, q):
        return fp32_sum(*((stored(p, "tf32"), stored(q, "tf32")) if dtype == "tf32" else (p, q)))
    if grad == "y":
        return Case(stored(stored(kernel(x, w.T), store) + b, store), x @ w.T + b, dtype,
                    np.sqrt(T.term_scale(np.matmul, x, w.T) ** 2 + b ** 2), 1,
                    lambda i: np.append(x[i[0]] * w[i[1]], b[i[1]]))
    if grad == "dx":
        return Case(stored(kernel(dy, w), store), dy @ w, dtype, T.term_scale(np.matmul, dy, w),
                    0, lambda i: dy[i[0]] * w[:, i[1]])
    if grad == "dw":
        mask = w != 0
        return Case(stored(kernel(dy.T, x) * mask, store), (dy.T @ x) * mask, dtype,
                    T.term_scale(np.matmul, dy.T, x) * mask, 0, lambda i: dy[:, i[0]] * x[:, i[1]])
    return Case(stored(dy.astype(np.float32).sum(0), store), dy.sum(0), dtype,
                np.sqrt((dy ** 2).sum(0)), 0, lambda i: dy[:, i[0]])


def moe_wgrad(rng, dtype: str) -> Case:
    """test_gpu_moe_backward's moe_wgrad: A[r,m] B[r,n] over an expert's rows, fp32 sums, W
    rounded once to the dtype."""
    a = stored(rng.standard_normal((320, 40)), dtype)
    b = stored(rng.standard_normal((320, 56)), dtype)
    return Case(stored(fp32_sum(a.T, b), dtype), a.T @ b, dtype, T.term_scale(np.matmul, a.T, b),
                0, lambda i: a[:, i[0]] * b[:, i[1]])


def moe_rows(rng, act: str | None) -> Case:
    """test_gpu_moe_backward's moe_rows (C float32, held to the float32 bound) and, with
    ``act``, moe_rows_act's dh = act'(h) · gate · G stored in float16 (GELU's tanh.approx
    allowance aside: silu and relu here)."""
    dy = stored(rng.standard_normal((128, 200)), "float16")
    w = stored(rng.standard_normal((200, 136)), "float16")
    g = fp32_sum(dy, w)
    rss = T.term_scale(np.matmul, dy, w)
    if act is None:
        return Case(g, dy @ w, "float32", rss, 0, lambda i: dy[i[0]] * w[:, i[1]])
    h = rng.standard_normal((128, 136)) * 2
    gate = rng.random(128)[:, None]
    d = {"silu": lambda v: (1 + v * (1 - 1 / (1 + np.exp(-v)))) / (1 + np.exp(-v)),
         "relu": lambda v: (v > 0).astype(float)}[act](h)
    return Case(stored(d * gate * g, "float16"), d * gate * (dy @ w), "float16",
                np.abs(d) * gate * rss, 0,
                lambda i: d[i] * gate[i[0], 0] * dy[i[0]] * w[:, i[1]])


CASES = {
    **{f"gemm-{d}": (lambda d: lambda rng: gemm(rng, d))(d)
       for d in ("float16", "bfloat16", "tf32")},
    "gemm-accumulate-tf32": lambda rng: gemm(rng, "tf32", 150, 70, 300, accumulate=True),
    "gemm-small-k-float16": lambda rng: gemm(rng, "float16", 64, 64, 40, density=1.0),
    "gemm-cublas-split-k-float16": lambda rng: gemm(rng, "float16", 70, 90, 1024, 1.0,
                                                    splits=4),
    **{f"spmm-{d}": (lambda d: lambda rng: spmm(rng, d))(d) for d in ("float32", "float16")},
    **{f"sddmm-{d}": (lambda d: lambda rng: sddmm(rng, d))(d) for d in ("float32", "float16")},
    **{f"rgcn-{o}-{d}": (lambda o, d: lambda rng: rgcn(rng, d, o))(o, d)
       for o in ("transform-first", "aggregate-first") for d in ("float16", "tf32")},
    "attention-float16": lambda rng: attention(rng, "float16"),
    "moe-float16": lambda rng: moe(rng, "float16"),
    **{f"moe-wgrad-{d}": (lambda d: lambda rng: moe_wgrad(rng, d))(d)
       for d in ("float16", "bfloat16")},
    "moe-rows-float32": lambda rng: moe_rows(rng, None),
    **{f"moe-rows-act-{a}-float16": (lambda a: lambda rng: moe_rows(rng, a))(a)
       for a in ("silu", "relu")},
    **{f"linear-{g}-{d}": (lambda g, d: lambda rng: linear(rng, d, g))(g, d)
       for g in ("y", "dx", "dw", "db") for d in ("float16", "bfloat16", "tf32")},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bound_passes_the_kernel_and_fails_one_dropped_term(name):
    case = CASES[name](np.random.default_rng(sorted(CASES).index(name)))
    check = dict(scale=case.scale, roundings=case.roundings)
    T.assert_close(case.got, case.want, case.dtype, **check)
    if case.drop is not None:
        with pytest.raises(AssertionError, match="beyond the"):
            T.assert_close(case.drop(), case.want, case.dtype, **check)
        return
    index = np.unravel_index(int(np.argmax(case.scale)), case.scale.shape)
    terms = case.terms(index)
    assert np.isclose(terms.sum(), case.want[index]) and len(terms) > 1
    nonzero = terms[terms != 0]
    typical = nonzero[np.argsort(np.abs(nonzero))[len(nonzero) // 2]]
    bad = case.got.copy()
    bad[index] -= typical
    with pytest.raises(AssertionError, match="1 of .* beyond the"):
        T.assert_close(bad, case.want, case.dtype, **check)


def test_roundings_must_not_be_negative():
    with pytest.raises(ValueError, match="roundings must be >= 0"):
        T.assert_close(np.ones(2), np.ones(2), "float16", scale=np.ones(2), roundings=-1)


def test_term_scale_takes_sparse_operands():
    """term_scale over a CSR or a Relational squares their values: the same scale as over the
    dense matrix."""
    rng = np.random.default_rng(0)
    a = T.random_csr(rng, (20, 30), "random", 0.3)
    x = rng.standard_normal((30, 5))
    np.testing.assert_allclose(T.term_scale(R.spmm_csr, a, x),
                               T.term_scale(np.matmul, a.to_dense(), x))
    g = Relational.from_relations([a, T.random_csr(rng, (20, 30), "random", 0.3)])
    w = rng.standard_normal((2, 5, 3))
    dense = [g.relation(r).to_dense() for r in range(2)]
    want = np.sqrt(sum((d ** 2) @ (x ** 2) @ (w[r] ** 2) for r, d in enumerate(dense)))
    np.testing.assert_allclose(T.term_scale(R.rgcn_reference, g, x, w), want)
