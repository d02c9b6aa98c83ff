"""The graph-capturable decode path on CPU: static buffers, the padded batch ladder, metadata reuse.

On CUDA the same static step is captured as a CUDA graph and replayed; here
it runs eagerly, which is what lets it be checked token for token against
``generate()`` and against the packed path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.pd.engine.outputs import ImageSlice, ScheduledChunk, SchedulerOutput
from services.pd.engine.request import SamplingParams
from services.pd.runner.decode_graphs import DecodeBuffers, batch_ladder
from services.pd.runner.decode_plan import StaticDecodeConfig
from services.pd.runner.model_runner import ModelRunner

VOCAB = 512
BLOCK_SIZE = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
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
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # wide gaps between top logits: greedy comparisons are robust
    return model


def _runner(model, *, kernel="ragged", max_num_seqs=8, enabled=True, num_blocks=NUM_BLOCKS) -> ModelRunner:
    static = StaticDecodeConfig(enabled=enabled, kernel=kernel, max_num_seqs=max_num_seqs, max_model_len=64)
    return ModelRunner(
        copy.deepcopy(model),
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype=torch.float32,
        static_decode=static,
    )


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_chunks(prompts, outputs, tables) -> list[ScheduledChunk]:
    return [
        ScheduledChunk(str(i), [out[-1]], len(p) + len(out) - 1, tables[i], sampling=GREEDY, num_output_tokens=len(out))
        for i, (p, out) in enumerate(zip(prompts, outputs))
    ]


def _generate(runner: ModelRunner, prompts, tables, num_new: int) -> list[list[int]]:
    """One packed prefill step, then decode steps of every request together."""
    chunks = [ScheduledChunk(str(i), p, 0, tables[i], sampling=GREEDY) for i, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(num_new):
        sampled = runner.execute(SchedulerOutput(chunks=chunks), {}).sampled
        for i, out in enumerate(outputs):
            out.append(sampled[str(i)].token_id)
        chunks = _decode_chunks(prompts, outputs, tables)
    return outputs


def test_batch_ladder_is_coarse_and_ends_at_max_num_seqs():
    assert batch_ladder(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_ladder(40) == (1, 2, 4, 8, 16, 32, 40)
    assert batch_ladder(3) == (1, 2, 3)
    assert batch_ladder(1) == (1,)
    with pytest.raises(ValueError):
        batch_ladder(0)


def test_static_decode_is_token_exact_with_generate_and_reuses_its_buffers(model):
    runner = _runner(model, max_num_seqs=8)
    decoder = runner.static_decoder
    buffers = decoder.buffers
    views = {name: getattr(buffers, name) for name in ("token_ids", "positions", "slot_mapping", "block_tables")}
    pointers = {name: view.data_ptr() for name, view in views.items()}
    calls = []
    real_fill = buffers.fill
    buffers.fill = lambda chunks, positions, rows: (
        calls.append((len(chunks), rows)),
        real_fill(chunks, positions, rows),
    )
    prompts = [_tokens(n, 40 + n) for n in (5, 11, 3, 8, 6)]  # 5 rows: padded to 8
    tables = [list(range(i, NUM_BLOCKS, 5))[:10] for i in range(5)]
    outputs = _generate(runner, prompts, tables, num_new=12)
    assert calls == [(5, 8)] * 11  # every decode step, padded to the ladder
    for name, view in views.items():  # the same buffers, written in place
        assert getattr(buffers, name) is view and view.data_ptr() == pointers[name]
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert output == expected[0, len(prompt) :].tolist()


def test_padded_rows_write_only_the_padding_block(model):
    runner = _runner(model, max_num_seqs=8)
    runner.key_cache.fill_(7.0)  # a sentinel: any write changes it
    prompts = [_tokens(6, 1), _tokens(9, 2), _tokens(4, 3)]
    tables = [[10, 11, 12, 13], [20, 21, 22, 23, 24], [30, 31, 32]]
    _generate(runner, prompts, tables, num_new=4)  # 3 rows padded to 4
    written = (runner.key_cache != 7.0).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    used = {b for table in tables for b in table}
    assert set(written) - used == {runner.pad_block} and runner.pad_block == NUM_BLOCKS


def test_only_decode_only_steps_that_fit_take_the_static_path(model):
    runner = _runner(model, max_num_seqs=2)
    decoder = runner.static_decoder
    one = ScheduledChunk("a", [5], 3, [1])
    assert decoder.accepts([one]) and decoder.accepts([one, one])
    assert not decoder.accepts([one, one, one])  # past the ladder's top
    assert not decoder.accepts([ScheduledChunk("a", [5, 6], 3, [1, 2])])
    assert not decoder.accepts([ScheduledChunk("a", [5], 3, [1], image_slices=[ImageSlice("i", 0, 0, 1)])])
    assert decoder.padded_size(1) == 1 and decoder.padded_size(2) == 2


def test_static_path_is_off_by_default_on_cpu_and_refuses_what_it_cannot_serve(model):
    assert _runner(model, enabled=None).static_decoder is None
    runner = _runner(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="block table"):  # a block outside the KV manager's range
        runner.compute_logits(SchedulerOutput(chunks=[ScheduledChunk("a", [5], 0, [NUM_BLOCKS])]), {})
    with pytest.raises(ValueError, match="block table"):  # a table that does not cover the context
        runner.compute_logits(SchedulerOutput(chunks=[ScheduledChunk("a", [5], 9, [1, 2])]), {})
    with pytest.raises(ValueError, match="flex"):
        runner.static_decoder.capture()  # the ragged kernel cannot be captured
    with pytest.raises(ValueError, match="kernel"):
        StaticDecodeConfig(kernel="fast")


def test_decode_buffers_pad_rows_into_the_padding_block():
    buffers = DecodeBuffers(
        max_rows=4, table_width=3, block_size=4, num_blocks=9, pad_block=9, device=torch.device("cpu")
    )
    buffers.fill([ScheduledChunk("a", [42], 5, [7, 3, 8])], [5], num_rows=2)
    assert buffers.token_ids[:2].tolist() == [42, 0]
    assert buffers.positions[:2].tolist() == [5, 0]
    assert buffers.slot_mapping[:2].tolist() == [3 * 4 + 1, 9 * 4]  # position 5 = block 3, offset 1
    assert buffers.num_blocks[:2].tolist() == [2, 1]
    assert buffers.block_tables[:2].tolist() == [[7, 3, 9], [9, 9, 9]]
    assert buffers.last_block[:2].tolist() == [3, 9] and buffers.last_fill[:2].tolist() == [2, 1]


_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _forbid_host_reads(monkeypatch) -> None:
    """Any read of a tensor's value into Python raises: a CUDA graph capture could not contain it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the static decode forward read a tensor back to the host")

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_flex_kernel_is_token_exact_reuses_its_metadata_and_reads_nothing_back(model, monkeypatch):
    # The GPU kernel, compiled by inductor for CPU here (one batch size: one compile).
    from torch._dynamo.utils import counters

    prompts = [_tokens(n, 60 + n) for n in (7, 4, 10, 5)]
    tables = [list(range(i, NUM_BLOCKS, 4))[:8] for i in range(4)]
    expected = _generate(_runner(model, max_num_seqs=4), prompts, tables, num_new=6)
    runner = _runner(model, kernel="flex", max_num_seqs=4)
    decoder = runner.static_decoder
    compiled_before = counters["stats"]["unique_graphs"]
    seen = []
    forward = decoder._forward

    def guarded(token_ids, positions, meta):
        seen.append(meta)
        with monkeypatch.context() as patch:
            _forbid_host_reads(patch)
            return forward(token_ids, positions, meta)

    decoder.warm_up(sizes=[4])  # compiles the kernel, unguarded
    assert counters["stats"]["unique_graphs"] - compiled_before == 1  # one compile serves every layer
    decoder._forward = guarded
    assert _generate(runner, prompts, tables, num_new=6) == expected
    assert len(seen) == 5 and all(meta is decoder.tables.metadata((), 4) for meta in seen)
    assert counters["stats"]["unique_graphs"] - compiled_before == 1


