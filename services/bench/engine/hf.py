"""The ``transformers`` baselines of ``epd bench engine``, on the engine's device and dtype.

- ``generate_batch``: HF's continuous batching with its own paged cache;
- ``generate``: ``model.generate()`` one request after another;
- ``static``: one left-padded batch, one prefill forward, then greedy decode
  steps (sdpa, ``DynamicCache``): plain HF code at its best, no scheduler.

Each returns ``(seconds, outputs)``; the clock stops once every token is on
the host (CUDA work is waited for, not just launched).
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.bench.engine.runner import Workload


def load_hf_model(model_dir: str, device: torch.device, dtype: torch.dtype):
    """The LM half of ``model_dir`` as a plain HF causal LM with sdpa attention, in eval mode."""
    from services.common.models import load_adapter

    model = load_adapter(model_dir).load_language_model(device, dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What ``ContinuousBatchingConfig`` calls its KV page size: ``page_size`` in the
# transformers the benchmarks were written with, ``block_size`` in 5.17 (the
# GPU machines'); the first one its signature takes is used.
PAGE_SIZE_PARAMETERS = ("page_size", "block_size")
_BATCHING_PARAMETERS = ("max_batch_tokens", "num_blocks")


def _batching_config_class():
    """transformers' ``ContinuousBatchingConfig``, or None where this version has none."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    return ContinuousBatchingConfig


def _parameters(function) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def batching_config_kwargs(
    config_class, *, page_size: int, max_batch_tokens: int, num_blocks: int
) -> tuple[dict[str, int] | None, str]:
    """The keyword arguments of ``config_class`` (a ``ContinuousBatchingConfig``) for this benchmark.

    Returns ``(kwargs, "")``, or ``(None, why)`` when its signature takes no
    page size or lacks another setting the benchmark needs to size it like the engine.
    """
    if config_class is None:
        return None, "this transformers has no ContinuousBatchingConfig"
    accepted = _parameters(config_class)
    page = next((name for name in PAGE_SIZE_PARAMETERS if name in accepted), None)
    missing = [name for name in _BATCHING_PARAMETERS if name not in accepted]
    if page is None or missing:
        lacks = missing if page is not None else ["/".join(PAGE_SIZE_PARAMETERS), *missing]
        return None, f"ContinuousBatchingConfig takes no {', '.join(lacks)}"
    return {page: page_size, "max_batch_tokens": max_batch_tokens, "num_blocks": num_blocks}, ""


def generate_batch_unsupported(model) -> str:
    """Why ``run_generate_batch`` cannot run with the installed transformers ("" = it can)."""
    import transformers

    version = f"transformers {transformers.__version__}"
    if "continuous_batching_config" not in _parameters(getattr(model, "generate_batch", None)):
        return f"{version}: generate_batch takes no continuous_batching_config"
    kwargs, why = batching_config_kwargs(_batching_config_class(), page_size=64, max_batch_tokens=1, num_blocks=1)
    return "" if kwargs is not None else f"{version}: {why}"


def run_generate_batch(model, workload: Workload, max_batch_tokens: int) -> tuple[float, list[list[int]]]:
    """HF continuous batching, sized like the engine: same token budget, a cache for every request.

    Its defaults (8192-token batches, a cache sized from free memory) were
    10-40x slower on CPU, mostly allocating; page size 64 was its fastest.
    ``warmup=False`` where it takes one: its CUDA graph capture would be
    timed as generation. Check ``generate_batch_unsupported`` first.
    """
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    config = GenerationConfig(
        max_new_tokens=workload.output_len,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=model.config.pad_token_id or 0,
    )
    page_size = 64
    longest = max(map(len, workload.prompts)) + workload.output_len
    config_class = _batching_config_class()
    kwargs, why = batching_config_kwargs(
        config_class,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        num_blocks=len(workload.prompts) * -(-longest // page_size) + 4,
    )
    if kwargs is None:
        raise ValueError(f"generate_batch cannot run here: {why}")
    extra = {"warmup": False} if "warmup" in _parameters(model.generate_batch) else {}
    started = time.perf_counter()
    results = model.generate_batch(
        [list(p) for p in workload.prompts],
        generation_config=config,
        continuous_batching_config=config_class(**kwargs),
        **extra,
    )
    seconds = time.perf_counter() - started
    ordered = list(results.values())  # generate_batch returns them in input order
    return seconds, [list(r.generated_tokens) for r in ordered]


def run_sequential(model, workload: Workload) -> tuple[float, list[list[int]]]:
    """``generate()`` per request, one after another."""
    model.set_attn_implementation("sdpa")
    device = _device(model)
    outputs = []
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in workload.prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=workload.output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id or 0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - started, outputs


def run_static(model, workload: Workload) -> tuple[float, list[list[int]]]:
    """One left-padded batch: one prefill forward, then ``output_len - 1`` greedy decode steps."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    device = _device(model)
    batch, width = len(workload.prompts), max(map(len, workload.prompts))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(workload.prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    _wait(device)
    started = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        tokens = [logits[:, -1].argmax(-1)]
        positions = positions[:, -1:]
        for _ in range(workload.output_len - 1):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = positions + 1
            logits = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits
            tokens.append(logits[:, -1].argmax(-1))
        generated = torch.stack(tokens, dim=1).tolist()  # waits for the device
    return time.perf_counter() - started, generated
