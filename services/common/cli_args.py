"""Command-line flags that also read ``EPD_*`` environment variables, and the help that shows them.

Every flag ``--some-flag`` defaults to ``$EPD_SOME_FLAG`` when set, then to
its documented default; ``--help`` shows both. The environment is read when
the parser is built (at start-up), never at import time. ``HelpFormatter``
and ``group_flags`` make a long ``--help`` read in titled groups.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

_METAVARS: dict[Any, str] = {int: "N", float: "NUM"}
"""Placeholders by flag type: ``--max-num-seqs N`` reads better than ``--max-num-seqs MAX_NUM_SEQS``."""


def _metavar(flag: str) -> str:
    """The placeholder of a text flag: its last word (``--internal-token-file FILE``, ``--metrics-host HOST``)."""
    return flag.rsplit("-", 1)[-1].upper()


_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """Help text without reST markup: ``--flag`` literals lose their double backticks."""
    return _LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``epd``'s help: descriptions keep their paragraphs and lists (a line too long is wrapped), reST
    literals print plain, and the default of a flag defined without ``add_flag`` is shown (never one
    that is None, empty or off)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 28, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in plain(text).splitlines():
            if len(indent) + len(line) <= width:
                lines.append(indent + line)
                continue
            hanging = " " * (len(line) - len(line.lstrip(" -")))  # a list item's continuation lines
            lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent + hanging)
        return "\n".join(lines)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain(text), width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = "%(default)" in text or "default:" in text or "(default" in text
        boring = action.default in (None, "", False, argparse.SUPPRESS) or not action.option_strings
        if shown or boring or isinstance(action, argparse._StoreConstAction | argparse._HelpAction):
            return action.help
        return f"{text} (default: %(default)s)"


def group_flags(parser: argparse.ArgumentParser, groups: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Moves flags already on ``parser`` into titled groups of ``--help``, in the order given.

    ``groups``: (title, flags) pairs. A title that exists already (``internal transport
    security``) is reused, the flags named here first. Parsing is unchanged: only ``--help``
    is arranged. A flag that ``parser`` does not have is a mistake (ValueError); a group left
    empty prints nothing.
    """
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    titled = {group.title: group for group in parser._action_groups}
    order = []
    for title, flags in groups:
        missing = [flag for flag in flags if flag not in by_flag]
        if missing:
            raise ValueError(f"{parser.prog}: no flag {', '.join(missing)} to put under {title!r}")
        moved = [by_flag[flag] for flag in flags]
        for other in parser._action_groups:
            other._group_actions[:] = [action for action in other._group_actions if action not in moved]
        group = titled.get(title) or parser.add_argument_group(title)
        titled[title] = group
        group._group_actions[:0] = moved
        order.append(group)
    # The positionals and what stays ungrouped (-h) first, the groups in the order given, then the others.
    first = [parser._positionals, parser._optionals]
    listed = list(dict.fromkeys(order))
    others = [group for group in parser._action_groups if group not in first and group not in listed]
    parser._action_groups[:] = [*first, *listed, *others]


DEFAULT_MODEL = "tiny"
"""What an empty ``--model`` runs: the built-in tiny preset (``epd make-model``), built on first use."""


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
    shown_default: str | None = None,
) -> None:
    """Adds ``flag`` whose default comes from ``EPD_<FLAG>`` when that is set.

    A bool default makes a switch: ``--flag`` / ``--no-flag``. ``--help`` shows the
    variable and the default (``shown_default`` when given: what an empty default
    means); an empty default is not shown, its help says what it means.
    """
    env = env_name(flag)
    raw = os.environ.get(env)
    shown = shown_default if shown_default is not None else default
    suffix = f"[env {env}; default: {shown}]" if shown != "" else f"[env {env}]"
    if isinstance(default, bool):
        value = _parse_bool(raw) if raw is not None else default
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=value,
            help=f"{help} {suffix}",
        )
        return
    convert: Callable[[str], Any] = type or str  # no type: the text as is
    initial = convert(raw) if raw is not None else default
    parser.add_argument(
        flag,
        type=convert,
        default=initial,
        choices=choices,
        metavar=None if choices else _METAVARS.get(type) or _metavar(flag),
        help=f"{help} {suffix}",
    )


def add_common_flags(parser: argparse.ArgumentParser, *, port: int, metrics_port: int | None) -> None:
    """Flags every gRPC service takes: model, device, dtype, address, logging."""
    add_flag(
        parser,
        "--model",
        default="",
        shown_default=DEFAULT_MODEL,
        help="checkpoint directory, preset name (built on first use) or hub id of a LLaVA, Qwen2-VL or Qwen2.5-VL "
        "checkpoint; empty = the built-in tiny model",
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
