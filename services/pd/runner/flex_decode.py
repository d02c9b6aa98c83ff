"""Decode attention with PyTorch's ``flex_attention``, reading the paged KV cache in place.

Why this kernel: FlashInfer does not install on the machines this project is
built on, and FlashAttention's paged kernels are a separate build per CUDA
and torch version. ``flex_attention`` ships inside PyTorch; inductor compiles
it to a Triton kernel on CUDA (for one query row, its decoding variant, which
packs the query heads of a KV head together, so GQA reads each KV head once
and never repeats it) and to C++ on CPU, so the same code is tested for
correctness on a CPU-only machine. Its ``BlockMask`` is a block table: row
``b`` lists the physical blocks of request ``b``, and the kernel reads K/V
where they lie, with no gather. Every tensor it reads is a static buffer
refilled in place, so a decode step can be captured once as a CUDA graph and
replayed (``decode_graphs.py``). Its speed on a GPU is unmeasured.

Layout: one layer's cache ``[KVH, blocks, block_size, D]`` is viewed as a
single sequence ``[1, KVH, blocks * block_size, D]`` that every query row
shares (a KV batch of 1 broadcasts over the B rows); the queries are
``[B, H, 1, D]``. Of a row's blocks only the last can be partly filled, so
the mask keeps a slot unless it lies in the row's last block at or past the
row's fill.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Query-side tile of the block mask. A decode row has one query, so any tile
# holds it; 128 is torch's default and divides every BLOCK_M its kernels use.
_Q_TILE = 128


@dataclass(frozen=True)
class FlexDecodeGroup:
    """Rows ``[0, num_rows)`` of the packed batch, one query each, attended with ``flex_attention``.

    The block mask is built once per batch size over views of static buffers
    (``decode_graphs.DecodeBuffers``); refilling those buffers in place is all
    a new step needs.
    """

    num_rows: int
    block_mask: Any  # torch BlockMask: [num_rows, 1, 1, table_width] block tables
    attend: Callable[..., torch.Tensor]  # flex_attention, compiled


def flex_available() -> bool:
    """Whether this PyTorch has ``flex_attention`` and block masks built straight from block lists."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def compile_flex(num_batch_sizes: int) -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled for static shapes, with room for one kernel per batch size.

    Dynamo keeps every specialisation of a function under one code object and
    by default stops compiling after 8; past that, flex_attention would run
    unfused (materialising every score). The limit is raised, never lowered.
    """
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, num_batch_sizes + 8)
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def flex_decode_group(
    *,
    num_rows: int,
    block_tables: torch.Tensor,
    num_blocks: torch.Tensor,
    last_block: torch.Tensor,
    last_fill: torch.Tensor,
    block_size: int,
    num_slots: int,
    attend: Callable[..., torch.Tensor],
) -> FlexDecodeGroup:
    """A group over the first ``num_rows`` rows of the static buffers.

    ``block_tables [rows, width]`` int32 (physical block ids, row ``b`` valid
    up to ``num_blocks[b]``), ``num_blocks [rows]`` int32, ``last_block`` and
    ``last_fill [rows]`` long: the row's last block and how many of its slots
    hold context. ``num_slots`` = blocks * block_size of the whole cache.
    """
    from torch.nn.attention.flex_attention import BlockMask

    last_block_rows, last_fill_rows = last_block[:num_rows], last_fill[:num_rows]

    def keep(b, h, q_idx, kv_idx):
        return (kv_idx // block_size != last_block_rows[b]) | (kv_idx % block_size < last_fill_rows[b])

    block_mask = BlockMask.from_kv_blocks(
        num_blocks[:num_rows].view(num_rows, 1, 1),
        block_tables[:num_rows].view(num_rows, 1, 1, -1),
        BLOCK_SIZE=(_Q_TILE, block_size),
        mask_mod=keep,
        seq_lengths=(1, num_slots),
        compute_q_blocks=False,  # inference only: the backward pass's transposed lists are never read
    )
    return FlexDecodeGroup(num_rows, block_mask, attend)


def flex_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: FlexDecodeGroup,
    scaling: float | None,
) -> torch.Tensor:
    """``query [H, T, D]`` (rows ``[0, num_rows)`` are the group's) over one layer's cache: ``[B, H, D]``."""
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
    q = query[:, : group.num_rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    keys = key_cache.view(1, num_kv_heads, -1, head_dim)  # [1, KVH, slots, D]
    values = value_cache.view(1, num_kv_heads, -1, head_dim)
    out = group.attend(
        q, keys, values, block_mask=group.block_mask, scale=scaling, enable_gqa=query.shape[0] != num_kv_heads
    )
    return out[:, :, 0]
