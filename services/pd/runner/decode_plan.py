"""Start-up policy of the static decode path (``decode_graphs``): whether it runs, how, and what a failure does.

``StaticDecodeConfig`` is what the PD was asked for (``--max-num-seqs``,
``--enforce-eager``, ...); ``plan_static_decode`` turns it into the plan for
one device (kernel, warm-up, capture, whether it is required), and
``start_static_decoder`` carries the plan out: a required path that fails to
build, compile or capture refuses start-up with ``DecodePathRefused``, an
optional one falls back to packed steps with a warning.

Nothing here touches a tensor or imports torch at run time: the service
shell reads the configuration and the refusal without loading the decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from services.pd.runner.decode_graphs import StaticDecoder

log = logging.getLogger(__name__)

KERNELS = ("flex", "ragged")

# The smallest KV block the flex kernel compiles for on CUDA: inductor's Triton
# template tiles the KV axis by the block mask's block size and needs a power
# of two of at least 16 (its smallest tile). The CPU template takes any size.
MIN_FLEX_BLOCK_SIZE = 16


class DecodePathRefused(RuntimeError):
    """The static decode path cannot run as configured, and the PD must not start without it.

    Its message is one line naming the flag that changes the outcome.
    """


@dataclass(frozen=True)
class StaticDecodeConfig:
    """How a runner serves decode-only steps (``decode_graphs``)."""

    enabled: bool | None = None  # None = on CUDA (when flex_attention is available), off elsewhere
    kernel: str = "auto"  # flex | ragged | auto (= flex on CUDA, ragged on CPU)
    cuda_graphs: bool = True  # capture and replay on CUDA; False is --enforce-eager
    max_num_seqs: int = 64  # largest decode batch: the top of the ladder
    max_model_len: int = 2048  # longest context: the width of the block tables

    def __post_init__(self) -> None:
        if self.kernel not in ("auto", *KERNELS):
            raise ValueError(f"static decode kernel must be 'auto' or one of {KERNELS}")
        if self.max_num_seqs <= 0 or self.max_model_len <= 0:
            raise ValueError("max_num_seqs and max_model_len must be positive")


@dataclass(frozen=True)
class StaticDecodePlan:
    """What start-up does for the static decode path on one device (see ``plan_static_decode``)."""

    kernel: str  # flex | ragged
    warm_up: bool  # run every ladder size once before ready (compiles the kernel)
    capture: bool  # capture every ladder size as a CUDA graph
    required: bool  # a failure refuses start-up (DecodePathRefused) instead of falling back to packed steps


def plan_static_decode(config: StaticDecodeConfig, device: torch.device, block_size: int) -> StaticDecodePlan | None:
    """The start-up plan of the static decode path for ``device``, or None when it is off.

    On CUDA it is required unless ``--enforce-eager`` (``cuda_graphs=False``):
    then nothing is captured, and a kernel that fails to build only logs a
    warning and decode steps take the packed path. Asking for it explicitly
    (``enabled=True``) always makes it required. Raises ``DecodePathRefused``
    for a block size the flex kernel cannot compile for.
    """
    on_cuda = device.type == "cuda"
    enabled = on_cuda if config.enabled is None else config.enabled
    if not enabled:
        return None
    kernel = config.kernel if config.kernel != "auto" else ("flex" if on_cuda else "ragged")
    if kernel == "flex" and on_cuda:
        check_flex_block_size(block_size)
    capture = on_cuda and config.cuda_graphs
    return StaticDecodePlan(kernel=kernel, warm_up=on_cuda, capture=capture, required=capture or bool(config.enabled))


def check_flex_block_size(block_size: int) -> None:
    """Refuses a KV block size the CUDA flex kernel cannot compile for (below 16, or not a power of two)."""
    if block_size < MIN_FLEX_BLOCK_SIZE or block_size & (block_size - 1):
        raise DecodePathRefused(
            f"--block-size {block_size} does not work with the CUDA flex_attention decode kernel: it needs a "
            f"power of two >= {MIN_FLEX_BLOCK_SIZE} (e.g. --block-size 16)"
        )


def start_static_decoder(build: Callable[[str], StaticDecoder], plan: StaticDecodePlan) -> StaticDecoder | None:
    """Builds the static decoder with ``build(kernel)``, then warms it up and captures it as ``plan`` says.

    A failure of a required path raises ``DecodePathRefused`` naming the stage
    that failed; otherwise it logs a warning and returns None (packed steps).
    """
    stage = "building"
    try:
        decoder = build(plan.kernel)
        if plan.warm_up:
            stage = "compiling (warm-up)"
            decoder.warm_up()
        if plan.capture:
            stage = "capturing CUDA graphs for"
            decoder.capture()
    except Exception as error:
        if not plan.required:
            log.warning("static decode path unavailable; decode steps take the packed path", exc_info=True)
            return None
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:300]  # one line
        raise DecodePathRefused(
            f"{stage} the {plan.kernel} static decode path failed ({detail}); refusing to start rather than "
            "decode without it: fix the cause, or pass --enforce-eager to run decode steps eagerly"
        ) from error
    return decoder
