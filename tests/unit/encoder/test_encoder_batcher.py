"""Batcher: micro-batching, max_wait, queue bound, single flight, dead/cancelled items, failures.

The vision module is a test double: a deterministic function of the pixels
that records every batch it sees and can be held on a gate or made to fail.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from torch import nn

from services.encoder.batcher import Batcher
from services.encoder.cache import EmbeddingCache
from services.encoder.errors import DeadlineExceeded, EncodeFailed, Overloaded, ShuttingDown
from services.encoder.metrics import EncoderMetrics

NUM_TOKENS = 4
HIDDEN = 8


class FakeVision(nn.Module):
    """[N, 3, H, W] -> [N, NUM_TOKENS, HIDDEN]: row n is pixels[n].sum() + arange."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[int] = []
        self.pixel_sums: list[float] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a forward starts
        self.fail_next = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(10), "test gate never opened"
        self.batch_sizes.append(pixels.shape[0])
        self.pixel_sums.extend(pixels.flatten(1).sum(1).tolist())
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        return expected(pixels)

    @property
    def num_forwards(self) -> int:
        return len(self.batch_sizes)


def expected(pixels: torch.Tensor) -> torch.Tensor:
    base = pixels.flatten(1).sum(1)  # [N]
    return base[:, None, None] + torch.arange(NUM_TOKENS * HIDDEN, dtype=pixels.dtype).view(NUM_TOKENS, HIDDEN)


def image(value: float, size: int = 4) -> torch.Tensor:
    return torch.full((3, size, size), value)


def make_batcher(vision: FakeVision, **overrides) -> Batcher:
    options = dict(max_batch_images=4, max_wait_ms=20.0, max_pending=16)
    options.update(overrides)
    return Batcher(
        vision,
        EmbeddingCache(1 << 20),
        device=torch.device("cpu"),
        dtype=torch.float32,
        **options,
    )


@pytest.fixture
def vision() -> FakeVision:
    return FakeVision()


@pytest.fixture
async def batcher(vision: FakeVision):
    b = make_batcher(vision)
    b.start()
    yield b
    vision.gate.set()
    await asyncio.to_thread(b.stop, 5)
    assert b.num_pending == 0


