"""Runs one scheduled step on the HF language model over a paged KV cache.

The runner owns the tensors: the KV cache and the model. Each step it packs
all scheduled tokens of all requests into one ``[1, T, hidden]`` batch (token
embeddings with image rows spliced in), runs ``model.model`` with the
``epd_paged`` attention (see ``attention.py``), and computes logits only at
the last position of each chunk that samples. Models with multimodal RoPE
(``uses_mrope``: the Qwen2-VL family) get ``[3, 1, T]`` rotary positions from
each chunk's plan (``positions.py``); KV slots stay the absolute indices.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.pd.attention import (
    ATTN_IMPLEMENTATION,
    DECODE_PATHS,
    METADATA_KWARG,
    GatherScratch,
    PagedAttentionMetadata,
    build_metadata,
    register_paged_attention,
)
from services.pd.cpu_linear import resolve_backend, use_onednn_linear
from services.pd.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from services.pd.sampler import Sampler


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
    """``[layers, kv_heads, blocks, block_size, head_dim]`` for a Llama-like config.

    Head-major: one head's rows of a run of consecutive blocks are contiguous,
    which decode attention reads ~30% faster than token-major (bench model).
    """
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return (config.num_hidden_layers, num_kv_heads, num_blocks, block_size, head_dim)


class ModelRunner:
    """Executes ``SchedulerOutput`` steps: packed forward, paged KV, sampling.

    Takes ownership of ``model``: its attention implementation is switched to
    ``epd_paged``, so it can no longer run a plain HF forward. The model must
    already live on ``device`` in ``dtype``; the KV cache is allocated there.
    ``decode_path`` picks the one-query attention path (``attention.py``);
    ``"auto"`` = ragged on CPU, padded elsewhere. ``linear_backend`` picks who
    runs the linear layers (``cpu_linear.py``); ``"auto"`` = oneDNN for fp32
    on CPU when it passes its self-check, else PyTorch's own.
    The runner keeps no per-request state (seeded sampling derives its RNG
    from the seed and the output length), so finished requests need no cleanup.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        sampler: Sampler | None = None,
        decode_path: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if decode_path not in ("auto", *DECODE_PATHS):
            raise ValueError(f"decode_path must be 'auto' or one of {DECODE_PATHS}")
        register_paged_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError("model does not support a custom attention implementation")
        self.model = model.eval()
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.device = torch.device(device)
        self.dtype = dtype
        # See attention.py: ragged decode attention wins on CPU, one padded
        # kernel per layer wins on GPU.
        if decode_path == "auto":
            decode_path = "ragged" if self.device.type == "cpu" else "padded"
        self.decode_path = decode_path
        self.linear_backend = resolve_backend(linear_backend, self.device, dtype)
        if self.linear_backend == "onednn":
            use_onednn_linear(model)
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = kv_cache_shape(model.config, num_blocks, block_size)
        # Zeros, not empty: padded decode attention reads unused slots under a
        # mask, and 0 * NaN from uninitialised memory would poison the output.
        self.key_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._scratch = GatherScratch(shape[1] * shape[3] * shape[4], dtype, self.device)
        self.sampler = sampler if sampler is not None else Sampler()

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one block across all layers."""
        layers, kv_heads, _, _, head_dim = kv_cache_shape(config, 1, block_size)
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def num_blocks_for_budget(config, budget_bytes: int, *, block_size: int, dtype: torch.dtype) -> int:
        """How many KV blocks fit in ``budget_bytes``."""
        return int(budget_bytes) // ModelRunner.kv_bytes_per_block(config, block_size, dtype)

    def prepare_embedding(self, embedding: torch.Tensor) -> torch.Tensor:
        """A received ``[num_tokens, hidden]`` embedding on this runner's device, in its dtype."""
        return embedding.to(device=self.device, dtype=self.dtype)

    def execute(
        self,
        scheduler_output: SchedulerOutput,
        embeddings: Mapping[str, torch.Tensor] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step; return a token for every chunk with ``sample``.

        ``embeddings[mm_hash]`` is ``[num_image_tokens, hidden]`` for every
        image sliced into this step's chunks.
        """
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        logits = self.compute_logits(scheduler_output, embeddings or {})
        sampling = [c for c in scheduler_output.chunks if c.sample]
        tokens = self.sampler.sample(
            logits, [c.sampling for c in sampling], [c.num_output_tokens for c in sampling]
        )
        return ModelRunnerOutput(sampled={c.request_id: t for c, t in zip(sampling, tokens)})

    def compute_logits(
        self,
        scheduler_output: SchedulerOutput,
        embeddings: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Run the step's forward (writing its KV) and return logits.

        Returns ``[num_sampling_chunks, vocab]`` in chunk order, one row per
        chunk with ``sample``, taken at the chunk's last position.
        """
        chunks = scheduler_output.chunks
        with torch.inference_mode():
            meta = self._metadata(chunks)
            inputs_embeds = self._embed(chunks, embeddings)
            hidden = self.model.model(
                inputs_embeds=inputs_embeds,
                position_ids=self._position_ids(chunks, meta),
                use_cache=False,
                **{METADATA_KWARG: meta},
            ).last_hidden_state                                    # [1, T, hidden]
            last_rows, end = [], 0
            for chunk in chunks:
                end += chunk.num_tokens
                if chunk.sample:
                    last_rows.append(end - 1)
            rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
            return self.model.lm_head(hidden[0, rows])

    def _metadata(self, chunks: list[ScheduledChunk]) -> PagedAttentionMetadata:
        if any(c.num_tokens == 0 for c in chunks):
            raise ValueError("a scheduled chunk has no tokens")
        return build_metadata(
            self.key_cache,
            self.value_cache,
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start_pos + c.num_tokens for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            scratch=self._scratch,
            device=self.device,
            decode_path=self.decode_path,
        )

    def _position_ids(self, chunks: list[ScheduledChunk], meta: PagedAttentionMetadata) -> torch.Tensor:
        """Rotary positions of the packed batch: ``[1, T]``, or ``[3, 1, T]`` for multimodal RoPE."""
        if not self.uses_mrope:
            return meta.positions[None]
        axes: tuple[list[int], list[int], list[int]] = ([], [], [])
        for chunk in chunks:
            start, end = chunk.start_pos, chunk.start_pos + chunk.num_tokens
            if chunk.rope is None:   # text only: every axis is the token index
                for axis in axes:
                    axis.extend(range(start, end))
                continue
            for axis, ids in zip(axes, chunk.rope.positions(start, end)):
                axis.extend(ids)
        positions = torch.tensor(axes, dtype=torch.long)                   # [3, T]
        return positions.to(self.device, non_blocking=True)[:, None, :]

    def _embed(self, chunks: list[ScheduledChunk], embeddings: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Token embeddings of the packed batch with image rows spliced in: ``[1, T, hidden]``."""
        token_ids = [t for c in chunks for t in c.token_ids]
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        embeds = self.model.get_input_embeddings()(ids)                 # [T, hidden]
        row = 0
        for chunk in chunks:
            for image in chunk.image_slices:
                if image.dst_start < 0 or image.dst_start + image.length > chunk.num_tokens:
                    raise ValueError("image slice falls outside its chunk")
                source = embeddings.get(image.mm_hash)
                if source is None:
                    raise KeyError("no embedding for an image scheduled in this step")
                rows = source[image.src_start : image.src_start + image.length]
                if image.src_start < 0 or rows.shape != (image.length, embeds.shape[1]):
                    raise ValueError("image slice does not match its embedding's shape")
                start = row + image.dst_start
                embeds[start : start + image.length] = rows.to(embeds.device, embeds.dtype, non_blocking=True)
            row += chunk.num_tokens
        return embeds[None]
