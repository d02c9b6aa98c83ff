"""KV cache sizing: vLLM's free-memory rule on CUDA (with a memory reader double), a fixed budget
on CPU, and the start-up refusal when one ``max_model_len`` request does not fit."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from services.pd import main as pd_main
from services.pd.config import PdConfig
from services.pd.runner.kv_sizing import (
    DeviceMemory,
    KvCacheTooSmall,
    KvSizing,
    blocks_in_budget,
    check_holds_one_request,
    kv_budget_from_memory,
    size_from_budget,
    size_from_device_memory,
)

GIB = 2**30


class MemoryReaderDouble:
    """Stands in for ``CudaMemoryReader``: reports ``reading`` and records the calls around the profile."""

    def __init__(self, reading: DeviceMemory) -> None:
        self.reading = reading
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> DeviceMemory:
        self.calls.append("read")
        return self.reading


def test_budget_is_this_pds_share_minus_what_it_uses_and_the_step_peak():
    # 80 GiB device, 0.9 allowed = 72; another process held 2 GiB before this PD loaded, this PD
    # now holds 15 more; the profile peaked 6 GiB above what stays allocated.
    memory = DeviceMemory(total=80 * GIB, used=17 * GIB, used_before=2 * GIB, peak=21 * GIB, current=15 * GIB)
    assert kv_budget_from_memory(memory, 0.9) == 72 * GIB - 15 * GIB - 6 * GIB
    # Two PDs of 0.45 on one GPU: the second is not charged for the first one's memory...
    second = DeviceMemory(total=80 * GIB, used=36 * GIB + GIB, used_before=36 * GIB, peak=GIB, current=GIB)
    assert kv_budget_from_memory(second, 0.45) == 36 * GIB - GIB
    # ...but never gets more than is free.
    crowded = DeviceMemory(total=80 * GIB, used=70 * GIB, used_before=60 * GIB, peak=GIB, current=GIB)
    assert kv_budget_from_memory(crowded, 0.9) == 10 * GIB
    assert kv_budget_from_memory(memory, 0.25) < 0
    assert blocks_in_budget(10 * 1000 + 999, 1000) == 9  # one block is the runner's padding block
    assert blocks_in_budget(-5, 1000) == 0


def test_device_memory_sizing_profiles_between_reset_and_read():
    reader = MemoryReaderDouble(DeviceMemory(total=80 * GIB, used=20 * GIB, used_before=0, peak=2 * GIB, current=GIB))
    profiled = []
    sizing = size_from_device_memory(
        reader,
        profile=lambda: profiled.append(reader.calls[:]),
        utilization=0.9,
        bytes_per_block=2**20,
        block_size=16,
        max_model_len=4096,
    )
    assert profiled == [["reset_peak"]] and reader.calls == ["reset_peak", "read"]
    assert sizing.num_blocks == (72 * GIB - 20 * GIB - GIB) // 2**20 - 1
    assert sizing.num_tokens == sizing.num_blocks * 16 and "0.9 of 80.0 GiB" in sizing.source


def test_device_memory_sizing_of_a_loaded_lm_runs_a_real_profiling_forward(tiny_model_dir):
    from services.common.models import load_adapter
    from services.pd.runner.kv_sizing import size_kv_cache

    model = load_adapter(str(tiny_model_dir)).load_language_model(torch.device("cpu"), torch.float32)
    reader = MemoryReaderDouble(DeviceMemory(total=4 * GIB, used=GIB, used_before=0, peak=0, current=0))
    sizing = size_kv_cache(
        PdConfig(model="", max_num_batched_tokens=64), model, torch.device("cpu"), torch.float32, 2048, memory=reader
    )
    assert reader.calls == ["reset_peak", "read"] and "0.9 of 4.0 GiB" in sizing.source
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 heads x 16
    assert sizing.num_blocks == int(2.6 * GIB) // bytes_per_block - 1
    explicit = size_kv_cache(
        PdConfig(model="", num_kv_blocks=7), model, torch.device("cpu"), torch.float32, 2048, memory=reader
    )
    assert explicit.num_blocks == 7 and reader.calls == ["reset_peak", "read"]  # taken as given, nothing read


def test_device_memory_that_cannot_hold_one_request_is_refused():
    reader = MemoryReaderDouble(DeviceMemory(total=16 * GIB, used=14 * GIB, used_before=0, peak=GIB, current=GIB))
    with pytest.raises(KvCacheTooSmall, match="--gpu-memory-utilization") as refusal:
        size_from_device_memory(
            reader, profile=lambda: None, utilization=0.9, bytes_per_block=2**30, block_size=16, max_model_len=4096
        )
    assert "fewer than one 4096-token request" in str(refusal.value)


def test_fixed_budget_is_capped_by_need_and_refused_below_one_request():
    sizing = size_from_budget(1024, bytes_per_block=2**20, block_size=16, max_model_len=128, max_num_seqs=4)
    assert sizing.num_blocks == 4 * 8  # every sequence at full length, no more
    with pytest.raises(KvCacheTooSmall, match="--kv-cache-memory-mb"):
        size_from_budget(8, bytes_per_block=2**20, block_size=16, max_model_len=128, max_num_seqs=4)
    check_holds_one_request(KvSizing(8, 16, "x"), 128, "hint")  # exactly one request fits


def test_a_pd_refuses_to_start_with_a_kv_cache_below_one_request(tiny_model_dir, capfd, monkeypatch):
    # For real on CPU: the tiny LM's 2048-token context needs 128 blocks of 16; 1 MiB holds 127.
    from services.pd.server import build_engine

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # run() configures logging for its process
    monkeypatch.setattr(root, "level", root.level)
    with pytest.raises(KvCacheTooSmall, match="--kv-cache-memory-mb 1"):
        build_engine(PdConfig(model=str(tiny_model_dir), kv_cache_memory_mb=1))
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "-1", "--kv-cache-memory-mb", "1"]
    )
    assert pd_main.run(args) == 2
    assert "pd cannot start: the KV cache (--kv-cache-memory-mb 1) holds 2032 tokens" in capfd.readouterr().err


def test_gpu_flags_reach_the_config_and_impossible_values_are_refused(monkeypatch):
    monkeypatch.delenv("EPD_KV_CACHE_MEMORY_MB", raising=False)  # the suite sets it for the services it starts
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    config = pd_main.config_from_args(parser.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager"]))
    assert config.gpu_memory_utilization == 0.5 and config.enforce_eager
    default = pd_main.config_from_args(parser.parse_args([]))
    assert default.gpu_memory_utilization == 0.9 and not default.enforce_eager and default.kv_cache_memory_mb == 0
    for bad in ({"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5}, {"kv_cache_memory_mb": -1}):
        with pytest.raises(ValueError):
            PdConfig(model="", **bad)
