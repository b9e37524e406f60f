"""Host time per steady-state call of each public op on a tiny problem (issue 16's measure):
wall time over back-to-back calls minus the GPU time of one call, beside torch's own op on the
same problem (the two alternate over several rounds and each reports its median round, since a
lent host's speed drifts by tens of percent within a minute); then what the pieces of a call
cost on this host (a driver launch, an allocation, the signature key...), and a cProfile of
each op's call (where the microseconds go).

    python3 scripts/host_time.py [--calls 1000] [--rounds 5] [--profile 300] [--json OUT]
                                 [--md docs/bench/host.md]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import warnings

import numpy as np
import torch

import pitgen
from pitgen.bench.timing import Timer, host_ms


def cases() -> dict:
    """name -> (pitgen callable, torch peer callable[, the compiled kernel]) on tiny problems."""
    from pitgen.graph import kernels as graph_ops
    from pitgen.graph.device import DeviceCSR, to_format
    from pitgen.ops.attention import sparse_attention
    from pitgen.ops.moe import moe_ffn

    rng = np.random.default_rng(0)
    h = torch.float16
    a = torch.randn(128, 128, device="cuda", dtype=h)
    a[:, torch.rand(128, device="cuda") < 0.5] = 0
    b = torch.randn(128, 128, device="cuda", dtype=h)
    mm = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16", micro_tile="32x1")
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=h) for _ in range(3))
    mask = torch.from_numpy(rng.random((128, 128)) < 0.5).cuda()
    x = torch.randn(64, 128, device="cuda", dtype=h)
    ids = torch.randint(0, 4, (64, 1), device="cuda", dtype=torch.int32)
    gates = torch.rand(64, 1, device="cuda")
    w1 = torch.randn(4, 128, 256, device="cuda", dtype=h) * 0.05
    w2 = torch.randn(4, 256, 128, device="cuda", dtype=h) * 0.05
    dense = rng.random((256, 256)) < 0.05
    ip = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int32)
    ix = np.nonzero(dense)[1].astype(np.int32)
    csr = DeviceCSR((256, 256), torch.from_numpy(ip).cuda(), torch.from_numpy(ix).cuda(),
                    torch.rand(len(ix), device="cuda"))
    feat = torch.randn(256, 64, device="cuda")
    hyb = to_format(csr, "hyb")
    sched = graph_ops.default_schedule("spmm", "hyb", 64, "float32")
    y = torch.empty(256, 64, device="cuda")
    with warnings.catch_warnings():  # torch's "sparse CSR is beta" notices
        warnings.simplefilter("ignore", UserWarning)
        a_t = torch.sparse_csr_tensor(csr.indptr, csr.indices, csr.values, size=(256, 256))
    return {
        "matmul 128^3 32x1": (lambda: mm(a, b), lambda: torch.mm(a, b), mm),
        "attention 1x2x128x64": (lambda: sparse_attention(q, k, v, mask),
                                 lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)),
        "moe T64 E4": (lambda: moe_ffn(x, ids, gates, w1, w2, check=False),
                       lambda: torch.mm(x, w1[0])),
        "spmm 256 nodes f64": (lambda: graph_ops.spmm(csr, feat, out=y),
                               lambda: torch.sparse.mm(a_t, feat)),
        "spmm hyb, given schedule": (lambda: graph_ops.spmm(hyb, feat, schedule=sched, out=y),
                                     lambda: torch.sparse.mm(a_t, feat)),
    }


def components(mm) -> dict:
    """name -> callable: the pieces a steady-state call is made of, each on its own (no GPU
    work but a one-word memset and an empty kernel)."""
    from pitgen.operands import raw_key
    from pitgen.runtime import TorchLaunch, current_stream, memset_d32

    a = torch.randn(128, 128, device="cuda", dtype=torch.float16)
    word = torch.zeros(1, device="cuda", dtype=torch.int32)
    launcher = next(iter(mm._fast.values()))
    empty_kernel = launcher.mod.bind("pit_gemm_zero", (1, 1, 1), (256, 1, 1))

    def context() -> None:
        with TorchLaunch():
            pass

    return {
        "python call": lambda: None,
        "raw_key(a, b, None, None)": lambda: raw_key(a, a, None, None),
        "torch.empty 128x128 fp16": lambda: torch.empty((128, 128), dtype=torch.float16,
                                                        device="cuda"),
        "torch.empty_like": lambda: torch.empty_like(a),
        "current_stream()": current_stream,
        "TorchLaunch enter/exit": context,
        "memset_d32 (driver)": lambda: memset_d32(word.data_ptr(), 0, 1, current_stream()),
        "bound launch, empty kernel": lambda: empty_kernel(current_stream(), a.data_ptr(), 0, 0,
                                                           1, 1),
        "torch add_ of 1 element (one torch op)": lambda: word.add_(1),
    }


def profile(fn, calls: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the 20 functions with the most own time."""
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per op (median)")
    ap.add_argument("--profile", type=int, default=300, help="profiled matmul calls (0: none)")
    ap.add_argument("--json")
    ap.add_argument("--md", help="write the table (issue 16's target judged per op) here")
    args = ap.parse_args()
    timer = Timer(repeats=50, flush=False)
    rows = []
    print(f"{torch.cuda.get_device_name()}: host us per call = wall/call - GPU/call "
          f"({args.calls} calls back to back)")
    print(f"{'op':24s} {'wall us':>9s} {'gpu us':>8s} {'host us':>8s} | {'torch wall':>10s} "
          f"{'torch gpu':>9s} {'torch host':>10s}")
    ops = cases()
    for name, (fn, peer, *_) in ops.items():
        r = {"op": name}
        walls: dict[str, list[float]] = {"pitgen": [], "torch": []}
        fn(), peer()
        for _ in range(args.rounds):   # alternating: both see the same drift
            for who, f in (("pitgen", fn), ("torch", peer)):
                walls[who].append(host_ms(f, args.calls) * 1e3)
        for who, f in (("pitgen", fn), ("torch", peer)):
            wall = float(np.median(walls[who]))
            gpu = timer(f, hide_ms=2.0) * 1e3
            r[who] = {"wall_us": wall, "gpu_us": gpu, "host_us": max(wall - gpu, 0.0),
                      "rounds_wall_us": walls[who]}
        rows.append(r)
        p, t = r["pitgen"], r["torch"]
        print(f"{name:24s} {p['wall_us']:9.1f} {p['gpu_us']:8.1f} {p['host_us']:8.1f} | "
              f"{t['wall_us']:10.1f} {t['gpu_us']:9.1f} {t['host_us']:10.1f}")
    parts = {}
    print(f"\n{'piece of a call':32s} {'us':>7s}")
    for name, fn in components(ops["matmul 128^3 32x1"][2]).items():
        fn()
        parts[name] = host_ms(fn, args.calls) * 1e3
        print(f"{name:32s} {parts[name]:7.2f}")
    if args.profile:
        for name, (fn, _, *_) in ops.items():
            print(f"\n== cProfile, {args.profile} calls of {name} ==")
            print(profile(fn, args.profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "pieces_us": parts},
                      f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows, parts, args))


