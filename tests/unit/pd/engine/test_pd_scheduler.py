"""Scheduler policy (budget, chunking, images, preemption, prefix hits), driven through the real engine core.

See ``scheduler_harness.py``: hand-made model outputs, no model, no torch.
"""

from __future__ import annotations

import pytest
from scheduler_harness import EOS, IMG, OTHER_EOS, TOKEN, chunk_of, force_preempt, refusal

from services.pd.engine import slo
from services.pd.engine.errors import ErrorKind
from services.pd.engine.request import RequestStatus


def test_chunked_prefill_then_decode(make):
    h = make(budget=4)
    request = h.add("a", range(10, 20), max_tokens=3)
    sizes = []
    for _ in range(3):
        out, _ = h.step()
        sizes.append((chunk_of(out, "a").start_pos, chunk_of(out, "a").num_tokens, chunk_of(out, "a").sample))
    assert sizes == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert request.output_token_ids == [TOKEN] and request.timings.first_token is not None
    out, _ = h.step()
    assert chunk_of(out, "a").token_ids == [TOKEN] and chunk_of(out, "a").start_pos == 10
    _, finished = h.step()
    assert finished == [request] and request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [TOKEN] * 3
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert h.sched.schedule().finished_request_ids == ["a"]


def test_decodes_and_prefill_share_the_budget(make):
    h = make(budget=8)
    h.add("a", range(5), max_tokens=10)
    h.step()  # a prefills, samples
    h.add("b", range(100, 130))
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_admission(make):
    h = make(max_num_seqs=2, budget=64)
    for i in range(3):
        h.add(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=2)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    h.step()  # r0, r1 finish (2 tokens)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["r2"]


def test_a_prefill_budget_caps_prefill_chunks_and_never_decodes(make):
    h = make(budget=16)
    h.add("a", range(5), max_tokens=10)
    h.add("b", range(20, 25), max_tokens=10)
    h.step()  # both prefill and sample
    h.add("c", range(100, 130))
    out, _ = h.step(prefill_budget=3)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 3)]
    h.add("d", range(200, 204))
    out, _ = h.step(prefill_budget=0)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    # Held back by the budget, not blocked on an image; nothing admitted.
    assert h.requests["c"].status is RequestStatus.RUNNING and h.requests["d"].status is RequestStatus.WAITING
    out, _ = h.step()  # the step budget alone
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 14)]
    h.run()


def test_a_spent_prefill_share_holds_a_prefilling_request_back(make):
    h = make(budget=64)
    h.add("a", range(10, 22), max_tokens=10)
    h.add("b", [3] * 4 + [IMG] * 6 + [4] * 10, spans=[("x", 4, 6)])  # stops before its image
    h.add("c", range(100, 180))  # 80 tokens: a partial chunk
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 12), ("b", 4), ("c", 48)]
    h.push("b", "x")
    out, _ = h.step(prefill_budget=5)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 5)]
    assert h.requests["c"].status is RequestStatus.RUNNING
    out, _ = h.step(prefill_budget=40)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 11), ("c", 29)]
    h.run()


def test_text_prefills_while_image_encodes_then_resumes(h):
    prompt = [5, 6, 7, 8, 9, 10] + [IMG] * 8 + [11, 12, 13]
    request = h.add("a", prompt, spans=[("cat", 6, 8)], max_tokens=2)
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert (chunk.start_pos, chunk.num_tokens, chunk.sample, chunk.image_slices) == (0, 6, False, [])
    h.clock.now = 1.0
    out, _ = h.step()
    assert out.is_empty and request.status is RequestStatus.WAITING_FOR_EMBEDDING
    h.clock.now = 3.0
    h.push("a", "cat")
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert (chunk.start_pos, chunk.num_tokens, chunk.sample) == (6, 11, True)
    [image] = chunk.image_slices
    assert (image.mm_hash, image.src_start, image.dst_start, image.length) == ("cat", 0, 0, 8)
    assert request.status is RequestStatus.RUNNING
    assert request.timings.embedding_wait_s == pytest.approx(2.0)
    # Computed into cached K/V: the blocks through the image are pinned in place of the embedding.
    assert request.span_refs == set() and h.emb.ref_count("cat") == 0
    assert h.kv.num_pinned_blocks == h.kv.num_blocks_for(14)
    h.run()
    assert h.emb.is_ready("cat") and h.emb.ref_count("cat") == 0  # stays cached for reuse


