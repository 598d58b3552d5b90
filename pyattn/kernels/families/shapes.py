"""The ``m64nNk16`` instruction shapes the 16-bit wgmma kernels instantiate (their tile tables'),
from which ``pyattn.jit.wgmma_gen`` generates ``kernels_src/wgmma.cuh`` (``tests/test_wgmma_gen.py``
checks the checked-in header is current). Apart from wgmma.py to keep each module short."""

from .backward import bwd_wgmma_shapes  # the backward's wgmmas share the header
from .base import HEAD_DIM_BUCKETS
from .wgmma import ATTN_FWD_WGMMA

__all__ = ["wgmma_shapes"]


def wgmma_shapes(tables=None) -> tuple:
    """The N of every ``m64nNk16`` instruction the wgmma kernel instantiates, ascending.

    Q K^T runs at N = block_n, P V at N = head_dim (each bucket the family takes), a bounded
    soft-cap's row sums at N = 8 (P times ones); the wgmma backward's shapes
    (``backward.bwd_wgmma_shapes``) are added.

    Parameters
    ----------
    tables : mapping, optional
        Tile tables as :attr:`Family.tables` (default: the family's own).
    """
    tables = ATTN_FWD_WGMMA.tables if tables is None else tables
    block_ns = {row.block_n for by_arch in tables.values() for rows in by_arch.values() for row in rows}
    return tuple(sorted(block_ns | {8} | {d for d in HEAD_DIM_BUCKETS if d % 64 == 0} | bwd_wgmma_shapes()))
