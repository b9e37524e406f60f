"""The GPU workloads of the peer suite (``pitgen bench peers``): each is a function of a
:class:`Ctx` that appends result rows (plain dicts, one per system and configuration) to a list
it is given, so that the rows measured before a crash are kept.

Every system runs inside :func:`attempt`: a failure becomes a row carrying its error, so one
broken peer never hides the others. Rows hold only measured times; a stage a system does not
have (dense cuBLAS has no conversion) or that was not measured is ``None``. Derived columns
(total, ideal, speed-ups) are computed by :func:`pitgen.bench.peers.derive` from these, so that
``--replot`` can recompute them from the saved JSON. Also the masks and skewed distributions
other benchmarks draw their inputs from.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .report import describe
from .timing import Timer

#: Relative error (Frobenius, against a float32 reference) above which a row is disqualified.
TOL = {"float16": 1e-2, "bfloat16": 2e-2}
#: cuSPARSE is tens of ms at low sparsity: few repeats.
CUSPARSE_REPEATS = 5
#: pitgen's explicit micro-tile per pattern (a 1x1 pattern has none of its own: 32x1 is PIT's).
EXPLICIT_TILE = {"1x1": "32x1", "32x1": "32x1", "1x64": "1x64", "32x64": "32x64"}
#: Triton BSR blocks to try in order (powers of two >= 16 in both dims); the first accepted wins.
BSR_BLOCKS = {"1x1": ((16, 16), (32, 32), (64, 64)), "32x1": ((16, 16), (32, 32), (64, 64)),
              "1x64": ((16, 16), (16, 64), (32, 64)), "32x64": ((32, 64), (32, 32), (16, 16))}
MICRO_EXPR = "C[m,n] += A[m,k] * B[k,n]"


@dataclass
class Ctx:
    """What a workload needs from the harness: the timer, where to report, when to stop."""

    timer: Timer
    quick: bool
    step: Callable[[str], None]
    out_of_time: Callable[[], bool]
    report: Callable[[dict], None]
    #: bytes per ms of a device-to-device copy (read + write), measured by the harness
    copy_bytes_per_ms: float | None = None
    device: str = "cuda"


# -- harness helpers --------------------------------------------------------------------------

def attempt(ctx: Ctx, rows: list[dict], base: dict, system: str,
            fn: Callable[[], dict]) -> dict:
    """Run one system; its row gets fn's fields, or the error that stopped it."""
    row = {**base, "system": system, "status": "ok"}
    try:
        row.update(fn())
    except Exception as e:  # a failing system is a result, not a crash
        row.update(status="error", error=describe(e))
        try:
            torch.cuda.synchronize()
        except Exception as e2:  # a sticky CUDA error: later rows will say so too
            row["error"] += f"; then {describe(e2)}"
        torch.cuda.empty_cache()
    rows.append(row)
    ctx.report(row)
    return row


def skip(ctx: Ctx, rows: list[dict], base: dict, systems: tuple[str, ...], reason: str) -> None:
    """Rows for systems not run, with the reason (they are listed, never silently dropped)."""
    for s in systems:
        row = {**base, "system": s, "status": "skipped", "note": reason}
        rows.append(row)
        ctx.report(row)


def judge(out: torch.Tensor, ref: torch.Tensor, dtype: str = "float16") -> dict:
    """Relative Frobenius error against the float32 reference; NaN/inf or > TOL is 'wrong'."""
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return {"rel_err": err, "dtype": dtype, "status": "ok" if err <= TOL[dtype] else "wrong"}


# -- data generators --------------------------------------------------------------------------

