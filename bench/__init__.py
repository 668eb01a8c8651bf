"""Reproducible benchmarks; ``python -m bench`` (or ``make bench``) runs them."""
