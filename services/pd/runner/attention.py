"""Paged attention for HF models, plugged in through ``transformers.AttentionInterface``.

The runner runs the HF language model on ONE packed batch (all scheduled tokens
of all requests concatenated, ``[1, T, hidden]``) with ``use_cache=False`` and
passes a :class:`PagedAttentionMetadata` as the forward kwarg
``epd_attn_metadata``. HF forwards unknown kwargs untouched from
``model.model(...)`` through every decoder layer into the attention interface,
so each layer's call of :func:`paged_attention_forward` sees it. Because the
implementation name is not in ``ALL_MASK_ATTENTION_FUNCTIONS`` HF builds no
mask (``attention_mask`` is ``None``): masking is ours.

Per layer the function writes the new K/V (RoPE already applied by HF) into the
paged KV tensors at the step's slots, then attends each request's queries over
its own context: cached blocks + new tokens. Longer chunks get one SDPA call
each (their cost is model math). Requests with one query token (decodes, or a
one-token prefill tail) take one of two paths picked at construction, or,
in a decode-only step of the static path, a third:

- ``"padded"`` (GPU): one SDPA call over block tables padded to the longest
  context; one kernel launch per layer matters more there than wasted reads.
- ``"ragged"`` (CPU): each request is attended with two ``bmm`` calls over
  exactly its context. Decode attention is bound by reading K/V from
  memory, so padding to the longest context cost up to 2x, and SDPA's flash
  kernel has a fixed cost per call that, with one query row, was ~4x the
  bmm's (measured on the bench model). A request whose blocks are
  consecutive (the KV manager places them so) is read in place; only the
  others are gathered, back to back: the gather was a third of decode
  attention.
- ``"kernel"`` (CPU, float32, where a C compiler built ``cpu_kernels``): every
  decode row of the step in one call of a C kernel that reads K/V in place
  through the block tables, over PyTorch's OpenMP threads; no per-request
  ops. At 32 streams of ~150 tokens it took a layer's decode attention from
  ~6 to ~1.6 ms on two cores (bench model shapes). When the decodes are the
  step's first rows (the scheduler puts them there) the kernel also writes
  their new K/V, so the layer's ``index_copy_`` covers only prefill rows.
- flex (decode-only steps on GPU; ``flex_decode.py``): PyTorch's
  ``flex_attention`` reads every row's blocks in place through a block mask
  over static tensors, so the step can be replayed from a CUDA graph
  (``decode_graphs.py``).

Prefill chunks with cached context attend a gather of their own blocks; GQA
is handled by folding each KV head's query heads into the query axis (no
copy of K/V per query head).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.common.cpu_kernels import load_paged_decode
from services.pd.runner.attention_metadata import (
    DecodeGroup,
    KernelDecodeGroup,
    PagedAttentionMetadata,
    PrefillSeq,
    RaggedDecodeGroup,
)
from services.pd.runner.flex_decode import FlexDecodeGroup, flex_decode_attention

ATTN_IMPLEMENTATION = "epd_paged"
METADATA_KWARG = "epd_attn_metadata"


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` as ``"epd_paged"`` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: ``query [1, H, T, D]``, ``key/value [1, KVH, T, D]``.

    Returns ``([1, T, H, D], None)`` like ``sdpa_attention_forward``. The
    ``attention_mask`` from HF is ignored (it is ``None`` for this
    implementation); the metadata kwarg defines who attends to what.
    ``dropout`` is ignored: the runner only does inference.
    """
    meta: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the {METADATA_KWARG} forward kwarg")
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    layer_idx = cast(int, module.layer_idx)  # HF's attention modules carry their layer's index
    key_cache = meta.key_cache[layer_idx]  # [KVH, blocks, block_size, D]
    value_cache = meta.value_cache[layer_idx]
    # index_copy_ on a [KVH, slots, D] view writes all new tokens of all requests in one op
    # (but those of the leading decode rows the kernel writes itself).
    written = meta.kernel_writes
    if written < key.shape[2]:
        slots = meta.slot_mapping[written:] if written else meta.slot_mapping
        key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, key[0, :, written:])
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, value[0, :, written:])

    out = query.new_empty(query.shape[2], query.shape[1], head_dim)  # [T, H, D]
    decode = meta.decode
    if isinstance(decode, FlexDecodeGroup):
        out[: decode.num_rows] = flex_decode_attention(query[0], key_cache, value_cache, decode, scaling)
    elif isinstance(decode, KernelDecodeGroup):
        new_kv = (key[0, :, :written].transpose(0, 1), value[0, :, :written].transpose(0, 1)) if written else None
        _kernel_decode_attention(query[0], key_cache, value_cache, decode, scaling, out, new_kv)
    elif isinstance(decode, RaggedDecodeGroup):
        out[decode.rows] = _ragged_decode_attention(query[0], key_cache, value_cache, meta, decode, scaling)
    elif decode is not None:
        out[decode.rows] = _decode_attention(query[0], key_cache, value_cache, meta, decode, scaling)
    for seq in meta.prefills:
        out[seq.query_start : seq.query_end] = _prefill_attention(
            query[0], key[0], value[0], key_cache, value_cache, meta, seq, scaling
        )
    return out.unsqueeze(0), None


