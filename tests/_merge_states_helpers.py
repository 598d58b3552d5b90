"""Shared by the ``pyattn.merge_states`` test modules (test_merge_states_validation.py,
test_merge_states_plan.py, test_gpu_merge_states.py): the dtypes under test, the hypothesis health
checks they suppress, and random states with dead rows in each layout's LSE convention."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def random_states(rng, n, shape, dtype, layout="bshd", dead=0.3):
    """n states of o shape ``shape`` with LSEs in ``layout``'s convention; about ``dead`` of the
    (state, row) pairs have LSE -inf and NaN in o."""
    os_ = rng.standard_normal((n, *shape)).astype(dtype)
    rows = (rng.standard_normal((n, *shape[:-1])) * 3).astype(np.float32)  # indexed like o's rows
    kill = rng.random(rows.shape) < dead
    rows[kill] = -np.inf
    os_[kill] = np.nan
    to_lse = {"bshd": lambda x: x.transpose(0, 1, 3, 2), "bhsd": lambda x: x, "thd": lambda x: x.transpose(0, 2, 1)}
    return os_, np.ascontiguousarray(to_lse[layout](rows))
