"""deploy/test-containers.sh in a real engine: build, up, requests, SIGKILL and recovery, drain, down.

Marked ``containers``: it runs only when selected (``pytest -m containers``)
and is skipped where no engine works (no Docker daemon, no Podman); it takes
minutes where one does. The environment reaches the script (build arguments,
SKIP_BUILD, CA_BUNDLE, ...). The script's own figures
(build, ready and recovery seconds) are printed and, with $RESULTS, recorded.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from deploy_support import DEPLOY, REPO

SCRIPT = DEPLOY / "test-containers.sh"


def _works(*command: str) -> bool:
    if shutil.which(command[0]) is None:
        return False
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _engine() -> tuple[str, str] | str:
    """``(engine, compose command)`` for the first engine that answers with a compose that runs, else why not."""
    if _works("docker", "info"):
        if _works("docker", "compose", "version"):
            return "docker", "docker compose"
        why = "`docker info` works but `docker compose` does not"
    else:
        why = "`docker info` fails"
    if _works("podman", "info"):
        if _works("podman-compose", "version"):
            return "podman", "podman-compose"
        return f"{why}; `podman info` works but podman-compose is not installed (pip install podman-compose)"
    return f"{why}; `podman info` fails: no container engine here"


def test_the_script_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.containers
@pytest.mark.timeout(3600)
def test_compose_stack_in_a_container_engine(request):
    # Opt-in: it builds an image (minutes, and a base image to pull), which a
    # plain `pytest` run on a machine that merely has an engine should not do.
    if "containers" not in (request.config.getoption("-m") or ""):
        pytest.skip("opt-in: run with `pytest -m containers` (builds the image and runs the stack)")
    found = _engine()
    if isinstance(found, str):
        pytest.skip(found)
    engine, compose = found
    env = {**os.environ, "ENGINE": engine, "COMPOSE": compose}
    result = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=3500)
    figures = [line for line in result.stderr.splitlines() if "=" in line and line.startswith("[test-containers]")]
    print("\n".join(figures))
    assert result.returncode == 0, result.stderr[-6000:]
