"""Validate ``pyattn.sparq_decode``'s arguments into a frozen problem (no device touched).

Every mistake is a ``ValueError``/``TypeError`` naming the argument, before any device work: the
query against the cache's pools, ``r`` and ``k``, the scale, and the limits of the kernels' grids
and row tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from .options import INT32_MAX, check_int, check_scale
from .paged import PoolInfo

__all__ = ["SparqProblem", "check_sparq", "MAX_GROUP", "SELECT"]

MAX_GROUP = 16  # query heads per kv head: the score stage keeps the group's q~ in shared memory
_MAX_ROWS = 65535  # batch x row heads: a grid dimension of the selection stages and of the decode
SELECT = ("group", "head")  # who shares the chosen channels and keys: the GQA group, or nobody


@dataclass(frozen=True)
class SparqProblem:
    """A validated SparQ decode (strides in elements)."""

    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: object
    q_strides: tuple  # (batch, head); head_dim contiguous
    q_on_device: bool
    r: int
    k: int
    scale: float
    pool: PoolInfo
    per_head: bool = False  # select="head"

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def row_heads(self) -> int:
        """Rows (choices) per sequence: the kv heads, or every query head."""
        return self.heads_q if self.per_head else self.heads_kv

    @property
    def row_group(self) -> int:
        """Query heads sharing one row's choices."""
        return 1 if self.per_head else self.group


def check_sparq(q, pool: PoolInfo, *, r, k, scale, select, max_rows_per_tile: int) -> SparqProblem:
    """Validate ``q`` (an Arg) against the cache's ``pool``.

    ``max_rows_per_tile``: the most query rows the decode kernel takes per kv head at this head
    dim (16 x its most row tiles); SparQ's decode runs 2 x group rows (the queries and q~).
    """
    if q.dtype != pool.dtype:
        raise TypeError(f"q: expected dtype {pool.dtype} (the KV cache's), got {q.dtype}")
    if len(q.shape) != 4:
        raise ValueError(f"q: expected shape (batch, 1, heads_q, head_dim), got {q.shape}")
    batch, q_len, heads_q, dim = q.shape
    if q_len != 1:
        raise ValueError(f"q: SparQ decodes one new token per sequence (q_len 1), got shape {q.shape}")
    if dim != pool.head_dim:
        raise ValueError(f"q: expected head_dim {pool.head_dim} (the KV cache's), got {dim}")
    if heads_q < 1 or heads_q % pool.heads_kv:
        raise ValueError(f"q: query heads ({heads_q}) must be a multiple of the cache's kv heads ({pool.heads_kv})")
    if not isinstance(select, str) or select not in SELECT:
        raise ValueError(f"select: expected one of {SELECT}, got {select!r}")
    per_head = select == "head"
    group = 1 if per_head else heads_q // pool.heads_kv
    if group > MAX_GROUP or 2 * group > max_rows_per_tile:
        raise ValueError(f"q: SparQ (select='group') takes at most {min(MAX_GROUP, max_rows_per_tile // 2)} query "
                         f"heads per kv head at head_dim {dim}, got {group}")
    row_heads = heads_q if per_head else pool.heads_kv
    if batch < 1 or batch * row_heads > _MAX_ROWS:
        raise ValueError(f"q: expected 1 <= batch x {'heads_q' if per_head else 'heads_kv'} <= {_MAX_ROWS}, got "
                         f"{batch} x {row_heads}")
    if q.on_device and q.strides[-1] != 1:
        raise ValueError(f"q: the head_dim axis must be contiguous, got element strides {q.strides}")
    r = check_int("r", r, 1, dim)
    k = check_int("k", k, 1, INT32_MAX)
    strides = (q.strides[0], q.strides[2]) if q.on_device else (heads_q * dim, dim)
    return SparqProblem(batch, heads_q, pool.heads_kv, dim, q.dtype, strides, q.on_device, r, k,
                        check_scale(scale, dim), pool, per_head)
