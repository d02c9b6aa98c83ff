"""What each query of a packed step attends: the metadata of ``attention.py``, built once per step.

The runner describes a step as per-request lists (query lengths, context
lengths, block tables, in packed-batch order); ``build_metadata`` turns them
into the flat KV slots every new token is written to and one group per kind
of attention: one-query rows (decodes) and prefill chunks. Decode-only steps
of the static path (``decode_graphs.py``) use ``decode_only_metadata`` over
their own static buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.pd.runner.flex_decode import FlexDecodeGroup

DECODE_PATHS = ("padded", "ragged", "kernel")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: on CUDA through page-locked memory, so the copy is queued, not waited for.

    (From pageable memory the driver copies through a bounce buffer and the
    host waits.) The caching host allocator keeps the staging alive until the
    copy is done.
    """
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with exactly one query token, attended in one padded SDPA call."""

    rows: slice | torch.Tensor  # packed-batch row of each query: a slice when contiguous, else [D] long
    block_tables: torch.Tensor  # [D, max_blocks] long, padded with block 0
    mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass(frozen=True)
class RaggedDecodeGroup:
    """Requests with exactly one query token, each attended over exactly its context."""

    rows: slice | torch.Tensor  # packed-batch row of each query: a slice when contiguous, else [D] long
    block_ids: torch.Tensor  # [n] long: tables of the requests read through the gather, concatenated
    # Per request: (in_place, first token row, context_len). In place: the row
    # of the layer's cache viewed as [KVH, blocks * block_size, D] (its blocks
    # are consecutive); else: the row of the gathered buffer.
    spans: tuple[tuple[bool, int, int], ...]


@dataclass(frozen=True)
class KernelDecodeGroup:
    """Requests with exactly one query token, attended in place by the CPU kernel (``cpu_kernels``)."""

    rows: slice | torch.Tensor  # packed-batch row of each query: a slice when contiguous, else [D] long
    block_tables: torch.Tensor  # [D, max_blocks] int32, each row valid up to its context
    context_lens: torch.Tensor  # [D] int32
    max_context: int


@dataclass(frozen=True)
class PrefillSeq:
    """One request with several query tokens (a prefill chunk)."""

    query_start: int  # rows [query_start, query_end) of the packed batch
    query_end: int
    context_len: int  # cached tokens + this chunk
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long
    mask: torch.Tensor | None  # [num_queries, context_len] bool; None = plain causal, no cached context


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything the attention function needs for one step, built once per step."""

    key_cache: torch.Tensor  # [layers, kv_heads, blocks, block_size, head_dim]
    value_cache: torch.Tensor  # same layout as key_cache
    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) per packed token
    decode: DecodeGroup | RaggedDecodeGroup | KernelDecodeGroup | FlexDecodeGroup | None
    prefills: tuple[PrefillSeq, ...]
    gather_keys: torch.Tensor  # flat scratch with room for any one gather of this step
    gather_values: torch.Tensor
    # The first ``kernel_writes`` packed tokens are decode rows whose new K/V the
    # CPU decode kernel writes as it attends them; the rest are written in one
    # index_copy_ per layer.
    kernel_writes: int = 0


class GatherScratch:
    """Reusable buffers that attention gathers a request's K/V blocks into.

    Every layer gathers the step's context blocks; writing them into one
    long-lived buffer instead of a fresh multi-MB tensor per layer saves the
    allocation and its page faults (measured as most of the gather cost on
    CPU). Grows on demand, never shrinks.
    """

    def __init__(self, block_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self._block_numel = block_numel  # kv_heads * block_size * head_dim: one block of one layer
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
    num_blocks: int | None = None,
) -> PagedAttentionMetadata:
    """Build the step's metadata from per-request lists (in packed-batch order).

    Request ``i`` owns ``query_lens[i]`` consecutive rows of the packed batch,
    which are its last tokens: KV positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.
    ``block_tables[i]`` must cover ``context_lens[i]`` tokens with ids below
    ``num_blocks`` (default: every block of the cache). ``decode_path`` is one
    of ``DECODE_PATHS`` (see the module docstring).
    """
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {DECODE_PATHS}")
    block_size = key_cache.shape[3]
    query_starts = [0]
    for n in query_lens:
        query_starts.append(query_starts[-1] + n)
    slot_mapping = _slots(
        query_lens,
        context_lens,
        block_tables,
        block_size,
        num_blocks=key_cache.shape[2] if num_blocks is None else num_blocks,
    )
    decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = tuple(
        _prefill_seq(query_starts[i], query_lens[i], context_lens[i], block_tables[i], block_size, device)
        for i, n in enumerate(query_lens)
        if n > 1
    )
    decode: DecodeGroup | RaggedDecodeGroup | KernelDecodeGroup | None = None
    if decode_ids:
        make_group: Callable[..., DecodeGroup | RaggedDecodeGroup | KernelDecodeGroup] = _decode_group
        if decode_path == "ragged":
            make_group = ragged_decode_group
        elif decode_path == "kernel":
            make_group = kernel_decode_group
        decode = make_group(
            [query_starts[i] for i in decode_ids],
            [context_lens[i] for i in decode_ids],
            [block_tables[i] for i in decode_ids],
            block_size,
            device,
        )
    gather_keys, gather_values = scratch.buffers(_largest_gather(prefills, decode))
    kernel_writes = 0
    if isinstance(decode, KernelDecodeGroup) and isinstance(decode.rows, slice) and decode.rows.start == 0:
        kernel_writes = decode.rows.stop  # the usual case: the decodes are the step's first rows
    return PagedAttentionMetadata(
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=to_device(slot_mapping, device),
        decode=decode,
        prefills=prefills,
        gather_keys=gather_keys,
        gather_values=gather_values,
        kernel_writes=kernel_writes,
    )


