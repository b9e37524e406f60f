"""The gather rate a floor is judged against, measured by pitgen's own probe kernel
(templates/probe.cu.j2): rows of B read by id in pieces of a slab's width, as a micro-tile
kernel's SRead along k reads them. Library gathers (``embedding_bag``, ``index_select``) also
reduce or write, and measured 1.2 TB/s on an H100 where the micro-tile kernels themselves pull
3-4 TB/s of gathered rows, so a floor priced at their rate sat above the kernels' own times."""
from __future__ import annotations

from typing import Any

from ..opspec import OpSpec, Permutation

PROBE = OpSpec("gather probe", "probe.cu.j2", {"pit_gather_probe": "PPiiiP"},
               (Permutation("B rows", "C[m,n] += A[m,k] * B[k,n]", "reduction", "B"),),
               ("float16", "bfloat16", "float32"))
#: Pieces in flight per lane; enough to cover L2 latency at one CTA of 256 threads per 2 KB.
LOADS = 4
THREADS = 256


def gather_rate(timer: Any, source: Any, rows: int, piece: int = 256) -> float:
    """Bytes per ms of reading ``rows`` random rows of the 2-D ``source`` (each of its rows
    about ``rows / len(source)`` times, so after the first touch from HBM the rest come from L2)
    in ``piece``-byte slabs (a multiple of 16 dividing 512 and the row's bytes)."""
    import torch

    from ..runtime import TorchLaunch, device_sms

    row_bytes = source.shape[1] * source.element_size()
    if piece % 16 or 512 % piece or row_bytes % piece:
        raise ValueError(f"piece {piece} B must be a multiple of 16 dividing 512 and the "
                         f"row's {row_bytes} B")
    g = torch.Generator(device=source.device).manual_seed(1)
    ids = torch.randint(0, source.shape[0], (rows,), device=source.device, generator=g,
                        dtype=torch.int32)
    sink = torch.zeros(1, dtype=torch.int32, device=source.device)
    mod = PROBE.module({"piece": piece, "loads": LOADS})
    grid = (8 * device_sms(),)

    def probe() -> None:
        with TorchLaunch() as tl:
            mod.launch("pit_gather_probe", grid, (THREADS,), tl.stream, source.data_ptr(),
                       ids.data_ptr(), rows, source.shape[0], row_bytes // 16, sink.data_ptr())
    return rows * row_bytes / timer(probe)
