"""Checkpoint keys in the layout the family's published checkpoints use, so every loader reads them as they are.

``save_pretrained`` of the pinned ``transformers`` writes LLaVA's vision
tower as ``vision_tower.<v>``; llava-hf's checkpoints (and the loaders that
follow them, vLLM's and SGLang's among them) have ``vision_tower.vision_model.<v>``.
The built-in presets are rewritten into the published layout after saving;
``loading.py`` reads both, and ``transformers`` maps both onto its modules.
Qwen2-VL-family checkpoints are saved in their published layout already.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def llava_hf_key(key: str) -> str:
    """A LLaVA checkpoint key in llava-hf's layout (``language_model.model.*``, ``language_model.lm_head.*``,
    ``vision_tower.vision_model.*``, ``multi_modal_projector.*``); keys already in it are returned unchanged."""
    for prefix, published in (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if key.startswith(prefix):
            key = published + key[len(prefix) :]
            break
    if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key[len("vision_tower.") :]
    return key


def rewrite_keys(directory: Path, rename: Callable[[str], str]) -> int:
    """Renames the tensors of every safetensors file in ``directory`` (and its index), in place, one file
    at a time (same tensors, same files); returns how many keys changed."""
    directory = Path(directory)
    changed = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            metadata = handle.metadata()
            names = list(handle.keys())
            if all(rename(name) == name for name in names):
                continue
            tensors = {rename(name): handle.get_tensor(name) for name in names}
        changed += sum(rename(name) != name for name in names)
        save_file(tensors, str(file), metadata=metadata)
    index = directory / INDEX_FILE
    if index.is_file():
        document = json.loads(index.read_text())
        document["weight_map"] = {rename(key): file for key, file in document["weight_map"].items()}
        index.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return changed