def test_an_arriving_image_ends_the_wait_of_the_prompts_it_blocked_at_once(h):
    # Blocked prompts are not waiting prompts for the step budget (slo.pending_prompts);
    # once their image is here they are, before the scheduler reaches them.
    first = h.add("a", [IMG] * 8 + [1, 2], spans=[("cat", 0, 8)])
    second = h.add("b", [IMG] * 8 + [3, 4], spans=[("cow", 0, 8)])
    other = h.add("c", [5] + [IMG] * 8 + [6], spans=[("dog", 1, 8)])
    h.clock.now = 1.0
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("c", 1)]
    h.clock.now = 2.0
    assert h.step()[0].is_empty
    assert all(r.timings.embedding_wait_since is not None for r in (first, second, other))
    h.clock.now = 4.0
    h.push("a", "cat")
    h.push("b", "cow")
    assert first.timings.embedding_wait_since is None and second.timings.embedding_wait_since is None
    assert first.timings.embedding_wait_s == pytest.approx(3.0)
    assert other.timings.embedding_wait_since == pytest.approx(2.0)  # still blocked on its own image
    queue = slo.pending_prompts([first, second, other], 4.0, lambda _: 10.0)
    assert [prompt.num_tokens for prompt in queue] == [10, 10]
    h.push("c", "dog")
    h.run()


def test_image_first_request_waits_while_others_go_ahead(h):
    blocked = h.add("img", [IMG] * 4 + [1, 2], spans=[("cat", 0, 4)])
    h.add("txt", [3, 4, 5])
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["txt"]
    assert blocked.status is RequestStatus.WAITING_FOR_EMBEDDING and not blocked.block_ids
    assert list(h.sched.waiting) == [blocked]
    h.push("img", "cat")
    out, _ = h.step()
    assert chunk_of(out, "img").num_tokens == 6
    h.run()


def test_chunk_splits_an_image_span(make):
    h = make(budget=5)
    prompt = [1, 2] + [IMG] * 8 + [3]
    h.add("a", prompt, spans=[("cat", 2, 8)], ready=["cat"])
    slices = []
    for _ in range(3):
        out, _ = h.step()
        slices.append([(s.src_start, s.dst_start, s.length) for s in chunk_of(out, "a").image_slices])
    assert slices == [[(0, 2, 3)], [(3, 0, 5)], []]


def test_two_images_in_one_chunk_and_partial_readiness(make):
    h = make(budget=64)
    prompt = [1] + [IMG] * 3 + [2] + [IMG] * 3 + [3]
    request = h.add("a", prompt, spans=[("x", 1, 3), ("y", 5, 3)], ready=["x"])
    out, _ = h.step()
    assert chunk_of(out, "a").num_tokens == 5  # up to the unready second image
    assert h.emb.ref_count("x") == 1 and h.emb.ref_count("y") == 1
    h.push("a", "y")
    out, _ = h.step()
    assert [(s.mm_hash, s.dst_start) for s in chunk_of(out, "a").image_slices] == [("y", 0)]
    assert request.span_refs == set()  # both computed: pinned K/V stands in for them
    assert h.kv.num_pinned_blocks == h.kv.num_blocks_for(8)
    h.run()
    assert h.emb.ref_count("x") == h.emb.ref_count("y") == 0


def test_same_image_twice_in_a_prompt(h):
    prompt = [1] + [IMG] * 2 + [2] + [IMG] * 2 + [3]
    h.add("a", prompt, spans=[("x", 1, 2), ("x", 4, 2)], ready=["x"])
    h.check()
    assert h.emb.ref_count("x") == 2
    h.run()
    assert h.emb.ref_count("x") == 0


def test_preempts_newest_and_admits_nothing_in_that_step(make):
    h = make(num_blocks=7, block_size=4, budget=64)
    old = h.add("old", range(8), max_tokens=20)
    new = h.add("new", range(100, 108), max_tokens=20)
    h.step()  # 2 blocks each, 3 free
    late = h.add("late", range(200, 205), max_tokens=1)  # needs 2 blocks: no room once both decode
    for _ in range(10):
        out, _ = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["new"]
    assert [c.request_id for c in out.chunks] == ["old"]  # no admission in a preempting step ...
    assert h.kv.num_free_blocks >= 2  # ... although late would fit now
    assert new.status is RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert h.sched.num_preemptions == 1
    assert new.block_ids == [] and new.num_computed_tokens == 0
    assert list(h.sched.waiting) == [new, late] and late.status is RequestStatus.WAITING
    outputs_before = list(new.output_token_ids)
    finished = h.run(max_steps=400)
    assert {r.request_id for r in finished} == {"old", "new", "late"}
    assert new.output_token_ids[: len(outputs_before)] == outputs_before
    assert len(old.output_token_ids) == len(new.output_token_ids) == 20


