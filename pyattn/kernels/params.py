"""Kernel parameter structs, defined once and rendered for both sides.

Each kernel takes one ``const __grid_constant__`` struct. Its field list lives here only: the
C++ declaration placed in the translation unit and the Python :mod:`struct` packer are both
derived from it (by :class:`~pyattn.kernels.param_struct.ParamStruct`), and the rendered source
``static_assert``s the size, so the two can never drift.
"""

from .param_struct import NestedParamStruct, ParamStruct

__all__ = ["ParamStruct", "ATTN_FWD_PARAMS", "MERGE_STATES_PARAMS", "DECODE_PARAMS", "KV_APPEND_PARAMS",
           "SPARSE_PARAMS", "NestedParamStruct", "PAGED_FWD_PARAMS", "PAGED_FWD_EXTRA", "ATTN_BWD_PARAMS",
           "KV_PAGES_PARAMS", "KV_SPARQ_PARAMS", "SPARQ_PARAMS", "ATTN_FWD_TMA_PARAMS", "MASK_BITS_PARAMS",
           "FP8_VT_PARAMS"]


def _strides(prefix: str):
    return tuple((f"{prefix}_stride_{axis}", "i64") for axis in ("b", "s", "h"))


# Strides are in elements; the head dimension is always contiguous (stride 1). Optional inputs
# (mask, alibi, cu_seqlens) are null when unused. The mask is read as mask[b, h, i, j] with
# stride 0 on broadcast axes. Varlen (cu_seqlens_q non-null): sequence b owns rows
# cu_seqlens[b]:cu_seqlens[b+1] of the packed arrays, q/k/v/o stride_b is 0 and seqlen_q/k are
# the maxima, total_q / total_k the packed rows (kernels_src/common.cuh clamp_rows keeps each
# sequence inside them and its lengths within the maxima; unused, 0, without cu_seqlens). LSE element
# (b, h, i) lives at lse[b * lse_stride_b + h * lse_stride_h + row0 + i], row0 = cu_seqlens_q[b] for
# varlen, else 0. causal: 0 none, 1 bottom-right, 2 top-left;
# window_left/right: -1 = unbounded (both relative to the bottom-right diagonal).
# Block-sparse (tile_ptr non-null): query tile m of head h visits only the key tiles
# tile_idx[tile_ptr[r] : tile_ptr[r + 1]] with r = h * tile_stride_h + m (tile_stride_h 0: one
# layout for all heads); tile_bits of each is a bit mask of its 16 x 16 sub-blocks (bit
# (row / 16) * (BLOCK_N / 16) + key / 16 within the tile), all ones for a fully visible tile.
ATTN_FWD_PARAMS = ParamStruct(
    "AttnFwdParams",
    (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "mut_ptr"), ("lse", "f32_ptr"),
     ("mask", "ptr"), ("alibi", "f32_cptr"), ("cu_seqlens_q", "i32_cptr"), ("cu_seqlens_k", "i32_cptr"),
     ("tile_ptr", "i32_cptr"), ("tile_idx", "i32_cptr"), ("tile_bits", "u64_cptr"))
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + (("mask_stride_b", "i64"), ("mask_stride_h", "i64"), ("mask_stride_q", "i64"), ("mask_stride_k", "i64"),
       ("lse_stride_b", "i64"), ("lse_stride_h", "i64"))
    + (("batch", "i32"), ("heads_q", "i32"), ("heads_kv", "i32"), ("group", "i32"),
       ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("head_dim", "i32"), ("causal", "i32"),
       ("window_left", "i32"), ("window_right", "i32"), ("alibi_stride_b", "i32"),
       ("scale_log2", "f32"), ("scale", "f32"), ("softcap", "f32"), ("tile_stride_h", "i32"),
       ("o_scale", "f32"),  # attn_fwd_fp8: V's descale, applied with the softmax's normalisation
       ("total_q", "i32"), ("total_k", "i32")),  # varlen: the packed rows its offsets are clamped into
)

