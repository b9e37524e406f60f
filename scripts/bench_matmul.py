"""Benchmark: pitgen's sparse matmul against dense cuBLAS.
The same as ``pitgen bench matmul --out docs/bench [options]``
(pitgen/bench/matmul.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["matmul", "--out", "docs/bench", *sys.argv[1:]]))
