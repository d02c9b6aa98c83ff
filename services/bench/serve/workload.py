"""Named, seeded workloads for ``epd bench serve``: request shapes, images, Poisson arrivals.

Everything is a function of (workload, seed, run index): the same arguments
give the same prompts, the same images (pixel for pixel) and the same
arrival pattern on every machine. Each run (one rate of one repeat) gets
its own images and prompts, so that caches filled by an earlier rate never
turn a later rate's "first-seen" images into hits; the same run index gives
every configuration the same requests.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import random
from dataclasses import dataclass
from typing import Any

from services.bench.serve.words import PROMPT_WORDS

WARMUP_RUN = 1_000_000
CALIBRATION_RUN = 2_000_000
"""Run indexes of warm-up and calibration requests: never equal to a measured run's."""


@dataclass(frozen=True)
class WorkloadShape:
    """How a workload's requests carry images."""

    image_request_fraction: float  # share of requests that carry images
    min_images: int  # images per image request, uniform in [min, max]
    max_images: int
    repeat_fraction: float = 0.0  # share of image requests whose image was sent earlier in the run
    description: str = ""
    media: str = "image"  # "video": each "image" is a short clip (Qwen2-VL family models only)
    # Share of requests with a long text prompt (no images) of ``long_words`` words, uniform in [min, max];
    # drawn before the images, so image requests are a share of the remaining requests.
    long_fraction: float = 0.0
    long_words: tuple[int, int] = (0, 0)


WORKLOADS = {
    "mixed": WorkloadShape(0.1, 1, 4, description="10% of requests carry 1-4 images, the rest are text (stall)"),
    "multi-image": WorkloadShape(1.0, 4, 4, description="every request carries 4 images"),
    "repeat": WorkloadShape(1.0, 1, 1, 0.5, description="one image per request; 50% repeat an earlier image (cache)"),
    "text": WorkloadShape(0.0, 0, 0, description="no images"),
    # Long prompts are what E+P+D is for: on a PD that also decodes, a 1-2k-token prefill lands
    # between the decode steps of every stream in its batch. 420-840 words are ~1-2k tokens with the
    # bench checkpoint's tokenizer (about 2.4 tokens a word, 2.8 for tiny's): with 64 output tokens
    # they stay well inside its 4096 positions.
    "long-mixed": WorkloadShape(
        0.125,  # of the other 80%: 10% of all requests
        1,
        2,
        long_fraction=0.2,
        long_words=(420, 840),
        description="20% of requests have a long text prompt (420-840 words, ~1-2k tokens), 10% carry 1-2 "
        "images, the rest are short text",
    ),
    "video": WorkloadShape(
        0.5,
        1,
        1,
        0.5,
        description="half the requests carry one 2-4 s clip (4 fps, sampled at 1-2 fps); 50% of clips repeat",
        media="video",
    ),
}

VIDEO_FPS = 4  # frame rate of the bench's clips; the sampling rate (1 or 2 fps) is drawn per clip


@dataclass(frozen=True)
class ImageRef:
    """A deterministic noise image: pixels are a function of ``key`` alone."""

    key: tuple[int, int, int]  # (seed, run, image number): unique within and across runs
    width: int
    height: int
    video: bool = False  # a clip of 2-4 s (length and sampling rate drawn from ``key``)

    @property
    def clip(self) -> tuple[int, int]:
        """(frames, sampling fps) of a video ref."""
        rng = random.Random(f"epd-bench-serve:clip:{self.key}")
        return VIDEO_FPS * rng.randint(2, 4), rng.choice((1, 2))


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run (before it is turned into an HTTP body)."""

    index: int
    prompt: str
    images: tuple[ImageRef, ...]
    image_class: str | None  # "first_seen" | "repeated" | "partial" | None (text)
    max_tokens: int
    long_prompt: bool = False  # a long text prompt of a ``long_fraction`` workload

    @property
    def kind(self) -> str:
        """The request's kind: image, long (a long text prompt) or text (a short one: a stream a prefill stalls)."""
        if self.images:
            return "image"
        return "long" if self.long_prompt else "text"