# merge_states: out = LSE-weighted combination of state a and the n_b states of stack b.
# Rows are addressed by up to three leading indices (i0, i1, i2) (shapes left-padded with 1s), so
# strided views (a transposed LSE, a bshd output) are read in place; stride_n steps through b's
# states. Strides are in elements; the head_dim axis is contiguous.
def _strides3(prefix: str):
    return tuple((f"{prefix}_stride_{axis}", "i64") for axis in ("0", "1", "2"))


MERGE_STATES_PARAMS = ParamStruct(
    "MergeStatesParams",
    (("o_a", "ptr"), ("lse_a", "f32_cptr"), ("o_b", "ptr"), ("lse_b", "f32_cptr"), ("out", "mut_ptr"),
     ("out_lse", "f32_ptr"), ("n_b", "i32"))
    + _strides3("o_a") + _strides3("o_b") + (("o_b_stride_n", "i64"),) + _strides3("out")
    + _strides3("lse_a") + _strides3("lse_b") + (("lse_b_stride_n", "i64"),) + _strides3("out_lse")
    + (("dim0", "i32"), ("dim1", "i32"), ("dim2", "i32"), ("head_dim", "i32")),
)


# Decode over a paged KV cache. Sequence b's pages: page_indices[page_indptr[b] + i] (CSR), or
# page_indices[b * table_stride + i] when page_indptr is null (a padded block table); its kv_len[b]
# tokens (uniform_len tokens for every sequence when kv_len is null: a batch of equal lengths, its
# length by value) are key t at slot t % page_size of page i = t / page_size. With kv_len given,
# uniform_len is the lengths' bound: each is clamped into [0, uniform_len], and each page entry
# into [0, num_pages - 1], so lengths and tables the host did not check (a CUDA graph's, whose
# replays read them as they are then: pyattn.paged_decode's max_seqlen) never read outside the
# pools; checked ones are unchanged by it. Pool strides (page,
# slot, head) are in elements, so NHD and HND pools are both read in place; page_shift = log2(page_size)
# for a power of two, else -1. Query row r of kv head h is (query token r / group, query head
# h * group + r % group). With num_splits > 1, split s writes its normalised fp32 output to
# o_part[s][b][qi][hq][:head_dim] and natural-log LSE to lse_part[s][b][qi][hq], and the last
# split of a unit to finish merges them into o and lse, counting in split_counters (one uint32 per
# (kv head x row block, sequence), zero before the launch and left zero; null: a second launch
# merges them); otherwise o and lse
# (lse[b * lse_stride_b + hq * lse_stride_h + qi]). Quantized pools (int8 / fp8 e4m3) carry
# one fp32 scale per (page, slot, kv head) in k_scale / v_scale (strides ks_* / vs_*): the value of
# an element is its stored code times that scale. Null for 16-bit pools. tmaps: the TMA decode
# (sm_90a, attention_decode_tma.cuh) only, two CUtensorMaps (K pool, V pool) in device memory
# (pyattn.ops._decode.pool_maps); null for the other decode kernels. sparq_fin: SparQ's
# chosen-key decode only (null otherwise), the records of its finish, which its last step does: o
# then holds the blended exact rows, (units, group / 2, head_dim) contiguous
# (kernels_src/decode_merge.cuh).
def _pool_strides(prefix: str):
    return tuple((f"{prefix}_stride_{axis}", "i64") for axis in ("page", "slot", "h"))


DECODE_PARAMS = ParamStruct(
    "DecodeParams",
    (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "mut_ptr"), ("lse", "f32_ptr"), ("o_part", "f32_ptr"),
     ("lse_part", "f32_ptr"), ("split_counters", "mut_ptr"), ("page_indices", "i32_cptr"), ("page_indptr", "i32_cptr"),
     ("kv_len", "i32_cptr"), ("batch_order", "i32_cptr"), ("alibi", "f32_cptr"), ("k_scale", "f32_cptr"),
     ("v_scale", "f32_cptr"), ("tmaps", "ptr"), ("num_splits", "i32"), ("uniform_len", "i32"),
     ("table_stride", "i64"), ("sparq_fin", "f32_cptr"))  # per call; the rest per plan
    + _strides("q") + _strides("o") + _pool_strides("k") + _pool_strides("v")
    + _pool_strides("ks") + _pool_strides("vs")
    + (("lse_stride_b", "i64"), ("lse_stride_h", "i64"))
    + (("batch", "i32"), ("q_len", "i32"), ("heads_q", "i32"), ("heads_kv", "i32"), ("group", "i32"),
       ("head_dim", "i32"), ("page_size", "i32"), ("page_shift", "i32"), ("num_pages", "i32"), ("row_blocks", "i32"),
       ("causal", "i32"),
       ("window_left", "i32"), ("window_right", "i32"), ("alibi_stride_b", "i32"),
       ("scale_log2", "f32"), ("scale", "f32"), ("softcap", "f32")),
)

