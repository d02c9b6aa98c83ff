"""Where the built-in checkpoints live, and ``--model`` resolved to a checkpoint, without torch.

``builder.ensure_model`` builds a missing preset in this process (it imports
torch); ``ensure_model_in_child`` has ``epd make-model`` build it in a child
process, for callers that must not import torch (the proxy, start-up checks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .presets import PRESETS

BUILD_VERSION = "v3"  # bump when the builder's output changes, so cached builds are not reused
CONFIG_FILE = "config.json"
DEFAULT_PRESET = "tiny"


class ModelBuildError(RuntimeError):
    """A built-in checkpoint could not be built (the child process has said why on stderr)."""


def cache_root() -> Path:
    """``$EPD_CACHE_DIR``, by default ``~/.cache/epd`` (read when called): built checkpoints and kernels."""
    return Path(os.environ.get("EPD_CACHE_DIR") or "~/.cache/epd").expanduser()


def default_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    """``$EPD_CACHE_DIR/models/<preset>-<BUILD_VERSION>`` (default cache dir ``~/.cache/epd``), read when called."""
    return cache_root() / "models" / f"{preset}-{BUILD_VERSION}"


def is_built(directory: Path) -> bool:
    """True once a checkpoint has been published in ``directory`` (builds are renamed into place whole)."""
    return (directory / CONFIG_FILE).is_file()


def resolve_model(preset_or_path: str | None, build: Callable[[str, Path], object]) -> Path | str:
    """Resolve ``--model``: empty means the tiny preset, a preset name is built on first use by ``build(name, dir)``.

    An existing directory is returned as is; anything else is returned
    unchanged as a hub id (or a path the loader will report as missing).
    """
    name = preset_or_path or DEFAULT_PRESET
    if name in PRESETS:
        target = default_model_dir(name)
        if not is_built(target):
            build(name, target)
        return target
    path = Path(name).expanduser()
    return path if path.is_dir() else name


def ensure_model_in_child(preset_or_path: str | None) -> Path | str:
    """``resolve_model`` with a missing preset built by ``epd make-model`` in a child process.

    Its progress goes to this process's stdout and stderr. ``ModelBuildError``
    when the checkpoint is still missing afterwards; a concurrent builder that
    published it first counts as success.
    """
    return resolve_model(preset_or_path, _build_in_child)


def _build_in_child(preset: str, target: Path) -> None:
    command = [sys.executable, "-m", "services.cli", "make-model", "--preset", preset, "--out", str(target)]
    code = subprocess.run(command, check=False).returncode
    if not is_built(target):
        raise ModelBuildError(f"the built-in model {preset} could not be built (epd make-model exited with {code})")