def make_requests(
    workload: str,
    num_requests: int,
    *,
    seed: int,
    run: int,
    image_size: int,
    prompt_words: int = 32,
    max_tokens: int = 64,
    long_words: tuple[int, int] | None = None,
) -> list[RequestSpec]:
    """The requests of one run, in arrival order (``long_words``: the long prompts' word range, None = the
    workload's)."""
    shape = _with_long_words(WORKLOADS[workload], long_words)
    rng = random.Random(f"epd-bench-serve:{workload}:{seed}:{run}")
    sent: list[ImageRef] = []
    requests = []
    for index in range(num_requests):
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(prompt_words))
        earlier = len(sent)  # images of earlier requests: sent[:earlier]
        images: list[ImageRef] = []
        num_repeated = 0
        # Only workloads with long prompts draw for them: the others' requests stay what they were.
        if shape.long_fraction and rng.random() < shape.long_fraction:
            prompt = _long_prompt(rng, shape)
            requests.append(RequestSpec(index, prompt, (), None, max_tokens, long_prompt=True))
            continue
        if rng.random() < shape.image_request_fraction:
            for _ in range(rng.randint(shape.min_images, shape.max_images)):
                if earlier and rng.random() < shape.repeat_fraction:
                    images.append(sent[rng.randrange(earlier)])
                    num_repeated += 1
                else:
                    width, height = (max(8, round(image_size * rng.uniform(0.75, 1.25))) for _ in range(2))
                    images.append(ImageRef((seed, run, len(sent)), width, height, shape.media == "video"))
                    sent.append(images[-1])
        requests.append(RequestSpec(index, prompt, tuple(images), _image_class(len(images), num_repeated), max_tokens))
    return requests


def _with_long_words(shape: WorkloadShape, long_words: tuple[int, int] | None) -> WorkloadShape:
    if long_words is None or not shape.long_fraction:
        return shape
    low, high = long_words
    if not 1 <= low <= high:
        raise ValueError(f"long prompt words must be 1 <= min <= max, got {low},{high}")
    return dataclasses.replace(shape, long_words=(low, high))


def _long_prompt(rng: random.Random, shape: WorkloadShape) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(*shape.long_words)))


def _image_class(num_images: int, num_repeated: int) -> str | None:
    """first_seen: every image is new in the run; repeated: every image was sent by an earlier request."""
    if not num_images:
        return None
    if not num_repeated:
        return "first_seen"
    return "repeated" if num_repeated == num_images else "partial"


def lone_requests(
    workload: str,
    count: int,
    *,
    seed: int,
    run: int,
    image_size: int,
    prompt_words: int = 32,
    max_tokens: int = 64,
    long_words: tuple[int, int] | None = None,
) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(text requests, heaviest requests of ``workload``) for single-request calibration.

    The heavy ones have the workload's longest prompt when it has long
    prompts (a 2k-token prefill costs more than its 1-2 images), otherwise
    they carry its most images, each new and exactly ``image_size`` square;
    the list is empty for a workload with neither.
    """
    texts = make_requests(
        "text", count, seed=seed, run=run, image_size=image_size, prompt_words=prompt_words, max_tokens=max_tokens
    )
    shape = _with_long_words(WORKLOADS[workload], long_words)
    if shape.long_fraction:
        rng = random.Random(f"epd-bench-serve:long:{seed}:{run}")
        longest = [" ".join(rng.choice(PROMPT_WORDS) for _ in range(shape.long_words[1])) for _ in texts]
        return texts, [RequestSpec(i, p, (), None, max_tokens, long_prompt=True) for i, p in enumerate(longest)]
    return texts, _heaviest_image_requests(workload, texts, seed=seed, run=run, image_size=image_size)


def warmup_requests(
    workload: str,
    *,
    seed: int,
    run: int,
    image_size: int,
    prompt_words: int = 32,
    max_tokens: int = 8,
    long_words: tuple[int, int] | None = None,
) -> list[RequestSpec]:
    """One request of each kind ``workload`` sends (text, long prompt, images): first-call costs of every
    path stay out of the measurement."""
    texts, heavy = lone_requests(
        workload,
        1,
        seed=seed,
        run=run,
        image_size=image_size,
        prompt_words=prompt_words,
        max_tokens=max_tokens,
        long_words=long_words,
    )
    images = _heaviest_image_requests(workload, texts, seed=seed, run=run, image_size=image_size)
    return texts + heavy + [spec for spec in images if spec not in heavy]


def _heaviest_image_requests(
    workload: str, texts: list[RequestSpec], *, seed: int, run: int, image_size: int
) -> list[RequestSpec]:
    """``texts`` each carrying ``workload``'s most images (none for a workload without images)."""
    max_tokens = texts[0].max_tokens if texts else 0
    num_images = WORKLOADS[workload].max_images
    heavy = (
        [
            RequestSpec(
                index=i,
                prompt=spec.prompt,
                image_class="first_seen",
                max_tokens=max_tokens,
                images=tuple(
                    ImageRef(
                        (seed, run, i * num_images + k), image_size, image_size, WORKLOADS[workload].media == "video"
                    )
                    for k in range(num_images)
                ),
            )
            for i, spec in enumerate(texts)
        ]
        if num_images
        else []
    )
    return heavy


