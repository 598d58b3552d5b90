"""Plans cached on frozen problems, and the signature memo that lets a repeat call skip validation.

A *plan* holds what a validated call needs besides its pointers and stream: kernels, launch
shapes, parameter structs with every non-pointer field packed. It is cached on the frozen problem
(a dataclass of everything validation decided), the device and the PTX switch, never on a tuple
an op assembles by hand.

A *signature* is every argument of a call, arrays by what was read of them (kind, shape, element
strides, dtype, device) and everything else by value. The memo maps a signature to the problem
validation made of it, so a repeat call costs a dict lookup instead of re-validating. It is built
from all of an op's arguments by construction (the op passes its ``locals()``), so no argument
can be left out of it; calls whose validity depends on array *values* (host data, device index
arrays) never use it.
"""

from __future__ import annotations

import os

from ..interop.inputs import HOST, Arg

__all__ = ["get_plan", "ptx_requested", "Memo", "signature"]

_MAX_PLANS = 4096
_plans: dict = {}


def ptx_requested() -> bool:
    """``PYATTN_PTX=1``: compile PTX instead of cubins (the stated fallback, see ``pyattn.jit.nvrtc``)."""
    return os.environ.get("PYATTN_PTX", "") == "1"


def get_plan(build, problem, device):
    """``build(problem, device)``, cached on (build, problem, device, PTX switch)."""
    key = (build, problem, device.ordinal, ptx_requested())
    plan = _plans.get(key)
    if plan is None:
        plan = build(problem, device)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


class Memo:
    """Signature -> validated problem, for one op (bounded; a workload with more signatures just
    validates again)."""

    _MAX = 4096

    def __init__(self):
        self._entries: dict = {}

    @staticmethod
    def key(values):
        """The signature of a call whose arguments are ``values`` (``Arg`` for arrays), or None when it
        cannot be memoised (host arrays, unhashable options)."""
        parts = []
        for v in values:
            if type(v) is Arg:
                if v.kind == HOST:
                    return None
                parts.append((v.kind, v.shape, v.strides, v.dtype, v.ordinal))
            else:
                parts.append(v)
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def get(self, key):
        return None if key is None else self._entries.get(key)

    def put(self, key, problem) -> None:
        if key is None:
            return
        if len(self._entries) >= self._MAX:
            self._entries.clear()
        self._entries[key] = problem


def signature(params: dict, args: dict):
    """The memo key of a call: ``params`` is the op's ``locals()`` taken first thing (every parameter,
    in order), ``args`` the :class:`Arg` read for its array parameters; ``stream`` is per call."""
    return Memo.key(tuple(args.get(n, v) for n, v in params.items() if n != "stream"))
