"""Benchmark: GNN SpMM / SDDMM, tuned formats against cuSPARSE.
The same as ``pitgen bench graphs --out docs/bench [options]``
(pitgen/bench/graphs.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["graphs", "--out", "docs/bench", *sys.argv[1:]]))
