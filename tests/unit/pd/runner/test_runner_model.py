"""ModelRunner + paged attention against HF's own forward / generate() (tiny random Llama, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.pd.engine.outputs import ImageSlice, ScheduledChunk, SchedulerOutput
from services.pd.engine.request import SamplingParams
from services.pd.runner import model_runner as model_runner_module
from services.pd.runner.attention import ATTN_IMPLEMENTATION, METADATA_KWARG
from services.pd.runner.model_runner import ModelRunner, kv_cache_shape

VOCAB = 512
BLOCK_SIZE = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


def _config(**overrides) -> LlamaConfig:
    settings = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(model for the runner, an identical reference that keeps HF's sdpa attention)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # wide gaps between top logits: greedy oracle is robust
    return model, copy.deepcopy(model)


@pytest.fixture(params=["padded", "ragged", "kernel"])
def runner(models, request) -> ModelRunner:
    """A runner per one-query attention path (all run on CPU; the C kernel is built by the test machine's cc)."""
    return ModelRunner(
        models[0],
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype=torch.float32,
        decode_path=request.param,
    )


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_logits(ref: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([token_ids])).logits[0]  # [n, vocab]


def _chunk(rid, tokens, start, blocks, **kw) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, token_ids=tokens, start_pos=start, block_ids=blocks, **kw)


def _step(runner, *chunks, embeddings=None) -> torch.Tensor:
    return runner.compute_logits(SchedulerOutput(chunks=list(chunks)), embeddings or {})


def test_packed_prefill_of_requests_with_different_lengths(runner, models):
    lengths = [9, 1, 17, 4, 12]
    seqs = [_tokens(n, seed) for seed, n in enumerate(lengths)]
    tables = [[11, 3, 40], [7], [0, 30, 2, 91, 5], [60], [8, 9, 10]]
    logits = _step(runner, *(_chunk(str(i), s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))))
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[i], _ref_logits(models[1], seq)[-1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_across_steps_matches_full_forward(runner, models):
    seq = _tokens(23, seed=5)
    blocks = [50, 12, 77, 3, 31, 64]  # out of order, covers 24 tokens
    expected = _ref_logits(models[1], seq)
    for start, end in [(0, 8), (8, 9), (9, 16), (16, 23)]:
        logits = _step(runner, _chunk("r", seq[start:end], start, blocks))
        torch.testing.assert_close(logits[0], expected[end - 1], atol=1e-4, rtol=1e-4)


def test_mixed_step_of_decodes_and_prefill_chunks(runner, models):
    ref = models[1]
    a, b, c, d = _tokens(10, 1), _tokens(6, 2), _tokens(14, 3), _tokens(5, 4)
    ta, tb, tc, td = [4, 9, 1], [20, 21], [33, 2, 90, 15], [70, 71]
    _step(runner, _chunk("a", a[:-1], 0, ta), _chunk("b", b[:-1], 0, tb), _chunk("c", c[:6], 0, tc, sample=False))
    # One step: two decodes, c's second chunk (context offset), d's whole prefill, in mixed order.
    logits = _step(
        runner,
        _chunk("a", a[-1:], 9, ta),
        _chunk("c", c[6:], 6, tc),
        _chunk("b", b[-1:], 5, tb),
        _chunk("d", d, 0, td),
    )
    for row, seq in enumerate([a, c, b, d]):
        torch.testing.assert_close(logits[row], _ref_logits(ref, seq)[-1], atol=1e-4, rtol=1e-4)


def test_interleaved_reversed_block_tables_and_non_sampling_chunks(runner, models):
    a, b = _tokens(15, 6), _tokens(15, 7)
    ta, tb = [9, 7, 5, 3], [8, 6, 4, 2]  # interleaved pool, descending ids
    logits = _step(runner, _chunk("a", a[:11], 0, ta, sample=False), _chunk("b", b[:11], 0, tb))
    assert logits.shape == (1, VOCAB)  # only sampling chunks get logits
    for i in range(11, 15):  # decode both, one token at a time
        logits = _step(runner, _chunk("b", b[i : i + 1], i, tb), _chunk("a", a[i : i + 1], i, ta))
    torch.testing.assert_close(logits[0], _ref_logits(models[1], b)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], _ref_logits(models[1], a)[-1], atol=1e-4, rtol=1e-4)


