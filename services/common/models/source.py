"""Where a checkpoint's files come from: a local directory or a Hugging Face hub id."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CONFIG_PATTERNS = ("config.json", "processor_config.json", "generation_config.json")
PROCESSOR_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json")


class CheckpointSource:
    """A checkpoint named by a directory or a hub id.

    A directory is used as is. A hub id is fetched lazily, only the files a
    caller asks for (the proxy never downloads weights): first from the local
    Hugging Face cache, then from the hub.
    """

    def __init__(self, path_or_hub_id: str | Path):
        self.name = str(path_or_hub_id)
        path = Path(self.name).expanduser()
        self.local_dir: Path | None = path if path.is_dir() else None
        if self.local_dir is None and _looks_like_path(self.name):
            raise FileNotFoundError(f"model directory {self.name!r} does not exist")

    @property
    def model_id(self) -> str:
        """The directory's name for a local checkpoint, else the hub id."""
        return self.local_dir.resolve().name if self.local_dir is not None else self.name

    def directory(self, patterns: Sequence[str]) -> Path:
        """A local directory holding at least the files matching ``patterns``."""
        if self.local_dir is not None:
            return self.local_dir
        from huggingface_hub import snapshot_download  # only hub ids need it

        try:
            return Path(snapshot_download(self.name, allow_patterns=list(patterns), local_files_only=True))
        except Exception:
            pass
        try:
            return Path(snapshot_download(self.name, allow_patterns=list(patterns)))
        except Exception as err:
            raise FileNotFoundError(
                f"{self.name!r} is not a local directory and could not be fetched from the Hugging Face hub "
                f"({type(err).__name__}); download it where there is network access and pass its directory"
            ) from err


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``owner/name``; anything else with path syntax is a missing directory."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