# Paged-cache append: item i copies one token's K and V rows (every kv head) to pool slot dst[i]
# (page dst / page_size, offset dst % page_size); src[i] >= 0 is a row of the new tokens
# (k_src + src * k_src_stride_t), src[i] < 0 the pool slot -1 - src[i] (a copy-on-write copy).
# Quantized pools: a new row is quantized (scale = amax / code max, written to k_scale / v_scale);
# a copy-on-write copy moves codes and scales unchanged.
KV_APPEND_PARAMS = ParamStruct(
    "KvAppendParams",
    # per call first (a cache pre-packs the rest once: ParamStruct.partial); the decode table's
    # patches (pyattn.paged.decode_table): table[patch[i]] = patch[n_patches + i]. With dst_base
    # (contiguous_decode's device lengths under max_seqlen, which a CUDA graph replays with): item
    # i's slot is dst[i] + dst_base[i / per_seq] clamped into [0, base_max], and len_out[b] =
    # that clamped base + per_seq, the decode's lengths after the append.
    (("k_src", "ptr"), ("v_src", "ptr"), ("dst", "i32_cptr"), ("src", "i32_cptr"), ("patch", "i32_cptr"),
     ("table", "i32_ptr"))
    + (("k_src_stride_t", "i64"), ("k_src_stride_h", "i64"), ("v_src_stride_t", "i64"), ("v_src_stride_h", "i64"))
    + (("n_items", "i32"), ("n_patches", "i32"), ("dst_base", "i32_cptr"), ("len_out", "i32_ptr"), ("per_seq", "i32"),
       ("base_max", "i32"))
    # per cache
    + (("k", "mut_ptr"), ("v", "mut_ptr"), ("k_scale", "f32_ptr"), ("v_scale", "f32_ptr"))
    + _pool_strides("k") + _pool_strides("v") + _pool_strides("ks") + _pool_strides("vs")
    + (("heads_kv", "i32"), ("head_dim", "i32"), ("page_size", "i32")),
)

# CSR sparse attention (attention_sparse.cuh): query row i of (batch b, query head h) attends to the
# keys indices[offsets[o + i] : offsets[o + i + 1]] with o = b * off_stride_b + h * off_stride_h
# (strides 0 for a pattern shared across batch / heads). Indices were range- and duplicate-checked
# on the host. LSE element (b, h, i) at lse[b * lse_stride_b + h * lse_stride_h + i].
SPARSE_PARAMS = ParamStruct(
    "SparseParams",
    (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "mut_ptr"), ("lse", "f32_ptr"), ("indices", "i32_cptr"),
     ("offsets", "i32_cptr"))
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + (("off_stride_b", "i64"), ("off_stride_h", "i64"), ("lse_stride_b", "i64"), ("lse_stride_h", "i64"))
    + (("batch", "i32"), ("heads_q", "i32"), ("group", "i32"), ("seqlen_q", "i32"), ("seqlen_k", "i32"),
       ("head_dim", "i32"), ("scale_log2", "f32")),
)


