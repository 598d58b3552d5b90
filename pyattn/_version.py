"""Single source of the package version (also part of every kernel cache key)."""

__version__ = "0.5.0.dev0"
