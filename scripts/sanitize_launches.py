"""One launch of every kernel kind (index build, tile kernel, SWrite passes), for
``compute-sanitizer --tool memcheck|racecheck python scripts/sanitize_launches.py``."""
import torch

import pitgen

M, N, K = 200, 136, 300  # not tile multiples
for dtype in ("float16", "float32"):
    A = torch.randn(M, K, device="cuda", dtype=getattr(torch, dtype))
    A = A * (torch.rand(M, K, device="cuda") < 0.2).to(A.dtype)
    B = torch.randn(K, N, device="cuda", dtype=A.dtype)
    ref = A.double() @ B.double()
    for micro in ("dense", "32x1", "1x64", "1x512", "32x32"):
        out = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype, micro_tile=micro)(A, B)
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"{dtype} {micro}: relative error {err:.2e}")
        assert err < 1e-2
    Bs = B * (torch.rand(K, N, device="cuda") < 0.2).to(B.dtype)
    out = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="B", dtype=dtype, micro_tile="1x32")(A, Bs)
    torch.cuda.synchronize()
    print(f"{dtype} sparse B 1x32: ok")
    mask = A != 0  # the index built from a byte mask instead of the values
    for micro in ("32x1", "1x64", "32x32"):
        pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype, micro_tile=micro)(A, B, mask=mask)
    torch.cuda.synchronize()
    print(f"{dtype} masked index: ok")

# The tile kernel on Hopper (wgmma + TMA; elsewhere mma.sync): its own dense tiles and 128- and
# 64-row k-blocks, ragged, with both consumer schedules (rows of 328 elements: TMA can map them)
from pitgen import lower

A = torch.randn(M, 328, device="cuda", dtype=torch.float16)
A = A * (torch.rand(M, 328, device="cuda") < 0.5).to(A.dtype)
B = torch.randn(328, N, device="cuda", dtype=A.dtype)
ref = A.double() @ B.double()
rule = lower.PINGPONG
for pingpong in (True, False):
    lower.PINGPONG = "always" if pingpong else "never"
    for micro in ("dense", "128x128", "64x128"):
        out = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16",
                             micro_tile=micro, vendor_dense=False)(A, B)
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"tile kernel {micro}, ping-pong {pingpong}: relative error {err:.2e}")
        assert err < 1e-2
lower.PINGPONG = rule
# the row-owner kernel (wgmma on Hopper: rows gathered by cp.async), k-tiles of one and two
# stages, B' n- and k-contiguous, accumulating
for micro in ("1x64", "1x128"):
    for expr, b in (("C[m,n] += A[m,k] * B[k,n]", B), ("C[m,n] += A[m,k] * B[n,k]", B.t().contiguous())):
        out = torch.randn(M, N, device="cuda", dtype=A.dtype)
        want = ref + out.double()
        pitgen.compile(expr, sparse="A", dtype="float16", micro_tile=micro)(A, b, out=out,
                                                                          accumulate=True)
        torch.cuda.synchronize()
        err = ((out.double() - want).norm() / want.norm()).item()
        print(f"rows {micro} {expr}: relative error {err:.2e}")
        assert err < 1e-2
# the products kernel (rows of at most a product or two; here also rows of several and more
# products than slots, which the finishing pass forms itself), B' n- and k-contiguous,
# accumulating or not, and N a multiple of 32 (the finishing pass discards the slots it read)
from pitgen.lower import Schedule, gemm_form
from pitgen.operands import as_operand
from pitgen.ops.matmul import GemmCall, Launcher