def test_the_newest_request_preempts_itself_when_it_runs_out(make):
    h = make(num_blocks=4, block_size=4, budget=64)
    a = h.add("a", range(6), max_tokens=2)  # 2 blocks, room up to position 7
    b = h.add("b", range(100, 108), max_tokens=4)  # 2 full blocks
    h.step()
    out, _ = h.step()  # b's decode needs a 5th block
    assert out.preempted_request_ids == ["b"] and [c.request_id for c in out.chunks] == ["a"]
    assert b.status is RequestStatus.PREEMPTED
    h.run()
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert len(b.output_token_ids) == 4


def test_image_cache_is_not_held_hostage_by_requests_past_their_prefill(make):
    """Second review, 5: a request held its images' embeddings until it ended, so a few long requests
    filled PD's embedding cache and every other image request got 503 while they ran. Once its
    images are computed, the cached K/V through them is pinned instead, and a preempted request
    recomputes from it."""
    h = make(num_blocks=8, block_size=4, budget=64, embedding_tokens=8)
    prompt = [1, 2, 3, 4] + [IMG] * 8 + [5]
    request = h.add("a", prompt, spans=[("cat", 4, 8)], ready=["cat"], max_tokens=8)
    h.step()
    assert h.emb.ref_count("cat") == 0 and h.kv.num_pinned_blocks == 3  # blocks 0-2 hold the image's K/V
    h.add("b", [IMG] * 8 + [9], spans=[("dog", 0, 8)], ready=["dog"])  # was RESOURCE_EXHAUSTED
    assert h.evicted == ["cat"]
    force_preempt(h, request)
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert chunk.start_pos == 12 and chunk.image_slices == []  # recomputed from the pinned K/V
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 8


def test_a_preempted_request_whose_images_are_still_cached_takes_them_back_and_frees_its_pins(make):
    h = make(num_blocks=6, block_size=4, budget=64)
    text = h.add("c", list(range(1, 9)), max_tokens=12)
    image = h.add("a", [1, 2, 3, 4] + [IMG] * 4 + [5], spans=[("cat", 4, 4)], ready=["cat"], max_tokens=8)
    h.step()
    assert h.emb.ref_count("cat") == 0 and h.kv.num_pinned_blocks == 2
    while image.status is not RequestStatus.PREEMPTED:  # "c" grows until it needs the newest one's room
        h.step()
    assert image.span_refs == {0} and h.emb.ref_count("cat") == 1 and h.kv.num_pinned_blocks == 0
    h.run()
    assert text.status is image.status is RequestStatus.FINISHED_LENGTH


def test_a_preempted_image_request_recomputes_its_image(make):
    """Its KV is gone (no prefix caching) and another image wants the room: it still finishes."""
    h = make(num_blocks=8, block_size=4, budget=64, embedding_tokens=8, prefix_caching=False)
    prompt = [1, 2, 3, 4] + [IMG] * 8 + [5]
    request = h.add("a", prompt, spans=[("cat", 4, 8)], ready=["cat"], max_tokens=8)
    h.step()
    force_preempt(h, request)
    assert refusal(h, "b", [IMG] * 8 + [9], spans=[("dog", 0, 8)]).kind is ErrorKind.RESOURCE_EXHAUSTED
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert chunk.start_pos == 0 and [(s.mm_hash, s.length) for s in chunk.image_slices] == [("cat", 8)]
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 8


def test_prefix_hit_sets_cached_tokens_and_skips_compute(h):
    a = h.add("a", range(13), max_tokens=1)
    h.run()
    b = h.add("b", list(range(13)) + [50, 51], max_tokens=1)
    out, _ = h.step()
    assert b.num_cached_tokens == 12 and chunk_of(out, "b").start_pos == 12
    assert chunk_of(out, "b").num_tokens == 3
    assert a.num_cached_tokens == 0
    assert h.sched.num_prefix_hit_tokens == 12
    h.run()


