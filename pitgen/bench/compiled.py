"""A model of pitgen modules under ``torch.compile(fullgraph=True)`` (``pitgen bench compiled``):
one training step (forward, backward, AdamW) of a transformer block built from
``pitgen.nn.SparseAttention`` (a block-sparse mask), a pruned ``SparseLinear`` (90% in 32x1
tiles), a sparse-input ``SparseLinear`` after a ReLU and ``pitgen.nn.MoE`` (8 experts, top-2),
eager against compiled (inductor, one graph), in the same run on the same weights.

Checked: no graph break (``torch._dynamo.explain``: one graph), the compiled forward equal to
the eager one within bf16 tolerance, and the steady-state step timed both ways (device time
and eager wall time, first calls excluded). Issue 16's target: the compiled step is no slower
than the eager one.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .report import fmt, fmt_x, md_table, rel_err, write_json

if TYPE_CHECKING:
    from .suite import Run

#: (batch, sequence, embed, heads): quick runs the first only
SHAPES = [(4, 1024, 512, 8), (8, 2048, 768, 12)]
#: the attention mask: 128-key blocks, this share of them allowed (plus the diagonal blocks)
ATTN_BLOCK, ATTN_DENSITY = 128, 0.25
#: forward error bound of compiled vs eager (bf16: different fusions round differently)
TOLERANCE = 2e-2


def _block(embed: int, heads: int, dtype: Any) -> Any:
    """The block, built once per shape (parameters on the GPU)."""
    import torch

    import pitgen.nn

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = {"device": "cuda", "dtype": dtype}
            self.attn = pitgen.nn.SparseAttention(embed, heads, **kw)
            self.up = pitgen.nn.SparseLinear(embed, 4 * embed, **kw)
            self.down = pitgen.nn.SparseLinear(4 * embed, embed, sparse_input=True, **kw)
            self.moe = pitgen.nn.MoE(embed, 2 * embed, num_experts=8, topk=2, **kw)
            self.up.prune_(0.9, tile=(32, 1))

        def forward(self, x: Any, mask: Any) -> Any:
            h = x + self.attn(x, x, x, mask=mask)[0]
            return h + self.down(torch.relu(self.up(h))) + self.moe(h)

    return Block()


def _mask(seq: int, gen: Any) -> Any:
    """Block-sparse [seq, seq] (True = attend): ATTN_DENSITY of the blocks and the diagonal."""
    import torch

    n = -(-seq // ATTN_BLOCK)
    blocks = (torch.rand(n, n, device="cuda", generator=gen) < ATTN_DENSITY) | torch.eye(
        n, dtype=torch.bool, device="cuda")
    return blocks.repeat_interleave(ATTN_BLOCK, 0).repeat_interleave(ATTN_BLOCK, 1)[:seq, :seq]


def _case(r: Run, batch: int, seq: int, embed: int, heads: int, gen: Any) -> dict:
    import torch

    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = _block(embed, heads, dtype)
    mask = _mask(seq, gen)
    x = torch.randn(batch, seq, embed, device="cuda", dtype=dtype, generator=gen)
    torch._dynamo.reset()
    with torch.no_grad():
        report = torch._dynamo.explain(model)(x, mask)
    compiled = torch.compile(model, fullgraph=True)
    t = time.perf_counter()
    with torch.no_grad():
        got = compiled(x, mask)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t
    with torch.no_grad():
        want = model(x, mask)
    err = rel_err(got, want)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(forward: Any) -> Any:
        def go() -> None:
            loss = forward(x, mask).float().square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return go

    for f in (model, compiled, model, compiled):   # the compiled backward builds on first use
        step(f)()
    eager = r.timer.both(step(model), calls=10)
    comp = r.timer.both(step(compiled), calls=10)
    return {"batch": batch, "seq": seq, "embed": embed, "heads": heads, "dtype": "bfloat16",
            "graphs": report.graph_count, "graph_breaks": report.graph_break_count,
            "compile_s": compile_s, "rel_err": err, "eager_ms": eager.gpu_ms,
            "eager_wall_ms": eager.wall_ms, "compiled_ms": comp.gpu_ms,
            "compiled_wall_ms": comp.wall_ms, "gpu_ratio": comp.gpu_ms / eager.gpu_ms,
            "wall_ratio": comp.wall_ms / eager.wall_ms}


def run(r: Run) -> int:
    import torch

    from .report import Progress

    shapes = SHAPES[:1] if r.args.quick else SHAPES
    progress = Progress(len(shapes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, seq, embed, heads in shapes:
        progress.step(f"compiled {batch}x{seq}x{embed}")
        rows.append(_case(r, batch, seq, embed, heads, gen))
    for x in rows:
        x["correct"] = x["rel_err"] <= TOLERANCE and x["graph_breaks"] == 0 and x["graphs"] == 1
        x["met"] = x["correct"] and x["wall_ratio"] <= 1.0 and x["gpu_ratio"] <= 1.0
    write_json(r.out / "compiled.json", {"meta": r.meta, "rows": rows})
    lines = [f"# pitgen modules under torch.compile(fullgraph=True), {r.meta['device']}", "",
             f"torch {r.meta['torch']}, CUDA {r.meta['cuda']}. One training step (forward, "
             "backward, AdamW) of a block: SparseAttention with a block-sparse mask "
             f"({ATTN_BLOCK}-key blocks, {ATTN_DENSITY:.0%} of them and the diagonal), "
             "SparseLinear pruned to 10% in 32x1 tiles, a sparse-input SparseLinear after a "
             "ReLU, and MoE (8 experts, top-2), bf16. Eager against `torch.compile(model, "
             "fullgraph=True)` (inductor) on the same weights; device time: median of "
             f"{r.timer.repeats} steps, L2 flushed; wall: eager wall time per step, 10 steps "
             "back to back; first calls (compiling) excluded. Target (issue 16): the compiled "
             "step no slower than the eager one.", ""]
    lines += md_table(
        ["batch × seq × embed (heads)", "graphs / breaks", "compile s", "fwd rel err",
         "eager ms (wall)", "compiled ms (wall)", "compiled / eager GPU", "compiled / eager wall",
         "target"],
        [[f"{x['batch']} × {x['seq']} × {x['embed']} ({x['heads']})",
          f"{x['graphs']} / {x['graph_breaks']}", f"{x['compile_s']:.1f}",
          f"{x['rel_err']:.1e}", f"{fmt(x['eager_ms'])} ({fmt(x['eager_wall_ms'])})",
          f"{fmt(x['compiled_ms'])} ({fmt(x['compiled_wall_ms'])})", fmt_x(x["gpu_ratio"]),
          fmt_x(x["wall_ratio"]), "met" if x["met"] else "**missed**"] for x in rows])
    text = "\n".join(lines) + "\n"
    (r.out / "compiled.md").write_text(text)
    print(text)
    return 0 if all(x["correct"] for x in rows) else 1
