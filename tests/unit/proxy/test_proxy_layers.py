"""The proxy's import contracts (pyproject.toml: ``proxy-layers``, ``proxy-acyclic``) hold on the real tree
and catch what they are for: each case plants one import in a copy of ``services/`` and runs ``lint-imports``
there with the project's configuration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
_CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
NAMES = {contract["id"]: contract["name"] for contract in _CONTRACTS if "id" in contract}
PROXY = ("proxy-layers", "proxy-acyclic")

pytestmark = pytest.mark.skipif(LINT_IMPORTS is None, reason="lint-imports is not installed (the lint extra)")


def lint_imports(tree: Path, *contracts: str) -> tuple[int, str]:
    """``lint-imports`` run in ``tree`` (the ``services`` package there is the one analysed), without a cache:
    its exit status and its report, whitespace collapsed (it wraps long lines)."""
    assert LINT_IMPORTS is not None
    selected = [arg for contract in contracts for arg in ("--contract", contract)]
    done = subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo", *selected],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the project's ``services`` package and ``pyproject.toml``, to plant imports in."""
    shutil.copytree(ROOT / "services", tmp_path / "services", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_real_tree_keeps_every_contract():
    status, report = lint_imports(ROOT)
    assert status == 0, report[-3000:]
    for contract in PROXY:
        assert f"{NAMES[contract]} KEPT" in report


def test_an_untouched_copy_keeps_the_proxy_contracts(tree: Path):
    # What the cases below plant into must pass as it is, or they would prove nothing.
    status, report = lint_imports(tree, *PROXY)
    assert status == 0, report[-3000:]
    assert "2 kept, 0 broken" in report


PLANTED = {
    # A low wing importing a higher one: the backends know nothing of dispatch.
    "backends import dispatch": ("backends/planted.py", "from services.proxy.dispatch import pipeline", "proxy-layers"),
    # The wings of one layer are independent of each other: the protocol builds no prompts.
    "openai imports prompt": ("openai/planted.py", "from services.proxy.prompt import preprocess", "proxy-layers"),
    # A wing importing the shell: the shell hands a wing what it needs, never its whole config.
    "prompt imports the config": ("prompt/planted.py", "from services.proxy import config", "proxy-layers"),
    # A shared module importing a wing.
    "errors import web": ("errors.py", "from services.proxy.web import http_util", "proxy-layers"),
    # A new module of the shell must be given a layer (the contract is exhaustive).
    "a module in no layer": ("planted.py", "from services.proxy import errors", "proxy-layers"),
    # The circle that was broken: an attempt calling back into the pipeline that runs it, even for types.
    "attempt imports the pipeline": (
        "dispatch/attempt.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from services.proxy.dispatch import pipeline",
        "proxy-acyclic",
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_import_breaks_its_contract(tree: Path, case: str):
    module, source, contract = PLANTED[case]
    path = tree / "services" / "proxy" / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{source}\n")
    status, report = lint_imports(tree, *PROXY)
    assert status != 0, report[-3000:]
    assert f"{NAMES[contract]} BROKEN" in report, report[-3000:]
