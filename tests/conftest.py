"""Hypothesis settings for the test suite: no deadline (sympy's first calls are slow), few
examples so the whole suite stays fast on small CI machines."""
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=30)
settings.load_profile("ci")
