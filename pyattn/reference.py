"""Float64 NumPy reference of every pyattn attention op: the semantics kernels must match.

One import for all of them; each lives in a module of its own, none of which imports this one:

- :mod:`pyattn.reference_dense`: ``attention_ref`` (how scores are built, masked and normalised;
  a row with no finite score gives output 0 and LSE ``-inf``, never NaN), its naive same-precision
  twin ``attention_lowp`` and the tolerance rule ``error_bound``;
- :mod:`pyattn.reference_composed`: packed varlen sequences, token trees, merging partial states;
- :mod:`pyattn.reference_backward`: gradients and their tolerance;
- :mod:`pyattn.reference_sparq`: SparQ attention;
- :mod:`pyattn.reference_fp8`: fp8 e4m3 inputs.
"""

from __future__ import annotations

from .reference_backward import (attention_backward_lowp, attention_backward_ref, attention_varlen_backward_ref,
                                 backward_error_bounds)
from .reference_composed import attention_varlen_ref, merge_states_ref, tree_ancestor_mask, tree_attention_ref
from .reference_dense import attention_lowp, attention_ref, error_bound
from .reference_fp8 import attention_fp8_lowp, attention_fp8_ref, dequantize_fp8, fp8_error_bound, quantize_fp8
from .reference_sparq import sparq_ref, sparq_selection_scores

__all__ = ["attention_ref", "attention_varlen_ref", "merge_states_ref", "attention_lowp",
           "error_bound", "tree_ancestor_mask", "tree_attention_ref", "attention_backward_ref",
           "attention_backward_lowp", "attention_varlen_backward_ref", "backward_error_bounds",
           "sparq_ref", "sparq_selection_scores", "attention_fp8_ref", "attention_fp8_lowp", "fp8_error_bound",
           "quantize_fp8", "dequantize_fp8"]