#: issue 16: host time per steady-state call of each op, in microseconds
TARGET_US = 20.0


def markdown(rows: list[dict], parts: dict, args: argparse.Namespace) -> str:
    """The run as docs/bench/host.md: device, method, one row per op with the target judged."""
    import datetime
    import subprocess
    commit = os.environ.get("PITGEN_COMMIT")   # a lent GPU's copy may carry no git history
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                    capture_output=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = ["# Host time per steady-state call (issue 16)", "",
           f"Device: **{torch.cuda.get_device_name()}** (torch {torch.__version__}); {now}; "
           f"commit {commit}; `python3 scripts/host_time.py --calls {args.calls} "
           f"--rounds {args.rounds}`.", "",
           f"Host µs = eager wall time per call over {args.calls} back-to-back calls of a tiny "
           f"problem minus the GPU time of one call (CUDA events); pitgen's op and torch's "
           f"alternate over {args.rounds} rounds and each reports its median round (a lent "
           f"host's speed drifts by tens of percent within a minute). Target: <= "
           f"{TARGET_US:g} µs.", "",
           "| op (tiny problem) | pitgen wall µs | pitgen GPU µs | **pitgen host µs** | "
           "torch peer host µs | pitgen / torch host | target |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        p, t = r["pitgen"], r["torch"]
        met = "met" if p["host_us"] <= TARGET_US else "**missed**"
        out.append(f"| {r['op']} | {p['wall_us']:.1f} | {p['gpu_us']:.1f} | "
                   f"**{p['host_us']:.1f}** | {t['host_us']:.1f} | "
                   f"{p['host_us'] / max(t['host_us'], 1e-9):.2f}x | <= {TARGET_US:g}: {met} |")
    out += ["", "Torch peers: matmul `torch.mm`, attention SDPA, MoE one `torch.mm`, SpMM "
            "`torch.sparse.mm`.", "", "What the pieces of a call cost on this host (µs):", "",
            "| piece | µs |", "|---|---:|"]
    out += [f"| {name} | {us:.2f} |" for name, us in parts.items()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
