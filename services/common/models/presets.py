"""Shapes of the built-in random-weight checkpoints (``epd make-model --preset``).

``tiny`` exists for tests: it builds and loads in about a second. ``bench`` has
ViT-B/16 and ~125M-parameter-LM shapes so that timings mean something.
``llava-siglip-tiny`` is ``tiny`` with a SigLIP vision tower. The ``qwen2.5-vl-*``
and ``qwen2-vl-tiny`` presets are Qwen2.5-VL / Qwen2-VL checkpoints (dynamic
resolution, multimodal RoPE) of the same two sizes; ``qwen3-vl-*`` are
Qwen3-VL ones (16-pixel patches, DeepStack features, interleaved M-RoPE),
``qwen3-vl-moe-tiny`` its mixture-of-experts variant.
``llava-1.5-7b-random`` has LLaVA-1.5-7B's shapes (CLIP ViT-L/14-336, a
32-layer 4096-wide Llama, llava-hf's 32064-row vocabulary; 7.06B parameters)
for GPU measurements, and ``qwen2.5-vl-7b-random`` Qwen2.5-VL-7B's; both are
built on CUDA in bfloat16 (about 14 and 17 GB) and never in CI.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""Per-channel pixel mean of CLIP (and of Qwen2-VL's towers, which reuse it)."""
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""Per-channel pixel standard deviation of CLIP."""


@dataclass(frozen=True)
class VisionShape:
    """A CLIP (or SigLIP) vision tower; ``(image_size // patch_size) ** 2`` patches (CLIP adds a CLS token)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    kind: str = "clip"  # "clip" (CLS token, dropped) or "siglip" (no CLS token)


@dataclass(frozen=True)
class QwenVisionShape:
    """A Qwen2-VL / Qwen2.5-VL vision tower with dynamic resolution.

    An image is resized (aspect ratio kept) to a multiple of ``patch_size *
    merge_size`` with between ``min_pixels`` and ``max_pixels`` pixels; each
    ``merge_size``x``merge_size`` block of patches becomes one LM token.
    ``window_size`` and ``full_attention_layers`` are Qwen2.5-VL's window attention;
    ``deepstack_layers`` (Qwen3-VL) the tower layers whose merged outputs are
    added to the LM's hidden states after its layers 0, 1, ...; and
    ``num_position_embeddings`` Qwen3-VL's learned position grid (a square).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    min_pixels: int
    max_pixels: int
    merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    deepstack_layers: tuple[int, ...] = ()
    num_position_embeddings: int = 0


@dataclass(frozen=True)
class TextShape:
    """A Llama decoder; its vocabulary size comes from the trained tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    mrope_section: tuple[int, ...] = ()  # Qwen's multimodal RoPE: rotary pairs per axis (t, h, w)
    head_dim: int = 0  # 0 = hidden_size // num_heads
    # Mixture of experts (qwen3_vl_moe): every layer's MLP is num_experts experts, num_experts_per_tok a token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0


@dataclass(frozen=True)
class Preset:
    """Everything that decides a built checkpoint, besides the seed."""

    name: str
    vision: VisionShape | QwenVisionShape
    text: TextShape
    tokenizer_vocab_size: int  # BPE training target, bytes and special tokens included
    corpus_lines: int  # lines of synthetic text the tokenizer is trained on
    # Gain of the LM's attention/MLP weights: how strongly context can overrule the
    # bigram backbone (see init_weights.py). Measured, per shape, by the greedy test.
    context_strength: float
    family: str = "llava"  # config model_type: "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl" or "qwen3_vl_moe"
    # LM vocabulary rows; 0 = the tokenizer's size. Rows past the tokenizer's are never sampled.
    lm_vocab_size: int = 0
    # Where the weights are made: "cpu" in float32 (byte-identical for a seed), or
    # "cuda" in bfloat16 for shapes a CPU machine's memory cannot hold in float32.
    build_device: str = "cpu"

    @property
    def llava_vision(self) -> VisionShape:
        """``vision`` of a LLaVA preset; TypeError for a dynamic-resolution one."""
        if not isinstance(self.vision, VisionShape):
            raise TypeError(f"the {self.name} preset has no fixed-size vision tower")
        return self.vision

    @property
    def qwen_vision(self) -> QwenVisionShape:
        """``vision`` of a Qwen2-VL / Qwen2.5-VL preset; TypeError for a LLaVA one."""
        if not isinstance(self.vision, QwenVisionShape):
            raise TypeError(f"the {self.name} preset has no dynamic-resolution vision tower")
        return self.vision

    @property
    def num_image_tokens(self) -> int:
        """Embedding rows per image of a fixed-size (LLaVA) preset (CLS dropped, as in llava-1.5)."""
        vision = self.llava_vision
        return (vision.image_size // vision.patch_size) ** 2


TINY = Preset(
    name="tiny",
    vision=VisionShape(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, image_size=32, patch_size=8),
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

LLAVA_SIGLIP_TINY = replace(TINY, name="llava-siglip-tiny", vision=replace(TINY.llava_vision, kind="siglip"))

# Qwen's tiny LM rotates fast (small rope_theta) so that every position axis
# visibly changes the output: a wrong height/width position fails the oracle.
_QWEN_TINY_TEXT = replace(TINY.text, rope_theta=100.0, mrope_section=(2, 3, 3))
_QWEN_TINY_VISION = QwenVisionShape(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    patch_size=8,
    min_pixels=16 * 16 * 4,
    max_pixels=16 * 16 * 64,
    window_size=32,
    full_attention_layers=(1,),
)

QWEN2_5_VL_TINY = Preset(
    name="qwen2.5-vl-tiny",
    vision=_QWEN_TINY_VISION,
    text=_QWEN_TINY_TEXT,
    tokenizer_vocab_size=1000,
    corpus_lines=3000,
    # Strong enough that images and their positions change the greedy text
    # (at 1.1 this shape's output ignored M-RoPE positions), with top-2 gaps
    # still far above float noise (tests/unit/models/test_models_greedy.py).
    context_strength=1.25,
    family="qwen2_5_vl",
)

QWEN2_VL_TINY = replace(
    QWEN2_5_VL_TINY,
    name="qwen2-vl-tiny",
    family="qwen2_vl",
    vision=replace(_QWEN_TINY_VISION, window_size=0, full_attention_layers=()),
)

QWEN2_5_VL_BENCH = Preset(
    name="qwen2.5-vl-bench",
    # ViT-B-sized tower with Qwen2.5-VL's 14-pixel patches and 112-pixel windows;
    # a 336x336 image becomes 144 tokens (bench's LLaVA: 196), at most 256.
    vision=QwenVisionShape(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        intermediate_size=3072,
        patch_size=14,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 256,
        window_size=112,
        full_attention_layers=(3, 7, 11),
    ),
    text=replace(BENCH.text, rope_theta=1000000.0, mrope_section=(8, 12, 12)),
    tokenizer_vocab_size=8192,
    corpus_lines=20000,
    context_strength=1.2,
    family="qwen2_5_vl",
)

# Qwen3-VL: 16-pixel patches as the published towers have, three DeepStack
# levels (one per tower layer) injected after the LM's first three layers, and
# the fast-rotating RoPE of the Qwen2.5-VL tiny. Images become 4 to 64 tokens.
_QWEN3_TINY_VISION = QwenVisionShape(
    hidden_size=32,
    num_layers=3,
    num_heads=2,
    intermediate_size=64,
    patch_size=16,
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 64,
    deepstack_layers=(0, 1, 2),
    num_position_embeddings=256,
)
_QWEN3_TINY_TEXT = replace(_QWEN_TINY_TEXT, num_layers=3, head_dim=16)

QWEN3_VL_TINY = Preset(
    name="qwen3-vl-tiny",
    vision=_QWEN3_TINY_VISION,
    text=_QWEN3_TINY_TEXT,
    tokenizer_vocab_size=1000,
    corpus_lines=3000,
    context_strength=1.25,
    family="qwen3_vl",
)

# The same with every MLP a mixture of 8 experts, 2 a token. Its expert width
# (48) differs from the hidden size and from half of it, so the published
# layout's transposed expert tensors can never be read untransposed.
QWEN3_VL_MOE_TINY = replace(
    QWEN3_VL_TINY,
    name="qwen3-vl-moe-tiny",
    family="qwen3_vl_moe",
    text=replace(_QWEN3_TINY_TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
)

QWEN3_VL_BENCH = Preset(
    name="qwen3-vl-bench",
    # ViT-B-sized tower with Qwen3-VL's 16-pixel patches and three DeepStack
    # levels (layers 3, 7, 11, as the 2B model takes 5, 11, 17 of 24): a
    # 336x336 image is resized to 320x320, 100 tokens (10x10 after the 2x2 merge), at most 256.
    vision=QwenVisionShape(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        intermediate_size=3072,
        patch_size=16,
        min_pixels=64 * 64,
        max_pixels=32 * 32 * 256,
        deepstack_layers=(3, 7, 11),
        num_position_embeddings=2304,
    ),
    text=replace(BENCH.text, rope_theta=5000000.0, mrope_section=(12, 10, 10), head_dim=64),
    tokenizer_vocab_size=8192,
    corpus_lines=20000,
    context_strength=1.2,
    family="qwen3_vl",
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
    tokenizer_vocab_size=8192,  # a real BPE like bench's; the LM's other rows are never sampled
    corpus_lines=20000,
    context_strength=1.2,
    lm_vocab_size=32064,
    build_device="cuda",
)

# Qwen2.5-VL-7B-Instruct's shapes (its config.json): a 32-layer 1280-wide tower
# with 112-pixel windows and full attention at layers 7, 15, 23, 31; a 28-layer
# 3584-wide LM with 4 KV heads and a 152064-row vocabulary. Built on CUDA in
# bfloat16 (about 17 GB), never in CI.
QWEN2_5_VL_7B = Preset(
    name="qwen2.5-vl-7b-random",
    vision=QwenVisionShape(
        hidden_size=1280,
        num_layers=32,
        num_heads=16,
        intermediate_size=3420,
        patch_size=14,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
        window_size=112,
        full_attention_layers=(7, 15, 23, 31),
    ),
    text=TextShape(
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        mrope_section=(16, 24, 24),
    ),
    tokenizer_vocab_size=8192,
    corpus_lines=20000,
    context_strength=1.2,
    lm_vocab_size=152064,
    family="qwen2_5_vl",
    build_device="cuda",
)

# Read-only view: presets are looked up, never registered at runtime.
PRESETS: MappingProxyType[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            TINY,
            BENCH,
            LLAVA_SIGLIP_TINY,
            QWEN2_5_VL_TINY,
            QWEN2_VL_TINY,
            QWEN2_5_VL_BENCH,
            QWEN3_VL_TINY,
            QWEN3_VL_MOE_TINY,
            QWEN3_VL_BENCH,
            LLAVA_15_7B,
            QWEN2_5_VL_7B,
        )
    }
)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``KeyError`` names the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
