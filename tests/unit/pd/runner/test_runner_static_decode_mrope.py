"""The static decode path for models with multimodal RoPE (Qwen2-VL, Qwen2.5-VL) on CPU.

Their decode rows carry three rotary positions (t, h, w), which after an image
are the token index shifted by the image's plan. The static buffers hold all
three, so the same step that CUDA captures runs here eagerly and must give the
packed path's tokens exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.models import load_adapter
from services.pd.engine.outputs import ImageSlice, ScheduledChunk, SchedulerOutput
from services.pd.engine.positions import build_plan
from services.pd.engine.request import MultiModalSpan, SamplingParams
from services.pd.runner.decode_graphs import DecodeBuffers
from services.pd.runner.decode_plan import StaticDecodeConfig
from services.pd.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen2.5-vl-tiny", "qwen2-vl-tiny"])
def qwen(request, build_model):
    adapter = load_adapter(build_model(request.param))
    return adapter, adapter.load_language_model(CPU, torch.float32)


def _runner(model, *, static: bool) -> ModelRunner:
    config = StaticDecodeConfig(enabled=static, kernel="ragged", max_num_seqs=4, max_model_len=128)
    return ModelRunner(
        copy.deepcopy(model), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32,
        static_decode=config,
    )  # fmt: skip


def _requests(adapter, seed: int):
    """Three prompts: an image of grid (1, 4, 6) after 5 text tokens, one of (1, 6, 2) after 3,
    and plain text; with their plans, block tables and image embeddings."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:  # plain tokens: below the tiny tokenizers' special ids
        return torch.randint(10, 400, (n,), generator=gen).tolist()

    requests, embeddings = [], {}
    for i, (before, grid, after) in enumerate([(5, (1, 4, 6), 7), (3, (1, 6, 2), 4), (9, None, 0)]):
        count = grid[0] * grid[1] * grid[2] if grid else 0
        prompt = text(before) + [adapter.image_token_id] * count + text(after)
        spans = [MultiModalSpan(f"{i:064d}", before, count, grid)] if grid else []
        slices = [ImageSlice(spans[0].mm_hash, 0, before, count)] if grid else []
        if grid:
            embeddings[spans[0].mm_hash] = torch.randn(count, adapter.hidden_size, generator=gen)
        table = list(range(i, NUM_BLOCKS, 3))[:24]
        requests.append((prompt, build_plan(spans, len(prompt)), table, slices))
    return requests, embeddings


def _generate(runner: ModelRunner, requests, embeddings) -> tuple[list[list[int]], list[list[list[int]]]]:
    """A packed prefill step, then decode steps of every request together; returns the tokens and,
    for each decode step, the positions the static buffers held (when the step took the static path)."""
    chunks = [
        ScheduledChunk(str(i), prompt, 0, table, image_slices=slices, sampling=GREEDY, rope=plan)
        for i, (prompt, plan, table, slices) in enumerate(requests)
    ]
    outputs: list[list[int]] = [[] for _ in requests]
    written = []
    for step in range(NUM_NEW):
        sampled = runner.execute(SchedulerOutput(chunks=chunks), embeddings if step == 0 else {}).sampled
        if step > 0 and runner.static_decoder is not None:
            written.append(runner.static_decoder.buffers.positions[:, : len(requests)].tolist())
        for i, out in enumerate(outputs):
            out.append(sampled[str(i)].token_id)
        chunks = [
            ScheduledChunk(str(i), [out[-1]], len(prompt) + len(out) - 1, table, sampling=GREEDY, rope=plan)
            for i, ((prompt, plan, table, _), out) in enumerate(zip(requests, outputs))
        ]
    return outputs, written


def test_qwen_static_decode_is_token_exact_with_the_packed_path(qwen):
    adapter, model = qwen
    requests, embeddings = _requests(adapter, seed=3)
    packed, _ = _generate(_runner(model, static=False), requests, embeddings)
    runner = _runner(model, static=True)
    assert runner.uses_mrope and runner.decode_paths()["static_decode"]
    assert runner.static_decoder.buffers.positions.shape == (3, 4)
    calls = []
    real_logits = runner.static_decoder.logits
    runner.static_decoder.logits = lambda chunks, positions: (
        calls.append(len(chunks)),
        real_logits(chunks, positions),
    )[1]
    static, written = _generate(runner, requests, embeddings)
    assert calls == [3] * (NUM_NEW - 1)  # every decode step took the static path
    assert static == packed
    # What the buffers held: each row's three plan positions, shifted from the token index after an image.
    for step, positions in enumerate(written):
        for row, (prompt, plan, _, _) in enumerate(requests):
            index = len(prompt) + step
            expected = [[index]] * 3 if plan is None else plan.positions(index, index + 1)
            assert [axis[row] for axis in positions] == [ids[0] for ids in expected]
    image_row = requests[0][1].positions(len(requests[0][0]), len(requests[0][0]) + 1)
    assert image_row[0][0] != len(requests[0][0])  # the image moved the positions: 3-D positions mattered


def test_three_axis_buffers_pad_with_position_zero_and_check_their_axes():
    buffers = DecodeBuffers(max_rows=4, table_width=3, block_size=4, num_blocks=9, pad_block=9, device=CPU, rope_axes=3)
    buffers.fill([ScheduledChunk("a", [42], 5, [7, 3, 8])], [[20], [21], [22]], num_rows=2)
    assert buffers.step_positions(2).tolist() == [[20, 0], [21, 0], [22, 0]]
    assert buffers.token_ids[:2].tolist() == [42, 0] and buffers.slot_mapping[:2].tolist() == [3 * 4 + 1, 9 * 4]
    with pytest.raises(ValueError, match="rotary axes"):
        buffers.fill([ScheduledChunk("a", [42], 5, [7, 3, 8])], [5], num_rows=1)  # one axis for three
