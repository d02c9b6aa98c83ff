"""deploy/Dockerfile: its build arguments, the CA secret that never lands in a layer, no VOLUME.

No engine builds the image here, so the pip steps' shell runs as written
with a stand-in ``python`` that records what pip would have been asked.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from deploy_support import DEPLOY, dockerfile_instructions

PIP_INSTALL = DEPLOY / "pip-install.sh"
SECRET_PATH = "/run/secrets/ca_bundle"

FAKE_PYTHON = """#!/bin/sh
# Stands in for the image's python: answers pip's certifi path, records a pip call.
if [ "$1" = "-c" ]; then echo "$FAKE_CERTIFI"; exit 0; fi
printf '%s\\n' "$@" > "$RECORD/args"
env | grep '^PIP_INDEX_URL=' > "$RECORD/index" || true
if [ -n "${PIP_CERT:-}" ]; then cat "$PIP_CERT" > "$RECORD/cert"; echo "$PIP_CERT" > "$RECORD/cert_path"; fi
"""


def _args() -> dict[str, str]:
    """Each ARG with its default."""
    return dict(rest.partition("=")[::2] for kind, rest in dockerfile_instructions() if kind == "ARG")


def _pip_runs() -> list[str]:
    return [rest for kind, rest in dockerfile_instructions() if kind == "RUN" and "pip-install.sh" in rest]


def test_base_image_is_an_argument():
    instructions = dockerfile_instructions()
    froms = [rest for kind, rest in instructions if kind == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")  # declared before FROM: usable there


def test_torch_comes_from_an_extra_index_and_find_links_never_instead_of_pypi():
    args = _args()
    assert {"TORCH_VERSION", "TORCH_EXTRA_INDEX_URL", "TORCH_FIND_LINKS", "PIP_INDEX_URL"} <= set(args)
    for kind, rest in dockerfile_instructions():
        assert "--index-url" not in rest.replace("--extra-index-url", ""), (kind, rest)
    assert "--index-url" not in PIP_INSTALL.read_text().replace("--extra-index-url", "")


def test_the_ca_bundle_is_a_build_secret_on_every_pip_step_and_never_in_a_layer():
    runs = _pip_runs()
    assert len(runs) == 2  # torch, then the project
    for run in runs:
        assert "--mount=type=secret,id=ca_bundle" in run
        assert "--mount=type=bind,source=deploy/pip-install.sh," in run  # mounted for the step, not copied
    for kind, rest in dockerfile_instructions():
        if kind in ("COPY", "ADD"):
            assert "ca" not in rest.split()[:-1] and "pip-install" not in rest, rest
        if kind in ("ENV", "ARG"):
            assert not {"PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"} & {w.split("=")[0] for w in rest.split()}


def test_no_volume_and_a_non_root_user():
    kinds = [kind for kind, _ in dockerfile_instructions()]
    assert "VOLUME" not in kinds  # one anonymous volume per container and per `up` otherwise
    users = [rest for kind, rest in dockerfile_instructions() if kind == "USER"]
    assert users == ["epd"] and kinds.index("USER") < kinds.index("ENTRYPOINT")


def test_the_build_context_holds_only_what_the_build_uses():
    lines = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "**"  # everything out (deploy/internal-token included) ...
    assert {"!pyproject.toml", "!README.md", "!services", "!deploy/pip-install.sh"} <= set(lines)  # ... but these


@pytest.fixture
def build_step(tmp_path):
    """Runs a Dockerfile pip step's shell with the given build arguments and an optional CA secret."""
    record, bin_dir = tmp_path / "record", tmp_path / "bin"
    record.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    certifi = tmp_path / "certifi.pem"
    certifi.write_text("PIP'S OWN ROOTS\n")
    secret = tmp_path / "ca_bundle"
    script = tmp_path / "pip-install.sh"
    script.write_text(PIP_INSTALL.read_text().replace(SECRET_PATH, str(secret)))

    def run(step: str, ca: str | None = None, **build_args: str) -> dict:
        if ca is not None:
            secret.write_text(ca)
        command = " ".join(t for t in shlex.split(step, posix=False) if not t.startswith("--mount="))
        command = command.replace("/tmp/pip-install.sh", str(script)).split(" && ")[0]
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "FAKE_CERTIFI": str(certifi)}
        env |= {**_args(), **build_args}
        subprocess.run(["/bin/sh", "-c", command], env=env, check=True, timeout=30)
        seen = {p.name: p.read_text() for p in record.iterdir()}
        for p in record.iterdir():
            p.unlink()
        return seen

    return run


def test_default_torch_step_uses_pytorchs_cpu_index_beside_pypi(build_step):
    torch_step, _ = _pip_runs()
    seen = build_step(torch_step)
    assert seen["args"].split() == [
        "-m",
        "pip",
        "install",
        "torch==2.13.0",
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    assert seen["index"] == "" and "cert" not in seen  # PyPI itself, no extra CA


def test_a_local_wheel_directory_and_a_mirror(build_step):
    torch_step, _ = _pip_runs()
    seen = build_step(
        torch_step,
        TORCH_EXTRA_INDEX_URL="",
        TORCH_FIND_LINKS="http://127.0.0.1:8080/wheels/",
        PIP_INDEX_URL="https://mirror.example/simple",
    )
    assert seen["args"].split()[3:] == ["torch==2.13.0", "--find-links", "http://127.0.0.1:8080/wheels/"]
    assert seen["index"].strip() == "PIP_INDEX_URL=https://mirror.example/simple"


def test_the_ca_secret_is_trusted_beside_pips_roots_and_removed(build_step):
    _, project_step = _pip_runs()
    seen = build_step(project_step, ca="CORPORATE ROOT\n")
    assert seen["args"].split() == ["-m", "pip", "install", ".[structured]"]
    assert seen["cert"] == "PIP'S OWN ROOTS\nCORPORATE ROOT\n"
    assert not Path(seen["cert_path"].strip()).exists(), "the combined bundle outlived the step"


def test_the_image_installs_the_structured_extra_unless_told_otherwise(build_step):
    _, project_step = _pip_runs()
    assert _args()["EPD_EXTRAS"] == "structured"  # PD serves structured outputs from the default image
    assert build_step(project_step)["args"].split()[3:] == [".[structured]"]
    assert build_step(project_step, EPD_EXTRAS="")["args"].split()[3:] == ["."]  # a proxy- or encoder-only image


def test_an_empty_secret_changes_nothing(build_step):
    _, project_step = _pip_runs()
    assert "cert" not in build_step(project_step, ca="")  # e.g. `--secret id=ca_bundle,src=/dev/null`
