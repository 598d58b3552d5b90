"""Sparse attention patterns: token-level CSR lists or block masks, built on the CPU with NumPy.

Every builder takes ``seqlen_q``, an optional ``seqlen_k`` (default ``seqlen_q``), ``causal`` and
``block_size`` (an int B for (B, B), or a pair (R, C)). Query row i sits at position
``t = i + seqlen_k - seqlen_q`` of the key sequence (bottom-right alignment, as
``pyattn.attention``'s causal and window); ``causal=True`` keeps keys ``j <= t``.

Without ``block_size`` a builder returns the CSR pair ``(indices, offsets)``: int32, offsets of
shape (seqlen_q + 1,) starting at 0, row i's keys ``indices[offsets[i]:offsets[i + 1]]`` sorted
and unique. With ``block_size=(R, C)`` it returns the bool block mask of shape
(ceil(seqlen_q / R), ceil(seqlen_k / C)) in which a block is set iff the token pattern has at
least one (row, key) pair inside it: a coarsening, so a superset of the token pattern (combine it
with ``causal`` in the attention call to drop the extra keys of diagonal blocks). The
block-sparse kernels need R and C to be multiples of 16.

The builders live in :mod:`pyattn.patterns.builders`, the conversions between CSR lists, masks and
block masks in :mod:`pyattn.patterns.convert`, the argument checks and CSR helpers they share in
``pyattn.patterns._base``; this package gathers the public names.
"""

from __future__ import annotations

from .builders import bigbird, dilated, global_tokens, local, random_k, strided
from .convert import csr_to_bsr, csr_to_mask, mask_to_csr, union

__all__ = ["local", "strided", "dilated", "global_tokens", "random_k", "bigbird", "csr_to_mask", "mask_to_csr",
           "csr_to_bsr", "union"]
