"""The one place pitgen's version is written (pyproject.toml reads it from here)."""
__version__ = "0.2.0"
