"""Shared keys, payload and builder of the kernel disk cache tests (test_cache.py,
test_cache_locking.py)."""

from __future__ import annotations

import hashlib
import logging
import pathlib
import threading
import time

KEY = hashlib.sha256(b"kernel-a").hexdigest()
KEY2 = hashlib.sha256(b"kernel-b").hexdigest()
KEY3 = hashlib.sha256(b"kernel-c").hexdigest()
PAYLOAD = bytes(range(256)) * 8
META = {"arch": "sm_90a", "names": ["k0", "k1"], "n": 3}


def _entry(directory: pathlib.Path, key: str = KEY) -> pathlib.Path:
    return directory / f"{key}.pyattnk"


def _cache_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pyattn.cache" and r.levelno >= logging.WARNING]


class _Builder:
    """Counts calls; thread-safe."""

    def __init__(self, payload: bytes = PAYLOAD, meta: dict = META, delay: float = 0.0):
        self.payload, self.meta, self.delay = payload, meta, delay
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return self.payload, self.meta
