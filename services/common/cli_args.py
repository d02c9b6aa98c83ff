"""Command-line flags that also read ``EPD_*`` environment variables.

Every flag ``--some-flag`` defaults to ``$EPD_SOME_FLAG`` when set, then to
its documented default; ``--help`` shows both. The environment is read when
the parser is built (at start-up), never at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env_name(flag: str) -> str:
    """``--max-batch-images`` -> ``EPD_MAX_BATCH_IMAGES``."""
    return "EPD_" + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: Any,
    help: str,
    type: Callable[[str], Any] | None = None,
    choices: list[Any] | None = None,
) -> None:
    """Adds ``flag`` whose default comes from ``EPD_<FLAG>`` when that is set.

    A bool default makes a switch: ``--flag`` / ``--no-flag``.
    """
    env = env_name(flag)
    raw = os.environ.get(env)
    if isinstance(default, bool):
        value = _parse_bool(raw) if raw is not None else default
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=value,
            help=f"{help} [env {env}; default: {default}]",
        )
        return
    convert: Callable[[str], Any] = type or str  # no type: the text as is
    initial = convert(raw) if raw is not None else default
    parser.add_argument(
        flag,
        type=convert,
        default=initial,
        choices=choices,
        help=f"{help} [env {env}; default: {default}]",
    )


def add_common_flags(parser: argparse.ArgumentParser, *, port: int, metrics_port: int | None) -> None:
    """Flags every gRPC service takes: model, device, dtype, address, logging."""
    add_flag(
        parser,
        "--model",
        default="",
        help="checkpoint directory, preset name (built on first use) or hub id of a LLaVA, Qwen2-VL or Qwen2.5-VL checkpoint (default: the built-in tiny model)",
    )
    add_flag(
        parser, "--device", default="auto", help="torch device: auto (cuda when present, else cpu), cpu, cuda, cuda:N"
    )
    add_flag(
        parser,
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype: auto = float32 on cpu, bfloat16 on cuda",
    )
    add_flag(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_flag(parser, "--port", type=int, default=port, help="gRPC port (0 = pick a free one)")
    if metrics_port is not None:
        add_flag(
            parser,
            "--metrics-port",
            type=int,
            default=metrics_port,
            help="Prometheus /metrics HTTP port (0 = pick a free one, -1 = off)",
        )
    add_flag(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    add_log_json_flag(parser)
    add_flag(parser, "--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")


def add_log_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-json``: one JSON object per log line (access lines carry their fields as keys)."""
    add_flag(parser, "--log-json", default=False, help="write logs as one JSON object per line")
