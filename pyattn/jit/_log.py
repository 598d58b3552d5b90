"""Loggers for the jit package that import :mod:`logging` at their first use.

A warm start (every kernel on disk) never logs, and importing ``logging`` took ~2 ms of a fresh
process's first call, which has a 15 ms budget; compiles and cache warnings still log as before,
to the same named loggers.
"""

from __future__ import annotations

__all__ = ["LazyLogger"]


class LazyLogger:
    """Stands for ``logging.getLogger(name)``: attribute reads go to the real logger."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        import logging

        return getattr(logging.getLogger(self.name), attr)