# Prefill over a paged KV cache (attention_prefill_wgmma.cuh / attention_prefill_mma.cuh): the
# AttnFwdParams member ``fwd`` carries the packed queries (cu_seqlens_q), the output, the LSE, the
# band and the modifiers; k / v there point at the pools and k_stride_h / v_stride_h are the pools'
# kv-head strides. Sequence b's keys are its kv_len[b] cached tokens, key t at slot t % page_size
# of page page_indices[page_indptr[b] + t / page_size] (page_shift = log2(page_size) or -1); with
# page_indptr null, a block table's row: page_indices[b * table_stride + t / page_size]. The kernels
# clamp each sequence's query rows as varlen's (common.cuh clamp_rows: into fwd.total_q and max_q
# rows), kv_len[b] into [0, max_k] and every page entry into [0, num_pages): tables no host check
# has seen (paged_prefill's max_seqlen_q / max_seqlen_k) then read wrong pages, never outside.
# row_group query heads of one GQA group share a block's rows: row r of sequence b is query token
# r / row_group of head (block's first head) + r % row_group. tree_mask (null unless a tree
# variant): bit j of tree_mask[cu_seqlens_q[b] + i] says whether token i may see key kv_len[b] -
# n_b + j (n_b = its new tokens, at most 64); keys before those are all visible. num_splits > 1:
# split s of a block's key tiles writes normalised fp32 rows to o_part + (s * part_stride + row
# * heads_q + head) * head_dim (row: the packed query row) and the natural-log LSE to lse_part +
# s * part_stride + row * heads_q + head; a combine launch merges them. The LSE of token i of a
# sequence whose first packed row is q_row0, head h: fwd.lse[q_row0 * lse_stride_b + h * lse_stride_h
# + i] (a block finds its sequence from the offsets, attention_mask.cuh paged_tile, and keeps no
# batch index past its main loop).
PAGED_FWD_EXTRA = ParamStruct(
    "PagedFwdExtra",
    (("page_indices", "i32_cptr"), ("page_indptr", "i32_cptr"), ("kv_len", "i32_cptr"), ("tree_mask", "u64_cptr"),
     ("o_part", "f32_ptr"), ("lse_part", "f32_ptr"))  # per call; the rest per plan
    + (("k_stride_page", "i64"), ("k_stride_slot", "i64"), ("v_stride_page", "i64"), ("v_stride_slot", "i64"),
       ("part_stride", "i64"))
    + (("page_size", "i32"), ("page_shift", "i32"), ("row_group", "i32"), ("num_splits", "i32"),
       ("num_pages", "i32"), ("table_stride", "i32"), ("max_q", "i32"), ("max_k", "i32"))
    + (("tmaps", "ptr"),),  # attn_prefill_tma: the pools' tensor maps (K, V) in device memory; else null
)
PAGED_FWD_PARAMS = NestedParamStruct("PagedFwdParams", (), base=ATTN_FWD_PARAMS, own=PAGED_FWD_EXTRA)

# attn_fwd_tma (attention_fwd_tma.cuh): AttnFwdParams ``fwd``, then the TMA tensor maps of q, k,
# v and the mask tensor (pyattn.runtime.tensormap; zeros without a mask), encoded per call
# because they hold the arrays' addresses. Then a persistent launch's tail split
# (kernels_src/fwd_tail_split.cuh; sk_iters 0: none): units from sk_first on are split by keys,
# sk_iters = their key tiles (sk_tiles each) shared out evenly over the blocks; a piece writes its
# fp32 O rows to sk_part[slot][row][head-dim bucket] and log2 LSEs to sk_lse[slot][row] (sk_slots
# slots a tail unit) and counts in sk_ctr (a zeroed uint32 per tail unit and consumer warp);
# sk_pieces: the most pieces one block's range holds.
ATTN_FWD_TMA_PARAMS = NestedParamStruct(
    "AttnFwdTmaParams", (), base=ATTN_FWD_PARAMS,
    own=ParamStruct("AttnFwdTmaMaps", (("tm_q", "tmap"), ("tm_k", "tmap"), ("tm_v", "tmap"), ("tm_mask", "tmap"),
                                       ("sk_part", "f32_ptr"), ("sk_lse", "f32_ptr"), ("sk_ctr", "mut_ptr"),
                                       ("sk_first", "i32"), ("sk_iters", "i32"), ("sk_tiles", "i32"),
                                       ("sk_slots", "i32"), ("sk_pieces", "i32"))))


