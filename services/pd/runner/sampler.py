"""Token sampling for one step: masked tokens, penalties, greedy, temperature, min-p, top-k, top-p, logprobs.

Greedy rows are one batched argmax. Random rows share one sort-based min-p /
top-k / top-p filter (``warp``); the draw uses the exponential-race trick (argmax of
``probs / Exp(1)`` is a sample from ``probs``), so each row's noise can come
from wherever it must. Unseeded rows take theirs from one shared generator.
Seeded rows take counter-based noise: a hash of the row's key and each token
id, computed for all seeded rows at once (no generator per row, no loop). The
key is ``step_seed(seed, num_output_tokens)``: the draw for a given token
depends only on the request, never on which other requests share the batch,
and a preempted and recomputed request draws the same tokens again. The
runner therefore keeps no per-request RNG state.

Masked tokens (a request's stop tokens before its ``min_tokens``, see
``Request.masked_token_ids``) get ``-inf`` logits first, for all rows in one
scatter, as transformers' ``MinNewTokensLengthLogitsProcessor`` does; the
``logit_bias`` entries of all rows are added in one more. Then the rows with
a penalty (those with a ``TokenHistory``) are penalised, all at once
(``penalties.py``), and last the rows with a grammar lose the tokens it
forbids, in one bitmask kernel (``grammar.py``). All four change greedy rows
too; each is skipped outright in a step where no row asks for them. The
logprobs still come from the unmodified logits, as vLLM's do by default.

Host to device: each step's per-row settings go up in one copy per dtype,
from page-locked memory on CUDA and without blocking (``to_device``); the only
wait is the one read-back of the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.pd.engine.outputs import SampledToken
from services.pd.engine.request import SamplingParams, TokenHistory
from services.pd.runner.attention_metadata import to_device
from services.pd.runner.grammar import apply_bitmask
from services.pd.runner.penalties import apply_penalties

_MASK_64 = (1 << 64) - 1
_MASK_32 = (1 << 32) - 1
_UNIFORM_BITS = 24  # a float32 mantissa: every uniform is exactly representable


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Seed of the draw for output token ``num_output_tokens`` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + (num_output_tokens + 1) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Samples one token per logits row.

    ``generator`` drives unseeded random rows; by default a fresh,
    nondeterministically seeded one on first use per device.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        masked_token_ids: Sequence[Sequence[int]] | None = None,
        histories: Sequence[TokenHistory | None] | None = None,
        *,
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: Sequence[int] = (),
    ) -> list[SampledToken]:
        """Sample from ``logits [N, vocab]``; row ``i`` uses ``params[i]``.

        ``num_output_tokens[i]`` is how many tokens request ``i`` has generated
        before this one (it picks the seeded draw). ``masked_token_ids[i]``:
        ids row ``i`` must not take (empty for most rows; None = none at all).
        ``histories[i]``: the tokens row ``i``'s penalties look at (None for a
        row without penalties; None = no row has any). ``grammar_bitmask``
        ``[N, ceil(vocab / 32)]`` int32 (host): the tokens each of
        ``grammar_rows`` may take (``runner/grammar.py``).
        """
        if logits.shape[0] != len(params) or len(params) != len(num_output_tokens):
            raise ValueError("logits rows, params and num_output_tokens must have the same length")
        logits = logits.float()
        scores = processed_logits(logits, params, masked_token_ids, histories)
        if grammar_bitmask is not None and grammar_rows:
            # Last, after biases and penalties (vLLM's order): a finite bias never revives a forbidden token.
            scores = apply_bitmask(scores, grammar_bitmask, grammar_rows)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:  # the common step: one argmax, no row indices to upload
            return _with_logprobs(logits, scores.argmax(dim=-1), params)
        token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if greedy_rows:
            rows = _index(greedy_rows, logits.device)
            token_ids[rows] = scores[rows].argmax(dim=-1)
        rows = _index(random_rows, logits.device)
        token_ids[rows] = self._sample_random(
            scores[rows],
            [params[i] for i in random_rows],
            [num_output_tokens[i] for i in random_rows],
        )
        return _with_logprobs(logits, token_ids, params)

    def _sample_random(self, logits, params, num_output_tokens) -> torch.Tensor:
        # One upload of [top_k, key] rows (the floats go up in warp()).
        keys = [step_seed(p.seed, n) if p.seed is not None else 0 for p, n in zip(params, num_output_tokens)]
        longs = to_device(torch.tensor([[p.top_k for p in params], keys], dtype=torch.long), logits.device)
        top_k, row_keys = longs[0], longs[1]
        sorted_logits, sorted_ids = warp(logits, params, top_k)
        probs = sorted_logits.softmax(dim=-1)
        noise = self._exponential_noise(probs, sorted_ids, params, row_keys)
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        return sorted_ids.gather(1, choice).squeeze(1)

    def _exponential_noise(self, probs, sorted_ids, params, row_keys) -> torch.Tensor:
        """``Exp(1)`` noise shaped like ``probs``: counter-based for seeded rows, the shared generator's for others."""
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) == len(params):
            return seeded_exponential(row_keys, sorted_ids)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self._shared_generator(probs.device))
        if seeded:
            rows = _index(seeded, probs.device)
            noise[rows] = seeded_exponential(row_keys[rows], sorted_ids[rows])
        # exponential_ may return exactly 0; keep the division finite.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.seed()
        return self._generator


