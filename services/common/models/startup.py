"""The start-up check every service runs on ``--model``: one clear line instead of a traceback.

Torch-free, and transformers-free (the proxy and ``epd up`` run it too): a
missing built-in checkpoint is built by ``epd make-model`` in a child process
and only ``config.json`` is read.
"""

from __future__ import annotations

import sys

from .cache import ModelBuildError, ensure_model_in_child
from .processing import UnsupportedModelError
from .served import check_supported
from .source import CheckpointSource


def refuse_unservable_model(model: str, prog: str) -> int | None:
    """Exit code 2, after one line on stderr, when ``model`` is missing or of a family not served; else None.

    A preset name is built first (as the service itself would); only the
    configs of a checkpoint are read.
    """
    try:
        check_supported(CheckpointSource(ensure_model_in_child(model or None)))
    except (UnsupportedModelError, FileNotFoundError, ModelBuildError) as error:
        print(f"{prog}: {error}", file=sys.stderr, flush=True)
        return 2
    return None
