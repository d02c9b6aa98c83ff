"""OpenAI messages / prompts -> ``Prompt``: token ids with expanded image spans.

This is the proxy's half of the model: the chat template, the tokenizer and
the image processor of the checkpoint (no weights). The contract with PD is
that ``Prompt.token_ids`` already holds ``num_tokens`` copies of the image
token for every image, at ``offset``; PD splices embedding rows there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.grids import grid_to_pb
from services.common.hashing import hash_settings, mm_hash
from services.common.models.processing import UnsupportedImageError
from services.common.pb import epd_pb2
from services.common.video_files import NO_BUDGET, DecodeBudget, Sampling, VideoLimits
from services.proxy.errors import (
    ImageError,
    PlaceholderMismatchError,
    RequestError,
    TooManyImagesError,
    TooManyPixelsError,
)
from services.proxy.faults import NO_FAULTS, ProxyFaults
from services.proxy.prompt.images import data_url_payload, decode_image_bytes, image_size
from services.proxy.prompt.placeholders import PlaceholderRun, expand_runs
from services.proxy.prompt.text_limits import TextLimit
from services.proxy.prompt.videos import ProcessedVideo, VideoStage


class Adapter(Protocol):
    """The part of a ``services.common.models.processing.ModelProcessing`` the proxy uses."""

    model_id: str
    image_token_id: int
    max_model_len: int

    def num_image_tokens(self, height: int, width: int) -> int: ...
    def image_shape(self, height: int, width: int) -> Any: ...  # -> processing.ImageShape
    def processor_settings(self) -> dict: ...


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: where its placeholder span is and what the encoder needs."""

    mm_hash: str
    offset: int  # first placeholder position in Prompt.token_ids
    num_tokens: int  # placeholder count == embedding rows
    image_file: bytes  # as the client sent it: the encoder decodes and processes it
    # Dynamic-resolution models only (else None): the patch grid goes to the
    # encoder, the same grid in LM tokens (t*h*w == num_tokens) to PD.
    patch_grid: tuple[int, int, int] | None = None
    token_grid: tuple[int, int, int] | None = None
    video: ProcessedVideo | None = None  # set when the item is a video (image_file is then empty)
    # A video whose temporal patches text separates (Qwen3-VL): where each patch's run starts (the first == offset).
    frame_offsets: tuple[int, ...] = ()

    def encode_item_pb(self, reservation_id: str) -> epd_pb2.EncodeItem:
        """The encoder's item for this image or video."""
        if self.video is not None:
            return self.video.encode_item_pb(reservation_id)
        return epd_pb2.EncodeItem(
            mm_hash=self.mm_hash,
            reservation_id=reservation_id,
            image_file=self.image_file,
            grid=grid_to_pb(self.patch_grid),
        )


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt ready for PD; ``images`` are in prompt order."""

    token_ids: list[int]
    images: tuple[ImageItem, ...] = ()
    cache_salt: str = ""  # the tenant's wire salt (cache_isolation.py); already inside each image's mm_hash

    @property
    def num_image_tokens(self) -> int:
        """Tokens of images and videos (embedding rows)."""
        return sum(item.num_tokens for item in self.images)

    @property
    def num_video_tokens(self) -> int:
        return sum(item.num_tokens for item in self.images if item.video is not None)

    def mm_items_pb(self) -> list[epd_pb2.MultiModalItem]:
        return [
            epd_pb2.MultiModalItem(
                mm_hash=i.mm_hash,
                offset=i.offset,
                num_tokens=i.num_tokens,
                grid=grid_to_pb(i.token_grid),
                second_per_grid_t=None if i.video is None else i.video.second_per_grid_t,
                frame_offsets=list(i.frame_offsets),
            )
            for i in self.images
        ]


def message_text_length(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of the messages' text: string contents and text parts."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, Mapping))
    return total


def image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The image URLs of chat messages, in prompt order."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            urls.extend(part["image_url"]["url"] for part in content if part.get("type") == "image_url")
    return urls


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the processor's chat-template form: content is always a list of parts.

    LLaVA-style templates iterate over content parts, so plain strings are
    wrapped; image parts lose their URL (the template only marks the position).
    """
    converted = []
    for message in messages:
        content = message.get("content")
        if content is None:
            parts: list[dict[str, Any]] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = [_template_part(part) for part in content]
        converted.append({"role": message["role"], "content": parts})
    return converted


