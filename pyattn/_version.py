"""Single source of the package version (also part of every kernel cache key)."""

__version__ = "0.1.0"