def processed_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    masked_token_ids: Sequence[Sequence[int]] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """The scores greedy rows take the argmax of and random rows sample from (before temperature).

    vLLM's order: masked ids and logit biases, then penalties. ``logits`` is
    never changed (the logprobs are its); it is returned as is when no row
    asks for any of them.
    """
    if masked_token_ids is not None and len(masked_token_ids) != len(params):
        raise ValueError("masked_token_ids must have one entry per row")
    if histories is not None and len(histories) != len(params):
        raise ValueError("histories must have one entry per row")
    scores = _masked(logits, masked_token_ids) if masked_token_ids is not None else logits
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        scores = _biased(scores, biased, params)
    if histories is not None:
        penalised = [(i, history) for i, history in enumerate(histories) if history is not None]
        if penalised:
            rows = [i for i, _ in penalised]
            scores = apply_penalties(scores, rows, [params[i] for i in rows], [h for _, h in penalised])
    return scores


def warp(
    logits: torch.Tensor, params: Sequence[SamplingParams], top_k: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows' scores as they are drawn from: ``(sorted_logits, sorted_ids)``, each ``[R, vocab]``.

    Temperature, then min_p, top-k and top-p, in vLLM's order (transformers
    applies min_p last; top-k commutes with it, top-p does not). Filtered
    entries are ``-inf``; each row is sorted by logit, descending.
    ``top_k [R]``: the rows' top_k already on the device (uploaded here when None).
    """
    device = logits.device
    # One upload of [temperature, top_p, min_p] rows.
    floats = to_device(torch.tensor([[p.temperature, p.top_p, p.min_p] for p in params]).T.contiguous(), device)
    temperature, top_p, min_p = floats[0], floats[1], floats[2]
    if top_k is None:
        top_k = to_device(torch.tensor([p.top_k for p in params], dtype=torch.long), device)
    sorted_logits, sorted_ids = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    if any(p.min_p > 0.0 for p in params):
        _apply_min_p(sorted_logits, min_p)
    _apply_top_k(sorted_logits, top_k)
    if any(p.top_p < 1.0 for p in params):
        _apply_top_p(sorted_logits, top_p)
    return sorted_logits, sorted_ids


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def _masked(logits: torch.Tensor, masked_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """``logits [N, vocab]`` with ``-inf`` at ``(i, t)`` for every ``t`` in ``masked_token_ids[i]``.

    A copy (the logprobs are the unmasked ones), made only when a row has
    something masked. The (row, id) pairs go up in one copy and are set in
    one scatter, whatever the number of rows.
    """
    rows = [i for i, ids in enumerate(masked_token_ids) if ids]
    if not rows:
        return logits
    pairs = [(i, t) for i in rows for t in masked_token_ids[i]]
    index = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), logits.device)  # [2, num_pairs]
    masked = logits.clone()
    masked[index[0], index[1]] = float("-inf")
    return masked


def _biased(scores: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """``scores`` plus each row's ``logit_bias`` at its token ids (a new tensor).

    All (row, id) pairs go up in one copy, the biases in another, and are
    added in one ``index_put``. Ids are unique within a row.
    """
    pairs = [(i, t) for i in rows for t, _ in params[i].logit_bias]
    biases = [b for i in rows for _, b in params[i].logit_bias]
    index = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), scores.device)  # [2, num_pairs]
    values = to_device(torch.tensor(biases, dtype=scores.dtype), scores.device)
    return scores.index_put((index[0], index[1]), values, accumulate=True)


def seeded_exponential(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``Exp(1)`` noise for token ``token_ids[r, j]`` of row ``r``, a pure function of ``(keys[r], token id)``.

    ``keys [R]`` (63-bit, from ``step_seed``) and ``token_ids [R, V]`` long, on
    one device; returns ``[R, V]`` float32, every value in ``(0, 17.4)``. The
    token id is hashed with the two halves of the key by two rounds of
    murmur3's 32-bit finaliser (a bijection of 32-bit values: within a row no
    two tokens share a uniform unless the vocabulary passes 2**32); the top 24
    bits make a uniform ``u`` in ``(0, 1)``, and ``-log(u)`` is exponential.
    Keyed by token id, not by rank, so the noise belongs to the token.
    """
    low, high = (keys & _MASK_32)[:, None], ((keys >> 32) & _MASK_32)[:, None]
    bits = _fmix32(_fmix32(token_ids ^ low) ^ high) >> (32 - _UNIFORM_BITS)
    uniform = (bits.float() + 0.5) * (1.0 / (1 << _UNIFORM_BITS))
    return -torch.log(uniform)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit values held in int64 (all intermediates stay below 2**49)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for 32-bit ``x`` without overflowing int64 (no signed wrap-around,
    whose result a device's integer kernels need not agree on): the constant in two 16-bit halves."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK_32


def _apply_min_p(sorted_logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens less probable than ``min_p`` times the top token (transformers' ``MinPLogitsWarper``;
    the top token always stays, ``min_p = 0`` keeps all)."""
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits.masked_fill_(probs < min_p[:, None] * probs[:, :1], float("-inf"))


def _apply_top_k(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep the first ``k`` sorted entries per row (``k <= 0`` keeps all); exact under ties."""
    vocab = sorted_logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=sorted_logits.device)
    sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))


