"""``epd <command> --help``: cheap to build (no torch), grouped, every default shown and none of them blank."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import cli
from services.bench import main as bench_main
from services.common import cli_args
from services.common.models import cache

REPO = Path(__file__).resolve().parents[3]
GROUPED = ("up", "encoder", "pd", "proxy")
"""Commands whose every flag sits in a titled group of ``--help``."""

HEAVY = ("torch", "transformers", "xgrammar")

_IMPORTS_OF_PARSER = """
import json, sys, time
started = time.monotonic()
from services import cli
cli.build_parser(sys.argv[1:])
print(json.dumps({"heavy": [m for m in %r if m in sys.modules], "took_s": time.monotonic() - started}))
"""


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("EPD_")}


def _sub_parser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser([command])
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices[command]


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_building_a_commands_parser_imports_no_torch(command):
    """``--help`` of every command (every benchmark's included) must not wait for torch to import."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_OF_PARSER % (HEAVY,), command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=True,
    )
    report = json.loads(done.stdout)
    print(f"epd {command}: parser built in {report['took_s']:.2f} s")
    assert report["heavy"] == [], f"building `epd {command}`'s parser imports {report['heavy']}"


@pytest.mark.parametrize("command", ["", *sorted(cli.COMMANDS)])
def test_help_answers_and_reads_plainly(command):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *([command] if command else []), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    print(f"epd {command} --help: {time.monotonic() - started:.2f} s")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "``" not in text  # reST literals print plain
    assert "None" not in text  # no "default: None" for flags without a default
    assert not re.search(r"default: ?[\]\)]", text)  # nor an empty one


def test_help_of_every_command_also_answers_in_process(capsys):
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        assert "usage: epd" in capsys.readouterr().out


@pytest.mark.parametrize("command", GROUPED)
def test_every_flag_is_in_a_titled_group(command):
    parser = _sub_parser(command)
    ungrouped = [
        action.option_strings
        for group in parser._action_groups
        if group in (parser._positionals, parser._optionals)
        for action in group._group_actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
    ]
    assert ungrouped == []
    titles = [group.title for group in parser._action_groups if group._group_actions]
    assert "logging and metrics" in titles and "internal transport security" in titles


@pytest.mark.parametrize("command", GROUPED)
def test_every_flag_names_its_variable_and_the_model_its_default(command):
    parser = _sub_parser(command)
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1].removeprefix("--no-").removeprefix("--")
        assert cli_args.env_name(f"--{flag}") in action.help, action.option_strings
    model = next(action for action in parser._actions if "--model" in action.option_strings)
    assert model.default == "" and "default: tiny]" in model.help
    assert cli_args.DEFAULT_MODEL == cache.DEFAULT_PRESET


def test_up_help_groups_read_in_order():
    titles = [group.title for group in _sub_parser("up")._action_groups if group._group_actions]
    assert titles == [
        "options",
        "model and devices",
        "topology",
        "routing (the proxy's)",
        "ports and network",
        "supervision",
        "logging and metrics",
        "internal transport security",
    ]


def test_epd_help_lists_every_benchmark():
    listed = cli.COMMANDS["bench"][1]
    assert all(name in listed for name in bench_main._benchmarks()), listed


def test_grouping_an_unknown_flag_is_a_mistake():
    parser = argparse.ArgumentParser(prog="epd x")
    cli_args.add_flag(parser, "--real", default=1, type=int, help="a flag")
    with pytest.raises(ValueError, match="--typo"):
        cli_args.group_flags(parser, [("group", ["--real", "--typo"])])
    cli_args.group_flags(parser, [("group", ["--real"])])
    assert parser.parse_args(["--real", "3"]).real == 3
    assert "group:\n  --real N" in parser.format_help()


def test_the_formatter_keeps_lists_prints_literals_plain_and_hides_empty_defaults():
    parser = argparse.ArgumentParser(
        prog="epd x",
        description="Runs ``epd up``.\n\n- one item\n- another",
        formatter_class=cli_args.HelpFormatter,
    )
    parser.add_argument("--count", type=int, default=3, help="how many")
    parser.add_argument("--name", default=None, help="a name")
    parser.add_argument("--text", default="", help="some text")
    parser.add_argument("--quick", action="store_true", help="fewer")
    text = " ".join(parser.format_help().split(" "))
    assert "Runs epd up.\n\n- one item\n- another" in text
    assert "how many (default: 3)" in text
    assert "a name\n" in text and "some text\n" in text and "fewer\n" in text