tiles = (torch.rand(M, 328 // 64 + 1, device="cuda") < 0.3).repeat_interleave(64, dim=1)[:, :328]
Ap = torch.randn(M, 328, device="cuda", dtype=torch.float16) * tiles.to(torch.float16)
for expr, b in (("C[m,n] += A[m,k] * B[k,n]", B), ("C[m,n] += A[m,k] * B[n,k]", B.t().contiguous()),
                ("C[m,n] += A[m,k] * B[k,n]", B[:, :128].contiguous())):
    b_kn = b if "B[k,n]" in expr else b.t()
    for accumulate in (False, True):
        op = pitgen.parse(expr)
        out = torch.randn(M, b_kn.shape[1], device="cuda", dtype=Ap.dtype)
        want = Ap.double() @ b_kn.double() + (out.double() if accumulate else 0)
        ops = {"A": as_operand("A", Ap), "B": as_operand("B", b)}
        launcher = Launcher(op, gemm_form(op, "A"), [("micro", "m", (1, 64))], "float16", ops,
                            as_operand("out", out), accumulate, Schedule(rows="products"))
        assert launcher.spec.gemm.a_mode == "products"
        GemmCall(launcher, Ap, b, out, reuse=True).run()
        torch.cuda.synchronize()
        err = ((out.double() - want).norm() / want.norm()).item()
        print(f"products {expr} N {b_kn.shape[1]} accumulate {accumulate}: relative error {err:.2e}")
        assert err < 1e-2

# The whole-operator kernels: MoE (routing, grouped GEMMs, scatter), attention (block index,
# fused kernel), SDDMM (both outputs), GPU format conversion + SpMM/SDDMM in every format, and
# the sparse-training autograd path.
import numpy as np

from pitgen.ops.attention import sparse_attention
from pitgen.testing import bigbird_mask, random_global_tokens, tile_mask
from pitgen.graph.device import DeviceCOO, DeviceCSR, to_format
from pitgen.graph.kernels import sddmm as graph_sddmm, spmm, spmm_coo
from pitgen.ops.moe import moe_ffn
from pitgen.ops.sddmm import sddmm

g = torch.Generator(device="cuda").manual_seed(0)
# T 200: the mma.sync kernels (top-1 routes inside the first GEMM); T 300 with ragged H, F: on
# Hopper the wgmma + TMA kernels and moe_place_gather
for T, H, F, E, topk in ((200, 64, 96, 5, 1), (200, 64, 96, 5, 2), (300, 72, 136, 5, 1),
                         (300, 72, 136, 5, 2)):
    x = torch.randn(T, H, device="cuda", dtype=torch.float16)
    ids = torch.randint(0, E, (T, topk), device="cuda", dtype=torch.int32)
    gates = torch.rand(T, topk, device="cuda")
    w1 = torch.randn(E, H, F, device="cuda", dtype=torch.float16) / 8
    w2 = torch.randn(E, F, H, device="cuda", dtype=torch.float16) / 8
    moe_ffn(x, ids, gates, w1, w2, torch.randn(E, F, device="cuda", dtype=torch.float16),
            torch.randn(E, H, device="cuda", dtype=torch.float16))
torch.cuda.synchronize()
print("moe top-1/top-2, both mainloops: ok")
# the backward's kernels (moe_gather, moe_rows_nn / _act / _nt, moe_wgrad): ragged H and F,
# an empty expert, both tile heights, every activation, bfloat16 too, with and without b2
for T, H, F, E, topk, act, dt in ((200, 72, 136, 5, 2, "gelu", torch.float16),
                                  (300, 64, 96, 5, 1, "silu", torch.bfloat16),
                                  (1100, 40, 56, 2, 1, "relu", torch.float16)):
    x = torch.randn(T, H, device="cuda", dtype=dt, requires_grad=True)
    ids = torch.randint(0, E - 1, (T, topk), device="cuda", dtype=torch.int32)
    gates = torch.rand(T, topk, device="cuda", requires_grad=True)
    w1 = (torch.randn(E, H, F, device="cuda", dtype=dt) / 8).requires_grad_()
    w2 = (torch.randn(E, F, H, device="cuda", dtype=dt) / 8).requires_grad_()
    b1 = torch.randn(E, F, device="cuda", dtype=dt, requires_grad=True)
    b2 = torch.randn(E, H, device="cuda", dtype=dt, requires_grad=True) if topk == 1 else None
    y = moe_ffn(x, ids, gates, w1, w2, b1, b2, activation=act)
    torch.autograd.grad(y, [t for t in (x, gates, w1, w2, b1, b2) if t is not None],
                        torch.randn_like(y))
torch.cuda.synchronize()
print("moe backward (moe_gather, moe_rows, moe_wgrad): ok")

rng = np.random.default_rng(0)
for d in (64, 128):
    for sq, sk in ((200, 200), (200, 256)):   # mask read byte by byte / 16 bytes at a time
        q = torch.randn(1, 2, sq, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, 2, sk, d, device="cuda", dtype=torch.float16) for _ in range(2))
        m = torch.from_numpy(tile_mask(rng, sq, sk, (1, 64), 0.7)).cuda()
        sparse_attention(q, k, v, m)
        # gathered key tiles and a dense-row tile (global rows)
        m = torch.from_numpy(bigbird_mask(rng, sq, sk, 32, random_global_tokens(rng, sq, 3), 6))
        sparse_attention(q, k, v, m.cuda())
        # a block layout's index (per-head layout, 128 x 64 blocks, ragged edges)
        lay = torch.from_numpy(rng.random((2, -(-sq // 128), -(-sk // 64))) < 0.5).cuda()
        sparse_attention(q, k, v, block_mask=lay, block_size=(128, 64))
torch.cuda.synchronize()
print("attention d 64/128, byte and vector mask, gathered keys, dense rows, block layout: ok")

# the backward over gathered key tiles (their dK, dV sums) and dense-row tiles, GQA
for d in (64, 128):
    for sq, sk in ((300, 200), (300, 256)):
        q = torch.randn(1, 4, sq, d, device="cuda", dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(1, 2, sk, d, device="cuda", dtype=torch.float16, requires_grad=True)
                for _ in range(2))
        m = torch.from_numpy(bigbird_mask(rng, sq, sk, 32, random_global_tokens(rng, sq, 5), 6))
        sparse_attention(q, k, v, m.cuda()).float().sum().backward()
torch.cuda.synchronize()
print("attention backward d 64/128, gathered keys, dense rows, GQA: ok")

# D = 200: four 64-deep steps on Hopper's wgmma tiles (the last ragged); a Q view strided in
# d runs the mma.sync tiles there
for dt in (torch.float16, torch.bfloat16):
    q = torch.randn(150, 200, device="cuda", dtype=dt)
    k = torch.randn(170, 200, device="cuda", dtype=dt)
    mask = torch.rand(150, 170, device="cuda") < 0.1
    for tile in ((32, 1), (1, 32), (16, 16), (64, 8)):
        sddmm(q, k, mask, tile)
        sddmm(q, k, mask, tile, out=torch.empty(150, 170, device="cuda", dtype=dt))
sddmm(torch.randn(200, 150, device="cuda", dtype=torch.float16).t(),
      torch.randn(170, 200, device="cuda", dtype=torch.float16), mask, (32, 1))
torch.cuda.synchronize()
print("sddmm tiles/dense out: ok")

adj = (torch.rand(300, 280, device="cuda") < 0.05).float()
adj[7] = 1.0  # one dense row: cut rows in hyb
csr = DeviceCSR.from_dense(adj)
for fmt, params in (("csr", {}), ("ell", {}), ("bsr", {"block": 16}), ("hyb", {"c": 2, "k": 3}),
                    ("hyb", {"c": 1, "k": 3})):
    a = to_format(csr, fmt, **params)
    spmm(a, torch.randn(280, 64, device="cuda"))
    graph_sddmm(a, torch.randn(300, 32, device="cuda"), torch.randn(280, 32, device="cuda"))
for c in (1, 2):   # hyb sized by bounds (no host sync): padding past the live slots
    a = to_format(csr, "hyb", sync=False, c=c, k=3)
    spmm(a, torch.randn(280, 64, device="cuda"))
    graph_sddmm(a, torch.randn(300, 32, device="cuda"), torch.randn(280, 32, device="cuda"))
r_, c_ = adj.nonzero().T
for sort in (True, False):   # edge lists: radix-sorted keys, or counts and a scatter
    DeviceCSR.from_coo((300, 280), r_, c_, check=False, sort=sort).row_stats()
# an edge list multiplied as it comes (atomic adds), int64 and int32 ids, edges out of range,
# vector and scalar widths, fp32 straight into out and fp16 through its float32 buffer
r_bad, c_bad = torch.cat([r_, torch.tensor([300, -1], device="cuda")]), torch.cat(
    [c_, torch.tensor([0, 5], device="cuda")])
for ids, feat, dt in ((torch.int64, 64, torch.float32), (torch.int32, 33, torch.float16)):
    coo = DeviceCOO((300, 280), r_bad.to(ids), c_bad.to(ids), torch.randn(
        r_bad.numel(), device="cuda").to(dt))
    spmm_coo(coo, torch.randn(280, feat, device="cuda").to(dt))
# corrupt buffers: indptr not monotone, columns out of range and unordered
bad = DeviceCSR((60, 50), torch.randint(-3, 400, (61,), device="cuda", dtype=torch.int32),
                torch.randint(-2, 53, (397,), device="cuda", dtype=torch.int32),
                torch.randn(397, device="cuda"))
for fmt, params in (("ell", {}), ("bsr", {"block": 8}), ("hyb", {"c": 3, "k": 2}),
                    ("hyb", {"c": 1, "k": 2, "sync": False})):
    a = to_format(bad, fmt, **params)
    spmm(a, torch.randn(50, 32, device="cuda"))
    graph_sddmm(a, torch.randn(60, 32, device="cuda"), torch.randn(50, 32, device="cuda"))
torch.cuda.synchronize()
print("formats csr/ell/bsr/hyb spmm+sddmm, hyb without sync, from_coo, edge-list spmm, "
      "corrupt CSR: ok")

from pitgen.ops.sage import aggregate, graph_spmm

csr.transpose()   # count + place kernels
xs = torch.randn(280, 32, device="cuda", requires_grad=True)
vs = csr.values.clone().requires_grad_()
for fmt in ("csr", "hyb"):   # forward, dX over Aᵀ, edge values by SDDMM
    (graph_spmm(csr, xs, vs, format=fmt).sum() + aggregate(csr, xs, "mean", fmt).sum()).backward()
torch.cuda.synchronize()
print("graph transpose, graph_spmm fwd+bwd: ok")

from pitgen.ops.linear import sparse_weight_linear

w = torch.randn(96, 128, device="cuda", dtype=torch.float16, requires_grad=True)
xin = torch.randn(64, 128, device="cuda", dtype=torch.float16, requires_grad=True)
sparse_weight_linear(xin, w, torch.rand(96, 128, device="cuda") < 0.2).float().sum().backward()
torch.cuda.synchronize()
print("sparse training fwd+bwd: ok")

from pitgen.ops.conv import channel_index, sparse_conv2d

xc = torch.relu(torch.randn(3, 70, 9, 11, device="cuda", dtype=torch.float16))
xc[:, torch.randperm(70, device="cuda")[:60]] = 0
wconv = torch.randn(40, 70, 3, 3, device="cuda", dtype=torch.float16)
with torch.no_grad():
    for xin_c in (xc, xc.contiguous(memory_format=torch.channels_last)):   # index, gather, GEMM
        y = sparse_conv2d(xin_c, wconv, padding=1)
        ref = torch.nn.functional.conv2d(xin_c.float(), wconv.float(), padding=1)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
        sparse_conv2d(xin_c, wconv[:, :, :1, :1].contiguous(), stride=2)
        channel_index(xin_c)
    # channels_last with more scalar columns than a CTA's threads: the index in two rounds
    wide_c = torch.relu(torch.randn(2, 301, 5, 7, device="cuda", dtype=torch.float16))
    channel_index(wide_c.contiguous(memory_format=torch.channels_last))
torch.cuda.synchronize()
print("sparse-channel conv index + gather + GEMM (NCHW, channels_last): ok")

# Small problems above ran the one-launch kernels (lower.FUSED_MAX_CTAS); the same calls again
# with two launches each (index pass, then tile kernel / attention forward)
from pitgen.ops import attention as attention_op

lower.FUSED_MAX_CTAS = 0
attention_op._EAGER.clear()
for dtype in ("float16", "float32"):
    A = torch.randn(M, K, device="cuda", dtype=getattr(torch, dtype))
    A = A * (torch.rand(M, K, device="cuda") < 0.2).to(A.dtype)
    B = torch.randn(K, N, device="cuda", dtype=A.dtype)
    for micro in ("32x1", "32x32"):
        kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype, micro_tile=micro)
        kern(A, B), kern(A, B, mask=A != 0)
for d in (64, 128):
    for sq, sk in ((200, 200), (200, 256)):
        q = torch.randn(1, 2, sq, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, 2, sk, d, device="cuda", dtype=torch.float16) for _ in range(2))
        m = torch.from_numpy(bigbird_mask(rng, sq, sk, 32, random_global_tokens(rng, sq, 3), 6))
        sparse_attention(q, k, v, m.cuda())
torch.cuda.synchronize()
print("matmul and attention in two launches: ok")
