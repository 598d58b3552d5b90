"""The kernel cache's location, file format and file names (no I/O here).

Each entry is one file ``<key>.pyattnk``::

    b"PYATTNK1"                      magic; the trailing digit is the format version
    uint32 little-endian n           length of the JSON header
    n bytes of UTF-8 JSON            {"key": <key>, "meta": <caller's dict>} (sorted keys, so it
                                     starts with '{"key": "<key>", "meta": ')
    payload                          the compiled binary
    32 bytes                         BLAKE2b-256 of everything above (:mod:`.digest`)

A memo (:meth:`~pyattn.jit.cache.KernelCache.get_memo`: a small value that is costly to
recompute, such as the kernel-source digest) is a file ``<key>.pyattnm`` of the same format; it is
not a kernel, so listings and counts leave it out.

Temp files are ``.<key>.<writer pid>.<random hex>.tmp``: the pid lets a later writer tell the
temp file of a dead writer (removable) from one being written right now.
"""

# No ``from __future__ import annotations`` here: typing.NamedTuple would compile every string
# annotation of its fields into a ForwardRef at import (~0.2 ms of a first call; issue 16).

import functools
import os
import pathlib
import re
import struct
from collections.abc import Mapping
from typing import NamedTuple

from . import digest

__all__ = ["CacheEntry", "EntryMeta", "default_cache_dir", "CorruptEntry", "check_key", "normalise_meta", "encode",
           "decode", "ENTRY_SUFFIX", "MEMO_SUFFIX", "LOCK_SUFFIX", "entry_key", "is_memo_name", "is_lock_name",
           "temp_name", "temp_writer_pid"]

_MAGIC = b"PYATTNK2"  # 2: BLAKE2b-256 checksum (1: sha256)
_HEADER_LEN = struct.Struct("<I")
_DIGEST_SIZE = digest.DIGEST_SIZE
_MIN_SIZE = len(_MAGIC) + _HEADER_LEN.size + _DIGEST_SIZE

ENTRY_SUFFIX = ".pyattnk"
MEMO_SUFFIX = ".pyattnm"
LOCK_SUFFIX = ".lock"
_TMP_SUFFIX = ".tmp"
_HEX_DIGITS = frozenset("0123456789abcdef")
# Entry, memo, lock and temp file names are matched only by listings and writes; a warm read needs
# none of these patterns, and compiling them at import cost ~0.3 ms of a first call's 15 ms.
_PATTERNS = {"entry": r"([0-9a-f]{16,128})" + re.escape(ENTRY_SUFFIX),
             "memo": r"[0-9a-f]{16,128}" + re.escape(MEMO_SUFFIX),
             "lock": r"[0-9a-f]{16,128}" + re.escape(LOCK_SUFFIX),
             # ".<key>.<pid>.<hex>.tmp"; the pid part is optional for the mkstemp names of
             # pyattn <= 0.4 (".<key>.<random>.tmp"), which are then judged by age alone.
             "temp": r"\.[0-9a-f]{16,128}\.(?:([0-9]+)\.)?[A-Za-z0-9_]+" + re.escape(_TMP_SUFFIX)}


@functools.lru_cache(maxsize=None)
def _pattern(kind: str):
    return re.compile(_PATTERNS[kind])


def entry_key(name: str) -> str | None:
    """The key of an entry file named ``name``, or None if it is not one."""
    match = _pattern("entry").fullmatch(name)
    return None if match is None else match.group(1)


def is_memo_name(name: str) -> bool:
    """Whether ``name`` is a memo file's name."""
    return _pattern("memo").fullmatch(name) is not None


def is_lock_name(name: str) -> bool:
    """Whether ``name`` is a lock file's name."""
    return _pattern("lock").fullmatch(name) is not None


