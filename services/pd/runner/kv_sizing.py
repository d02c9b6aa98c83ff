"""How many KV blocks a PD gets: from free device memory on CUDA, from a fixed budget on CPU.

CUDA, the rule vLLM users expect: ``gpu_memory_utilization`` is this PD's
own share of the device, whatever other processes use (two PDs on one GPU
take 0.45 each). Note what is in use before the weights load, load them, run
one profiling forward of a whole step (``max_num_batched_tokens`` tokens) to
learn the activations' peak, then the KV cache gets

    gpu_memory_utilization x total - what this PD uses now (weights, buffers)
                                   - the step's transient peak (peak - still allocated)

and never more than is free. The decode CUDA graphs are captured afterwards;
their pool, a few decode steps' activations, comes out of the
``1 - gpu_memory_utilization`` left over.

CPU: ``--kv-cache-memory-mb`` (default 1024), capped at what ``max_num_seqs``
requests at full length could ever use.

Either way the cache must hold one ``max_model_len`` request, or the PD
refuses to start with a message that says which flag to change. An explicit
``--num-kv-blocks`` is taken as given (tests use a tiny pool to force
preemption).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MB = 1024


class KvCacheTooSmall(ValueError):
    """The KV cache could not hold one ``max_model_len`` request."""


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory, in bytes."""

    total: int  # the device's capacity
    used: int  # in use now by every process and allocator (total - free)
    used_before: int  # in use before this PD loaded anything (other processes, the CUDA context)
    peak: int  # this process's allocator peak since the last reset
    current: int  # this process's allocator, allocated now


class MemoryReader(Protocol):
    """Reads a device's memory; the profiling forward runs between ``reset_peak`` and ``read``."""

    def reset_peak(self) -> None: ...

    def read(self) -> DeviceMemory: ...


class CudaMemoryReader:
    """``torch.cuda``'s view of one device; create it before the weights load (it notes what is in use)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        free, total = torch.cuda.mem_get_info(device)
        self._used_before = total - free

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self._device)

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self._device)
        free, total = torch.cuda.mem_get_info(self._device)
        stats = torch.cuda.memory_stats(self._device)
        return DeviceMemory(
            total=total,
            used=total - free,
            used_before=self._used_before,
            peak=stats["allocated_bytes.all.peak"],
            current=stats["allocated_bytes.all.current"],
        )


@dataclass(frozen=True)
class KvSizing:
    """The KV cache a PD starts with."""

    num_blocks: int
    block_size: int
    source: str  # how it was sized, for the log line and the refusal message

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_budget_from_memory(memory: DeviceMemory, utilization: float) -> int:
    """Bytes the KV cache may take (negative when the share, or the device, is already used up)."""
    transient = memory.peak - memory.current
    by_share = int(memory.total * utilization) - (memory.used - memory.used_before) - transient
    return min(by_share, memory.total - memory.used - transient)


def blocks_in_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks the KV manager gets from ``budget_bytes``: one more is the runner's padding block."""
    return max(0, budget_bytes // bytes_per_block - 1)


def check_holds_one_request(sizing: KvSizing, max_model_len: int, hint: str) -> None:
    """Raises ``KvCacheTooSmall`` unless ``sizing`` holds one ``max_model_len``-token request."""
    needed = -(-max_model_len // sizing.block_size)
    if sizing.num_blocks < needed:
        raise KvCacheTooSmall(
            f"the KV cache ({sizing.source}) holds {sizing.num_tokens} tokens, fewer than one "
            f"{max_model_len}-token request (--max-model-len) needs: {hint}"
        )


def size_from_device_memory(
    memory: MemoryReader, *, profile, utilization: float, bytes_per_block: int, block_size: int, max_model_len: int
) -> KvSizing:
    """CUDA: runs ``profile()`` (one full step's forward), then sizes the cache from what is left."""
    memory.reset_peak()
    profile()
    reading = memory.read()
    budget = kv_budget_from_memory(reading, utilization)
    sizing = KvSizing(
        blocks_in_budget(budget, bytes_per_block),
        block_size,
        f"{utilization:g} of {reading.total / 2**30:.1f} GiB, {max(budget, 0) / 2**30:.2f} GiB left for KV",
    )
    check_holds_one_request(
        sizing, max_model_len, "raise --gpu-memory-utilization, lower --max-model-len or free device memory"
    )
    return sizing


def size_from_budget(
    memory_mb: int, *, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int
) -> KvSizing:
    """A fixed budget (``--kv-cache-memory-mb``), never more than every sequence at full length could use."""
    by_memory = blocks_in_budget(memory_mb * 2**20, bytes_per_block)
    by_need = max_num_seqs * -(-max_model_len // block_size)
    sizing = KvSizing(min(by_memory, by_need), block_size, f"--kv-cache-memory-mb {memory_mb}")
    check_holds_one_request(sizing, max_model_len, "raise --kv-cache-memory-mb or lower --max-model-len")
    return sizing


@torch.inference_mode()
def profile_step(model: PreTrainedModel, num_tokens: int, device: torch.device) -> None:
    """One forward of ``num_tokens`` tokens through the LM as loaded (its own attention), and one logits row.

    Its activation peak stands for the engine's largest step: a packed prefill
    of the same number of tokens.
    """
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    model.lm_head(hidden[:, -1])


def size_kv_cache(
    config,
    model: PreTrainedModel,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    memory: MemoryReader | None = None,
) -> KvSizing:
    """The KV cache for ``config`` (a ``PdConfig``) and the loaded LM; raises ``KvCacheTooSmall``.

    ``memory`` reads the device (a ``CudaMemoryReader`` made before the
    weights loaded; None on CPU): without ``--kv-cache-memory-mb`` the cache
    is sized from it, after a profiling forward.
    """
    from services.pd.runner.model_runner import ModelRunner

    block_size = config.block_size
    if config.num_kv_blocks > 0:
        return KvSizing(config.num_kv_blocks, block_size, "--num-kv-blocks")
    bytes_per_block = ModelRunner.kv_bytes_per_block(model.config, block_size, dtype)
    if config.kv_cache_memory_mb == 0 and memory is not None:
        return size_from_device_memory(
            memory,
            profile=lambda: profile_step(model, config.max_num_batched_tokens, device),
            utilization=config.gpu_memory_utilization,
            bytes_per_block=bytes_per_block,
            block_size=block_size,
            max_model_len=max_model_len,
        )
    return size_from_budget(
        config.kv_cache_memory_mb or DEFAULT_CPU_KV_MB,
        bytes_per_block=bytes_per_block,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
    )