def poisson_arrivals(num_requests: int, rate: float, *, seed: int) -> list[float]:
    """Arrival times (seconds) of an open-loop Poisson process at ``rate`` requests/s; the first is at 0.

    The unit-rate gaps depend on ``seed`` only, so every rate replays the same
    pattern, stretched.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(f"epd-bench-serve:arrivals:{seed}")
    times, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(1.0) / rate
        times.append(now)
    return times


def render_image(ref: ImageRef) -> bytes:
    """The JPEG bytes of ``ref`` (uniform noise: no two images share an embedding)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(list(ref.key)).integers(0, 256, size=(ref.height, ref.width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def render_video(ref: ImageRef) -> bytes:
    """The MP4 bytes of a video ``ref``: frames of a noise image scrolling sideways (MPEG-4 part 2)."""
    import av
    import numpy as np

    num_frames, _ = ref.clip
    base = np.random.default_rng(list(ref.key)).integers(0, 256, size=(ref.height, ref.width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = ref.width // 2 * 2, ref.height // 2 * 2, "yuv420p"
        for index in range(num_frames):
            frame = np.ascontiguousarray(np.roll(base, 4 * index, axis=1)[: stream.height, : stream.width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def _media_part(ref: ImageRef, urls: dict[tuple[int, int, int], str]) -> dict[str, Any]:
    if ref.video:
        return {"type": "video_url", "video_url": {"url": urls[ref.key]}}
    return {"type": "image_url", "image_url": {"url": urls[ref.key]}}


def chat_body(
    spec: RequestSpec, image_urls: dict[tuple[int, int, int], str], *, images_first: bool = False
) -> dict[str, Any]:
    """The streaming OpenAI chat request for ``spec`` (greedy, fixed length, token ids returned).

    The text comes before the images (as in OpenAI's examples) unless
    ``images_first``: then a repeated image is a shared prompt prefix that
    PD's prefix cache can serve.
    """
    if spec.images:
        text: list[Any] = [{"type": "text", "text": spec.prompt}]
        images = [_media_part(ref, image_urls) for ref in spec.images]
        content: Any = images + text if images_first else text + images
    else:
        content = spec.prompt
    videos = [ref for ref in spec.images if ref.video]
    sampling = {"mm_processor_kwargs": {"fps": videos[0].clip[1]}} if videos else {}
    return {
        **sampling,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # every request generates exactly max_tokens: TPOT compares like with like
        "return_token_ids": True,  # exact token counts per SSE chunk
    }


def encode_bodies(specs: list[RequestSpec], *, images_first: bool = False) -> list[bytes]:
    """JSON bodies of ``specs``, built before the clock starts (each distinct image rendered once)."""
    urls: dict[tuple[int, int, int], str] = {}
    for spec in specs:
        for ref in spec.images:
            if ref.key not in urls and ref.video:
                urls[ref.key] = "data:video/mp4;base64," + base64.b64encode(render_video(ref)).decode()
            elif ref.key not in urls:
                urls[ref.key] = "data:image/jpeg;base64," + base64.b64encode(render_image(ref)).decode()
    return [
        json.dumps(chat_body(spec, urls, images_first=images_first), separators=(",", ":")).encode() for spec in specs
    ]
