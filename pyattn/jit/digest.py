"""The one hash of the kernel cache: cache keys, entry checksums and the kernel-source digest.

BLAKE2b with a 32-byte digest, not ``hashlib.sha256``: importing :mod:`hashlib` loads OpenSSL's
libcrypto (~2.6 ms measured, of the 15 ms a fresh process's first call may take; issue 16), while
BLAKE2 is built into CPython (~0.2 ms). ``hashlib.blake2b`` *is* that built-in; it is taken from
its own module so that hashlib's OpenSSL probe is not paid, and from hashlib where a Python build
lacks the module. Either way the bytes are the same.
"""

from __future__ import annotations

try:
    from _blake2 import blake2b as _blake2b
except ImportError:  # pragma: no cover - CPython always builds _blake2; other Pythons may not
    from hashlib import blake2b as _blake2b

__all__ = ["DIGEST_SIZE", "new", "hexdigest"]

DIGEST_SIZE = 32


def new(data: bytes = b""):
    """A running BLAKE2b-256 hash (``update``, ``digest``, ``hexdigest``), started with ``data``."""
    return _blake2b(data, digest_size=DIGEST_SIZE)


def hexdigest(data: bytes) -> str:
    """The BLAKE2b-256 of ``data`` as 64 lowercase hex digits."""
    return _blake2b(data, digest_size=DIGEST_SIZE).hexdigest()
