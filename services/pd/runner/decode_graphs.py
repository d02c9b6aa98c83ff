"""Decode-only steps from static buffers, padded to a ladder of batch sizes; CUDA graphs on CUDA.

A decode-only step (every chunk one token, no image rows) has a shape known
in advance up to its batch size. Its rows are padded up to the next size of
a ladder (1, 2, 4, 8, then every 16, up to ``max_num_seqs``), and its inputs
(token ids, positions, KV slots, block tables, how full each row's last
block is) are written in place into buffers allocated once for the largest
size. On CUDA the LM forward of every ladder size is captured once at
start-up as a CUDA graph (a warm-up run first, one memory pool shared by all
sizes) and replayed: one launch instead of a few hundred kernel launches per
step, which is where a GPU decode step's time went. Elsewhere, or with
``--enforce-eager``, the same static step runs eagerly. When the path is on,
and whether a failure to build or capture it refuses start-up, is
``decode_plan``'s business.

Padded rows cannot touch real state: each has a context of one token in the
runner's padding block, a block outside the KV manager's range, so its K/V
write lands there, it attends only there, and its logits are never read.

Host to device: each step's inputs are written into one host staging area
per dtype (pinned on CUDA) and copied with ``non_blocking`` copies. Before
the staging is rewritten, the previous step's copies are waited for (an
event; normally long done, since every step reads its sampled tokens back),
so no copy ever reads a half-written staging area.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.pd.engine.outputs import ScheduledChunk
from services.pd.runner.attention_metadata import (
    GatherScratch,
    PagedAttentionMetadata,
    decode_only_metadata,
    ragged_decode_group,
)
from services.pd.runner.flex_decode import compile_flex, flex_decode_group

log = logging.getLogger(__name__)

# (token ids [B], positions [B] or [rope_axes, B], metadata) -> logits [B, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]


def batch_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 4, 8, then every 16, and ``max_num_seqs`` itself.

    Coarse on purpose: a GPU decode step is bound by reading the weights, so a
    padded row costs little, while every size is one more kernel to compile
    and one more graph to capture at start-up.
    """
    if max_num_seqs <= 0:
        raise ValueError("max_num_seqs must be positive")
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return tuple(sorted(sizes))


def is_decode_only(chunks: Sequence[ScheduledChunk]) -> bool:
    """Every chunk is one token with no image row (the shape the static path serves)."""
    return bool(chunks) and all(c.num_tokens == 1 and not c.image_slices for c in chunks)