def test_image_rows_spliced_across_chunks(runner, models):
    ref = models[1]
    image = torch.randn(6, ref.config.hidden_size, generator=torch.Generator().manual_seed(9))
    prompt = _tokens(13, 8)
    prompt[3:9] = [1] * 6  # placeholder tokens for the 6 image rows
    with torch.no_grad():
        embeds = ref.get_input_embeddings()(torch.tensor(prompt))
        embeds[3:9] = image
        expected = ref(inputs_embeds=embeds[None]).logits[0]
    blocks = [17, 4, 60, 22]
    # The first chunk ends inside the image: rows 0..2 now, rows 3..5 next step.
    first = _chunk("r", prompt[:6], 0, blocks, image_slices=[ImageSlice("img", 0, 3, 3)])
    second = _chunk("r", prompt[6:], 6, blocks, image_slices=[ImageSlice("img", 3, 0, 3)])
    torch.testing.assert_close(_step(runner, first, embeddings={"img": image})[0], expected[5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_step(runner, second, embeddings={"img": image})[0], expected[-1], atol=1e-4, rtol=1e-4)


def test_batched_greedy_generation_equals_hf_generate(runner, models):
    ref = models[1]
    prompts = [_tokens(n, 20 + n) for n in (5, 11, 3, 8)]
    num_new = 20
    blocks_per_request = -(-(max(map(len, prompts)) + num_new) // BLOCK_SIZE)
    tables = [list(range(i, NUM_BLOCKS, 4))[:blocks_per_request] for i in range(4)]  # strided pool
    outputs: list[list[int]] = [[] for _ in prompts]
    # Step 0 prefills everything; later steps decode all four together.
    chunks = [_chunk(str(i), p, 0, tables[i], sampling=GREEDY) for i, p in enumerate(prompts)]
    for _ in range(num_new):
        sampled = runner.execute(SchedulerOutput(chunks=chunks), {}).sampled
        for i in range(len(prompts)):
            outputs[i].append(sampled[str(i)].token_id)
        chunks = [
            _chunk(
                str(i),
                [outputs[i][-1]],
                len(p) + len(outputs[i]) - 1,
                tables[i],
                sampling=GREEDY,
                num_output_tokens=len(outputs[i]),
            )
            for i, p in enumerate(prompts)
        ]
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
        assert output == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("decode_path", ["padded", "ragged", "kernel"])
def test_multi_head_attention_with_explicit_head_dim(decode_path):
    # No GQA (kv heads == heads) and head_dim != hidden / heads: the other attention branches.
    torch.manual_seed(1)
    model = LlamaForCausalLM(_config(num_key_value_heads=4, head_dim=8)).eval()
    ref = copy.deepcopy(model)
    runner = ModelRunner(
        model, num_blocks=16, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32, decode_path=decode_path
    )
    a, b = _tokens(11, 30), _tokens(7, 31)
    _step(runner, _chunk("a", a[:5], 0, [3, 1]), _chunk("b", b[:6], 0, [9, 8]))
    logits = _step(runner, _chunk("b", b[6:], 6, [9, 8]), _chunk("a", a[5:], 5, [3, 1, 12]))
    torch.testing.assert_close(logits[0], _ref_logits(ref, b)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], _ref_logits(ref, a)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decodes_ahead_of_prefills_write_their_kv_in_the_kernel(head_dim):
    # The scheduler's order: decodes first, so the CPU kernel writes their new K/V as it attends them and
    # index_copy_ writes only the prefill rows; the next decode step reads back what both wrote.
    torch.manual_seed(2)
    model = LlamaForCausalLM(_config(hidden_size=4 * head_dim, head_dim=head_dim)).eval()
    ref = copy.deepcopy(model)
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32)
    assert runner.decode_path == "kernel"
    a, b, c = _tokens(9, 40), _tokens(7, 41), _tokens(12, 42)
    ta, tb, tc = [5, 2, 7], [11, 3], [20, 21, 22]
    _step(runner, _chunk("a", a[:7], 0, ta), _chunk("b", b[:5], 0, tb), _chunk("c", c[:4], 0, tc, sample=False))
    mixed = [_chunk("a", a[7:8], 7, ta), _chunk("b", b[5:6], 5, tb), _chunk("c", c[4:11], 4, tc)]
    assert runner._metadata(mixed).kernel_writes == 2  # a's and b's rows; c's seven go through index_copy_
    logits = _step(runner, *mixed)
    for row, seq in enumerate([a[:8], b[:6], c[:11]]):
        torch.testing.assert_close(logits[row], _ref_logits(ref, seq)[-1], atol=1e-4, rtol=1e-4)
    logits = _step(runner, _chunk("a", a[8:], 8, ta), _chunk("b", b[6:], 6, tb), _chunk("c", c[11:], 11, tc))
    for row, seq in enumerate([a, b, c]):
        torch.testing.assert_close(logits[row], _ref_logits(ref, seq)[-1], atol=1e-4, rtol=1e-4)


def test_execute_with_empty_step_and_finished_ids(runner):
    out = runner.execute(SchedulerOutput(finished_request_ids=["gone"], preempted_request_ids=["x"]), {})
    assert out.sampled == {}


def test_invalid_block_tables_are_refused(runner):
    with pytest.raises(ValueError, match="cover"):
        _step(runner, _chunk("r", _tokens(9, 1), 0, [1, 2]))  # 9 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match="out of range"):
        _step(runner, _chunk("r", _tokens(3, 1), 0, [NUM_BLOCKS]))


def test_invalid_image_slices_are_refused(runner, models):
    hidden = models[1].config.hidden_size
    tokens = _tokens(6, 3)
    with pytest.raises(KeyError):
        _step(runner, _chunk("r", tokens, 0, [1, 2], image_slices=[ImageSlice("missing", 0, 0, 2)]))
    with pytest.raises(ValueError, match="outside"):
        _step(
            runner,
            _chunk("r", tokens, 0, [1, 2], image_slices=[ImageSlice("i", 0, 5, 2)]),
            embeddings={"i": torch.zeros(4, hidden)},
        )
    with pytest.raises(ValueError, match="shape"):
        _step(
            runner,
            _chunk("r", tokens, 0, [1, 2], image_slices=[ImageSlice("i", 3, 0, 2)]),
            embeddings={"i": torch.zeros(4, hidden)},
        )


def test_decode_path_is_picked_by_device_or_refused(models, monkeypatch):
    model = copy.deepcopy(models[1])
    assert ModelRunner(model, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32).decode_path == "kernel"
    with pytest.raises(ValueError, match="decode_path"):
        ModelRunner(model, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32, decode_path="fast")
    # Where the C kernel cannot be built (no compiler), CPU steps attend in PyTorch instead; asking for it fails.
    monkeypatch.setattr(model_runner_module, "load_paged_decode", lambda: None)
    assert ModelRunner(model, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32).decode_path == "ragged"
    with pytest.raises(ValueError, match="kernel"):
        ModelRunner(model, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32, decode_path="kernel")


def test_attention_without_metadata_fails_loudly(runner):
    assert runner.model.config._attn_implementation == ATTN_IMPLEMENTATION
    with torch.inference_mode(), pytest.raises(RuntimeError, match=METADATA_KWARG):
        runner.model.model(inputs_embeds=torch.zeros(1, 2, 64), use_cache=False)


def test_kv_cache_sizing_from_memory_budget():
    config = _config()
    assert kv_cache_shape(config, 10, 16) == (2, 2, 10, 16, 16)
    per_block = ModelRunner.kv_bytes_per_block(config, 16, torch.float16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2
    assert ModelRunner.num_blocks_for_budget(config, 10 * per_block + 1, block_size=16, dtype=torch.float16) == 10
    assert ModelRunner.num_blocks_for_budget(config, per_block - 1, block_size=16, dtype=torch.float16) == 0


def test_ragged_decode_reads_consecutive_blocks_in_place_and_gathers_the_rest():
    from services.pd.runner.attention_metadata import ragged_decode_group

    group = ragged_decode_group([0, 1, 2], [9, 4, 5], [[6, 7, 8], [3], [2, 9]], 4, "cpu")
    assert group.spans == ((True, 24, 9), (True, 12, 4), (False, 0, 5))
    assert group.block_ids.tolist() == [2, 9]  # only the scattered table


def test_kv_blocks_are_read_as_a_copy_in_push_order_and_written_back(runner):
    generator = torch.Generator().manual_seed(3)
    runner.key_cache.copy_(torch.randn(runner.key_cache.shape, generator=generator))
    runner.value_cache.copy_(torch.randn(runner.value_cache.shape, generator=generator))
    blocks = [7, 2, 3, 40]
    kv = runner.read_kv_blocks(blocks)
    index = torch.tensor(blocks)
    expected = torch.stack((runner.key_cache.index_select(2, index), runner.value_cache.index_select(2, index)))
    assert kv.device.type == "cpu" and kv.is_contiguous() and kv.shape == runner.kv_push_shape(len(blocks))
    assert torch.equal(kv, expected)
    runner.key_cache.zero_()  # the blocks may be reused once read: the copy keeps what was read
    assert torch.equal(kv, expected)
    runner.write_kv_blocks([10, 11, 12, 13], kv)
    assert torch.equal(runner.read_kv_blocks([10, 11, 12, 13]), expected)
