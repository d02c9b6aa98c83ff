"""The CPU linear backends (packed kernel, oneDNN): same numbers as torch, picked at construction."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from services.common import cpu_kernels
from services.common.cpu_linear import (
    KernelLinear,
    OneDnnLinear,
    onednn_works,
    padded_rows,
    resolve_backend,
    use_kernel_linear,
    use_onednn_linear,
)
from services.pd.engine.outputs import ScheduledChunk, SchedulerOutput
from services.pd.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not onednn_works(), reason="this PyTorch build has no oneDNN linear")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def test_switch_keeps_parameters_and_matches_torch():
    model = _model()
    before = {name: p for name, p in model.named_parameters()}
    linear = nn.Linear(64, 32)
    x = torch.randn(2, 7, 64)
    expected = linear(x)
    assert use_onednn_linear(nn.Sequential(linear)) == 1
    assert type(linear) is OneDnnLinear
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    assert use_onednn_linear(model) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    assert {name: p for name, p in model.named_parameters()} == before  # same tensors, same names


def test_rows_are_padded_to_few_buckets_with_little_waste():
    buckets = {padded_rows(n) for n in range(1, 4097)}
    assert len(buckets) <= 16 + 8 * 5  # multiples of 8 to 128, then 8 per doubling
    for n in range(1, 4097):
        assert n <= padded_rows(n) <= max(n + 7, n * 1.125)  # at most 7 rows or 12.5% of padding
        assert padded_rows(padded_rows(n)) == padded_rows(n)


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (2, 65, 64), (129, 64)])
def test_padded_rows_do_not_change_the_real_rows(shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(*shape)
    expected = linear(x)
    use_onednn_linear(nn.Sequential(linear))
    got = linear(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_backend_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.float32) == "kernel"  # the test machine has a C compiler
    assert resolve_backend("onednn", cpu, torch.float32) == "onednn"
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend("auto", cuda, torch.float32) == "torch"
    assert resolve_backend("torch", cpu, torch.float32) == "torch"
    for backend in ("onednn", "kernel"):
        with pytest.raises(ValueError):
            resolve_backend(backend, cuda, torch.float32)
    with pytest.raises(ValueError):
        resolve_backend("kernel", cpu, torch.bfloat16)
    with pytest.raises(ValueError):
        resolve_backend("blas", cpu, torch.float32)


def test_without_a_compiler_auto_falls_back_to_onednn_and_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    cpu_kernels.load_linear.cache_clear()
    try:
        assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "onednn"
        with pytest.raises(ValueError, match="could not be built"):
            resolve_backend("kernel", torch.device("cpu"), torch.float32)
    finally:
        cpu_kernels.load_linear.cache_clear()


def test_kernel_switch_packs_every_linear_and_drops_only_unshared_weights():
    model = _model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many checkpoints are
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        expected = model(x).logits
    kernel = cpu_kernels.load_linear()
    assert kernel is not None
    assert use_kernel_linear(model, kernel) == 2 * 7 + 1
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert model.model.layers[0].self_attn.q_proj.weight is None  # packed away: memory does not double
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the embedding still needs it
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-4, atol=1e-4)


def test_runner_logits_agree_across_backends():
    model = _model()
    runners = {
        backend: ModelRunner(
            copy.deepcopy(model), num_blocks=8, block_size=4, device="cpu", dtype=torch.float32, linear_backend=backend
        )
        for backend in ("torch", "onednn", "kernel")
    }
    assert type(runners["torch"].model.lm_head) is nn.Linear
    assert type(runners["onednn"].model.lm_head) is OneDnnLinear
    assert type(runners["kernel"].model.lm_head) is KernelLinear
    assert (
        ModelRunner(copy.deepcopy(model), num_blocks=8, block_size=4, device="cpu", dtype=torch.float32).linear_backend
        == "kernel"
    )
    step = SchedulerOutput(chunks=[ScheduledChunk("r", list(range(1, 12)), 0, [0, 1, 2])])
    logits = {backend: runner.compute_logits(step, {}) for backend, runner in runners.items()}
    torch.testing.assert_close(logits["onednn"], logits["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits["kernel"], logits["torch"], rtol=1e-4, atol=1e-4)