def _apply_top_p(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest prefix whose probability mass reaches ``p`` (the top token always)."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))


def _with_logprobs(logits, token_ids, params) -> list[SampledToken]:
    """Attach logprobs of the chosen token and top alternatives where asked.

    Logprobs come from ``log_softmax`` of the unmodified logits (before
    temperature / top-k / top-p), as OpenAI reports them. Everything is read
    back to the host in one go: one wait for the device per step.
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        [ids] = read_back(token_ids)
        return [SampledToken(token_id=t) for t in ids]
    index = _index(rows, logits.device)
    logprobs = logits[index].log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[index][:, None]).squeeze(1)
    num_top = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    ids, chosen, top_values, top_ids = read_back(token_ids, chosen, top_values, top_ids)
    out = [SampledToken(token_id=t) for t in ids]
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = SampledToken(
            token_id=ids[i],
            logprob=chosen[j],
            top_token_ids=tuple(top_ids[j][:n]),
            top_logprobs=tuple(top_values[j][:n]),
        )
    return out


def read_back(*tensors: torch.Tensor) -> list[list]:
    """The tensors as Python lists, with one wait for the device.

    On CUDA each is copied into page-locked host memory without blocking and
    the stream is synchronised once; ``.tolist()`` per tensor would wait once
    per tensor.
    """
    device = tensors[0].device
    if device.type != "cuda":
        return [t.tolist() for t in tensors]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(hosts, tensors):
        host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return [host.tolist() for host in hosts]
