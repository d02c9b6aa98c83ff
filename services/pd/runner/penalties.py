"""Penalties over each row's token history, for every row that uses one in a handful of tensor ops.

vLLM's semantics (``vllm/model_executor/layers/utils.py::apply_penalties``):

- ``repetition_penalty`` ``r`` (1.0 = off): every token seen in the prompt or
  the output has its logit divided by ``r`` when positive and multiplied by
  ``r`` otherwise: transformers' ``RepetitionPenaltyLogitsProcessor``, whose
  ``input_ids`` are prompt and output together;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (0.0 = off),
  OpenAI's: ``logit -= f * count + p * (count > 0)``, where ``count`` is how
  many times the token occurs in the output (the prompt does not count).

The histories of all penalised rows go up to the device in one copy of one
flat id list; the per-row ``[vocab]`` occurrence counts are built there with
one ``index_add_`` (no per-row loop, no padding). Rows without penalties
never reach this module (``Request.penalty_history`` is None for them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from services.pd.engine.request import SamplingParams, TokenHistory
from services.pd.runner.attention_metadata import to_device


def apply_penalties(
    scores: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
) -> torch.Tensor:
    """``scores [N, vocab]`` with rows ``rows`` penalised (row ``rows[j]`` by ``params[j]`` over ``histories[j]``).

    Returns a new tensor; ``scores`` is left as it was. Every token id of a
    history must be below ``vocab``.
    """
    num_rows, vocab = len(rows), scores.shape[1]
    device = scores.device
    prompt_lens = [len(h.prompt_token_ids) for h in histories]
    output_lens = [len(h.output_token_ids) for h in histories]
    flat_ids = list(itertools.chain.from_iterable(itertools.chain(*h) for h in histories))
    num_ids = len(flat_ids)
    if num_ids == 0:  # nothing seen yet (first token, output-only penalties): nothing to penalise
        return scores
    # One upload per dtype: [ids | prompt lengths | output lengths | rows] and [r | f | p] rows.
    longs = to_device(torch.tensor(flat_ids + prompt_lens + output_lens + list(rows), dtype=torch.long), device)
    ids, prompt_len, output_len, row_index = longs.split([num_ids, num_rows, num_rows, num_rows])
    floats = to_device(
        torch.tensor(
            [
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ]
        ),
        device,
    )
    repetition, frequency, presence = floats[0, :, None], floats[1, :, None], floats[2, :, None]
    seen, output_counts = _occurrences(ids, prompt_len, output_len, vocab)
    penalised = scores[row_index]  # [R, vocab], a copy
    factor = torch.where(seen, repetition, 1.0)
    penalised = torch.where(penalised > 0, penalised / factor, penalised * factor)
    penalised -= frequency * output_counts
    penalised -= presence * (output_counts > 0)
    return scores.index_put((row_index,), penalised)


def _occurrences(
    ids: torch.Tensor, prompt_len: torch.Tensor, output_len: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the rows' ids laid end to end (each row's prompt, then its output): ``seen [R, vocab]``
    (bool, in prompt or output) and ``output_counts [R, vocab]`` (float, occurrences in the output)."""
    num_rows, num_ids = prompt_len.shape[0], ids.shape[0]
    lengths = prompt_len + output_len
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=ids.device), lengths, output_size=num_ids)
    starts = lengths.cumsum(0) - lengths
    position = torch.arange(num_ids, device=ids.device) - starts[row_of]  # index within its row's history
    is_output = (position >= prompt_len[row_of]).float()
    flat_index = row_of * vocab + ids
    seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=ids.device).index_fill_(0, flat_index, True)
    counts = torch.zeros(num_rows * vocab, device=ids.device).index_add_(0, flat_index, is_output)
    return seen.view(num_rows, vocab), counts.view(num_rows, vocab)
