"""mkdocs hook: the command reference, rendered from the ``epd`` commands' own argparse parsers at build time.

A page that holds the line ``<!-- cli-reference -->`` gets it replaced by one
section per command of ``services.cli.COMMANDS`` (``epd bench`` with one
section per benchmark): its description, then one table per argument group
(``parser._action_groups``: whatever groups the commands declare) with each
flag's default, environment variable and help. Nothing is copied by hand, so
the page cannot drift from ``epd <command> --help``.

``EPD_*`` variables are cleared while the parsers are built (each flag's
default reads its variable then), so the page shows the built-in defaults
whatever the environment of the build.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MARKER = "<!-- cli-reference -->"
REPO_ROOT = Path(__file__).resolve().parents[2]
# services/common/cli_args.py appends "[env EPD_X; default: Y]" to every flag's help.
_ENV_SUFFIX = re.compile(r"^(?P<text>.*?)\s*\[env (?P<env>EPD_[A-Z0-9_]+); default: (?P<default>.*)\]\s*$", re.DOTALL)
_CODE_SPAN = re.compile(r"(`[^`]*`)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """mkdocs event: fills the marker of the page that has one."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_reference())


def render_reference() -> str:
    """Every command's section, in ``COMMANDS`` order."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from services import cli

    sections = [_summary(cli.COMMANDS)]
    with _without_epd_environment():
        for name in cli.COMMANDS:
            sections.append(_command_section(f"epd {name}", _subcommand(cli.build_parser([name]), name), level=2))
    return "\n".join(sections)


@contextlib.contextmanager
def _without_epd_environment() -> Iterator[None]:
    saved = {key: value for key, value in os.environ.items() if key.startswith("EPD_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` of ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise LookupError(f"no subcommand {name!r}")


def _summary(commands: dict[str, tuple[str, str]]) -> str:
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| [`epd {name}`](#{_slug(f'epd {name}')}) | {_cell(text)} |" for name, (_, text) in commands.items()]
    return "\n".join(rows) + "\n"


def _slug(title: str) -> str:
    """The anchor the toc extension gives a heading of plain words (``epd make-model`` -> ``epd-make-model``)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _command_section(title: str, parser: argparse.ArgumentParser, level: int) -> str:
    lines = [f"{'#' * level} {title}", ""]
    if parser.description:
        lines += [_prose(parser.description), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _documented(a)]
        if not actions:
            continue
        heading = "Options" if group.title in ("options", "optional arguments") else (group.title or "").capitalize()
        lines += [f"**{_cell(heading)}**", ""]
        if group.description:
            lines += [_prose(group.description), ""]
        lines += ["| flag | default | environment | meaning |", "|---|---|---|---|"]
        lines += [_row(parser, action) for action in actions]
        lines.append("")
    for action in parser._actions:  # epd bench: one section per benchmark
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines.append(_command_section(f"{title} {name}", sub, level + 1))
    return "\n".join(lines)


def _documented(action: argparse.Action) -> bool:
    return (
        not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and action.help != argparse.SUPPRESS
    )


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest}`"
    text = _expanded_help(parser, action)
    env, default = "", _default_text(action.default)
    match = _ENV_SUFFIX.match(text)
    if match:
        text, env, default = match["text"], f"`{match['env']}`", match["default"]
        default = f"`{default}`" if default else '`""`'
    if action.choices is not None and not isinstance(action.choices, dict):
        text += " (one of: " + ", ".join(f"`{choice}`" for choice in action.choices) + ")"
    return f"| {flags} | {default} | {env} | {_cell(text)} |"


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text with argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it."""
    text = action.help or ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    if isinstance(params.get("choices"), list | tuple):
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    with contextlib.suppress(KeyError, TypeError, ValueError):
        text = text % params
    return " ".join(text.split())


def _default_text(default: Any) -> str:
    if default is None or default is argparse.SUPPRESS:
        return ""
    return f"`{default}`" if default != "" else '`""`'


def _prose(text: str) -> str:
    """A description as markdown: rst-style ``code`` as code, paragraphs kept."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "\n\n".join(_escape(p.replace("``", "`")) for p in paragraphs if p)


def _cell(text: str) -> str:
    """``text`` inside a table cell: one line, pipes escaped."""
    return _escape(" ".join(text.replace("``", "`").split())).replace("|", "\\|")


def _escape(text: str) -> str:
    """Markdown and HTML specials outside code spans, so that help text renders as written."""
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = html.escape(parts[i], quote=False).replace("*", "\\*").replace("_", "\\_")
    return "".join(parts)
