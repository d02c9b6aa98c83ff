"""``epd bench engine``'s ``generate_batch`` baseline across transformers versions: the page size
goes by the name the installed ``ContinuousBatchingConfig`` takes, and a version it cannot run
with is left out with a note instead of a traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from services import cli
from services.bench.engine import hf
from services.bench.engine.runner import Workload


@dataclass
class ConfigOf5_24:  # named after the version whose signature it copies
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None


@dataclass
class ConfigOf5_17:
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None


@dataclass
class ConfigWithoutPages:
    num_blocks: int | None = None
    max_batch_tokens: int | None = None


SIZES = {"page_size": 64, "max_batch_tokens": 128, "num_blocks": 9}


def test_the_page_size_goes_by_the_name_the_installed_config_takes():
    assert hf.batching_config_kwargs(ConfigOf5_24, **SIZES) == (SIZES, "")
    kwargs, _ = hf.batching_config_kwargs(ConfigOf5_17, **SIZES)
    assert kwargs == {"block_size": 64, "max_batch_tokens": 128, "num_blocks": 9}
    assert ConfigOf5_17(**kwargs).block_size == 64  # type: ignore[arg-type]


def test_a_config_it_cannot_size_is_explained_not_called():
    assert hf.batching_config_kwargs(ConfigWithoutPages, **SIZES) == (
        None,
        "ContinuousBatchingConfig takes no page_size/block_size",
    )
    assert hf.batching_config_kwargs(None, **SIZES) == (None, "this transformers has no ContinuousBatchingConfig")


class GenerateBatchModelDouble:
    """Stands in for an HF model: ``generate_batch`` as transformers 5.17 has it (no ``warmup``)."""

    config = SimpleNamespace(pad_token_id=0)

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def set_attn_implementation(self, name: str) -> None:
        pass

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None):
        self.calls.append({"inputs": inputs, "batching": continuous_batching_config})
        n = generation_config.max_new_tokens
        return {str(i): SimpleNamespace(generated_tokens=[7] * n) for i in range(len(inputs))}


def test_generate_batch_runs_with_the_5_17_config_and_without_warmup(monkeypatch):
    monkeypatch.setattr(hf, "_batching_config_class", lambda: ConfigOf5_17)
    model = GenerateBatchModelDouble()
    assert hf.generate_batch_unsupported(model) == ""
    seconds, outputs = hf.run_generate_batch(model, Workload(prompts=[[1, 2, 3], [4, 5]], output_len=4), 256)
    assert outputs == [[7] * 4, [7] * 4] and seconds >= 0
    [call] = model.calls
    assert call["batching"] == ConfigOf5_17(block_size=64, num_blocks=2 * 1 + 4, max_batch_tokens=256)


def test_the_installed_transformers_runs_generate_batch():
    model = SimpleNamespace(generate_batch=GenerateBatchModelDouble().generate_batch)
    assert hf.generate_batch_unsupported(model) == ""  # what this machine has is supported as it is


def test_what_cannot_run_is_named_with_the_version(monkeypatch):
    monkeypatch.setattr(hf, "_batching_config_class", lambda: ConfigWithoutPages)
    why = hf.generate_batch_unsupported(GenerateBatchModelDouble())
    assert why.startswith("transformers ") and why.endswith("ContinuousBatchingConfig takes no page_size/block_size")
    assert "no continuous_batching_config" in hf.generate_batch_unsupported(SimpleNamespace())
    with pytest.raises(ValueError, match="page_size/block_size"):
        hf.run_generate_batch(GenerateBatchModelDouble(), Workload(prompts=[[1]], output_len=1), 8)


def test_bench_engine_skips_a_generate_batch_it_cannot_run_with_a_note(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hf, "_batching_config_class", lambda: ConfigWithoutPages)
    out = tmp_path / "bench.json"
    argv = ["bench", "engine", "--model", str(tiny_model_dir), "--quick", "--json", str(out)]
    skips = ["--skip", "engine", "--skip", "engine_torch_linear", "--skip", "generate", "--skip", "ttft"]
    assert cli.main([*argv, *skips]) == 0
    printed = capsys.readouterr().out
    [note] = [line for line in printed.splitlines() if line.startswith("generate_batch skipped: transformers ")]
    assert note.endswith("takes no page_size/block_size") and "Traceback" not in printed
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"static"}
    assert report["machine"]["generate_batch"].startswith("skipped (transformers ")
