"""The encoder's video decode threads (``--video-threads``, ``--video-queue``): ``common.video_decodes``, whose
full queue is the encoder's ``Overloaded`` (RESOURCE_EXHAUSTED + ``retry-after-ms``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from services.common import video_decodes
from services.common.video_decodes import RETRY_AFTER_MS, DecodesFull
from services.encoder.errors import Overloaded

T = TypeVar("T")


class VideoDecodes(video_decodes.VideoDecodes):
    """``threads`` decode threads and at most ``max_queued`` calls waiting for one; beyond them ``Overloaded``."""

    async def run(self, fn: Callable[[], T]) -> T:
        try:
            return await super().run(fn)
        except DecodesFull as error:
            raise Overloaded(str(error), RETRY_AFTER_MS) from None