def block_mask(shape: tuple[int, int], unit: tuple[int, int], density: float,
               gen: torch.Generator | None = None, device: str = "cuda") -> torch.Tensor:
    """Boolean mask whose non-zeros come in aligned ``unit`` blocks: exactly
    round(density x blocks) of them, those of the smallest values of a fresh uniform draw on the
    device. (Kept each with probability ``density``, a 4096^2 operand's 1,024 blocks of
    128 x 128 held 118 at "90% sparsity" in one benchmark run: the cell measured 88.5%.)"""
    draw = torch.rand((-(-shape[0] // unit[0]), -(-shape[1] // unit[1])), generator=gen,
                      device=device)
    grid = torch.zeros(draw.numel(), dtype=torch.bool, device=device)
    grid[torch.argsort(draw.flatten(), stable=True)[: round(density * draw.numel())]] = True
    grid = grid.view(draw.shape)
    return grid.repeat_interleave(unit[0], 0).repeat_interleave(unit[1], 1)[: shape[0], : shape[1]]


def zipf_popularity(experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Expert probabilities proportional to 1/rank^s, ranks shuffled (skewed routing)."""
    p = 1.0 / np.arange(1, experts + 1) ** s
    return (p / p.sum())[rng.permutation(experts)]


def long_tail_lengths(batch: int, pad: int, rng: np.random.Generator) -> np.ndarray:
    """Sequence lengths in [1, pad]: log-normal with median pad/6 (most sequences short, a
    few long ones up to the padded length, as in GLUE-style batches)."""
    raw = np.exp(rng.normal(math.log(pad / 6), 0.9, size=batch))
    return np.clip(np.ceil(raw), 1, pad).astype(np.int64)


# -- systems shared by the workloads ----------------------------------------------------------

def run_dense(ctx: Ctx, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
    ms = ctx.timer(lambda: torch.matmul(a, b))
    return {"compute_ms": ms, **judge(torch.matmul(a, b), ref)}


def run_pitgen(ctx: Ctx, expr: str, sparse: str, micro: str, a: torch.Tensor, b: torch.Tensor,
               ref: torch.Tensor) -> dict:
    """pitgen: index build and compute timed apart, then the whole call ``kern(a, b, out)``.
    Compute runs on a call prepared once; the index build on a fresh call per run, as kern()
    does (a reused call would keep every run's index buffers and allocate inside the timing)."""
    import pitgen

    kern = pitgen.compile(expr, sparse=sparse, dtype="float16", micro_tile=micro)
    out = torch.empty(ref.shape, dtype=torch.float16, device=ctx.device)
    t0 = time.perf_counter()
    call = kern.prepare(a, b, out=out)  # plans ('auto') and compiles or loads the module
    prepare_s = time.perf_counter() - t0
    index_ms = ctx.timer(lambda: kern.prepare(a, b, out=out).build_index(None))
    call.build_index(None)
    compute_ms = ctx.timer(lambda: call.compute(None))
    call_ms = ctx.timer(lambda: kern(a, b, out=out))
    out.fill_(float("nan"))
    kern(a, b, out=out)
    return {"conv_ms": index_ms, "compute_ms": compute_ms, "call_ms": call_ms,
            "variant": f"{micro} -> {kern.plan.choice.label}", "prepare_s": prepare_s,
            **judge(out, ref)}


# -- 1. micro-benchmark -----------------------------------------------------------------------

MICRO_SYSTEMS = ("dense", "cusparse", "bsr", "stk", "pitgen-auto", "pitgen-tile")


def _cusparse(ctx: Ctx, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
    reps = min(ctx.timer.repeats, CUSPARSE_REPEATS)
    conv = ctx.timer(lambda: a.to_sparse_csr(), repeats=reps, warmup=1)
    s = a.to_sparse_csr()
    comp = ctx.timer(lambda: torch.matmul(s, b), repeats=reps, warmup=1)
    return {"conv_ms": conv, "compute_ms": comp, "repeats": reps, "variant": f"nnz {s._nnz()}",
            **judge(torch.matmul(s, b), ref)}


def _bsr(ctx: Ctx, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor,
         blocks: tuple[tuple[int, int], ...]) -> dict:
    from torch.sparse._triton_ops import bsr_dense_mm

    refused = []
    for bs in blocks:
        try:
            s = a.to_sparse_bsr(bs)
            bsr_dense_mm(s, b)
            torch.cuda.synchronize()
            break
        except Exception as e:
            refused.append(f"{bs[0]}x{bs[1]}: {describe(e)}")
    else:
        raise RuntimeError("no block size accepted: " + " | ".join(refused))
    conv = ctx.timer(lambda: a.to_sparse_bsr(bs))
    comp = ctx.timer(lambda: bsr_dense_mm(s, b))
    row = {"conv_ms": conv, "compute_ms": comp, "block": f"{bs[0]}x{bs[1]}",
           "variant": f"block {bs[0]}x{bs[1]}, {s._nnz()} blocks", **judge(bsr_dense_mm(s, b), ref)}
    if refused:
        row["note"] = "refused: " + " | ".join(refused)
    return row


def _stk(ctx: Ctx, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
    import stk

    conv = ctx.timer(lambda: stk.ops.to_sparse(a, blocking=128))
    s = stk.ops.to_sparse(a, blocking=128)
    comp = ctx.timer(lambda: stk.ops.dsd(s, b))
    return {"conv_ms": conv, "compute_ms": comp,
            "variant": f"block 128x128, {s.data.shape[0]} blocks", **judge(stk.ops.dsd(s, b), ref)}


def micro(ctx: Ctx, rows: list[dict], sizes: list[int], grans: list[str],
          sparsities: list[float]) -> None:
    """PIT's micro-benchmark: C = A @ B in fp16, A sparse in aligned units of a granularity."""
    for n in sizes:
        gen = torch.Generator(device=ctx.device).manual_seed(n)
        a0 = torch.randn(n, n, generator=gen, device=ctx.device).half()
        b = torch.randn(n, n, generator=gen, device=ctx.device).half()
        for gran in grans:
            unit = tuple(int(v) for v in gran.split("x"))
            for sp in sparsities:
                base = {"workload": "micro", "size": n, "granularity": gran, "sparsity": sp}
                ctx.step(f"micro {n} {gran} {sp:g}%")
                if ctx.out_of_time():
                    skip(ctx, rows, base, MICRO_SYSTEMS, "time budget spent")
                    continue
                mask = block_mask((n, n), unit, 1 - sp / 100, gen, ctx.device)
                a = a0 * mask
                base["density"] = mask.sum().item() / mask.numel()
                del mask
                ref = a.float() @ b.float()
                attempt(ctx, rows, base, "dense", lambda: run_dense(ctx, a, b, ref))
                if ctx.quick and sp < 90:
                    skip(ctx, rows, base, ("cusparse",), "below 90% sparsity in --quick")
                else:
                    attempt(ctx, rows, base, "cusparse", lambda: _cusparse(ctx, a, b, ref))
                attempt(ctx, rows, base, "bsr", lambda: _bsr(ctx, a, b, ref, BSR_BLOCKS[gran]))
                attempt(ctx, rows, base, "stk", lambda: _stk(ctx, a, b, ref))
                attempt(ctx, rows, base, "pitgen-auto",
                        lambda: run_pitgen(ctx, MICRO_EXPR, "A", "auto", a, b, ref))
                attempt(ctx, rows, base, "pitgen-tile",
                        lambda: run_pitgen(ctx, MICRO_EXPR, "A", EXPLICIT_TILE[gran], a, b, ref))


# -- 2a. MoE ----------------------------------------------------------------------------------

MOE_SYSTEMS = ("loop", "grouped-fp16", "grouped-bf16", "pitgen-fused", "pitgen-experts",
               "pitgen-shared", "stk")


def _timed_layer(ctx: Ctx, fn: Callable[[], torch.Tensor]) -> dict:
    """Device time of a whole layer with its host launches hidden, and host wall time per call."""
    t = ctx.timer.both(fn, calls=3)
    return {"total_ms": t.gpu_ms, "host_ms": t.wall_ms}


class _Moe:
    """One MoE layer's data: tokens X, top-1 expert ids, expert weights W1[e], W2[e]."""

    def __init__(self, ctx: Ctx, experts: int, tokens: int, hidden: int, ffn: int, seed: int):
        self.E, self.T, self.H, self.F, dev = experts, tokens, hidden, ffn, ctx.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        p = torch.tensor(zipf_popularity(experts, 1.0, np.random.default_rng(seed)), device=dev)
        self.eid = torch.multinomial(p, tokens, replacement=True, generator=gen)
        self.x = torch.randn(tokens, hidden, generator=gen, device=dev).half()
        self.w1 = (torch.randn(experts, hidden, ffn, generator=gen, device=dev)
                   / math.sqrt(hidden)).half()
        self.w2 = (torch.randn(experts, ffn, hidden, generator=gen, device=dev)
                   / math.sqrt(ffn)).half()
        self.ref = torch.empty(tokens, hidden, device=dev)
        for e in range(experts):
            idx = (self.eid == e).nonzero().squeeze(1)
            h = torch.relu(self.x[idx].float() @ self.w1[e].float())
            self.ref[idx] = h @ self.w2[e].float()
        counts = torch.bincount(self.eid, minlength=experts).cpu()
        self.stats = {"max_tokens": int(counts.max()), "min_tokens": int(counts.min()),
                      "empty_experts": int((counts == 0).sum())}


def _moe_loop(m: _Moe) -> torch.Tensor:
    """The plain PyTorch loop: sort tokens by expert, one matmul pair per expert. Needs the
    per-expert counts on the host (one sync)."""
    order = torch.argsort(m.eid)
    counts = torch.bincount(m.eid, minlength=m.E).tolist()
    xs = m.x[order]
    ys = torch.empty_like(xs)
    s = 0
    for e, c in enumerate(counts):
        if c:
            ys[s:s + c] = torch.relu(xs[s:s + c] @ m.w1[e]) @ m.w2[e]
        s += c
    y = torch.empty_like(m.x)
    y[order] = ys
    return y


def _moe_grouped(m: _Moe, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over tokens sorted by expert with int32 group end offsets (bf16 runs
    CUTLASS on sm90 without a sync; fp16 falls back to a loop that copies offsets to the host)."""
    order = torch.argsort(m.eid)
    offs = torch.cumsum(torch.bincount(m.eid, minlength=m.E), 0, dtype=torch.int32)
    h = torch.relu(torch._grouped_mm(x[order], w1, offs=offs))
    ys = torch._grouped_mm(h, w2, offs=offs)
    y = torch.empty_like(x)
    y[order] = ys
    return y


class _StkMoe:
    """MegaBlocks' dMoE on stk (:func:`pitgen.bench.moe.stk_dmoe`), ReLU between the GEMMs."""

    def __init__(self, m: _Moe):
        self.m = m
        self.w1 = m.w1.permute(1, 0, 2).reshape(m.H, m.E * m.F).contiguous()  # [H, E*F]
        self.w2 = m.w2.reshape(m.E * m.F, m.H)  # [E*F, H]

    def __call__(self) -> torch.Tensor:
        from .moe import stk_dmoe

        m = self.m
        o, order = stk_dmoe(m.x, m.eid, self.w1, self.w2, m.E, m.F,
                            lambda blocks, cols: torch.relu(blocks))
        y = torch.empty_like(m.x)
        y[order] = o
        return y


def _pitgen_kernels(m: _Moe):
    import pitgen

    k1 = pitgen.compile("Y[t,f] += X[t,h] * W[h,f]", sparse="X", dtype="float16",
                        micro_tile=(1, m.H))
    k2 = pitgen.compile("Y[t,h] += X[t,f] * W[f,h]", sparse="X", dtype="float16",
                        micro_tile=(1, m.F))
    return k1, k2


class _PitgenExperts:
    """pitgen through its public API only: per expert, the expert's rows of the token matrix
    are a sparse-m operand (other rows zeroed by a mask), micro-tile 1 x hidden; results
    accumulate into one output. Each call builds its own index; the masked copies are the
    price of having no shared routing index in the API."""

    def __init__(self, m: _Moe):
        self.m = m
        self.k1, self.k2 = _pitgen_kernels(m)

    def __call__(self) -> torch.Tensor:
        m = self.m
        onehot = (m.eid[None, :] == torch.arange(m.E, device=m.eid.device)[:, None])
        onehot = onehot.to(m.x.dtype).unsqueeze(-1)  # [E, T, 1]
        h = torch.zeros(m.T, m.F, dtype=m.x.dtype, device=m.x.device)
        y = torch.zeros_like(m.x)
        xm = torch.empty_like(m.x)
        for e in range(m.E):
            torch.mul(m.x, onehot[e], out=xm)
            self.k1(xm, m.w1[e], out=h, accumulate=True)
        h.relu_()
        hm = torch.empty_like(h)
        for e in range(m.E):
            torch.mul(h, onehot[e], out=hm)
            self.k2(hm, m.w2[e], out=y, accumulate=True)
        return y


class _PitgenShared:
    """PIT's MoE scheme: one pitgen index build over a token x (expert, 16) indicator matrix
    lists every expert's tokens (micro-tile 1x16 along tokens: one row list per expert, no
    sort, no host sync); each expert's two GEMMs then gather their rows through that list.
    Hands the routing index to the expert calls with GemmCall.use_index."""

    WIDTH = 16

    def __init__(self, m: _Moe):
        import pitgen

        self.m = m
        k1, k2 = _pitgen_kernels(m)
        self.kr = pitgen.compile("R[t,n] += I[t,k] * D[k,n]", sparse="I", dtype="float16",
                                 micro_tile=(1, self.WIDTH))
        dev = m.x.device
        self.ind = torch.zeros(m.T, m.E, self.WIDTH, dtype=m.x.dtype, device=dev)
        self.dummy = torch.zeros(m.E * self.WIDTH, 16, dtype=m.x.dtype, device=dev)
        self.h = torch.zeros(m.T, m.F, dtype=m.x.dtype, device=dev)
        self.y = torch.zeros_like(m.x)
        self.c1 = [k1.prepare(m.x, m.w1[e], out=self.h, accumulate=True) for e in range(m.E)]
        self.c2 = [k2.prepare(self.h, m.w2[e], out=self.y, accumulate=True) for e in range(m.E)]
        self.experts = torch.arange(m.E, device=dev)

    def index(self):
        """The routing index: every expert's token lists, one per row block of the row-owner
        kernel (counts [E * blocks], token ids [E * blocks, rows per block]; expert-major)."""
        m = self.m
        self.ind.copy_((m.eid[:, None] == self.experts[None, :])[:, :, None]
                       .expand(m.T, m.E, self.WIDTH))
        call = self.kr.prepare(self.ind.view(m.T, m.E * self.WIDTH), self.dummy)
        call.build_index(None)
        return call.counts, call.ids

    def __call__(self) -> torch.Tensor:
        counts, ids = self.index()
        n = counts.numel() // self.m.E  # row blocks (the expert GEMMs have as many: same rows)
        self.h.zero_()
        self.y.zero_()
        for e, c in enumerate(self.c1):
            c.use_index(counts[e * n:(e + 1) * n], ids[e * n:(e + 1) * n])
            c.compute(None)
        self.h.relu_()
        for e, c in enumerate(self.c2):
            c.use_index(counts[e * n:(e + 1) * n], ids[e * n:(e + 1) * n])
            c.compute(None)
        return self.y


def moe(ctx: Ctx, rows: list[dict], experts_list: list[int], tokens: int, hidden: int,
        ffn: int) -> None:
    """Switch-base MoE FFN (top-1, skewed routing): every system maps (X, expert ids) to Y."""
    for n_exp in experts_list:
        base = {"workload": "moe", "experts": n_exp, "tokens": tokens, "hidden": hidden,
                "ffn": ffn}
        ctx.step(f"moe {n_exp} experts")
        if ctx.out_of_time():
            skip(ctx, rows, base, MOE_SYSTEMS, "time budget spent")
            continue
        m = _Moe(ctx, n_exp, tokens, hidden, ffn, seed=n_exp)
        base.update(m.stats)
        weight_bytes = (m.w1.numel() + m.w2.numel()) * m.w1.element_size()
        if ctx.copy_bytes_per_ms:
            base["floor_ms"] = weight_bytes / ctx.copy_bytes_per_ms

        def measure(fn: Callable[[], torch.Tensor], dtype: str = "float16") -> dict:
            return {**_timed_layer(ctx, fn), **judge(fn(), m.ref, dtype)}

        attempt(ctx, rows, base, "loop", lambda: {**measure(lambda: _moe_loop(m)),
                                                  "note": "host sync: per-expert counts"})
        attempt(ctx, rows, base, "grouped-fp16",
                lambda: measure(lambda: _moe_grouped(m, m.x, m.w1, m.w2)))

        def grouped_bf16() -> dict:
            xb, w1b, w2b = m.x.bfloat16(), m.w1.bfloat16(), m.w2.bfloat16()
            return {**measure(lambda: _moe_grouped(m, xb, w1b, w2b), "bfloat16"),
                    "note": "inputs converted to bf16 outside the timing"}

        attempt(ctx, rows, base, "grouped-bf16", grouped_bf16)

        def fused() -> dict:
            from pitgen.ops.moe import moe_ffn

            ids, gates = m.eid[:, None], torch.ones(m.T, 1, device=m.x.device)
            return {**measure(lambda: moe_ffn(m.x, ids, gates, m.w1, m.w2, activation="relu",
                                              check=False)),
                    "note": "pitgen.ops.moe.moe_ffn: the layer in one op (routing index, both "
                            "expert GEMMs, scatter)"}

        attempt(ctx, rows, base, "pitgen-fused", fused)
        attempt(ctx, rows, base, "pitgen-experts",
                lambda: {**measure(_PitgenExperts(m)),
                         "note": "per expert: masked copy of X / H, index build, GEMM"})

        def shared() -> dict:
            s = _PitgenShared(m)
            out = measure(s)
            out["conv_ms"] = ctx.timer(s.index)
            out["note"] = "one routing index (index column), handed to the experts' GemmCalls"
            return out

        attempt(ctx, rows, base, "pitgen-shared", shared)
        # last: a fault inside a peer's kernels must not take pitgen's rows with it
        attempt(ctx, rows, base, "stk", lambda: {**measure(_StkMoe(m)),
                                                 "note": "host sync: padded token count"})


# -- 2b. dynamic sequence length --------------------------------------------------------------

SEQLEN_SYSTEMS = ("dense", "packed", "pitgen-auto", "pitgen-tile")


def seqlen(ctx: Ctx, rows: list[dict], pads: list[int], outs: list[int], batch: int,
           hidden: int) -> None:
    """BERT-base linear layers on a padded batch: padding rows are zero, a sparse-m pattern."""
    rng = np.random.default_rng(7)
    for pad in pads:
        lengths = long_tail_lengths(batch, pad, rng)
        gen = torch.Generator(device=ctx.device).manual_seed(pad)
        lens = torch.tensor(lengths, device=ctx.device)
        valid = (torch.arange(pad, device=ctx.device)[None, :] < lens[:, None]).reshape(-1)
        x = (torch.randn(batch * pad, hidden, generator=gen, device=ctx.device)
             * valid[:, None]).half()
        for n_out in outs:
            base = {"workload": "seqlen", "pad": pad, "out_features": n_out, "batch": batch,
                    "hidden": hidden, "mean_len": float(lengths.mean()),
                    "max_len": int(lengths.max()),
                    "valid_frac": float(lengths.sum()) / (batch * pad)}
            ctx.step(f"seqlen pad {pad} {hidden}->{n_out}")
            if ctx.out_of_time():
                skip(ctx, rows, base, SEQLEN_SYSTEMS, "time budget spent")
                continue
            w = (torch.randn(hidden, n_out, generator=gen, device=ctx.device)
                 / math.sqrt(hidden)).half()
            ref = x.float() @ w.float()

            def packed() -> torch.Tensor:
                """Remove padding (token ids from the attention mask), matmul, scatter back."""
                idx = valid.nonzero().squeeze(1)
                y = torch.zeros(batch * pad, n_out, dtype=x.dtype, device=x.device)
                y[idx] = x[idx] @ w
                return y

            attempt(ctx, rows, base, "dense", lambda: run_dense(ctx, x, w, ref))
            attempt(ctx, rows, base, "packed",
                    lambda: {"compute_ms": ctx.timer(packed), **judge(packed(), ref),
                             "note": "host sync: nonzero"})
            expr = "Y[t,n] += X[t,k] * W[k,n]"
            attempt(ctx, rows, base, "pitgen-auto",
                    lambda: run_pitgen(ctx, expr, "X", "auto", x, w, ref))
            attempt(ctx, rows, base, "pitgen-tile",
                    lambda: run_pitgen(ctx, expr, "X", f"1x{hidden}", x, w, ref))


# -- 2c. activation sparsity ------------------------------------------------------------------

FFN_SYSTEMS = ("dense", "pitgen-auto", "pitgen-tile")
FFN_TARGET = 0.90  # fraction of zeros after the ReLU, as OPT's fc2 inputs


def _bias_for(pre: torch.Tensor, spread: torch.Tensor, target: float) -> float:
    """Bias shift mu (bisection) such that relu(pre + mu + spread) has ``target`` zeros."""
    lo, hi = -20.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        zeros = ((pre + (mid + spread)) <= 0).float().mean().item()
        lo, hi = (lo, mid) if zeros < target else (mid, hi)
    return (lo + hi) / 2


def ffn(ctx: Ctx, rows: list[dict], tokens: int, hidden: int, ffn_dim: int) -> None:
    """OPT-style fc2 after ReLU: Y = relu(H @ W1 + b) @ W2 with the ReLU's zeros as sparsity.
    Two biases: one shift for all neurons (zeros scattered at random), and a per-neuron shift
    drawn N(mu, 2) (some neurons almost never fire: zeros come in columns, as in OPT)."""
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    hs = torch.randn(tokens, hidden, generator=gen, device=ctx.device).half()
    w1 = torch.randn(hidden, ffn_dim, generator=gen, device=ctx.device) / math.sqrt(hidden)
    w2 = (torch.randn(ffn_dim, hidden, generator=gen, device=ctx.device)
          / math.sqrt(ffn_dim)).half()
    pre = (hs @ w1.half()).float()
    for bias, sd in (("uniform", 0.0), ("per-neuron", 2.0)):
        base = {"workload": "ffn", "bias": bias, "tokens": tokens, "hidden": hidden,
                "ffn": ffn_dim}
        ctx.step(f"ffn {bias} bias")
        if ctx.out_of_time():
            skip(ctx, rows, base, FFN_SYSTEMS, "time budget spent")
            continue
        spread = sd * torch.randn(ffn_dim, generator=gen, device=ctx.device)
        mu = _bias_for(pre, spread, FFN_TARGET)
        x = torch.relu(pre + (mu + spread)).half()
        nz = x != 0
        base.update({
            "bias_mu": mu, "bias_sd": sd, "act_sparsity": 1 - nz.float().mean().item(),
            "zero_tiles_32x1": 1 - nz[: tokens // 32 * 32].reshape(tokens // 32, 32, ffn_dim)
            .any(1).float().mean().item(),
            "zero_columns": 1 - nz.any(0).float().mean().item()})
        del nz
        ref = x.float() @ w2.float()
        expr = "Y[t,h] += X[t,f] * W[f,h]"
        attempt(ctx, rows, base, "dense", lambda: run_dense(ctx, x, w2, ref))
        for system, micro in (("pitgen-auto", "auto"), ("pitgen-tile", "32x1")):
            attempt(ctx, rows, base, system,
                    lambda: run_pitgen(ctx, expr, "X", micro, x, w2, ref))