def _largest_gather(prefills: tuple[PrefillSeq, ...], decode) -> int:
    """Blocks of the largest single gather of the step (prefills with context, decodes)."""
    gather_blocks = [seq.block_ids.shape[0] for seq in prefills if seq.mask is not None]
    if isinstance(decode, DecodeGroup):
        gather_blocks.append(decode.block_tables.numel())
    elif isinstance(decode, RaggedDecodeGroup):
        gather_blocks.append(decode.block_ids.numel())
    return max(gather_blocks, default=0)


def decode_only_metadata(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    decode: RaggedDecodeGroup | FlexDecodeGroup,
    scratch: GatherScratch,
) -> PagedAttentionMetadata:
    """Metadata of a step whose rows are all one-query decodes (``decode_graphs.py``).

    ``slot_mapping`` is the caller's (static) buffer; nothing here copies it.
    """
    num_gathered = decode.block_ids.numel() if isinstance(decode, RaggedDecodeGroup) else 0
    gather_keys, gather_values = scratch.buffers(num_gathered)
    return PagedAttentionMetadata(key_cache, value_cache, slot_mapping, decode, (), gather_keys, gather_values)


def _slots(query_lens, context_lens, block_tables, block_size, *, num_blocks) -> torch.Tensor:
    """Flat KV slot of every packed token (a CPU tensor).

    Plain Python: for a step's few thousand tokens this beats a chain of tiny
    tensor ops, whose per-op overhead dominates at decode sizes.
    """
    slots: list[int] = []
    for num_queries, context_len, table in zip(query_lens, context_lens, block_tables):
        num_needed = -(-context_len // block_size)
        if num_needed > len(table):
            raise ValueError("a block table does not cover its request's context")
        # An out-of-range block id would be a device-side assert on GPU: refuse it here.
        if min(table[:num_needed]) < 0 or max(table[:num_needed]) >= num_blocks:
            raise ValueError("block id out of range of the KV cache")
        span = range(context_len - num_queries, context_len)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
    return torch.tensor(slots, dtype=torch.long)


def _rows(token_indices: list[int], device) -> slice | torch.Tensor:
    first = token_indices[0]
    if token_indices == list(range(first, first + len(token_indices))):
        return slice(first, first + len(token_indices))  # the usual case: decodes come first
    return to_device(torch.tensor(token_indices, dtype=torch.long), device)


def ragged_decode_group(token_indices, context_lens, block_tables, block_size, device) -> RaggedDecodeGroup:
    """The ragged one-query group of rows ``token_indices`` (see ``RaggedDecodeGroup``)."""
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
        block_ids=to_device(torch.tensor(block_ids, dtype=torch.long), device),
        spans=tuple(spans),
    )


def kernel_decode_group(token_indices, context_lens, block_tables, block_size, device) -> KernelDecodeGroup:
    """The in-place one-query group of rows ``token_indices`` (CPU only: the kernel reads host memory)."""
    num_blocks = [-(-n // block_size) for n in context_lens]
    width = max(num_blocks)
    tables = [list(t[:nb]) + [0] * (width - nb) for t, nb in zip(block_tables, num_blocks)]
    return KernelDecodeGroup(
        rows=_rows(token_indices, device),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        max_context=max(context_lens),
    )


def _decode_group(token_indices, context_lens, block_tables, block_size, device) -> DecodeGroup:
    num_blocks = [-(-n // block_size) for n in context_lens]
    max_blocks = max(num_blocks)
    tables = [list(t[:nb]) + [0] * (max_blocks - nb) for t, nb in zip(block_tables, num_blocks)]
    lens = torch.tensor(context_lens, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    return DecodeGroup(
        rows=_rows(token_indices, device),
        block_tables=to_device(torch.tensor(tables, dtype=torch.long), device),
        mask=to_device(mask[:, None, None, :], device),
    )


def _prefill_seq(query_start, num_queries, context_len, block_table, block_size, device) -> PrefillSeq:
    num_blocks = -(-context_len // block_size)
    mask = None
    if context_len > num_queries:
        # Query i sits at absolute position (context_len - num_queries + i) and
        # sees every key up to and including that position.
        offset = context_len - num_queries
        query_pos = torch.arange(num_queries)[:, None] + offset
        mask = to_device(torch.arange(context_len)[None, :] <= query_pos, device)
    return PrefillSeq(
        query_start=query_start,
        query_end=query_start + num_queries,
        context_len=context_len,
        block_ids=to_device(torch.tensor(list(block_table[:num_blocks]), dtype=torch.long), device),
        mask=mask,
    )
