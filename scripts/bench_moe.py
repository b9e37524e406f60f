"""Benchmark: the fused MoE layer against a loop over experts, _grouped_mm and stk.
The same as ``pitgen bench moe --out docs/bench [options]``
(pitgen/bench/moe.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["moe", "--out", "docs/bench", *sys.argv[1:]]))