class _TokenizerDouble:
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"t{t} " for t in token_ids)


def _engine_outputs(model, *, static: bool) -> tuple[dict[str, list[int]], int, int]:
    """A mixed run through the real EngineCore: staggered arrivals, chunked prefill, a shared
    prefix, a KV pool too small for everyone (preemption). Returns (tokens per request,
    preemptions, prefix-hit tokens)."""
    from services.pd.engine.core import EngineCore
    from services.pd.engine.embedding_cache import EmbeddingCache
    from services.pd.engine.kv_cache import KVCacheManager
    from services.pd.engine.outputs import Failed, TokenDelta
    from services.pd.engine.request import Request
    from services.pd.engine.scheduler import Scheduler, SchedulerConfig

    num_blocks = 24
    runner = _runner(model, enabled=static, max_num_seqs=8, num_blocks=num_blocks)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64),
        KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True),
        EmbeddingCache(64),
    )
    core = EngineCore(scheduler=scheduler, runner=runner, tokenizer=_TokenizerDouble(), hidden_size=64)
    shared = _tokens(12, 99)
    prompts = {f"r{i}": (shared if i % 3 == 0 else []) + _tokens(5 + 3 * i, 70 + i) for i in range(7)}
    sampling = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    arrivals = {0: ["r0", "r1", "r2"], 4: ["r3", "r4"], 9: ["r5", "r6"]}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(400):
        for rid in arrivals.get(step, []):
            core.add_request(Request(rid, list(prompts[rid]), sampling))
        for rid, event in core.step().events:
            assert not isinstance(event, Failed), event
            if isinstance(event, TokenDelta):
                outputs[rid] += event.token_ids
        if step > max(arrivals) and not core.has_work():
            break
    core.check_integrity()
    stats = core.stats()
    return outputs, stats.num_preemptions, stats.num_prefix_hit_tokens


def test_static_and_packed_paths_agree_over_a_mixed_run_with_preemption_and_prefix_hits(model):
    packed, packed_preemptions, packed_hits = _engine_outputs(model, static=False)
    static, static_preemptions, static_hits = _engine_outputs(model, static=True)
    assert all(len(tokens) == 14 for tokens in packed.values())
    assert static == packed
    assert static_preemptions == packed_preemptions > 0
    assert static_hits == packed_hits > 0
