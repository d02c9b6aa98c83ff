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
one-token prefill tail) take one of two paths, picked at construction:

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "epd_paged"
METADATA_KWARG = "epd_attn_metadata"


DECODE_PATHS = ("padded", "ragged")


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with exactly one query token, attended in one padded SDPA call."""

    rows: slice | torch.Tensor   # packed-batch row of each query: a slice when contiguous, else [D] long
    block_tables: torch.Tensor   # [D, max_blocks] long, padded with block 0
    mask: torch.Tensor           # [D, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass(frozen=True)
class RaggedDecodeGroup:
    """Requests with exactly one query token, each attended over exactly its context."""

    rows: slice | torch.Tensor   # packed-batch row of each query: a slice when contiguous, else [D] long
    block_ids: torch.Tensor      # [n] long: tables of the requests read through the gather, concatenated
    # Per request: (in_place, first token row, context_len). In place: the row
    # of the layer's cache viewed as [KVH, blocks * block_size, D] (its blocks
    # are consecutive); else: the row of the gathered buffer.
    spans: tuple[tuple[bool, int, int], ...]


@dataclass(frozen=True)
class PrefillSeq:
    """One request with several query tokens (a prefill chunk)."""

    query_start: int             # rows [query_start, query_end) of the packed batch
    query_end: int
    context_len: int             # cached tokens + this chunk
    block_ids: torch.Tensor      # [ceil(context_len / block_size)] long
    mask: torch.Tensor | None    # [num_queries, context_len] bool; None = plain causal, no cached context


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything the attention function needs for one step, built once per step."""

    key_cache: torch.Tensor      # [layers, kv_heads, blocks, block_size, head_dim]
    value_cache: torch.Tensor    # same layout as key_cache
    positions: torch.Tensor      # [T] long: absolute position of each packed token
    slot_mapping: torch.Tensor   # [T] long: flat slot (block * block_size + offset) per packed token
    decode: DecodeGroup | RaggedDecodeGroup | None
    prefills: tuple[PrefillSeq, ...]
    gather_keys: torch.Tensor    # flat scratch with room for any one gather of this step
    gather_values: torch.Tensor


