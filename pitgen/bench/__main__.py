"""``python -m pitgen.bench``: the benchmark suite without the pitgen command."""
import sys

from .suite import main

if __name__ == "__main__":  # worker processes (spawn) import this module again
    sys.exit(main())
