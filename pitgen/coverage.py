"""Planning from data that lives on the GPU: every candidate's coverage counts (non-zero
micro-tiles, dense tiles after packing, covered elements) are reduced on the device and come
back in one small copy, so ``micro_tile='auto'`` never moves the operand to the host."""
from __future__ import annotations

from typing import Any

from .expr import Operator
from .planner import Plan, candidate_counting, make_plan
from .operands import Operand


def _tile_counts_torch(mask, counting):
    """[len(counting), 3] int64 tensor of (nonzero tiles, dense tiles, covered elements)."""
    import torch

    rows = []
    for (kind, _, shape), axis_dim, (chunk, run) in counting:
        t = [min(s, n) for s, n in zip(shape, mask.shape)]
        grid_shape = [-(-n // s) for n, s in zip(mask.shape, t)]
        padded = torch.zeros([g * s for g, s in zip(grid_shape, t)], dtype=torch.uint8,
                             device=mask.device)
        padded[tuple(slice(0, n) for n in mask.shape)] = mask
        view = padded.reshape([v for g, s in zip(grid_shape, t) for v in (g, s)])
        grid = view.amax(dim=tuple(range(1, 2 * len(t), 2)))
        sizes = None
        for d, (n, s) in enumerate(zip(mask.shape, t)):
            ext = torch.full((grid_shape[d],), s, dtype=torch.int64, device=mask.device)
            ext[-1] = n - s * (grid_shape[d] - 1)
            ext = ext.reshape([-1 if i == d else 1 for i in range(len(t))])
            sizes = ext if sizes is None else sizes * ext
        g64 = grid.to(torch.int64)
        nonzero = g64.sum()
        covered = (g64 * sizes).sum()
        if kind == "micro":
            along = g64.movedim(axis_dim, -1)
            along = torch.nn.functional.pad(along, (0, -along.shape[-1] % run))
            per_run = along.reshape(*along.shape[:-1], -1, run).sum(dim=-1)
            dense = ((per_run + chunk - 1) // chunk).sum()
        elif kind == "block":
            dense = nonzero
        else:
            dense = torch.tensor(g64.numel(), device=mask.device)
        rows.append(torch.stack([nonzero, dense, covered]))
    return torch.stack(rows)


def plan_on_device(op: Operator, sparse: str, operand: Operand, tile: Any = None,
                   width: int | None = None) -> Plan:
    """Plan for ``operand``'s actual sparsity: counts reduced on the GPU, one copy back.
    ``width``: the product's N (see :func:`pitgen.planner.make_plan`)."""
    if not operand.is_torch:  # a GPUArray: without torch's reductions, plan from one host copy
        return make_plan(op, sparse, mask=operand.obj.get() != 0, tile=tile, width=width)
    import torch

    counting = candidate_counting(op, sparse, operand.shape, tile)
    specs = [s for s, _, _ in counting]
    mask = operand.obj != 0
    table = torch.cat([_tile_counts_torch(mask, counting).reshape(-1),
                       mask.sum().reshape(1).to(torch.int64)]).cpu().numpy()
    counts = {spec: tuple(int(v) for v in table[3 * i: 3 * i + 3]) for i, spec in enumerate(specs)}
    return make_plan(op, sparse, tile=tile, shape=operand.shape,
                     coverage={"counts": counts, "nnz": int(table[-1])}, width=width)
