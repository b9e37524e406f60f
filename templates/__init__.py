"""Jinja2 CUDA templates, shipped inside the package as ``pitgen.templates``."""