def test_prefix_hit_with_images(h):
    prompt = [1, 2] + [IMG] * 8 + [3, 4, 5]
    h.add("a", prompt, spans=[("cat", 2, 8)], ready=["cat"], max_tokens=1)
    h.run()
    other = h.add("b", prompt, spans=[("dog", 2, 8)], ready=["dog"], max_tokens=1)
    same = h.add("c", prompt, spans=[("cat", 2, 8)], max_tokens=1)  # cat is READY: pinned
    out, _ = h.step()
    assert other.num_cached_tokens == 0  # same tokens, other image: no sharing
    assert same.num_cached_tokens == 12
    assert chunk_of(out, "c").image_slices == []
    assert h.emb.ref_count("cat") == 0  # span covered by KV: reference dropped
    h.run()


def test_a_waiting_request_reports_only_the_tokens_its_cached_prefix_leaves(h):
    # GetLoad's uncached tokens are the cache-aware proxy's load; the proxy counts a follow-up turn by what
    # the cache did not hold, so a PD must too while the turn waits (its prefix is found at Preallocate).
    prompt = [1, 2] + [IMG] * 8 + [3, 4, 5]
    h.add("a", prompt, spans=[("cat", 2, 8)], ready=["cat"], max_tokens=1)
    h.run()
    follow = h.add("b", prompt + [6, 7, 8, 9], spans=[("cat", 2, 8)], max_tokens=2)
    assert follow in h.sched.waiting
    assert h.core.stats().num_waiting_tokens == follow.num_tokens - 12
    h.step()
    assert follow in h.sched.running and follow.num_cached_tokens == 12
    assert h.core.stats().num_running_tokens == follow.num_tokens - 12
    h.run()


@pytest.mark.parametrize(
    "sampling, tokens, status, num_out",
    [
        ({}, [TOKEN, EOS], RequestStatus.FINISHED_STOPPED, 2),
        ({}, [TOKEN, OTHER_EOS], RequestStatus.FINISHED_STOPPED, 2),  # any of the EOS ids stops
        ({"ignore_eos": True}, [EOS, OTHER_EOS, EOS, OTHER_EOS], RequestStatus.FINISHED_LENGTH, 4),
        ({"stop_token_ids": (42,)}, [TOKEN, 42], RequestStatus.FINISHED_STOPPED, 2),
        ({}, [TOKEN] * 4, RequestStatus.FINISHED_LENGTH, 4),
    ],
)
def test_stop_conditions(h, sampling, tokens, status, num_out):
    request = h.add("a", [1, 2, 3], max_tokens=4, **sampling)
    for token in tokens:
        h.step({"a": token})
    assert request.status is status and len(request.output_token_ids) == num_out


def test_max_model_len_stops_generation(make):
    h = make(max_model_len=6)
    request = h.add("a", [1, 2, 3, 4], max_tokens=100)
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 6


def _long_prompt_behind_a_decode(h):
    h.add("dec", [2, 3], max_tokens=20)
    h.step(prefill_budget=40)  # "dec" prefills and starts decoding
    h.add("long", [1] * 120, max_tokens=2)
    h.step(prefill_budget=40)  # "long" is admitted with a 40-token chunk
    h.add("short", [4, 5, 6, 7, 8, 9], max_tokens=2)
    out, _ = h.step(prefill_budget=40)
    return {c.request_id: c.num_tokens for c in out.chunks}


def test_a_long_prompt_in_progress_leaves_half_the_prefill_share_to_the_queue(make):
    h = make(budget=64, share_prefill_with_queue=True)
    assert _long_prompt_behind_a_decode(h) == {"dec": 1, "long": 20, "short": 6}
    out, _ = h.step(prefill_budget=40)  # nobody waits: the prompt in progress takes the whole share
    assert {c.request_id: c.num_tokens for c in out.chunks}["long"] == 40
    h.run()


def test_strict_fcfs_chunks_when_sharing_is_off(make):
    h = make(budget=64)
    assert _long_prompt_behind_a_decode(h) == {"dec": 1, "long": 40}
    h.run()