def _decode_attention(
    query, key_cache, value_cache, meta: PagedAttentionMetadata, group: DecodeGroup, scaling
) -> torch.Tensor:
    """One query per request over its padded context (``group``, the step's decodes): ``[D, H, head_dim]``."""
    num_heads, head_dim = query.shape[0], query.shape[2]
    num_reqs, max_blocks = group.block_tables.shape
    num_kv_heads, block_size = key_cache.shape[0], key_cache.shape[2]
    # GQA without repeating K/V: the n_rep query heads of a KV head become the
    # "query length" axis, so each KV head is read once (HF's pack_gqa trick).
    q = query[:, group.rows].transpose(0, 1).reshape(num_reqs, num_kv_heads, -1, head_dim)
    shape = (num_kv_heads, num_reqs, max_blocks * block_size, head_dim)
    k = _gather(key_cache, group.block_tables.view(-1), meta.gather_keys).view(shape).transpose(0, 1)
    v = _gather(value_cache, group.block_tables.view(-1), meta.gather_values).view(shape).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling)
    return out.reshape(num_reqs, num_heads, head_dim)


def _kernel_decode_attention(
    query,
    key_cache,
    value_cache,
    group: KernelDecodeGroup,
    scaling,
    out: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The step's decodes attended in place by the CPU kernel, written into their rows of ``out [T, H, D]``;
    ``new_kv``: the rows' new keys and values (``[D, KVH, head_dim]`` each), for the kernel to write first."""
    kernel = load_paged_decode()
    if kernel is None:  # the runner picks this path only where the kernel loaded
        raise RuntimeError("the CPU paged decode kernel is not available")
    scale = query.shape[2] ** -0.5 if scaling is None else scaling
    q = query[:, group.rows].transpose(0, 1)  # [D, H, head_dim]: a view when the rows are a slice
    if isinstance(group.rows, slice):
        new_keys, new_values = new_kv if new_kv is not None else (None, None)
        kernel(
            q,
            key_cache,
            value_cache,
            group.block_tables,
            group.context_lens,
            group.max_context,
            scale,
            out[group.rows],
            new_keys,
            new_values,
        )
    else:
        rows_out = torch.empty_like(q)
        kernel(q, key_cache, value_cache, group.block_tables, group.context_lens, group.max_context, scale, rows_out)
        out[group.rows] = rows_out


def _ragged_decode_attention(
    query, key_cache, value_cache, meta: PagedAttentionMetadata, group: RaggedDecodeGroup, scaling
) -> torch.Tensor:
    """One query per request over its own gathered context (``group``, the step's decodes): ``[D, H, head_dim]``."""
    num_heads, head_dim = query.shape[0], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    scale = head_dim**-0.5 if scaling is None else scaling
    # [KVH, tokens, head_dim] views, each head's rows contiguous: the cache in
    # place, and the gathered blocks.
    sources = {
        True: (key_cache.view(num_kv_heads, -1, head_dim), value_cache.view(num_kv_heads, -1, head_dim)),
        False: (
            _gather(key_cache, group.block_ids, meta.gather_keys).view(num_kv_heads, -1, head_dim),
            _gather(value_cache, group.block_ids, meta.gather_values).view(num_kv_heads, -1, head_dim),
        ),
    }
    # [D, KVH, n_rep, head_dim]: GQA without repeating K/V, the n_rep query
    # heads of a KV head are the rows of one matrix product.
    q = (query[:, group.rows] * scale).transpose(0, 1).reshape(len(group.spans), num_kv_heads, -1, head_dim)
    out = torch.empty_like(q)
    for i, (in_place, start, length) in enumerate(group.spans):
        keys, values = sources[in_place]
        scores = torch.bmm(q[i], keys[:, start : start + length].mT)  # [KVH, n_rep, len]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, values[:, start : start + length], out=out[i])
    return out.view(len(group.spans), num_heads, head_dim)


def _prefill_attention(
    query, key, value, key_cache, value_cache, meta: PagedAttentionMetadata, seq: PrefillSeq, scaling
) -> torch.Tensor:
    """A chunk's queries over its context: ``[num_queries, H, head_dim]``."""
    num_heads, num_kv_heads, head_dim = query.shape[0], key.shape[0], key.shape[2]
    q = query[:, seq.query_start : seq.query_end].unsqueeze(0)  # [1, H, n, D]
    if seq.mask is None:
        # Whole context is in this chunk: use the fresh K/V, skip the gather.
        k = key[:, seq.query_start : seq.query_end].unsqueeze(0)  # [1, KVH, n, D]
        v = value[:, seq.query_start : seq.query_end].unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=num_heads != num_kv_heads
        )
        return out[0].transpose(0, 1)
    k = _gather(key_cache, seq.block_ids, meta.gather_keys).view(num_kv_heads, -1, head_dim)[:, : seq.context_len]
    v = _gather(value_cache, seq.block_ids, meta.gather_values).view(num_kv_heads, -1, head_dim)[:, : seq.context_len]
    # GQA without repeating K/V (and without enable_gqa, which with a mask sends
    # CUDA SDPA to its math fallback): the n_rep query heads of a KV head are
    # stacked on the query axis, [1, KVH, n_rep * n, D], and the mask repeats
    # along it. HF's repeat_kv order: query head h reads KV head h // n_rep.
    # 4-D, as SDPA's fused CPU kernel needs: 3-D inputs go to its math path, which materializes every
    # score (2,048 queries over 6,000 keys, 12 heads: 1.6 s a layer against 0.66 s).
    num_queries, n_rep = q.shape[2], num_heads // num_kv_heads
    q = q.reshape(1, num_kv_heads, n_rep * num_queries, head_dim)
    mask = seq.mask.repeat(n_rep, 1) if n_rep > 1 else seq.mask
    out = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=scaling)  # [1, KVH, n_rep * n, D]
    return out.view(num_heads, num_queries, head_dim).transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` of one layer's ``cache`` [KVH, blocks, block_size, D],
    copied into the front of the flat ``scratch``: ``[KVH, n, block_size, D]``.

    ``index_select`` copies whole blocks; advanced indexing ``cache[:, ids]``
    was measured many times slower on CPU for the same gather.
    """
    num_kv_heads, _, block_size, head_dim = cache.shape
    shape = (num_kv_heads, block_ids.shape[0], block_size, head_dim)
    out = scratch[: num_kv_heads * block_ids.shape[0] * block_size * head_dim].view(shape)
    return torch.index_select(cache, 1, block_ids, out=out)
