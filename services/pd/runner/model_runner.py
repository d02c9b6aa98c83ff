"""Runs one scheduled step on the HF language model over a paged KV cache.

The runner owns the tensors: the KV cache and the model. A step takes one of
two paths:

- packed (any step): all scheduled tokens of all requests in one
  ``[1, T, hidden]`` batch (token embeddings with image rows spliced in),
  ``model.model`` with the ``epd_paged`` attention (``attention.py``), logits
  only at the last position of each chunk that samples;
- static (decode-only steps, on by default on CUDA): rows padded to a ladder
  of batch sizes, inputs written in place into buffers allocated once, the
  forward replayed from a CUDA graph (``decode_graphs.py``).

Images' rows are spliced into the packed batch (``step_inputs.py``); a model
with DeepStack features (Qwen3-VL) also gets each image slice's feature rows,
added after its first layers (``deepstack.py``). Decode-only steps hold no image.

Both paths get their rotary positions from ``step_position_ids``
(``step_inputs.py``), the one place they are made. Models with multimodal
RoPE (``uses_mrope``: the Qwen2-VL family) get three rows (t, h, w) from each
chunk's plan (``positions.py``), on either path (the static buffers hold
three position rows for them); KV slots stay the absolute token indices.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from services.common.cpu_kernels import load_paged_decode
from services.common.cpu_linear import use_linear_backend
from services.pd.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from services.pd.runner.attention import ATTN_IMPLEMENTATION, METADATA_KWARG, register_paged_attention
from services.pd.runner.attention_metadata import (
    DECODE_PATHS,
    GatherScratch,
    PagedAttentionMetadata,
    build_metadata,
    to_device,
)
from services.pd.runner.decode_graphs import DecodeBuffers, FlexTables, RaggedTables, StaticDecoder, batch_ladder
from services.pd.runner.decode_plan import StaticDecodeConfig, plan_static_decode, start_static_decoder
from services.pd.runner.deepstack import DeepstackRows
from services.pd.runner.flex_decode import flex_available
from services.pd.runner.fused_ops import use_fused_rms_norm, use_fused_silu_mlp
from services.pd.runner.grammar import BitmaskFiller
from services.pd.runner.sampler import Sampler
from services.pd.runner.step_inputs import splice_image_rows, step_position_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
    """``[layers, kv_heads, blocks, block_size, head_dim]`` for a Llama-like config.

    Head-major: one head's rows of a run of consecutive blocks are contiguous,
    which decode attention reads ~30% faster than token-major (bench model).
    """
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return (config.num_hidden_layers, num_kv_heads, num_blocks, block_size, head_dim)


def default_decode_path(device: torch.device, dtype: torch.dtype) -> str:
    """``decode_path="auto"``: the C kernel on CPU in float32 where it loads, ragged otherwise on CPU, padded on GPU."""
    if device.type != "cpu":
        return "padded"
    return "kernel" if dtype == torch.float32 and load_paged_decode() is not None else "ragged"


class ModelRunner:
    """Executes ``SchedulerOutput`` steps: packed or static forward, paged KV, sampling.

    Takes ownership of ``model``: its attention implementation is switched to
    ``epd_paged``, so it can no longer run a plain HF forward. The model must
    already live on ``device`` in ``dtype``; the KV cache is allocated there,
    with one block past ``num_blocks`` that only padded rows of static decode
    steps write to. ``decode_path`` picks the one-query attention of packed
    steps (``attention.py``); ``"auto"`` = the C kernel on CPU (ragged where
    it cannot be built), padded elsewhere.
    ``linear_backend`` picks who runs the linear layers (``cpu_linear.py``);
    ``"auto"`` = for fp32 on CPU the packed C kernel where it builds, else
    oneDNN when it passes its self-check; elsewhere PyTorch's own. ``static_decode`` says how decode-only steps run
    (``decode_plan.py``, ``decode_graphs.py``); on CUDA its graphs are captured here.
    The runner keeps no per-request state (seeded sampling derives its RNG
    from the seed and the output length; a grammar's matcher rides on its
    request), so finished requests need no cleanup.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        sampler: Sampler | None = None,
        decode_path: str = "auto",
        linear_backend: str = "auto",
        static_decode: StaticDecodeConfig | None = None,
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
        # DeepStack feature rows per image token (Qwen3-VL; its adapter sets it): embeddings are then 3-D.
        self.num_deepstack_levels = int(getattr(model, "num_deepstack_levels", 0))
        self.device = torch.device(device)
        self.dtype = dtype
        # See attention.py: on CPU the C kernel where it builds (float32), else
        # ragged attention; on GPU one padded kernel per layer.
        if decode_path == "auto":
            decode_path = default_decode_path(self.device, dtype)
        if decode_path == "kernel" and (self.device.type != "cpu" or dtype != torch.float32 or not load_paged_decode()):
            raise ValueError("decode_path 'kernel' needs float32 on the CPU and a built CPU kernel")
        self.decode_path = decode_path
        use_fused_rms_norm(model)
        use_fused_silu_mlp(model)
        self.linear_backend = use_linear_backend(model, linear_backend, self.device, dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks
        shape = kv_cache_shape(model.config, num_blocks + 1, block_size)
        # Zeros, not empty: padded decode attention reads unused slots under a
        # mask, and 0 * NaN from uninitialised memory would poison the output.
        self.key_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._scratch = GatherScratch(shape[1] * shape[3] * shape[4], dtype, self.device)
        self.sampler = sampler if sampler is not None else Sampler()
        self._masks = BitmaskFiller(int(model.config.vocab_size))
        self.static_decoder = self._start_static_decode(static_decode or StaticDecodeConfig())

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one block across all layers."""
        layers, kv_heads, _, _, head_dim = kv_cache_shape(config, 1, block_size)
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def num_blocks_for_budget(config, budget_bytes: int, *, block_size: int, dtype: torch.dtype) -> int:
        """How many KV blocks fit in ``budget_bytes``."""
        return int(budget_bytes) // ModelRunner.kv_bytes_per_block(config, block_size, dtype)

    # ------------------------------------------------------------ static decode
    def _start_static_decode(self, config: StaticDecodeConfig) -> StaticDecoder | None:
        """Builds (and on CUDA warms up and captures) the static decode path, or None.

        Off unless asked for, or on CUDA. On CUDA without ``--enforce-eager``
        a failure refuses start-up (``DecodePathRefused``); see
        ``plan_static_decode`` for when it only logs a warning instead.
        """
        plan = plan_static_decode(config, self.device, self.block_size)
        if plan is None:
            return None
        return start_static_decoder(functools.partial(self._static_decoder, config), plan)

    def read_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[2 (K, V), layers, kv_heads, len(block_ids), block_size, head_dim]`` on the CPU: what a KV push sends.

        A copy the blocks can be reused after: on the CPU one gather straight into the tensor that is
        sent (no stack, no second copy); on an accelerator a gather there, then one copy to the host."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty(self.kv_push_shape(len(block_ids)), dtype=self.dtype)
        for half, cache in zip(out, (self.key_cache, self.value_cache), strict=True):
            if self.device.type == "cpu":
                torch.index_select(cache, 2, index, out=half)
            else:
                half.copy_(cache.index_select(2, index))
        return out

    def write_kv_blocks(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Writes a received push (``read_kv_blocks``' layout) into ``block_ids``, in place (graphs keep
        their buffers); ValueError for a tensor of another shape or dtype."""
        if kv.dtype != self.dtype or tuple(kv.shape) != self.kv_push_shape(len(block_ids)):
            raise ValueError("the KV push's shape or dtype differs from this server's cache")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.key_cache.index_copy_(2, index, kv[0].to(self.device))
        self.value_cache.index_copy_(2, index, kv[1].to(self.device))

    def kv_push_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of a push of ``num_blocks`` blocks."""
        layers, kv_heads, _, block_size, head_dim = self.key_cache.shape
        return (2, layers, kv_heads, num_blocks, block_size, head_dim)

    def decode_paths(self) -> dict[str, bool]:
        """Which fast decode paths this runner uses (the ready line and ``epd_pd_captured_paths``).

        ``static_decode``: decode-only steps run from static buffers;
        ``flex_kernel``: their attention is the compiled ``flex_attention``;
        ``cuda_graphs``: they are replayed from captured CUDA graphs.
        """
        decoder = self.static_decoder
        return {
            "static_decode": decoder is not None,
            "flex_kernel": decoder is not None and decoder.tables.kernel == "flex",
            "cuda_graphs": decoder is not None and decoder.num_graphs > 0,
        }

    def _static_decoder(self, config: StaticDecodeConfig, kernel: str) -> StaticDecoder:
        if kernel == "flex" and not flex_available():
            raise ValueError("flex_attention with block masks from block lists needs a newer PyTorch")
        sizes = batch_ladder(config.max_num_seqs)
        width = -(-config.max_model_len // self.block_size)
        if kernel == "flex" and self.device.type == "cpu":
            # Inductor's CPU flex template requires the mask to span the whole
            # KV sequence: every block of the cache (tests run it on CPU).
            width = max(width, self.num_blocks + 1)
        buffers = DecodeBuffers(
            max_rows=sizes[-1],
            table_width=width,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            pad_block=self.pad_block,
            device=self.device,
            rope_axes=3 if self.uses_mrope else 1,  # multimodal RoPE: t, h, w per row
        )
        make_tables = FlexTables if kernel == "flex" else RaggedTables
        tables = make_tables(buffers, self.key_cache, self.value_cache, self._scratch, sizes)
        return StaticDecoder(self._forward_tokens, buffers, tables, sizes)

    # -------------------------------------------------------------------- steps
    def prepare_embedding(self, embedding: torch.Tensor) -> torch.Tensor:
        """A received embedding (``[num_tokens, hidden]``, with DeepStack features ``[num_tokens, 1 +
        levels, hidden]``) on this runner's device, in its dtype.

        On CUDA the host tensor is staged in page-locked memory first
        (``to_device``): the copy is queued behind the running step instead
        of being waited for.
        """
        if self.device.type == "cuda" and embedding.device.type == "cpu":
            return to_device(embedding, self.device).to(self.dtype)
        return embedding.to(device=self.device, dtype=self.dtype)

    def execute(
        self,
        scheduler_output: SchedulerOutput,
        embeddings: Mapping[str, torch.Tensor] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step; return a token for every chunk with ``sample``.

        ``embeddings[mm_hash]`` is ``[num_image_tokens, hidden]`` (``[num_image_tokens,
        1 + levels, hidden]`` for a model with DeepStack features) for every
        image sliced into this step's chunks.
        """
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        sampling = [c for c in scheduler_output.chunks if c.sample]
        grammars = [c.grammar for c in sampling]
        # Constrained rows: their masks are filled on the mask thread while the forward runs.
        masks = self._masks.submit(grammars) if any(g is not None for g in grammars) else None
        logits = self.compute_logits(scheduler_output, embeddings or {})
        tokens = self.sampler.sample(
            logits,
            [c.sampling for c in sampling],
            [c.num_output_tokens for c in sampling],
            [c.masked_token_ids for c in sampling],
            [c.history for c in sampling],
            grammar_bitmask=None if masks is None else masks.result(),
            grammar_rows=[i for i, g in enumerate(grammars) if g is not None],
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
        if any(c.num_tokens == 0 for c in chunks):
            raise ValueError("a scheduled chunk has no tokens")
        positions = step_position_ids(chunks, self.uses_mrope)
        sampling_rows, end = [], 0
        for chunk in chunks:
            end += chunk.num_tokens
            if chunk.sample:
                sampling_rows.append(end - 1)
        with torch.inference_mode():
            if self.static_decoder is not None and self.static_decoder.accepts(chunks):
                rows = positions if self.uses_mrope else positions[0]
                logits = self.static_decoder.logits(chunks, rows)  # [len(chunks), vocab]
                return logits if len(sampling_rows) == len(chunks) else logits[self._index(sampling_rows)]
            meta = self._metadata(chunks)
            num_tokens = len(positions[0])
            deepstack = (
                DeepstackRows(self.num_deepstack_levels, num_tokens, self.device) if self.num_deepstack_levels else None
            )
            token_ids = self._index([t for c in chunks for t in c.token_ids])
            embeds = self.model.get_input_embeddings()(token_ids)  # [T, hidden]
            inputs_embeds = splice_image_rows(embeds, chunks, embeddings, deepstack)  # [1, T, hidden]
            position_ids = self._index(positions)  # [1, T] or [3, T]
            if self.uses_mrope:
                position_ids = position_ids[:, None, :]  # [3, 1, T]
            extra = deepstack.forward_kwargs(inputs_embeds.dtype) if deepstack is not None else {}
            hidden = self._hidden(inputs_embeds, position_ids, meta, **extra)  # [T, hidden]
            return self.model.lm_head(hidden[self._index(sampling_rows)])

    def _forward_tokens(
        self, token_ids: torch.Tensor, position_ids: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """Logits of every row: ``token_ids [B]`` at ``position_ids`` (``[B]``, or ``[3, B]`` for multimodal
        RoPE) -> ``[B, vocab]`` (static steps)."""
        inputs_embeds = self.model.get_input_embeddings()(token_ids)[None]
        return self.model.lm_head(self._hidden(inputs_embeds, position_ids[..., None, :], meta))

    def _hidden(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, meta: PagedAttentionMetadata, **extra: object
    ) -> torch.Tensor:
        """The decoder's last hidden states, ``[T, hidden]``, for ``inputs_embeds [1, T, hidden]``
        at ``position_ids`` (``[1, T]``, or ``[3, 1, T]`` for multimodal RoPE); ``extra``: the step's
        DeepStack features (``DeepstackRows.forward_kwargs``)."""
        return self.model.model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, **{METADATA_KWARG: meta}, **extra
        ).last_hidden_state[0]

    def _index(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), self.device)

    def _metadata(self, chunks: list[ScheduledChunk]) -> PagedAttentionMetadata:
        return build_metadata(
            self.key_cache,
            self.value_cache,
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start_pos + c.num_tokens for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            scratch=self._scratch,
            device=self.device,
            decode_path=self.decode_path,
            num_blocks=self.num_blocks,
        )
