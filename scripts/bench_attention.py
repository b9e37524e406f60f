"""Benchmark: dynamic sparse attention against SDPA and FlexAttention.
The same as ``pitgen bench attention --out docs/bench [options]``
(pitgen/bench/attention.py)."""
import sys

from pitgen.bench import main

if __name__ == "__main__":  # worker processes (spawn) import this file again
    sys.exit(main(["attention", "--out", "docs/bench", *sys.argv[1:]]))
