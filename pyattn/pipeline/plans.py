"""Plans cached on frozen problems, and the signature memo that lets a repeat call skip validation.

A *plan* holds what a validated call needs besides its pointers and stream: kernels, launch
shapes, parameter structs with every non-pointer field packed. It is cached on the frozen problem
(a dataclass of everything validation decided), the device and the PTX switch, never on a tuple
an op assembles by hand.

A *signature* is every argument of a call, arrays by what was read of them (kind, shape, element
strides, dtype, device) and everything else by value. The memo maps a signature to the problem
validation made of it, so a repeat call costs a dict lookup instead of re-validating. It is built
from all of an op's arguments by construction (the op passes its ``locals()``), so no argument
can be left out of it; calls whose validity depends on array *values* (host masks and slopes,
device index arrays) or flags (a host ``out=``'s writeable flag) never use it; host arrays that
validation reads only for their shape, dtype and strides (attention's q, k, v) may.
"""

from __future__ import annotations

import os

from ..interop.inputs import HOST
from ..kernels.registry import generation

__all__ = ["get_plan", "ptx_requested", "Memo", "signature"]

_MAX_PLANS = 4096
_plans: dict = {}
_by_id: dict = {}  # id(problem) -> (problem, build, ordinal, ptx, generation, plan)


_ptx = None  # PYATTN_PTX, read once: an environment read costs ~1.5 us of a 20 us call


def ptx_requested() -> bool:
    """``PYATTN_PTX=1``: compile PTX instead of cubins (the stated fallback, see ``pyattn.jit.nvrtc``).
    Read from the environment at pyattn's first kernel use in the process."""
    global _ptx
    if _ptx is None:
        _ptx = os.environ.get("PYATTN_PTX", "") == "1"
    return _ptx


def get_plan(build, problem, device):
    """``build(problem, device)``, cached on (build, problem, device, PTX switch, kernel generation:
    ``pyattn.kernels.families.override_tiles`` makes every plan rebuild)."""
    ordinal, ptx, gen = device.ordinal, ptx_requested(), generation()
    # A memoised call hands the same problem object every time: find its plan by identity first,
    # which skips hashing every field of the problem (the entry holds the problem, so its id is
    # not reused while the entry lives).
    hit = _by_id.get(id(problem))
    if hit is not None and hit[0] is problem and hit[1] is build and hit[2:5] == (ordinal, ptx, gen):
        return hit[5]
    key = (build, problem, ordinal, ptx, gen)
    plan = _plans.get(key)
    if plan is None:
        plan = build(problem, device)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
            _by_id.clear()
        _plans[key] = plan
    if len(_by_id) >= _MAX_PLANS:
        _by_id.clear()
    _by_id[id(problem)] = (problem, build, ordinal, ptx, gen, plan)
    return plan


_memos: list = []  # every Memo made (tests that swap the driver empty them: see tests/fake_driver.py)


class Memo:
    """A call key (:func:`signature`, or :func:`pyattn.interop.quick.quick_key`) -> what validation
    made of it, for one op (bounded; a workload with more keys just validates again). A None key
    (a call that cannot be memoised) is never found or stored, nor is an unhashable one."""

    _MAX = 4096

    def __init__(self):
        self._entries: dict = {}
        _memos.append(self)

    def get(self, key):
        try:
            return None if key is None else self._entries.get(key)
        except TypeError:  # an unhashable value in the key (e.g. a list inside a tuple option)
            return None

    def put(self, key, value) -> None:
        if key is None or value is None:
            return
        if len(self._entries) >= self._MAX:
            self._entries.clear()
        try:
            self._entries[key] = value
        except TypeError:
            pass


def signature(params: dict, args: dict, host_ok: tuple = ()):
    """The memo key of a call: ``params`` is the op's ``locals()`` taken first thing (every parameter,
    in order), ``args`` the :class:`~pyattn.interop.inputs.Arg` (or None) read for its array parameters; ``stream`` is per
    call. None when the call cannot be memoised (unhashable options, or host arrays other than those
    named in ``host_ok``: the parameters whose validation reads only kind, shape, dtype and strides,
    never values or flags, e.g. attention's q, k, v but not a host mask, slopes or ``out=``)."""
    values = dict(params)  # a copy keeps the parameters' order; the array entries are overwritten in place
    del values["stream"]
    for n, a in args.items():
        if a is not None:  # (a None Arg stands for a None parameter, already there)
            if a.kind == HOST and n not in host_ok:
                return None
            values[n] = a[1:6]  # kind, shape, dtype, strides, ordinal: a tuple slice
    # With the values' types: causal=1 must not reuse what validation made of causal=True (equal, same hash).
    key = tuple(values.values()) + tuple(map(type, values.values()))
    try:
        hash(key)
    except TypeError:
        return None
    return key