# The backward pass (attention_bwd_*.cuh), one struct for its three kernels (pre, main, convert).
# q, k, v, o, dout and the outputs dq, dk, dv are read/written with (b, s, h) element strides like
# AttnFwdParams (varlen: stride_b 0, rows offset by cu_seqlens); the LSE the forward returned is
# read at lse[b * lse_stride_b + h * lse_stride_h + (q_row0 + i) * lse_stride_s]. Scratch, fp32,
# one row per (b, query head, query i): row index r = b * acc_stride_b + h * acc_stride_h + row0 + i
# with row0 = cu_seqlens_q[b] + b * 128 for varlen (each sequence padded by 128 rows, so rows up to
# the next multiple of block_m stay its own), else 0; lse_log2[r] (LSE in log2 units, +inf for a
# row that sees no key), dsum[r] = rowsum(dout * o), dq_acc[r * head_dim + d]. sem: the deterministic
# mode's per-(b, query head, query tile) counters, (b * heads_q + h) * m_blocks + m.
ATTN_BWD_PARAMS = ParamStruct(
    "AttnBwdParams",
    (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr"), ("dout", "ptr"), ("lse", "f32_cptr"),
     ("dq", "mut_ptr"), ("dk", "mut_ptr"), ("dv", "mut_ptr"), ("dq_acc", "f32_ptr"), ("lse_log2", "f32_ptr"),
     ("dsum", "f32_ptr"), ("sem", "i32_ptr"), ("alibi", "f32_cptr"), ("cu_seqlens_q", "i32_cptr"),
     ("cu_seqlens_k", "i32_cptr"))
    + _strides("q") + _strides("k") + _strides("v") + _strides("o") + _strides("dout") + _strides("dq")
    + _strides("dk") + _strides("dv")
    + (("lse_stride_b", "i64"), ("lse_stride_h", "i64"), ("lse_stride_s", "i64"), ("acc_stride_b", "i64"),
       ("acc_stride_h", "i64"))
    + (("batch", "i32"), ("heads_q", "i32"), ("heads_kv", "i32"), ("group", "i32"), ("seqlen_q", "i32"),
       ("seqlen_k", "i32"), ("head_dim", "i32"), ("causal", "i32"), ("window_left", "i32"), ("window_right", "i32"),
       ("alibi_stride_b", "i32"), ("m_blocks", "i32"), ("block_m", "i32"), ("deterministic", "i32"),
       ("scale", "f32"), ("scale_log2", "f32"), ("softcap", "f32"), ("total_q", "i32"), ("total_k", "i32")),
)


# Per-channel key scales (kv_pages.cuh kv_key_pages): job j = jobs[5j : 5j+5] = (dst page, n filled
# slots, offset of its n slot sources in src, staging slot or -1, source page or -1). A source s >= 0
# is row s of the new tokens (k_src + s * k_src_stride_t); -1 - x for x < stage_rows is row x of the
# fp32 staging copy (rows, heads_kv, head_dim); else slot x - stage_rows of the source page,
# dequantized. rec: the (page, kv head) scale records, float32 [S, 0, 0, 0, fp16 r[head_dim]].
KV_PAGES_PARAMS = ParamStruct(
    "KvPagesParams",
    (("k_src", "ptr"), ("k", "mut_ptr"), ("rec", "f32_ptr"), ("stage", "f32_ptr"), ("jobs", "i32_cptr"),
     ("src", "i32_cptr"), ("k_src_stride_t", "i64"), ("k_src_stride_h", "i64"))
    + _pool_strides("k") + (("rec_stride_page", "i64"), ("rec_stride_h", "i64"))
    + (("n_jobs", "i32"), ("heads_kv", "i32"), ("head_dim", "i32"), ("page_size", "i32"), ("stage_rows", "i32")),
)

# SparQ cache state (kv_pages.cuh kv_sparq): items = pool slots whose key rows are copied into kt
# (page, kv head, channel, slot: channel stride page_size); job j = jobs[4j : 4j+4] = (destination
# row, source row or -1, offset into slots, count): vsum[dst] = vsum[src] (or 0) + the V rows of the
# count slots, in order. vsum is (rows, heads_kv, head_dim) float32.
KV_SPARQ_PARAMS = ParamStruct(
    "KvSparqParams",
    (("k", "ptr"), ("v", "ptr"), ("kt", "mut_ptr"), ("vsum", "f32_ptr"), ("items", "i32_cptr"), ("jobs", "i32_cptr"),
     ("slots", "i32_cptr"))
    + _pool_strides("k") + _pool_strides("v")
    + (("kt_stride_page", "i64"), ("kt_stride_h", "i64"), ("vsum_stride_row", "i64"))
    + (("n_items", "i32"), ("n_jobs", "i32"), ("heads_kv", "i32"), ("head_dim", "i32"), ("page_size", "i32")),
)

