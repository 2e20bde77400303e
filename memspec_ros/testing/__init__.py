"""Fixtures built on the spot: tiny random models and tokenizers, and a tiny zoo on disk.

Tests use them, and so do the benchmarks and the demo when the bundled zoo is missing. They sit
just above runtime/ (they import only it), so any layer may use them and runtime/ never does.
"""
