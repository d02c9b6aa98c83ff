"""The README's links land on files that exist, and the command reference the docs build renders from the
parsers covers every command with its built-in defaults (``mkdocs build --strict`` in CI checks the rest)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from services.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[3]
HOOK = ROOT / "docs" / "hooks" / "cli_reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_of_the_readme_exists():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    relative = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert relative, "the README links into the docs"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert missing == []


def test_the_command_reference_renders_every_command_with_its_built_in_defaults(monkeypatch):
    monkeypatch.setenv("EPD_PD_BASE_PORT", "30000")  # a build's environment never shows on the page
    page = _hook().render_reference()
    for name in COMMANDS:
        assert f"\n## epd {name}\n" in page
    assert "\n### epd bench engine\n" in page
    assert "| `--pd-base-port` | `21061` | `EPD_PD_BASE_PORT` |" in page
    assert "| `--proxy-metrics-port` | `9099` | `EPD_PROXY_METRICS_PORT` |" in page


def test_the_hook_fills_only_the_page_with_the_marker():
    hook = _hook()
    assert hook.on_page_markdown("# Other page\n", page=None, config=None, files=None) == "# Other page\n"
    filled = hook.on_page_markdown(f"# Reference\n\n{hook.MARKER}\n", page=None, config=None, files=None)
    assert hook.MARKER not in filled and "## epd up" in filled
