"""``epd make-model``: build a random-weight checkpoint (LLaVA, Qwen2-VL, Qwen2.5-VL) offline."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from services.common import cli_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.models import PRESETS

    cli_args.add_flag(
        parser,
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="model shapes: tiny (tests, seconds) or bench (ViT-B/16 + ~125M LM) LLaVA; "
        "llava-siglip-tiny (SigLIP tower); qwen2.5-vl-tiny, qwen2-vl-tiny (tests) or "
        "qwen2.5-vl-bench (bench-sized Qwen2.5-VL); llava-1.5-7b-random (LLaVA-1.5-7B shapes, "
        "7.06B parameters) and qwen2.5-vl-7b-random (Qwen2.5-VL-7B shapes): built with --device cuda in "
        "bfloat16, ~14 and ~17 GB",
    )
    cli_args.add_flag(
        parser,
        "--device",
        default="",
        help="where the weights are made: cpu for every preset but the *-7b-random ones (float32, "
        "byte-identical per seed), cuda for those (bfloat16); '' = the preset's",
    )
    cli_args.add_flag(
        parser,
        "--out",
        default="",
        help="output directory (default: the model cache, $EPD_CACHE_DIR/models/<preset>-v3)",
    )
    cli_args.add_flag(
        parser, "--seed", type=int, default=0, help="random seed; the same seed gives byte-identical weights"
    )
    cli_args.add_flag(parser, "--force", default=False, help="replace an existing checkpoint in --out")


def run(args: argparse.Namespace) -> int:
    from services.common.models import build_checkpoint, default_model_dir, get_preset
    from services.common.models.builder import build_device

    preset = get_preset(args.preset)
    if args.device and args.device != preset.build_device:
        print(f"the {preset.name} preset is built on {preset.build_device}, not {args.device}", file=sys.stderr)
        return 2
    try:
        build_device(preset)
    except ValueError as error:  # e.g. the 7B preset on a machine without CUDA
        print(f"cannot build {preset.name}: {error}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_model_dir(args.preset)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"{out} already exists and is not empty; pass --force to replace it", file=sys.stderr)
        return 2
    started = time.monotonic()
    path = build_checkpoint(
        args.preset, out, seed=args.seed, overwrite=args.force, progress=lambda msg: print(f"  {msg}", flush=True)
    )
    print(
        f"built {args.preset} checkpoint at {path} in {time.monotonic() - started:.1f}s "
        "(random weights: its text is gibberish by design)"
    )
    return 0