def test_a_keyed_order_serves_a_later_short_prompt_before_a_long_one_in_progress(make):
    h = make(budget=64)
    deadline = {"dec": 0.0, "long": 9.0, "short": 1.0}  # the short prompt's first token is due first
    h.add("dec", [1, 2, 3], max_tokens=8)
    h.step()
    h.add("long", [1] * 120, max_tokens=2)
    h.step(prefill_budget=40, prefill_key=lambda r: deadline[r.request_id])
    h.add("short", [4, 5, 6, 7, 8, 9], max_tokens=2)
    out, _ = h.step(prefill_budget=40, prefill_key=lambda r: deadline[r.request_id])
    assert {c.request_id: c.num_tokens for c in out.chunks} == {"dec": 1, "short": 6, "long": 34}
    assert [c.request_id for c in out.chunks] == ["dec", "short", "long"]  # decode rows first
    h.run()


@pytest.mark.parametrize(
    ("first", "chunks", "preempted"),
    [("a", {"a": 8}, ["b"]), ("b", {"b": 4}, [])],
    ids=["newer-one-outside-the-step-is-preempted", "nobody-outside-the-step-so-it-waits"],
)
def test_a_keyed_prefill_out_of_room_preempts_the_newest_request_not_in_the_step(make, first, chunks, preempted):
    h = make(num_blocks=5, block_size=4, budget=64)  # 20 tokens of KV
    h.add("a", [1] * 16, max_tokens=2)
    h.add("b", [2] * 12, max_tokens=2)
    h.step(prefill_budget=8, prefill_key=lambda r: r.request_id != "a")  # "a": 8 tokens, 2 blocks
    h.step(prefill_budget=8, prefill_key=lambda r: r.request_id != "b")  # "b": 8 tokens, 2 blocks
    out, _ = h.step(prefill_budget=8, prefill_key=lambda r: r.request_id != first)  # 1 block free
    assert {c.request_id: c.num_tokens for c in out.chunks} == chunks
    assert out.preempted_request_ids == preempted
    h.run()


def test_image_requests_waiting_for_embeddings_do_not_hold_decode_slots(make):
    """Second review, 8: with every slot taken by image requests blocked on a slow encoder, a text
    request waited for them; now it is admitted at once, and the image requests resume as slots free."""
    h = make(max_num_seqs=2)
    for name, image in (("img1", "cat"), ("img2", "dog")):
        h.add(name, [5, 6, 7, 8] + [IMG] * 8 + [9], spans=[(image, 4, 8)], max_tokens=2)
    h.step()  # both prefill their text, then wait for their images
    h.step()
    assert [r.status for r in h.sched.running] == [RequestStatus.WAITING_FOR_EMBEDDING] * 2
    assert h.sched.num_active == 0
    h.add("txt", [1, 2, 3], max_tokens=6)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["txt"]
    h.push("img1", "cat")
    h.push("img2", "dog")
    out, _ = h.step()  # one slot left beside the decoding text request: one image request resumes
    assert [c.request_id for c in out.chunks] == ["txt", "img1"]
    assert h.sched.get_request("img2").status is RequestStatus.WAITING_FOR_EMBEDDING
    assert h.sched.num_active == 2
    h.run()


def test_pins_of_waiting_requests_never_leave_the_next_one_without_room(make):
    """Nothing runs and a preempted request's pinned K/V leaves the prompt served next no room: the
    pins are given up, and the preempted request, whose image is gone by then, fails cleanly."""
    h = make(num_blocks=5, block_size=4, budget=64, embedding_tokens=4)
    image = h.add("a", [1, 2, 3, 4] + [IMG] * 4 + [5], spans=[("cat", 4, 4)], ready=["cat"], max_tokens=4)
    h.step()
    h.add("b", [IMG] * 4 + [6], spans=[("dog", 0, 4)], ready=["dog"], max_tokens=2)
    assert h.evicted == ["cat"] and h.kv.num_pinned_blocks == 2
    force_preempt(h, image)
    h.add("c", list(range(10, 26)), max_tokens=2)  # 4 blocks; 3 are free
    order = {"c": 0, "b": 1, "a": 2}
    out, _ = h.step(prefill_key=lambda r: order[r.request_id])
    assert out.is_empty and out.stalled == "c" and h.kv.num_pinned_blocks == 0
    out, ended = h.step(prefill_key=lambda r: order[r.request_id])
    assert chunk_of(out, "c").num_tokens == 16
    ended += h.run()
    assert image in ended and image.status is RequestStatus.FINISHED_ERROR
    assert {r.request_id for r in ended} == {"a", "b", "c"}