class GatherScratch:
    """Reusable buffers that attention gathers a request's K/V blocks into.

    Every layer gathers the step's context blocks; writing them into one
    long-lived buffer instead of a fresh multi-MB tensor per layer saves the
    allocation and its page faults (measured as most of the gather cost on
    CPU). Grows on demand, never shrinks.
    """

    def __init__(self, block_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self._block_numel = block_numel      # kv_heads * block_size * head_dim: one block of one layer
        self._dtype = dtype
        self._device = device
        self._keys = torch.empty(0, dtype=dtype, device=device)
        self._values = torch.empty_like(self._keys)

    def buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat key and value buffers with room for at least ``num_blocks`` blocks."""
        needed = num_blocks * self._block_numel
        if needed > self._keys.numel():
            size = max(needed, 2 * self._keys.numel())
            self._keys = torch.empty(size, dtype=self._dtype, device=self._device)
            self._values = torch.empty_like(self._keys)
        return self._keys, self._values


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` as ``"epd_paged"`` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def build_metadata(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scratch: GatherScratch,
    device: torch.device,
    decode_path: str = "padded",
) -> PagedAttentionMetadata:
    """Build the step's metadata from per-request lists (in packed-batch order).

    Request ``i`` owns ``query_lens[i]`` consecutive rows of the packed batch,
    which are its last tokens: absolute positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.
    ``block_tables[i]`` must cover ``context_lens[i]`` tokens. ``decode_path``
    is one of ``DECODE_PATHS`` (see the module docstring).
    """
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {DECODE_PATHS}")
    block_size = key_cache.shape[3]
    query_starts = [0]
    for n in query_lens:
        query_starts.append(query_starts[-1] + n)
    positions, slot_mapping = _positions_and_slots(
        query_lens, context_lens, block_tables, block_size, num_blocks=key_cache.shape[2]
    )
    decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = tuple(
        _prefill_seq(query_starts[i], query_lens[i], context_lens[i], block_tables[i], block_size, device)
        for i, n in enumerate(query_lens) if n > 1
    )
    decode = None
    if decode_ids:
        make_group = _ragged_decode_group if decode_path == "ragged" else _decode_group
        decode = make_group(
            [query_starts[i] for i in decode_ids],
            [context_lens[i] for i in decode_ids],
            [block_tables[i] for i in decode_ids],
            block_size,
            device,
        )
    gather_blocks = [seq.block_ids.shape[0] for seq in prefills if seq.mask is not None]
    if isinstance(decode, DecodeGroup):
        gather_blocks.append(decode.block_tables.numel())
    elif decode is not None:
        gather_blocks.append(decode.block_ids.numel())
    gather_keys, gather_values = scratch.buffers(max(gather_blocks, default=0))
    return PagedAttentionMetadata(
        key_cache=key_cache,
        value_cache=value_cache,
        positions=positions.to(device, non_blocking=True),
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        decode=decode,
        prefills=prefills,
        gather_keys=gather_keys,
        gather_values=gather_values,
    )


def _positions_and_slots(query_lens, context_lens, block_tables, block_size, *, num_blocks):
    """Absolute position and flat KV slot of every packed token (CPU tensors).

    Plain Python: for a step's few thousand tokens this beats a chain of tiny
    tensor ops, whose per-op overhead dominates at decode sizes.
    """
    positions: list[int] = []
    slots: list[int] = []
    for num_queries, context_len, table in zip(query_lens, context_lens, block_tables):
        num_needed = -(-context_len // block_size)
        if num_needed > len(table):
            raise ValueError("a block table does not cover its request's context")
        # An out-of-range block id would be a device-side assert on GPU: refuse it here.
        if min(table[:num_needed]) < 0 or max(table[:num_needed]) >= num_blocks:
            raise ValueError("block id out of range of the KV cache")
        span = range(context_len - num_queries, context_len)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
    return torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long)


def _rows(token_indices: list[int], device) -> slice | torch.Tensor:
    first = token_indices[0]
    if token_indices == list(range(first, first + len(token_indices))):
        return slice(first, first + len(token_indices))  # the usual case: decodes come first
    return torch.tensor(token_indices, dtype=torch.long).to(device, non_blocking=True)


def _ragged_decode_group(token_indices, context_lens, block_tables, block_size, device) -> RaggedDecodeGroup:
    block_ids: list[int] = []
    spans = []
    for context_len, table in zip(context_lens, block_tables):
        blocks = table[: -(-context_len // block_size)]
        first = blocks[0]
        if blocks[-1] - first == len(blocks) - 1 and all(b == first + i for i, b in enumerate(blocks)):
            spans.append((True, first * block_size, context_len))
        else:
            spans.append((False, len(block_ids) * block_size, context_len))
            block_ids.extend(blocks)
    return RaggedDecodeGroup(
        rows=_rows(token_indices, device),
        block_ids=torch.tensor(block_ids, dtype=torch.long).to(device, non_blocking=True),
        spans=tuple(spans),
    )


def _decode_group(token_indices, context_lens, block_tables, block_size, device) -> DecodeGroup:
    num_blocks = [-(-n // block_size) for n in context_lens]
    max_blocks = max(num_blocks)
    tables = [list(t[:nb]) + [0] * (max_blocks - nb) for t, nb in zip(block_tables, num_blocks)]
    lens = torch.tensor(context_lens, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    return DecodeGroup(
        rows=_rows(token_indices, device),
        block_tables=torch.tensor(tables, dtype=torch.long).to(device, non_blocking=True),
        mask=mask[:, None, None, :].to(device, non_blocking=True),
    )


def _prefill_seq(query_start, num_queries, context_len, block_table, block_size, device) -> PrefillSeq:
    num_blocks = -(-context_len // block_size)
    mask = None
    if context_len > num_queries:
        # Query i sits at absolute position (context_len - num_queries + i) and
        # sees every key up to and including that position.
        offset = context_len - num_queries
        query_pos = torch.arange(num_queries)[:, None] + offset
        mask = (torch.arange(context_len)[None, :] <= query_pos).to(device, non_blocking=True)
    return PrefillSeq(
        query_start=query_start,
        query_end=query_start + num_queries,
        context_len=context_len,
        block_ids=torch.tensor(list(block_table[:num_blocks]), dtype=torch.long).to(device, non_blocking=True),
        mask=mask,
    )


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
    key_cache = meta.key_cache[module.layer_idx]      # [KVH, blocks, block_size, D]
    value_cache = meta.value_cache[module.layer_idx]
    # index_copy_ on a [KVH, slots, D] view writes all new tokens of all requests in one op.
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, key[0])
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, value[0])

    out = query.new_empty(query.shape[2], query.shape[1], head_dim)  # [T, H, D]
    if isinstance(meta.decode, RaggedDecodeGroup):
        out[meta.decode.rows] = _ragged_decode_attention(query[0], key_cache, value_cache, meta, scaling)
    elif meta.decode is not None:
        out[meta.decode.rows] = _decode_attention(query[0], key_cache, value_cache, meta, scaling)
    for seq in meta.prefills:
        out[seq.query_start : seq.query_end] = _prefill_attention(
            query[0], key[0], value[0], key_cache, value_cache, meta, seq, scaling
        )
    return out.unsqueeze(0), None


def _decode_attention(query, key_cache, value_cache, meta: PagedAttentionMetadata, scaling) -> torch.Tensor:
    """One query per request over its padded context: ``[D, H, head_dim]``."""
    group = meta.decode
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


def _ragged_decode_attention(query, key_cache, value_cache, meta: PagedAttentionMetadata, scaling) -> torch.Tensor:
    """One query per request over its own gathered context: ``[D, H, head_dim]``."""
    group = meta.decode
    num_heads, head_dim = query.shape[0], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    scale = head_dim**-0.5 if scaling is None else scaling
    # [KVH, tokens, head_dim] views, each head's rows contiguous: the cache in
    # place, and the gathered blocks.
    sources = {
        True: (key_cache.view(num_kv_heads, -1, head_dim), value_cache.view(num_kv_heads, -1, head_dim)),
        False: (_gather(key_cache, group.block_ids, meta.gather_keys).view(num_kv_heads, -1, head_dim),
                _gather(value_cache, group.block_ids, meta.gather_values).view(num_kv_heads, -1, head_dim)),
    }
    # [D, KVH, n_rep, head_dim]: GQA without repeating K/V, the n_rep query
    # heads of a KV head are the rows of one matrix product.
    q = (query[:, group.rows] * scale).transpose(0, 1).reshape(len(group.spans), num_kv_heads, -1, head_dim)
    out = torch.empty_like(q)
    for i, (in_place, start, length) in enumerate(group.spans):
        keys, values = sources[in_place]
        scores = torch.bmm(q[i], keys[:, start : start + length].mT)          # [KVH, n_rep, len]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, values[:, start : start + length], out=out[i])
    return out.view(len(group.spans), num_heads, head_dim)


def _prefill_attention(
    query, key, value, key_cache, value_cache, meta: PagedAttentionMetadata, seq: PrefillSeq, scaling
) -> torch.Tensor:
    """A chunk's queries over its context: ``[num_queries, H, head_dim]``."""
    num_heads, num_kv_heads, head_dim = query.shape[0], key.shape[0], key.shape[2]
    q = query[:, seq.query_start : seq.query_end].unsqueeze(0)           # [1, H, n, D]
    if seq.mask is None:
        # Whole context is in this chunk: use the fresh K/V, skip the gather.
        k = key[:, seq.query_start : seq.query_end].unsqueeze(0)         # [1, KVH, n, D]
        v = value[:, seq.query_start : seq.query_end].unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=num_heads != num_kv_heads
        )
        return out[0].transpose(0, 1)
    k = _gather(key_cache, seq.block_ids, meta.gather_keys).view(num_kv_heads, -1, head_dim)[:, : seq.context_len]
    v = _gather(value_cache, seq.block_ids, meta.gather_values).view(num_kv_heads, -1, head_dim)[:, : seq.context_len]
    if num_heads != num_kv_heads:
        # enable_gqa together with a mask sends CUDA SDPA to its math
        # fallback; repeat the KV heads instead, as HF's sdpa path does.
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    out = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=seq.mask, scale=scaling)
    return out[0].transpose(0, 1)


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
