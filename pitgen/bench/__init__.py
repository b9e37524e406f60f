"""pitgen's benchmark harness: one GPU timer and the device's ceilings (:mod:`.timing`),
tables, CSV, JSON and plots (:mod:`.report`), and the suite behind ``pitgen bench``
(:func:`main`). Importing it needs neither torch nor a GPU; timing does."""
from .report import (Progress, describe, fmt, fmt_e, fmt_x, geomean, md_table, plot, ratio,
                     rel_err, write_csv, write_json)
from .suite import PARTS, main
from .timing import Ceilings, Timer, Timing, device_meta, host_ms, measure_ceilings

__all__ = [
    "main", "PARTS", "Timer", "Timing", "host_ms", "Ceilings", "measure_ceilings", "device_meta",
    "md_table", "write_csv", "write_json", "geomean", "ratio", "rel_err", "describe", "fmt",
    "fmt_x", "fmt_e", "plot", "Progress",
]