class DecodeBuffers:
    """The static inputs of a decode-only step, for up to ``max_rows`` rows, allocated once.

    Device views (each row ``b`` of a step; rows past the step's requests are padding):
    ``token_ids``, ``slot_mapping``, ``last_block``, ``last_fill`` ``[max_rows]``
    long; ``positions`` ``[max_rows]`` long, or ``[rope_axes, max_rows]`` for
    multimodal RoPE (the Qwen2-VL family: t, h, w); ``num_blocks
    [max_rows]`` and ``block_tables [max_rows, table_width]`` int32. ``fill``
    rewrites them in place; no step ever allocates a new one.
    """

    _LONG_FIELDS = ("token_ids", "slot_mapping", "last_block", "last_fill")  # then one positions row per axis
    # Rows of ``_long``, bound by name from ``_LONG_FIELDS`` in ``__init__``.
    token_ids: torch.Tensor
    slot_mapping: torch.Tensor
    last_block: torch.Tensor
    last_fill: torch.Tensor

    def __init__(
        self,
        *,
        max_rows: int,
        table_width: int,
        block_size: int,
        num_blocks: int,
        pad_block: int,
        device: torch.device,
        rope_axes: int = 1,
    ) -> None:
        if rope_axes <= 0:
            raise ValueError("rope_axes must be positive")
        self.max_rows, self.table_width, self.rope_axes = max_rows, table_width, rope_axes
        self.block_size, self.num_blocks_limit, self.pad_block = block_size, num_blocks, pad_block
        pin = device.type == "cuda"  # page-locked staging: only CUDA copies gain from it
        num_long = len(self._LONG_FIELDS) + rope_axes
        self._long = torch.zeros(num_long, max_rows, dtype=torch.long, device=device)
        self._int = torch.zeros(max_rows * (1 + table_width), dtype=torch.int32, device=device)
        self._host_long = torch.zeros(self._long.shape, dtype=torch.long, pin_memory=pin)
        self._host_int = torch.zeros(self._int.shape, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # recorded after each step's copies
        for name, row in zip(self._LONG_FIELDS, self._long):
            setattr(self, name, row)
        first = len(self._LONG_FIELDS)
        self.positions = self._long[first] if rope_axes == 1 else self._long[first:]
        self.num_blocks = self._int[:max_rows]
        self.block_tables = self._int[max_rows:].view(max_rows, table_width)
        # numpy views of the staging: per-element writes cost ~1 us instead of a tensor op's ~5.
        self._stage_long = self._host_long.numpy()
        self._stage_num_blocks = self._host_int[:max_rows].numpy()
        self._stage_tables = self._host_int[max_rows:].view(max_rows, table_width).numpy()

    def step_positions(self, num_rows: int) -> torch.Tensor:
        """The positions of a step's first ``num_rows`` rows: ``[num_rows]``, or ``[rope_axes, num_rows]``."""
        return self.positions[..., :num_rows]

    def fill(self, chunks: Sequence[ScheduledChunk], positions: Sequence, num_rows: int) -> None:
        """Writes the rows of ``chunks``, then padding up to ``num_rows``.

        ``positions``: each chunk's rotary position (``Sequence[int]``), or with
        ``rope_axes > 1`` one such sequence per axis (``step_position_ids``'s rows).
        """
        count, block_size = len(chunks), self.block_size
        if count > num_rows or num_rows > self.max_rows:
            raise ValueError("more decode rows than the static buffers hold")
        axes = [positions] if self.rope_axes == 1 else list(positions)
        if len(axes) != self.rope_axes or any(len(axis) < count for axis in axes):
            raise ValueError("decode positions do not match the rows and rotary axes of the static buffers")
        stage, tables, num_blocks = self._stage_long, self._stage_tables, self._stage_num_blocks
        if self._copied is not None:
            self._copied.synchronize()
        pad = (0, self.pad_block * block_size, self.pad_block, 1) + (0,) * self.rope_axes  # token, slot, block, fill
        for field, value in enumerate(pad):
            stage[field, count:num_rows] = value
        tables[:num_rows] = self.pad_block
        num_blocks[count:num_rows] = 1
        first_axis = len(self._LONG_FIELDS)
        for row, chunk in enumerate(chunks):
            kv_position = chunk.start_pos
            used = kv_position // block_size + 1
            blocks = chunk.block_ids[:used]
            in_range = bool(blocks) and min(blocks) >= 0 and max(blocks) < self.num_blocks_limit
            if used > min(len(blocks), self.table_width) or not in_range:
                raise ValueError("a decode row's block table does not cover its context within the KV cache")
            stage[:first_axis, row] = (
                chunk.token_ids[0],
                blocks[-1] * block_size + kv_position % block_size,
                blocks[-1],
                kv_position % block_size + 1,
            )
            for axis, axis_positions in enumerate(axes):
                stage[first_axis + axis, row] = axis_positions[row]
            num_blocks[row] = used
            tables[row, :used] = blocks
        self._long[:, :num_rows].copy_(self._host_long[:, :num_rows], non_blocking=True)
        self.num_blocks[:num_rows].copy_(self._host_int[:num_rows], non_blocking=True)
        start, end = self.max_rows, self.max_rows + num_rows * self.table_width
        self._int[start:end].copy_(self._host_int[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class FlexTables:
    """flex_attention metadata per ladder size, built once over the static buffers (graph-capturable)."""

    kernel = "flex"
    captures = True

    def __init__(
        self, buffers: DecodeBuffers, key_cache, value_cache, scratch: GatherScratch, sizes: Sequence[int]
    ) -> None:
        attend = compile_flex(len(sizes))
        num_slots = key_cache.shape[2] * key_cache.shape[3]
        self._metadata = {
            size: decode_only_metadata(
                key_cache,
                value_cache,
                buffers.slot_mapping[:size],
                flex_decode_group(
                    num_rows=size,
                    block_tables=buffers.block_tables,
                    num_blocks=buffers.num_blocks,
                    last_block=buffers.last_block,
                    last_fill=buffers.last_fill,
                    block_size=buffers.block_size,
                    num_slots=num_slots,
                    attend=attend,
                ),
                scratch,
            )
            for size in sizes
        }

    def metadata(self, chunks: Sequence[ScheduledChunk], num_rows: int) -> PagedAttentionMetadata:
        return self._metadata[num_rows]


class RaggedTables:
    """CPU: the ragged per-row attention, its spans rebuilt from the chunks every step (not capturable)."""

    kernel = "ragged"
    captures = False

    def __init__(
        self, buffers: DecodeBuffers, key_cache, value_cache, scratch: GatherScratch, sizes: Sequence[int]
    ) -> None:
        self._buffers, self._caches, self._scratch = buffers, (key_cache, value_cache), scratch

    def metadata(self, chunks: Sequence[ScheduledChunk], num_rows: int) -> PagedAttentionMetadata:
        buffers = self._buffers
        num_pad = num_rows - len(chunks)
        group = ragged_decode_group(
            list(range(num_rows)),
            [c.start_pos + 1 for c in chunks] + [1] * num_pad,
            [c.block_ids for c in chunks] + [[buffers.pad_block]] * num_pad,
            buffers.block_size,
            buffers.slot_mapping.device,
        )
        return decode_only_metadata(*self._caches, buffers.slot_mapping[:num_rows], group, self._scratch)


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab]: the graph's output, rewritten by every replay


class StaticDecoder:
    """Runs decode-only steps from ``DecodeBuffers``: replayed CUDA graphs when captured, else eagerly."""

    def __init__(
        self, forward: Forward, buffers: DecodeBuffers, tables: FlexTables | RaggedTables, sizes: Sequence[int]
    ) -> None:
        self._forward = forward
        self.buffers = buffers
        self.tables = tables
        self.sizes = tuple(sizes)
        self._graphs: dict[int, _Captured] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def accepts(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether this step is decode-only and fits the largest padded size."""
        return len(chunks) <= self.sizes[-1] and is_decode_only(chunks)

    def padded_size(self, num_rows: int) -> int:
        return next(size for size in self.sizes if size >= num_rows)

    def logits(self, chunks: Sequence[ScheduledChunk], positions: Sequence) -> torch.Tensor:
        """Logits of every chunk, ``[len(chunks), vocab]``, from the static step (``positions``: see
        ``DecodeBuffers.fill``)."""
        num_rows = self.padded_size(len(chunks))
        self.buffers.fill(chunks, positions, num_rows)
        captured = self._graphs.get(num_rows)
        if captured is not None:
            captured.graph.replay()
            return captured.logits[: len(chunks)]
        return self._run(num_rows, chunks)[: len(chunks)]

    def _run(self, num_rows: int, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        buffers = self.buffers
        meta = self.tables.metadata(chunks, num_rows)
        return self._forward(buffers.token_ids[:num_rows], buffers.step_positions(num_rows), meta)

    @torch.inference_mode()
    def warm_up(self, sizes: Sequence[int] | None = None) -> None:
        """Runs each of ``sizes`` (default: the whole ladder) once with padding rows only.

        Compiles the kernels, so that no request meets a cold one; writes only
        the padding block.
        """
        for size in self.sizes if sizes is None else sizes:
            self.buffers.fill((), (), size)
            self._run(size, ())

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the forward of every ladder size as a CUDA graph (call ``warm_up`` first).

        Largest first, so the shared pool is sized by it and smaller graphs
        reuse its memory. Raises on failure, leaving nothing captured.
        """
        if not self.tables.captures:
            raise ValueError("only the flex decode kernel can be captured")
        pool = None
        try:
            for size in reversed(self.sizes):
                self.buffers.fill((), (), size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._run(size, ())
                pool = graph.pool()
                self._graphs[size] = _Captured(graph, logits)
            torch.cuda.synchronize()
        except Exception:
            self._graphs.clear()
            raise
        log.info("captured decode CUDA graphs for batch sizes %s", ",".join(map(str, self.sizes)))
