"""Benchmark: one sparse-training step against the dense step.
The same as ``pitgen bench training --out docs/bench [options]``
(pitgen/bench/training.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["training", "--out", "docs/bench", *sys.argv[1:]]))
