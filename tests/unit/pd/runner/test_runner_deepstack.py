"""DeepStack features through ModelRunner: chunks that split an image and packed steps of several
requests compute what transformers' Qwen3-VL text model computes on each whole prompt."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

from services.common.models.qwen3_vl import Qwen3VLTextForCausalLM
from services.pd.engine.outputs import ScheduledChunk, SchedulerOutput
from services.pd.engine.positions import build_plan
from services.pd.engine.request import MultiModalSpan
from services.pd.engine.spans import image_slices
from services.pd.runner.deepstack import DeepstackRows
from services.pd.runner.model_runner import ModelRunner

HIDDEN, LEVELS, VOCAB, BLOCK_SIZE = 32, 3, 128, 4


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3VLTextForCausalLM, Qwen3VLTextForCausalLM]:
    """(the runner's model, an identical reference that keeps transformers' attention)."""
    torch.manual_seed(0)
    config = Qwen3VLTextConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LEVELS + 1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [1, 1, 2]},
    )
    model = Qwen3VLTextForCausalLM(config).eval()
    model.num_deepstack_levels = LEVELS
    return model, copy.deepcopy(model)


@pytest.fixture
def runner(models) -> ModelRunner:
    return ModelRunner(models[0], num_blocks=64, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32)


class Prompt:
    """A prompt with image spans, their embeddings ``[rows, 1 + levels, hidden]`` and its M-RoPE plan."""

    def __init__(self, name: str, token_ids: list[int], spans: list[MultiModalSpan], seed: int) -> None:
        self.name, self.token_ids, self.spans = name, token_ids, spans
        generator = torch.Generator().manual_seed(seed)
        self.embeddings = {s.mm_hash: torch.randn(s.num_tokens, 1 + LEVELS, HIDDEN, generator=generator) for s in spans}
        self.plan = build_plan(spans, len(token_ids))

    def chunk(self, start: int, end: int, blocks: list[int]) -> ScheduledChunk:
        return ScheduledChunk(
            request_id=self.name,
            token_ids=self.token_ids[start:end],
            start_pos=start,
            block_ids=blocks,
            image_slices=image_slices(self.spans, start, end),
            rope=self.plan,
        )

    def reference_logits(self, model) -> torch.Tensor:
        """transformers' own forward over the whole prompt: image rows spliced in, features added."""
        embeds = model.model.embed_tokens(torch.tensor(self.token_ids))
        visual = torch.zeros(len(self.token_ids), dtype=torch.bool)
        features = []
        for span in self.spans:
            rows = self.embeddings[span.mm_hash]
            for run in span.runs():
                part = rows[run.row : run.row + run.length]
                embeds[run.offset : run.offset + run.length] = part[:, 0]
                visual[run.offset : run.offset + run.length] = True
                features.append((run.offset, part[:, 1:]))
        deep = torch.cat([rows for _, rows in sorted(features, key=lambda item: item[0])])
        positions = torch.tensor(self.plan.positions(0, len(self.token_ids)))[:, None]
        with torch.no_grad():
            return model(
                inputs_embeds=embeds[None],
                position_ids=positions,
                visual_pos_masks=visual[None],
                deepstack_visual_embeds=list(deep.unbind(1)),
            ).logits[0]


def _image_prompt() -> Prompt:
    ids = [3] * 5 + [1] * 12 + [4] * 4  # an image of 3 x 4 tokens at 5..16
    return Prompt("image", ids, [MultiModalSpan("a" * 64, 5, 12, (1, 3, 4))], seed=1)


def _video_prompt() -> Prompt:
    # Qwen3-VL's video: two frames of 2 x 2 tokens, each after its timestamp text.
    ids = [5, 6] + [2] * 4 + [7, 8, 9] + [2] * 4 + [5, 6]
    video = MultiModalSpan("b" * 64, 2, 8, (2, 2, 2), frame_offsets=(2, 9))
    return Prompt("video", ids, [video], seed=2)


def test_chunks_that_split_an_image_add_its_features_where_the_whole_prompt_does(runner, models):
    prompt = _image_prompt()
    want = prompt.reference_logits(models[1])
    blocks = list(range(10, 16))
    for start, end in [(0, 8), (8, 13), (13, 21)]:  # the first two cut the image
        logits = runner.compute_logits(SchedulerOutput(chunks=[prompt.chunk(start, end, blocks)]), prompt.embeddings)
        torch.testing.assert_close(logits[0], want[end - 1], atol=1e-4, rtol=1e-4)


def test_a_packed_step_of_several_requests_adds_each_slice_its_own_features(runner, models):
    image, video = _image_prompt(), _video_prompt()
    embeddings = {**image.embeddings, **video.embeddings}
    step = [image.chunk(0, 10, list(range(20, 26))), video.chunk(0, 11, list(range(30, 34)))]
    first = runner.compute_logits(SchedulerOutput(chunks=step), embeddings)
    # Then the rest of both in one step, the video's second frame and the image's tail packed together.
    step = [video.chunk(11, 15, list(range(30, 34))), image.chunk(10, 21, list(range(20, 26)))]
    second = runner.compute_logits(SchedulerOutput(chunks=step), embeddings)
    image_want, video_want = image.reference_logits(models[1]), video.reference_logits(models[1])
    torch.testing.assert_close(first[0], image_want[9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], video_want[10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], video_want[14], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[1], image_want[20], atol=1e-4, rtol=1e-4)


def test_the_features_change_the_output(runner, models):
    prompt = _image_prompt()
    flat = {h: torch.cat([e[:, :1], torch.zeros_like(e[:, 1:])], dim=1) for h, e in prompt.embeddings.items()}
    chunk = prompt.chunk(0, 21, list(range(40, 46)))
    with_features = runner.compute_logits(SchedulerOutput(chunks=[chunk]), prompt.embeddings)
    without = runner.compute_logits(SchedulerOutput(chunks=[chunk]), flat)
    assert not torch.allclose(with_features, without, atol=1e-3)


def test_an_embedding_without_the_models_features_is_refused(runner):
    prompt = _image_prompt()
    bare = {h: e[:, 0] for h, e in prompt.embeddings.items()}  # [rows, hidden]: no DeepStack levels
    with pytest.raises(ValueError, match="shape"):
        runner.compute_logits(SchedulerOutput(chunks=[prompt.chunk(0, 21, list(range(50, 56)))]), bare)


def test_a_step_without_images_passes_no_features():
    rows = DeepstackRows(LEVELS, 6, torch.device("cpu"))
    assert rows.forward_kwargs(torch.float32) == {}
    with pytest.raises(ValueError, match="levels"):
        rows.add(0, torch.zeros(2, LEVELS + 1, HIDDEN))