def default_cache_dir() -> pathlib.Path:
    """Return the default kernel cache directory, without creating it.

    Returns
    -------
    pathlib.Path
        ``$PYATTN_CACHE_DIR`` if set and non-empty (``~`` expanded), else
        ``$XDG_CACHE_HOME/pyattn`` if set and non-empty, else ``~/.cache/pyattn``.
    """
    explicit = os.environ.get("PYATTN_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "pyattn"
    return pathlib.Path.home() / ".cache" / "pyattn"


class CacheEntry(NamedTuple):
    """One entry file found in the cache directory (immutable).

    A NamedTuple rather than a frozen dataclass: building the dataclass's methods at import took
    ~0.5 ms of a fresh process's first call (a 15 ms budget), the named tuple ~0.1 ms.

    Attributes
    ----------
    key : str
        The hex key the entry was stored under.
    path : pathlib.Path
        Location of the entry file.
    size : int
        Size of the file on disk in bytes (header and checksum included).
    """

    key: str
    path: pathlib.Path
    size: int


def temp_name(key: str) -> str:
    """A fresh temp file name for writing ``key``'s entry, carrying this process's pid."""
    return f".{key}.{os.getpid()}.{os.urandom(6).hex()}{_TMP_SUFFIX}"


def temp_writer_pid(name: str) -> int | None:
    """For a temp file name: the writer's pid, or 0 when the name carries none; None if ``name``
    is not a temp file name."""
    match = _pattern("temp").fullmatch(name)
    if match is None:
        return None
    return int(match.group(1) or 0)


class CorruptEntry(Exception):
    """An entry file that must be treated as a miss; the message says why."""


def check_key(key: object) -> str:
    # The key becomes a file name: restricting it to hex means it can never leave the directory.
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not (16 <= len(key) <= 128 and _HEX_DIGITS.issuperset(key)):
        raise ValueError(f"key must be 16 to 128 lowercase hex digits, got {key!r}")
    return key


class EntryMeta(Mapping):
    """An entry's metadata, read-only, parsed from its JSON header when first looked at.

    A warm start reads kernels, not their metadata: parsing it lazily keeps :mod:`json` (~1 ms of
    imports on a GPU host, of a first call's 15 ms budget) off that path. The header was written
    by :func:`encode` and is covered by the entry's checksum, so it parses; if not, the access
    raises :class:`CorruptEntry`.
    """

    __slots__ = ("_raw", "_data")

    def __init__(self, raw: bytes):
        self._raw, self._data = raw, None

    def _meta(self) -> dict:
        if self._data is None:
            import json

            try:
                meta = json.loads(self._raw.decode())["meta"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptEntry(f"unreadable header ({exc})") from None
            if not isinstance(meta, dict):
                raise CorruptEntry("meta is not a JSON object")
            self._data = meta
        return self._data

    def __getitem__(self, name):
        return self._meta()[name]

    def __iter__(self):
        return iter(self._meta())

    def __len__(self) -> int:
        return len(self._meta())

    def __repr__(self) -> str:
        return f"EntryMeta({self._meta()!r})"


def normalise_meta(meta: object) -> dict:
    # Round-trip through JSON so a freshly built entry and a cache hit return equal dicts.
    import json  # imported here: only writes need it (see EntryMeta)

    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise TypeError("meta must be a dict with str keys")
    return json.loads(json.dumps(meta, allow_nan=False))


def encode(key: str, payload: bytes, meta: dict) -> bytes:
    if meta:
        import json

        header = json.dumps({"key": key, "meta": meta}, allow_nan=False, sort_keys=True).encode()
    else:  # a memo: json's bytes for a hex key, written without importing json on a warm start
        header = b'{"key": "' + key.encode() + b'", "meta": {}}'
    body = b"".join([_MAGIC, _HEADER_LEN.pack(len(header)), header, payload])
    return body + digest.new(body).digest()


def decode(key: str, data: bytes) -> tuple[bytes, EntryMeta]:
    if len(data) < _MIN_SIZE:
        raise CorruptEntry(f"file too short ({len(data)} bytes)")
    if data[: len(_MAGIC)] != _MAGIC:
        raise CorruptEntry(f"bad magic/version {data[:len(_MAGIC)]!r}")
    body, checksum = data[:-_DIGEST_SIZE], data[-_DIGEST_SIZE:]
    if digest.new(body).digest() != checksum:
        raise CorruptEntry("checksum mismatch")
    (header_len,) = _HEADER_LEN.unpack_from(body, len(_MAGIC))
    start = len(_MAGIC) + _HEADER_LEN.size
    if start + header_len > len(body):
        raise CorruptEntry("header length exceeds file size")
    header = body[start : start + header_len]
    # encode() sorts the header's keys, so the stored key is its first value: compared as bytes.
    if not header.startswith(b'{"key": "' + key.encode() + b'", "meta": '):
        stored = re.match(rb'\{"key": "([^"]*)"', header)
        raise CorruptEntry(f"stored key {stored.group(1).decode(errors='replace') if stored else '?'!r} "
                           f"differs from requested key")
    return body[start + header_len :], EntryMeta(header)
