"""The repeat-call key: what identifies a call whose validation can be reused, read straight from
the user's arrays (no :class:`~pyattn.interop.inputs.Arg` built), and the pointers and producer
streams that are read per call with it.
"""

import numpy as np

from .inputs import CAI, DEVICE, DLPACK, HOST, LEGACY_PRODUCER, TORCH, dlpack_ordinal, type_kind

__all__ = ["quick_key"]

# Option values keyed as they are: hashable, compared by value, and never arrays. Their type goes into
# the key too, so that ``causal=1`` cannot reuse the validation of ``causal=True`` (equal, same hash).
_PLAIN = frozenset({type(None), bool, int, float, str, tuple, np.bool_, np.int32, np.int64, np.float32, np.float64})
_quick_kinds: dict = {}  # type -> DEVICE, TORCH, CAI, or None (read through Args every call)


def _quick_kind(tp):
    # NumPy arrays (host data) have no key; any type read_args looks at object by object may carry
    # a CUDA array interface, on the class (CuPy, Numba) or per instance (a SimpleNamespace wrapper).
    kind = type_kind(tp)
    return None if kind == HOST else kind


def _quick_cai(name, x, add, reads):
    """The key entry of a CUDA array interface argument, or False when the call must take the full
    path: a mask, read-only data, or any field the full path would refuse or read differently. An
    object without the interface is keyed by :func:`_quick_dlpack`. An opaque ``V`` type (bfloat16,
    fp8) is keyed with the object's ``dtype`` attribute, from which the full path took the dtype.
    Its pointer and producer stream go to ``reads[name]`` (the interface is read once a call: CuPy
    builds its dict, and looks its current stream up, on every access)."""
    try:
        cai = x.__cuda_array_interface__
    except AttributeError:
        return _quick_dlpack(x, add)
    except Exception:
        return False
    if type(cai) is not dict:
        return False
    typestr, data = cai.get("typestr"), cai.get("data")
    if (type(typestr) is not str or type(data) is not tuple or len(data) != 2
            or type(data[0]) is not int or data[0] < 0 or data[1] is not False or cai.get("mask") is not None):
        return False
    version = cai.get("version", 0)
    if type(version) is not int:
        return False
    producer = LEGACY_PRODUCER
    if version >= 3:
        stream = cai.get("stream")
        if stream is not None:
            if type(stream) is not int or stream == 0:
                return False
            producer = stream
    ordinal = dlpack_ordinal(x)  # a device the array does not tell would be asked of the driver each call
    if ordinal is None:
        return False
    named = getattr(x, "dtype", None) if typestr[1:2] == "V" else None
    add((type(x), cai.get("shape"), typestr, cai.get("strides"), ordinal, named))
    reads[name] = (data[0], producer)
    return True


def _quick_dlpack(x, add):
    """The key entry of a DLPack-only CUDA array (JAX, ...), what the full path reads of it, raw:
    type, shape, dtype, strides as its attributes give them, device ordinal. False when the full
    path must read it. It is imported per call, with the call's stream as the consumer
    (:func:`pyattn.pipeline.device.begin`)."""
    if getattr(x, "__dlpack__", None) is None:
        return False
    ordinal = dlpack_ordinal(x)  # (None: no __dlpack_device__, or not a CUDA one)
    shape, dt = getattr(x, "shape", None), getattr(x, "dtype", None)
    if type(ordinal) is not int or shape is None or dt is None:
        return False
    stride = getattr(x, "stride", None)
    strides = stride() if callable(stride) else getattr(x, "strides", None)
    add((type(x), DLPACK, shape, dt, strides, ordinal))
    return True


def quick_key(params: dict, reads: dict = None):
    """The repeat-call key of an op's call, or None when it has none.

    ``params`` is the op's ``locals()`` taken first thing (every parameter). Arrays that are
    ``DeviceArray``s or CUDA torch tensors are keyed by what an :class:`~pyattn.interop.inputs.Arg`
    of them would say (type, shape, dtype, element strides, device), read straight from their
    attributes: no Arg is built. Arrays with a CUDA array interface (CuPy, Numba, ...) are keyed
    by its shape, typestr and strides, their type and their ``__dlpack_device__`` ordinal; their
    pointer and producer stream, read from the same interface dict, go to ``reads`` (name ->
    ``(ptr, producer)``) for :func:`pyattn.pipeline.device.begin`. DLPack-only arrays (JAX) are
    keyed by their type, shape, dtype, strides and device, and imported by ``begin``. Without
    ``reads`` neither has a key. Option values are keyed by type and value. Any other array kind
    (NumPy), a CPU tensor, an interface the full path would refuse or read otherwise, or an option
    of another type gives None: such calls take the full path every time. ``stream`` (per call) is
    left out unless it is a plain value (None, an int), where keeping it only splits the cache.
    Pointers and producer streams are not in the key: they are read per call.

    Equal keys mean equal signatures (:func:`pyattn.pipeline.plans.signature`), so a key can stand
    for the problem validation made of the first call that had it.
    """
    key = []
    add = key.append
    for name, v in params.items():
        tp = type(v)
        if tp in _PLAIN:
            add(tp if tp is not tuple else tuple(map(type, v)))  # (window=(True, 2) is not (1, 2) either)
            add(v)
            continue
        kind = _quick_kinds.get(tp, False)
        if kind is False:
            kind = _quick_kinds[tp] = _quick_kind(tp)
        if kind is DEVICE:
            add((tp, v.shape, v.dtype, v.elem_strides, v.device))
        elif kind is TORCH:
            ordinal = v.get_device()
            if ordinal < 0:  # a CPU tensor: host data
                return None
            add((tp, v.shape, v.dtype, v.stride(), ordinal))
        elif kind is CAI and reads is not None and name != "stream":
            if not _quick_cai(name, v, add, reads):
                return None
        elif name != "stream":
            return None
    return tuple(key)
