"""What ``fake_driver.install`` resets: pyattn's per-process device state (devices, streams, pools,
loaded kernels, plans and every cache that names a device address), so that nothing made under the
fake driver reaches a real one later, nor anything made under a real one the fake."""

from __future__ import annotations

import threading

from pyattn.kernels import registry
from pyattn.ops import _contiguous, _decode, block_sparse
from pyattn.pipeline import chunks, plans
from pyattn.runtime import _resource, device, memory, pinned, stream, tensormap


def fresh_state(monkeypatch) -> None:
    """Fresh pyattn device state for the life of ``monkeypatch`` (the real driver may have been
    initialised)."""
    monkeypatch.setattr(device, "_initialised", False)
    monkeypatch.setattr(device, "_driver_module", None)
    monkeypatch.setattr(device, "_devices", {})
    monkeypatch.setattr(stream, "_default_streams", {})
    monkeypatch.setattr(stream, "_borrowed", {})
    monkeypatch.setattr(stream, "_order_events", type(stream._order_events)())
    monkeypatch.setattr(memory, "_pools", {})
    monkeypatch.setattr(pinned, "_staging", {})
    monkeypatch.setattr(pinned, "_signals", {})
    monkeypatch.setattr(pinned, "_results", None)  # (its pinned blocks would be fake ones)
    monkeypatch.setattr(_resource, "_deferred", [])  # releases a staging worker left: fake handles
    monkeypatch.setattr(memory, "POISON_ALLOC", False)
    monkeypatch.setattr(registry, "_kernels", {})
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_by_id", {})
    monkeypatch.setattr(tensormap, "_memo", {})  # maps and the decode's uploaded map pairs name old addresses
    monkeypatch.setattr(_decode, "_maps", {})
    # The NumPy path's per-device pipelines (streams, events, staging) and block-sparse tile lists
    # on the device: made under the fake, a later GPU test in the same process would use their
    # fake handles and addresses (a NumPy attention crashed in its staging copy after this file's
    # tests, before these were reset).
    monkeypatch.setattr(chunks, "_pipelines", {})
    monkeypatch.setattr(block_sparse, "_lists", {})
    # contiguous_decode's kept page tables (fake device blocks) and its per-thread mailboxes (views
    # of the fake's pinned blocks, freed with it: a later test wrote through one and the process
    # segfaulted in the next teardown's gc).
    monkeypatch.setattr(_contiguous, "_tables", {})
    monkeypatch.setattr(_contiguous, "_boxes", threading.local())
    for memo in plans._memos:  # what they hold names the devices replaced above
        monkeypatch.setattr(memo, "_entries", {})
