"""capdispatch's version (pyproject.toml's), below every room: locks, proofs and reports
record it without importing the faces."""
__version__ = "0.1.0"
