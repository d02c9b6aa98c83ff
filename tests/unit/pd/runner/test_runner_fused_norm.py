"""RMSNorm through ``F.rms_norm`` (``fused_norm.py``): switched only where bit-identical to HF's forward."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from services.pd.runner.fused_norm import use_fused_rms_norm


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    return LlamaForCausalLM(config).eval()


def test_every_llama_norm_is_switched_and_the_logits_stay_bit_identical():
    model = _llama()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_()  # not the all-ones init: the weight must take part
    reference = copy.deepcopy(model)
    assert use_fused_rms_norm(model) == 2 * 2 + 1  # two per layer and the final one
    assert use_fused_rms_norm(model) == 0  # a second runner over the same model
    assert all(type(m).__name__ == "FusedLlamaRMSNorm" for m in model.modules() if "RMSNorm" in type(m).__name__)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


class GemmaStyleDoubleRMSNorm(nn.Module):
    """A test double of an RMSNorm with another formula (Gemma's ``1 + weight``): it must be kept."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normed * (1.0 + self.weight)


def test_a_norm_of_another_formula_keeps_its_forward(caplog):
    model = nn.Sequential(GemmaStyleDoubleRMSNorm(16), GemmaStyleDoubleRMSNorm(16))
    caplog.set_level("INFO", logger="services.pd.runner.fused_norm")
    assert use_fused_rms_norm(model) == 0
    assert all(type(m) is GemmaStyleDoubleRMSNorm for m in model)
    assert "HF's forward kept for GemmaStyleDoubleRMSNorm" in caplog.text
