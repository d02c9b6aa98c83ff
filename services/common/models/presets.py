"""Shapes of the built-in random-weight checkpoints (``epd make-model --preset``).

``tiny`` exists for tests: it builds and loads in about a second. ``bench`` has
ViT-B/16 and ~125M-parameter-LM shapes so that timings mean something.
``llava-1.5-7b-random`` has LLaVA-1.5-7B's shapes (CLIP ViT-L/14-336, a
32-layer 4096-wide Llama, llava-hf's 32064-row vocabulary; 7.06B parameters)
for GPU measurements; it is built on CUDA in bfloat16 (about 14 GB) and never
in CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class VisionShape:
    """A CLIP vision tower; ``(image_size // patch_size) ** 2`` patches plus one CLS token."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int


@dataclass(frozen=True)
class TextShape:
    """A Llama decoder; its vocabulary size comes from the trained tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class Preset:
    """Everything that decides a built checkpoint, besides the seed."""

    name: str
    vision: VisionShape
    text: TextShape
    tokenizer_vocab_size: int  # BPE training target, bytes and special tokens included
    corpus_lines: int  # lines of synthetic text the tokenizer is trained on
    # Gain of the LM's attention/MLP weights: how strongly context can overrule the
    # bigram backbone (see init_weights.py). Measured, per shape, by the greedy test.
    context_strength: float
    # LM vocabulary rows; 0 = the tokenizer's size. Rows past the tokenizer's are never sampled.
    lm_vocab_size: int = 0
    # Where the weights are made: "cpu" in float32 (byte-identical for a seed), or
    # "cuda" in bfloat16 for shapes a CPU machine's memory cannot hold in float32.
    build_device: str = "cpu"

    @property
    def num_image_tokens(self) -> int:
        """Embedding rows per image (CLS dropped, as in llava-1.5)."""
        return (self.vision.image_size // self.vision.patch_size) ** 2


TINY = Preset(
    name="tiny",
    vision=VisionShape(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, image_size=32, patch_size=8
    ),
    text=TextShape(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
    ),
    tokenizer_vocab_size=1000,
    corpus_lines=3000,
    context_strength=1.1,
)

BENCH = Preset(
    name="bench",
    vision=VisionShape(
        hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, image_size=224, patch_size=16
    ),
    text=TextShape(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=3072,
        max_position_embeddings=4096,
    ),
    tokenizer_vocab_size=8192,
    corpus_lines=20000,
    context_strength=1.2,
)

LLAVA_15_7B = Preset(
    name="llava-1.5-7b-random",
    vision=VisionShape(
        hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096, image_size=336, patch_size=14
    ),
    text=TextShape(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
    ),
    tokenizer_vocab_size=8192,   # a real BPE like bench's; the LM's other rows are never sampled
    corpus_lines=20000,
    context_strength=1.2,
    lm_vocab_size=32064,
    build_device="cuda",
)

# Read-only view: presets are looked up, never registered at runtime.
PRESETS: MappingProxyType[str, Preset] = MappingProxyType({p.name: p for p in (TINY, BENCH, LLAVA_15_7B)})


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``KeyError`` names the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
