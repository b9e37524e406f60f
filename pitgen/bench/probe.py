"""The gather rate a floor is judged against, measured by pitgen's own probe kernel
(templates/probe.cu.j2): rows of B read by id in pieces of a slab's width, as a micro-tile
kernel's SRead along k reads them. Library gathers (``embedding_bag``, ``index_select``) also
reduce or write, and measured 1.2 TB/s on an H100 where the micro-tile kernels themselves pull
3-4 TB/s of gathered rows, so a floor priced at their rate sat above the kernels' own times."""
from __future__ import annotations

from typing import Any

from ..opspec import OpSpec, Permutation

PROBE = OpSpec("gather probe", "probe.cu.j2", {"pit_gather_probe": "PPiiiiiP",
                                              "pit_read_probe": "PqP"},
               (Permutation("B rows", "C[m,n] += A[m,k] * B[k,n]", "reduction", "B"),),
               ("float16", "bfloat16", "float32"))
#: 16-byte loads in flight per thread, in both probes.
LOADS = 4
#: Threads per CTA of the read probe and of the gather probe (the latter as the packed
#: micro-tile kernel's CTA; both fixed by the kernels' __launch_bounds__).
THREADS, GATHER_THREADS = 256, 128
#: Ids per stripe of the gather probe: about a 4096-deep k list at 90% sparsity.
IDS_PER = 512


def gather_rate(timer: Any, source: Any, rows: int, piece: int = 256,
                window: int = 8 << 20) -> float:
    """Bytes per ms of reading random rows of the 2-D ``source`` in ``piece``-byte slabs (a
    multiple of 16 dividing 512), over its first columns up to ``window`` bytes in all: the slab
    of B' that the tile kernels' CTAs share in L2, so after the first touch the reads come from
    L2, as theirs do. CTAs take (stripe of IDS_PER sorted ids, slab) as the kernels take
    (m-tile, n-tile). The rate is marginal, between ``rows`` and ``9 * rows`` rows read: the
    launch and the window's first touch from DRAM (after the timer's L2 flush) cost both runs
    alike, and at a few tens of microseconds they had halved the rate a long gather sustains
    (H200: 3.5 against 8.5 TB/s, session 47)."""
    import torch

    from ..runtime import TorchLaunch

    if piece % 16 or 512 % piece:
        raise ValueError(f"piece {piece} B must be a multiple of 16 dividing 512")
    elem, n_rows = source.element_size(), source.shape[0]
    if source.stride(1) != 1 or (source.stride(0) * elem) % 16 or source.data_ptr() % 16:
        raise ValueError("the probe reads 16-byte vectors of rows: contiguous, aligned rows")
    row_bytes = source.shape[1] * elem
    width = max(piece, min(row_bytes, window // max(n_rows, 1)) // piece * piece)
    if width > row_bytes:
        raise ValueError(f"rows of {row_bytes} B are narrower than one {piece}-byte slab")
    stripes = max(1, rows // IDS_PER)
    g = torch.Generator(device=source.device).manual_seed(1)
    ids = torch.randint(0, n_rows, (9 * stripes, IDS_PER), device=source.device, generator=g,
                        dtype=torch.int32).sort(dim=1).values
    sink = torch.zeros(1, dtype=torch.int32, device=source.device)
    mod = PROBE.module({"piece": piece, "loads": LOADS})
    slabs, stride_vecs = width // piece, source.stride(0) * elem // 16

    def probe(n: int) -> None:
        with TorchLaunch() as tl:
            mod.launch("pit_gather_probe", (n * slabs,), (GATHER_THREADS,), tl.stream,
                       source.data_ptr(), ids.data_ptr(), IDS_PER, IDS_PER, slabs, n_rows,
                       stride_vecs, sink.data_ptr())
    short, long = timer(lambda: probe(stripes)), timer(lambda: probe(9 * stripes))
    return 8 * stripes * IDS_PER * width / max(long - short, 1e-9)


def read_ms(timer: Any, source: Any) -> float:
    """Device ms of streaming the contiguous ``source`` once in 16-byte loads: what a pass over
    an operand (an index build) takes at best. After the timer's L2 flush a read also writes
    back the dirty lines it evicts, so it takes longer than half a copy."""
    import torch

    from ..runtime import TorchLaunch, device_sms

    if not source.is_contiguous() or source.nbytes % 16 or source.data_ptr() % 16:
        raise ValueError("the read probe streams 16-byte vectors: a contiguous, aligned source "
                         "of whole vectors")
    sink = torch.zeros(1, dtype=torch.int32, device=source.device)
    mod = PROBE.module({"piece": 512, "loads": LOADS})
    grid = (8 * device_sms(),)

    def read() -> None:
        with TorchLaunch() as tl:
            mod.launch("pit_read_probe", grid, (THREADS,), tl.stream, source.data_ptr(),
                       source.nbytes // 16, sink.data_ptr())
    return timer(read)
