"""CPU only: write a standalone kernel (``<name>.cu`` + ``<name>.h``, built by nvcc alone, no
Python at run time) into a temporary folder and print the C API its header declares.
``pitgen emit EXPR --sparse A --micro-tile 32x1 --out DIR`` does the same from the shell.

    python examples/emit_kernel.py
"""
import tempfile
from pathlib import Path

from pitgen.emit import Request, emit, write

kernel = emit(Request("C[m,n] += A[m,k] * B[k,n]", sparse="A", micro_tile="32x1", dtype="float16"))
with tempfile.TemporaryDirectory() as tmp:
    paths = write([kernel], Path(tmp))
    print(f"kernel {kernel.name}: {kernel.summary}")
    print("files:", ", ".join(p.name for p in paths))
    header = (Path(tmp) / f"{kernel.name}.h").read_text()
print("C API:")
for line in header.splitlines():
    if line.startswith(("cudaError_t ", "const char* ")):
        print("  " + line)
