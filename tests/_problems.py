"""Test helpers: validate raw arrays the way the ops do (read each into an Arg, then validate)."""

from __future__ import annotations

from pyattn.interop.inputs import read, read_optional
from pyattn.validate.attention import make_problem, make_varlen_problem


def problem(q, k, v, *, mask=None, alibi_slopes=None, out=None, **kw):
    """``validate.attention.make_problem`` on raw arrays."""
    return make_problem(read("q", q), read("k", k), read("v", v), mask=read_optional("mask", mask),
                        alibi=read_optional("alibi_slopes", alibi_slopes), out=read_optional("out", out), **kw)


def _host_values(a):
    if a.on_device:
        raise AssertionError(f"{a.name}: a device index array's values would need the GPU")
    return a.obj


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, out=None, **kw):
    """``validate.attention.make_varlen_problem`` on raw arrays: ``(problem, (cu_q, cu_k))``."""
    return make_varlen_problem(read("q", q), read("k", k), read("v", v), read("cu_seqlens_q", cu_seqlens_q),
                               read("cu_seqlens_k", cu_seqlens_k), _host_values,
                               alibi=read_optional("alibi_slopes", alibi_slopes), out=read_optional("out", out), **kw)