# SparQ decode stages (sparq.cuh). Rows are (sequence, row head): row_heads per sequence, each with
# `group` query heads (q heads rh * group ...), reading kv head rh / kv_div. ws: one workspace;
# off_*: byte offsets of its parts (per-block softmax partials at 0, then order-key scores,
# thresholds, candidate keys and positions, and the rows' finish records that the chosen-key
# decode reads with vsum: DecodeParams.sparq_fin), laid out by pyattn.ops.sparq. zeroed: the rows'
# histograms (4096 words a row) then their counters (4 a row), in the stream's zeroed counter
# block (MemoryPool.counters): zero when the score stage starts, left zero by the select stage.
# The page table is the cache's CSR (page_indices, page_indptr, kv_len); sel / sel_pos / dec_len are
# the decode's block table (k_max entries a row), the chosen positions and counts; vrow each
# sequence's row of the cache's V sums (of vsum_stride_row elements).
SPARQ_PARAMS = ParamStruct(
    "SparqParams",
    (("q", "ptr"), ("qx", "mut_ptr"), ("kt", "ptr"), ("page_indices", "i32_cptr"), ("page_indptr", "i32_cptr"),
     ("kv_len", "i32_cptr"), ("ws", "mut_ptr"), ("sel", "mut_ptr"), ("sel_pos", "mut_ptr"), ("dec_len", "mut_ptr"),
     ("vsum", "f32_cptr"), ("vrow", "i32_cptr"), ("zeroed", "mut_ptr"), ("lpad", "i64"), ("off_part", "i64"),
     ("off_score", "i64"), ("off_info", "i64"), ("off_cand_u", "i64"), ("off_cand_i", "i64"), ("off_fin", "i64"),
     ("n_chunks", "i32"), ("chunk_steps", "i32"), ("k_max", "i32"))  # per call; the rest per plan
    + (("q_stride_b", "i64"), ("q_stride_h", "i64"), ("kt_stride_page", "i64"), ("kt_stride_h", "i64"),
       ("vsum_stride_row", "i64"))
    + (("batch", "i32"), ("heads_kv", "i32"), ("group", "i32"), ("head_dim", "i32"), ("page_size", "i32"),
       ("r", "i32"), ("k", "i32"), ("scale_log2", "f32"), ("row_heads", "i32"), ("kv_div", "i32")),
)

# A bool mask packed to bits (mask_bits.cuh): src's byte (b, h, q, key) at b * stride_b + h * stride_h +
# q * stride_q + key * stride_k (bytes; 0 on broadcast axes) -> dst, rows (rows_b, rows_h, rows_q) of
# `words` u32 words, rows = rows_b * rows_h * rows_q. A 128-key group of query row q wholly outside
# the band lo <= key - q <= hi (validate.block_layout.band_limits) is written as zeros unread.
MASK_BITS_PARAMS = ParamStruct(
    "MaskBitsParams",
    (("src", "ptr"), ("dst", "mut_ptr"), ("stride_b", "i64"), ("stride_h", "i64"), ("stride_q", "i64"),
     ("stride_k", "i64"), ("rows", "i64"), ("band_lo", "i64"), ("band_hi", "i64"), ("rows_h", "i32"),
     ("rows_q", "i32"), ("keys", "i32"), ("words", "i32")),
)

# fp8 V transposed for attn_fwd_fp8 (kernels_src/fp8_vt.cuh): v (batch, keys, kv heads, head_dim) with
# element strides; vt (batch, kv heads, head_dim, keys_pad) contiguous, keys permuted per 16-key group.
FP8_VT_PARAMS = ParamStruct(
    "Fp8VtParams",
    (("v", "ptr"), ("vt", "mut_ptr"), ("v_stride_b", "i64"), ("v_stride_s", "i64"), ("v_stride_h", "i64"),
     ("seqlen_k", "i32"), ("keys_pad", "i32"), ("heads_kv", "i32"), ("head_dim", "i32"), ("key_tiles", "i32")),
)
