"""The start-up check every service runs on ``--model``: one clear line instead of a traceback."""

from __future__ import annotations

import sys

from .adapter import UnsupportedModelError
from .builder import ensure_model
from .families import check_supported
from .source import CheckpointSource


def refuse_unservable_model(model: str, prog: str) -> int | None:
    """Exit code 2, after one line on stderr, when ``model`` is missing or of a family not served; else None.

    A preset name is built first (as the service itself would); only the
    configs of a checkpoint are read.
    """
    try:
        check_supported(CheckpointSource(ensure_model(model or None)))
    except (UnsupportedModelError, FileNotFoundError) as error:
        print(f"{prog}: {error}", file=sys.stderr, flush=True)
        return 2
    return None
