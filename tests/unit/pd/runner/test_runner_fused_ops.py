"""Norms and MLPs in one call each (``fused_ops.py``): the C kernels on float32 CPU, ``F.rms_norm`` where it is
bit-identical, HF's forward wherever a probe disagrees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from services.common.cpu_kernels import load_elementwise
from services.pd.runner.fused_ops import use_fused_rms_norm, use_fused_silu_mlp

needs_kernel = pytest.mark.skipif(load_elementwise() is None, reason="no C compiler: the CPU kernels did not build")


def _llama(hidden_act: str = "silu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
        hidden_act=hidden_act,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_()  # not the all-ones init: the weight must take part
    return model


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_without_the_kernel_every_llama_norm_runs_f_rms_norm_bit_identically():
    model = _llama()
    reference = copy.deepcopy(model)
    assert use_fused_rms_norm(model, cpu_kernel=False) == 2 * 2 + 1  # two per layer and the final one
    assert use_fused_rms_norm(model, cpu_kernel=False) == 0  # a second runner over the same model
    assert all(type(m).__name__ == "FusedLlamaRMSNorm" for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert torch.equal(_logits(model), _logits(reference))


@needs_kernel
def test_on_float32_cpu_norms_and_mlps_run_the_kernels_within_a_few_ulps():
    model = _llama()
    reference = copy.deepcopy(model)
    assert use_fused_rms_norm(model) == 5
    assert use_fused_silu_mlp(model) == 2
    assert use_fused_rms_norm(model) == use_fused_silu_mlp(model) == 0  # idempotent
    names = {type(m).__name__ for m in model.modules()}
    assert {"KernelLlamaRMSNorm", "KernelLlamaMLP"} <= names and "LlamaRMSNorm" not in names
    got, want = _logits(model), _logits(reference)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernel
def test_a_switched_module_falls_back_where_the_kernel_does_not_take_the_input():
    model = _llama()
    reference = copy.deepcopy(model)
    use_fused_rms_norm(model)
    use_fused_silu_mlp(model)
    x = torch.randn(3, 64, requires_grad=True)  # autograd: the kernels are inference only
    layer, ref_layer = model.model.layers[0], reference.model.layers[0]
    torch.testing.assert_close(layer.mlp(layer.input_layernorm(x)), ref_layer.mlp(ref_layer.input_layernorm(x)))
    double = copy.deepcopy(layer).double()  # another dtype
    ref_double = copy.deepcopy(ref_layer).double()
    torch.testing.assert_close(
        double.mlp(double.input_layernorm(x.double())), ref_double.mlp(ref_double.input_layernorm(x.double()))
    )


def test_an_mlp_of_another_activation_keeps_its_forward(caplog):
    model = _llama(hidden_act="gelu")
    caplog.set_level("INFO", logger="services.pd.runner.fused_ops")
    assert use_fused_silu_mlp(model) == 0
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)
    if load_elementwise() is not None:
        assert "HF's forward kept for LlamaMLP" in caplog.text


class GemmaStyleDoubleRMSNorm(nn.Module):
    """A test double of an RMSNorm with another formula (Gemma's ``1 + weight``): it must be kept."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normed * (1.0 + self.weight)


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_a_norm_of_another_formula_keeps_its_forward(caplog, cpu_kernel):
    model = nn.Sequential(GemmaStyleDoubleRMSNorm(16), GemmaStyleDoubleRMSNorm(16))
    caplog.set_level("INFO", logger="services.pd.runner.fused_ops")
    assert use_fused_rms_norm(model, cpu_kernel=cpu_kernel) == 0
    assert all(type(m) is GemmaStyleDoubleRMSNorm for m in model)
    assert "HF's forward kept for GemmaStyleDoubleRMSNorm" in caplog.text
