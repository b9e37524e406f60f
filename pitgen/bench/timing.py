"""One way to time GPU work, shared by every benchmark and sweep, and the device's ceilings
measured in the same run (the floors every result is judged against).

Device time comes from CUDA events around the callable; warm-up runs first, the result is the
median of many runs. Before each run a buffer larger than L2 is written, so every run starts
cold, as an operator inside a model would, and a spin kernel queued ahead of the start event
keeps the GPU busy while the host queues the callable, so the events bracket device work only.
Host wall-clock time of the same callable is measured apart (:meth:`Timer.both`): a call whose
host work exceeds its device work is launch bound, which device time alone hides. torch is
imported on first use, so this module imports without it.
"""
from __future__ import annotations

import importlib.metadata
import math
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: Spin cycles per ms of hidden host time: an upper bound of the SM clock (H100/H200 boost is
#: 1.98 GHz), so the spin lasts at least as long as asked.
SLEEP_CYCLES_PER_MS = 2_000_000
#: Smallest L2 flush buffer; it is also at least twice the device's L2.
FLUSH_MIN_BYTES = 256 << 20
#: Longest spin ahead of a timed call (ms): beyond it the host time is reported, not hidden.
MAX_HIDE_MS = 200.0
#: Shortest stretch (ms) of back-to-back calls one eager wall-time round covers, the rounds
#: whose median :meth:`Timer.both` reports, and the most calls one round makes
WALL_MIN_MS, WALL_ROUNDS, MAX_WALL_CALLS = 5.0, 3, 2000

Inputs = Sequence[tuple]


def _run(fn: Callable[..., Any], inputs: Inputs | None, i: int) -> Any:
    return fn(*inputs[i % len(inputs)]) if inputs else fn()


@dataclass(frozen=True)
class Timing:
    """Device time and eager host time of one callable."""

    gpu_ms: float   #: median device ms (CUDA events)
    wall_ms: float  #: host wall-clock ms per call, calls back to back, synchronised at both ends


class Timer:
    """Median device milliseconds of ``fn()``: warm-up, L2 flushed, host launches hidden.

    ``inputs`` rotates among argument tuples (run i calls ``fn(*inputs[i % len(inputs)])``), so
    that a call that caches per input (a mask's index, a plan) sees a new one every run.
    """

    def __init__(self, repeats: int = 20, warmup: int = 2, flush: bool = True,
                 hide_ms: float = 1.0):
        import torch

        self.repeats, self.warmup, self.hide_ms = repeats, warmup, hide_ms
        self.flush = None
        if flush:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            size = max(FLUSH_MIN_BYTES, 2 * getattr(props, "L2_cache_size", 0))
            self.flush = torch.empty(size, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[..., Any], *, inputs: Inputs | None = None,
                 repeats: int | None = None, warmup: int | None = None,
                 hide_ms: float | None = None) -> float:
        import torch

        for i in range(self.warmup if warmup is None else warmup):
            _run(fn, inputs, i)
        spin = int((self.hide_ms if hide_ms is None else hide_ms) * SLEEP_CYCLES_PER_MS)
        times = []
        for i in range(repeats or self.repeats):
            if self.flush is not None:
                self.flush.zero_()
            torch.cuda._sleep(spin)  # the host queues fn meanwhile
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            _run(fn, inputs, i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def both(self, fn: Callable[..., Any], *, inputs: Inputs | None = None, calls: int = 20,
             repeats: int | None = None) -> Timing:
        """Device time and eager wall time of the same callable. The first call (compiles,
        plans, tunes) is kept out of both clocks; ``calls`` back-to-back calls then warm the
        device up at the pace measured, and when they take less than WALL_MIN_MS the wall time
        is the median of WALL_ROUNDS rounds of as many calls as fill it (so a sub-millisecond
        op's is not one synchronisation's latency or a clock ramp after the host's own work).
        The spin ahead of each timed run outlasts the host time just measured, so the device
        time stays free of launch gaps."""
        _run(fn, inputs, 0)
        wall = host_ms(fn, calls, inputs=inputs)
        if wall * calls < WALL_MIN_MS:
            n = min(MAX_WALL_CALLS, max(calls, math.ceil(WALL_MIN_MS / max(wall, 1e-4))))
            wall = statistics.median(host_ms(fn, n, inputs=inputs) for _ in range(WALL_ROUNDS))
        hide = max(self.hide_ms, min(1.5 * wall + 0.5, MAX_HIDE_MS))
        return Timing(self(fn, inputs=inputs, repeats=repeats, hide_ms=hide), wall)


def host_ms(fn: Callable[..., Any], calls: int, *, inputs: Inputs | None = None) -> float:
    """Host wall-clock ms per call of ``fn``, ``calls`` calls back to back, synchronised at both
    ends (what an eager caller waits, launch overhead and host syncs included)."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        _run(fn, inputs, i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


@dataclass(frozen=True)
class Ceilings:
    """What the device can do at best, measured in this run: no kernel moves bytes faster than
    a device-to-device copy, and no dense matmul beats the vendor's."""

    copy_bytes_per_ms: float         #: device-to-device copy, bytes read + written per ms
    matmul_tflops: dict[str, float]  #: dense square matmul per dtype name

    def copy_ms(self, nbytes: float) -> float:
        """The floor of a kernel that must move ``nbytes`` (reads + writes)."""
        return nbytes / self.copy_bytes_per_ms

    def to_json(self) -> dict:
        return {"copy_gb_s": round(self.copy_bytes_per_ms / 1e6, 1),
                "matmul_tflops": {k: round(v, 1) for k, v in self.matmul_tflops.items()}}


def measure_ceilings(timer: Timer, copy_mib: int = 512, matmul_n: int = 8192,
                     dtypes: Sequence[str] = ("float16", "bfloat16")) -> Ceilings:
    """Copy rate of a ``copy_mib`` MiB buffer and the dense ``matmul_n``^3 matmul rate (torch,
    i.e. cuBLAS) per dtype, each timed like everything else."""
    import torch

    rates = {}
    for name in dtypes:
        a, b = (torch.randn(matmul_n, matmul_n, device="cuda", dtype=getattr(torch, name))
                for _ in range(2))
        rates[name] = 2 * matmul_n ** 3 / timer(lambda: torch.matmul(a, b)) / 1e9
    return Ceilings(_copy_rate(timer, copy_mib << 20), rates)


def _copy_rate(timer: Timer, nbytes: int) -> float:
    """Bytes read + written per ms by a device-to-device copy of ``nbytes``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_meta() -> dict:
    """Device, driver and software versions of this run (written beside every result)."""
    import torch

    import pitgen

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {
        "device": p.name, "compute_capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "pitgen": pitgen.__version__,
        "triton": _version("triton"), "stk": _version("stanford-stk"),
        "pycuda": _version("pycuda"), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if getattr(p, "L2_cache_size", 0):
        meta["l2_cache_mib"] = round(p.L2_cache_size / 2**20, 1)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,"
             "power.limit", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        meta["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        meta["driver"] = meta["nvidia_smi"].splitlines()[0].split(",")[1].strip()
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        meta.setdefault("nvidia_smi", f"unavailable: {e}")
    return meta