async def wait_until(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def hold_worker(batcher: Batcher, vision: FakeVision) -> asyncio.Task:
    """Starts one job and blocks the worker inside its forward."""
    vision.gate.clear()
    vision.entered.clear()
    task = asyncio.create_task(batcher.encode("holder", image(100.0), None))
    await asyncio.to_thread(vision.entered.wait, 5)
    return task


async def test_concurrent_submits_share_one_batch(batcher: Batcher, vision: FakeVision) -> None:
    results = await asyncio.gather(*(batcher.encode(f"h{i}", image(float(i)), None) for i in range(4)))
    assert vision.batch_sizes == [4]
    for i, result in enumerate(results):
        assert not result.cache_hit
        assert torch.equal(result.embedding, expected(image(float(i))[None])[0])
        assert result.encode_s > 0


async def test_batch_size_is_capped(vision: FakeVision) -> None:
    b = make_batcher(vision, max_batch_images=2)
    b.start()
    try:
        await asyncio.gather(*(b.encode(f"h{i}", image(float(i)), None) for i in range(5)))
    finally:
        await asyncio.to_thread(b.stop, 5)
    assert max(vision.batch_sizes) == 2 and sum(vision.batch_sizes) == 5


async def test_worker_waits_max_wait_for_stragglers(vision: FakeVision) -> None:
    b = make_batcher(vision, max_wait_ms=400.0)
    b.start()
    try:
        first = asyncio.create_task(b.encode("a", image(1.0), None))
        await asyncio.sleep(0.05)  # well inside max_wait: joins the same batch
        second = asyncio.create_task(b.encode("b", image(2.0), None))
        await asyncio.gather(first, second)
    finally:
        await asyncio.to_thread(b.stop, 5)
    assert vision.batch_sizes == [2]


async def test_lone_image_runs_after_max_wait(vision: FakeVision) -> None:
    b = make_batcher(vision, max_wait_ms=60.0)
    b.start()
    try:
        start = time.monotonic()
        await b.encode("a", image(1.0), None)
        elapsed = time.monotonic() - start
    finally:
        await asyncio.to_thread(b.stop, 5)
    assert vision.batch_sizes == [1]
    assert 0.05 <= elapsed < 2.0


async def test_groups_by_pixel_shape(batcher: Batcher, vision: FakeVision) -> None:
    small, large = image(1.0, size=4), image(2.0, size=6)
    a, b = await asyncio.gather(batcher.encode("s", small, None), batcher.encode("l", large, None))
    assert sorted(vision.batch_sizes) == [1, 1]
    assert torch.equal(a.embedding, expected(small[None])[0])
    assert torch.equal(b.embedding, expected(large[None])[0])


async def test_queue_full_raises_overloaded(vision: FakeVision) -> None:
    b = make_batcher(vision, max_pending=2)
    b.start()
    try:
        holder = await hold_worker(b, vision)
        queued = asyncio.create_task(b.encode("q", image(1.0), None))
        await wait_until(lambda: b.num_pending == 2)
        with pytest.raises(Overloaded) as info:
            await b.encode("rejected", image(2.0), None)
        assert info.value.retry_after_ms > 0
        # A hash already in flight joins its job instead of needing a slot.
        joiner = asyncio.create_task(b.encode("q", image(1.0), None))
        vision.gate.set()
        await asyncio.gather(holder, queued, joiner)
    finally:
        vision.gate.set()
        await asyncio.to_thread(b.stop, 5)
    assert b.num_pending == 0
    assert 2.0 * 3 * 16 not in vision.pixel_sums  # the rejected image never ran


async def test_single_flight_runs_vision_once(batcher: Batcher, vision: FakeVision) -> None:
    holder = await hold_worker(batcher, vision)
    waiters = [asyncio.create_task(batcher.encode("same", image(7.0), None)) for _ in range(6)]
    await asyncio.sleep(0.02)
    assert batcher.num_pending == 2  # holder + one shared job
    vision.gate.set()
    results = await asyncio.gather(*waiters)
    await holder
    assert vision.num_forwards == 2 and vision.pixel_sums.count(7.0 * 48) == 1
    assert all(r.embedding is results[0].embedding for r in results)


async def test_cache_hit_skips_vision(batcher: Batcher, vision: FakeVision) -> None:
    first = await batcher.encode("h", image(1.0), None)
    second = await batcher.encode("h", image(1.0), None)
    assert vision.num_forwards == 1
    assert second.cache_hit and second.encode_s == 0.0
    assert torch.equal(first.embedding, second.embedding)


async def test_a_known_hash_with_other_pixels_is_encoded_not_served_from_the_cache(
    batcher: Batcher, vision: FakeVision
) -> None:
    # Poisoning: a caller (bug or hostile peer) sends a popular image's hash with other pixels.
    genuine = await batcher.encode("popular", image(1.0), None)
    forged = await batcher.encode("popular", image(9.0), None)
    assert not forged.cache_hit and torch.equal(forged.embedding, expected(image(9.0)[None])[0])
    # The genuine entry is untouched: the real image still hits and gets its own embedding.
    again = await batcher.encode("popular", image(1.0), None)
    assert again.cache_hit and torch.equal(again.embedding, genuine.embedding)
    assert vision.num_forwards == 2


async def test_same_hash_other_pixels_in_flight_are_two_jobs(batcher: Batcher, vision: FakeVision) -> None:
    holder = await hold_worker(batcher, vision)
    first = asyncio.create_task(batcher.encode("h", image(2.0), None))
    second = asyncio.create_task(batcher.encode("h", image(3.0), None))
    await wait_until(lambda: batcher.num_pending == 3)  # not joined: each waits for its own forward
    vision.gate.set()
    a, b = await asyncio.gather(first, second)
    await holder
    assert torch.equal(a.embedding, expected(image(2.0)[None])[0])
    assert torch.equal(b.embedding, expected(image(3.0)[None])[0])


async def test_dead_item_dropped_at_dequeue(batcher: Batcher, vision: FakeVision) -> None:
    holder = await hold_worker(batcher, vision)
    doomed = asyncio.create_task(batcher.encode("late", image(5.0), time.monotonic() + 0.05))
    await asyncio.sleep(0.1)  # its deadline passes while the worker is busy
    vision.gate.set()
    with pytest.raises(DeadlineExceeded):
        await doomed
    await holder
    assert 5.0 * 48 not in vision.pixel_sums
    await wait_until(lambda: batcher.num_pending == 0)


async def test_cancelled_item_is_removed_and_never_run(batcher: Batcher, vision: FakeVision) -> None:
    holder = await hold_worker(batcher, vision)
    cancelled = asyncio.create_task(batcher.encode("gone", image(3.0), None))
    await wait_until(lambda: batcher.num_pending == 2)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert batcher.num_pending == 1  # slot freed at once, not at dequeue
    vision.gate.set()
    await holder
    await asyncio.sleep(0.05)
    assert 3.0 * 48 not in vision.pixel_sums


async def test_one_cancelled_waiter_does_not_cancel_the_shared_job(batcher: Batcher, vision: FakeVision) -> None:
    holder = await hold_worker(batcher, vision)
    leaving = asyncio.create_task(batcher.encode("shared", image(4.0), None))
    staying = asyncio.create_task(batcher.encode("shared", image(4.0), None))
    await asyncio.sleep(0.02)
    leaving.cancel()
    vision.gate.set()
    result = await staying
    await holder
    assert torch.equal(result.embedding, expected(image(4.0)[None])[0])


async def test_vision_failure_fails_batch_and_worker_survives(batcher: Batcher, vision: FakeVision) -> None:
    vision.fail_next = True
    with pytest.raises(EncodeFailed):
        await batcher.encode("bad", image(1.0), None)
    assert batcher.num_pending == 0
    result = await batcher.encode("good", image(2.0), None)
    assert torch.equal(result.embedding, expected(image(2.0)[None])[0])
    # The failed image was not cached: asking again recomputes it.
    again = await batcher.encode("bad", image(1.0), None)
    assert not again.cache_hit


async def test_stop_fails_queued_jobs_and_refuses_new_ones(vision: FakeVision) -> None:
    b = make_batcher(vision)
    b.start()
    holder = await hold_worker(b, vision)
    queued = asyncio.create_task(b.encode("q", image(1.0), None))
    await wait_until(lambda: b.num_pending == 2)
    stopping = asyncio.create_task(asyncio.to_thread(b.stop, 5))
    with pytest.raises(ShuttingDown):
        await queued
    vision.gate.set()
    await holder  # the running forward still completes
    await stopping
    assert b.num_pending == 0
    with pytest.raises(ShuttingDown):
        await b.encode("after", image(1.0), None)


class BrokenMetricsDouble(EncoderMetrics):
    def on_batch(self, num_images: int, forward_s: float, ok: bool) -> None:
        raise RuntimeError("metrics bug")


async def test_broken_metrics_hook_does_not_stall_the_worker(vision: FakeVision) -> None:
    b = make_batcher(vision, metrics=BrokenMetricsDouble())
    b.start()
    try:
        first = await b.encode("a", image(1.0), None)
        second = await b.encode("b", image(2.0), None)
    finally:
        await asyncio.to_thread(b.stop, 5)
    assert torch.equal(first.embedding, expected(image(1.0)[None])[0])
    assert torch.equal(second.embedding, expected(image(2.0)[None])[0])


def test_embeddings_to_host_gives_each_image_its_own_tensor():
    from services.common.models.loaded_vision import embeddings_to_host

    out = torch.arange(24.0).view(2, 3, 4)
    rows = embeddings_to_host(list(out.unbind(0)))
    assert torch.equal(torch.stack(rows), out)
    # A cached image must not keep the whole batch alive.
    assert all(row.untyped_storage().nbytes() == 3 * 4 * 4 and row.is_contiguous() for row in rows)