def _template_part(part: Mapping[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "image_url":
        return {"type": "image"}
    if kind == "video_url":
        return {"type": "video"}
    return {"type": "text", "text": part["text"]}


@dataclass(frozen=True)
class ProcessedImage:
    """One image after the image stage: its decoded pixels are gone, only what PD and the encoder need is kept."""

    mm_hash: str
    num_tokens: int  # placeholder count for its size
    image_file: bytes  # the client's file; its decoded pixels are gone
    patch_grid: tuple[int, int, int] | None = None
    token_grid: tuple[int, int, int] | None = None


class Preprocessor:
    """Turns chat messages or completion prompts into ``Prompt`` objects, in two stages.

    The text stage (``chat_tokens``, ``completion_prompt``) renders and
    tokenizes, after refusing text too long for the context by its length
    alone (``text_limits``). The image stage (``chat_images``) reads every
    image's size from its header and checks the per-image and per-request
    pixel caps before decoding any, then decodes, hashes and processes one
    image at a time, dropping each decoded image before the next. The app
    runs the stages on separate pools (``workers``), so images never delay
    text; ``assemble`` joins them.

    Thread-safe: tokenizer calls are serialised (HF fast tokenizers must not
    be used concurrently), image work is not.
    """

    def __init__(
        self,
        adapter: Adapter,
        processor: Any,
        *,
        max_images: int,
        max_image_pixels: int,
        max_request_pixels: int | None = None,
        max_model_len: int | None = None,
        faults: ProxyFaults = NO_FAULTS,
        video_limits: VideoLimits | None = None,
    ) -> None:
        self.adapter = adapter
        self.faults = faults  # test-only (services/proxy/faults.py)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_images = max_images
        self.max_image_pixels = max_image_pixels
        self.max_request_pixels = max_request_pixels or max(1, max_images) * max_image_pixels
        self.text_limit = TextLimit(self.tokenizer, max_model_len or adapter.max_model_len)
        self._settings = adapter.processor_settings()
        self._tokenizer_lock = threading.Lock()
        self.video_limits = video_limits or VideoLimits(
            max_frame_pixels=max_image_pixels, max_total_pixels=self.max_request_pixels
        )
        self.videos = VideoStage(adapter, self.video_limits)

    def check_image_count(self, num_images: int) -> None:
        """Refuses more images than allowed (before any is fetched or decoded)."""
        if num_images > self.max_images:
            raise TooManyImagesError(
                f"The request has {num_images} images; at most {self.max_images} are allowed.", "messages"
            )

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], sources: Sequence[str | bytes] | None = None
    ) -> Prompt:
        """Validated OpenAI chat messages -> ``Prompt``: both stages in this thread.

        ``sources``: one per image in prompt order, a data URL or fetched
        bytes (``media.image_sources``); by default the messages' own URLs,
        which must then be data URLs.
        """
        sources = image_urls(messages) if sources is None else list(sources)
        self.check_image_count(len(sources))
        return self.assemble(self.chat_tokens(messages), self.chat_images(sources))

    def chat_tokens(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Text stage of a chat request: the rendered template's token ids, one image token per image.

        The messages' own text is checked against the context before the
        template is rendered: the rendered prompt holds all of it (the
        templates served here drop no message), so text that is too long
        already is refused without the work of rendering it.
        """
        self.text_limit.check(message_text_length(messages), "messages")
        rendered = self.render(messages, template_kwargs)
        self.text_limit.check(len(rendered), "messages")
        with self._tokenizer_lock:
            return self._encode(rendered)

    def chat_images(self, sources: Sequence[str | bytes], cache_salt: str = "") -> tuple[ProcessedImage, ...]:
        """Image stage: sizes and caps first, then one decoded image alive at a time; each image's
        ``mm_hash`` is salted with the tenant's ``cache_salt`` (``cache_isolation``)."""
        self.check_image_count(len(sources))
        payloads = [source if isinstance(source, bytes) else data_url_payload(source) for source in sources]
        sizes = [image_size(payload, self.max_image_pixels) for payload in payloads]
        total = sum(width * height for width, height in sizes)
        if total > self.max_request_pixels:
            raise TooManyPixelsError(
                f"The request's images have {total} pixels together; the limit is {self.max_request_pixels}.",
                "messages",
            )
        return tuple(self._process(payload, cache_salt) for payload in payloads)

    def _process(self, payload: bytes, cache_salt: str) -> ProcessedImage:
        """Decodes one image (400 if it is not a good file), counts its tokens (400 if the processor
        would refuse its shape) and hashes its pixels; the encoder gets the file itself."""
        self.faults.before_decode()
        image = decode_image_bytes(payload, self.max_image_pixels)
        try:
            shape = self.adapter.image_shape(image.height, image.width)
            return ProcessedImage(
                mm_hash=mm_hash(
                    image, hash_settings(self._settings, shape.patch_grid), self.adapter.model_id, cache_salt
                ),
                num_tokens=shape.num_tokens,
                image_file=payload,
                patch_grid=shape.patch_grid,
                token_grid=shape.token_grid,
            )
        except UnsupportedImageError as error:
            raise ImageError(str(error), "image_url") from None
        finally:
            image.close()  # the decoded pixels go now, not when the request ends

    def chat_videos(
        self,
        sources: Sequence[str | bytes | list[str | bytes]],
        sampling: Sampling,
        cache_salt: str = "",
        budget: DecodeBudget = NO_BUDGET,
    ) -> tuple[ProcessedVideo, ...]:
        """Video stage (``videos.VideoStage``): limits from headers first, then one video at a time, until
        ``budget`` ends (``DecodeStopped``)."""
        return self.videos.process(sources, sampling, cache_salt, budget)

    def assemble(
        self,
        token_ids: Sequence[int],
        images: Sequence[ProcessedImage],
        cache_salt: str = "",
        videos: Sequence[ProcessedVideo] = (),
    ) -> Prompt:
        """Expands each image and video token of ``token_ids`` into its item's span; ``cache_salt`` must be
        the one the items were hashed with."""
        image_id, video_id = self.adapter.image_token_id, getattr(self.adapter, "video_token_id", None)
        placeholders = {image_id: [[PlaceholderRun((), image.num_tokens, ())] for image in images]}
        if video_id is not None:
            placeholders[video_id] = [self._video_runs(video) for video in videos]
        expanded, offsets = expand_runs(token_ids, placeholders)
        items = [
            ImageItem(image.mm_hash, runs[0], image.num_tokens, image.image_file, image.patch_grid, image.token_grid)
            for image, runs in zip(images, offsets[image_id])
        ]
        if video_id is not None:
            items += [
                ImageItem(
                    video.mm_hash,
                    runs[0],
                    video.num_tokens,
                    b"",
                    video.patch_grid,
                    video.token_grid,
                    video,
                    frame_offsets=tuple(runs) if video.frame_texts else (),
                )
                for video, runs in zip(videos, offsets[video_id])
            ]
        items.sort(key=lambda item: item.offset)
        return Prompt(token_ids=expanded, images=tuple(items), cache_salt=cache_salt)

    def _video_runs(self, video: ProcessedVideo) -> list[PlaceholderRun]:
        """A video's placeholders: one run, or one per temporal patch with its text (``frame_texts``)."""
        if not video.frame_texts:
            return [PlaceholderRun((), video.num_tokens, ())]
        per_frame = video.num_tokens // len(video.frame_texts)
        with self._tokenizer_lock:  # the text around each run, tokenized alone: special tokens bound it
            return [
                PlaceholderRun(self._text_ids(before), per_frame, self._text_ids(after))
                for before, after in video.frame_texts
            ]

    def _text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat template applied to ``messages``: one image token per image, generation prompt added;
        ``template_kwargs`` are template variables (``chat_template_kwargs``, checked by the caller)."""
        return self.processor.apply_chat_template(
            _template_messages(messages), add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )

    def completion_prompt(self, prompt: str | Sequence[int], cache_salt: str = "") -> Prompt:
        """A text prompt or a list of token ids -> text-only ``Prompt`` under the tenant's ``cache_salt``."""
        if isinstance(prompt, str):
            self.text_limit.check(len(prompt), "prompt")
            with self._tokenizer_lock:
                token_ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            token_ids = [int(t) for t in prompt]
            vocab_size = len(self.tokenizer)
            if any(not 0 <= t < vocab_size for t in token_ids):
                raise RequestError(f"Token ids must be in [0, {vocab_size}).", "prompt")
        if not token_ids:
            raise RequestError("The prompt is empty.", "prompt")
        media_ids = {self.adapter.image_token_id, getattr(self.adapter, "video_token_id", None)}
        if any(token in media_ids for token in token_ids):
            raise PlaceholderMismatchError("Text-only prompts must not contain the image or video token.", "prompt")
        return Prompt(token_ids=token_ids, cache_salt=cache_salt)

    def _encode(self, rendered: str) -> list[int]:
        # A template that writes the BOS token itself must not get a second
        # one from the tokenizer.
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and rendered.startswith(bos))
        return list(self.tokenizer(rendered, add_special_tokens=add_special)["input_ids"])
