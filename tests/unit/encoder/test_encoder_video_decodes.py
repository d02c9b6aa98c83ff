"""VideoDecodes: videos decode on their own bounded threads (encoder and colocated PD); the queue is bounded;
nothing stays admitted. A decode stopped by its budget is DEADLINE_EXCEEDED at the encoder and at a colocated PD."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common.models.pixel_layout import PixelLayout
from services.common.pb import epd_pb2
from services.common.video_files import DecodeBudget, DecodeStopped
from services.encoder.errors import DeadlineExceeded, Overloaded
from services.encoder.servicer import EncoderServicer
from services.encoder.video_decodes import VideoDecodes
from services.pd import colocated
from services.pd.engine.errors import EngineError, ErrorKind


@pytest.mark.timeout(30)
async def test_one_thread_runs_one_decode_at_a_time_and_the_queue_is_bounded():
    decodes = VideoDecodes(threads=1, max_queued=1)
    release, started = threading.Event(), threading.Event()

    def blocking() -> str:
        started.set()
        release.wait(10)
        return "first"

    first = asyncio.create_task(decodes.run(blocking))
    await asyncio.to_thread(started.wait, 10)
    second = asyncio.create_task(decodes.run(lambda: "second"))
    await asyncio.sleep(0)
    assert decodes.num_admitted == 2
    with pytest.raises(Overloaded):  # one running, one queued: the third is refused at once
        await decodes.run(lambda: "third")
    second.cancel()  # a call that goes away while queued takes its decode out of the queue
    with pytest.raises(asyncio.CancelledError):
        await second
    release.set()
    assert await first == "first"
    for _ in range(100):  # bounded: the done callbacks run on the executor's thread
        if decodes.num_admitted == 0:
            break
        await asyncio.sleep(0.01)
    assert decodes.num_admitted == 0
    decodes.shutdown()


def test_the_bounds_must_make_sense():
    with pytest.raises(ValueError):
        VideoDecodes(threads=0, max_queued=1)
    with pytest.raises(ValueError):
        VideoDecodes(threads=1, max_queued=-1)


class _StoppedVideo:
    """A ``ProcessFile`` whose video decoding always meets the end of its budget."""

    def __call__(self, data, cache_salt):
        raise AssertionError("no image in these requests")

    def video(self, item, cache_salt, budget):
        budget.check()
        raise DecodeStopped("the request's deadline passed")


def _video_request() -> epd_pb2.EncodeRequest:
    item = epd_pb2.EncodeItem(
        mm_hash="h", reservation_id="r", grid=epd_pb2.ImageGrid(t=1, h=2, w=2), video_file=b"\x1a\x45\xdf\xa3"
    )
    return epd_pb2.EncodeRequest(request_id="req", pd_address="127.0.0.1:1", items=[item])


@pytest.mark.timeout(30)
async def test_a_decode_past_its_deadline_is_deadline_exceeded_at_the_encoder():
    servicer = EncoderServicer(
        None, None, None, layout=PixelLayout(patch_dim=8, merge_size=2), process_file=_StoppedVideo()
    )  # type: ignore[arg-type]
    with pytest.raises(DeadlineExceeded):
        await servicer._parse(_video_request(), DecodeBudget())
    assert servicer.video_decodes.num_admitted == 0


def test_a_decode_past_its_deadline_is_deadline_exceeded_at_a_colocated_pd():
    with pytest.raises(EngineError) as stopped:
        colocated.parse_encode_request(
            _video_request(), 0.0, PixelLayout(patch_dim=8, merge_size=2), _StoppedVideo(), budget=DecodeBudget()
        )
    assert stopped.value.kind is ErrorKind.DEADLINE_EXCEEDED


@pytest.mark.timeout(30)
async def test_a_colocated_pd_decodes_videos_on_bounded_threads_of_their_own():
    servicer = colocated.ColocatedEncoderServicer(None)  # type: ignore[arg-type]
    release, started = threading.Event(), threading.Event()

    def blocking() -> list:
        started.set()
        release.wait(10)
        return []

    decodes = servicer.video_decodes
    running = asyncio.create_task(servicer._decode_videos(blocking))
    await asyncio.to_thread(started.wait, 10)
    queued = [asyncio.create_task(servicer._decode_videos(list)) for _ in range(colocated.VIDEO_QUEUE)]
    await asyncio.sleep(0)
    assert decodes.num_admitted == 1 + colocated.VIDEO_QUEUE
    with pytest.raises(EngineError) as full:  # every thread and queue slot taken: refused at once
        await servicer._decode_videos(list)
    assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED and full.value.retry_after_s
    release.set()
    assert await running == [] and await asyncio.gather(*queued) == [[]] * colocated.VIDEO_QUEUE
    for _ in range(100):  # bounded: the done callbacks run on the executor's thread
        if decodes.num_admitted == 0:
            break
        await asyncio.sleep(0.01)
    assert decodes.num_admitted == 0
    decodes.shutdown()
