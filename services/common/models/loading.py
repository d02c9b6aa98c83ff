"""Partial loading of Hugging Face checkpoints from safetensors.

Each service loads only the tensors it runs: the encoder reads the vision
tower and projector, the PD reads the language model. Tensors are read with
``safetensors.safe_open`` (never pickle), one by one, straight into modules
built on the meta device.

Checkpoint key layouts handled (``<v>`` is the vision tower's own names):

=====================  ====================================  ===========================
part                   transformers 5                        llava-hf (legacy)
=====================  ====================================  ===========================
vision tower           ``model.vision_tower.<v>``            ``vision_tower[.vision_model].<v>``
projector              ``model.multi_modal_projector.*``     ``multi_modal_projector.*``
LM decoder             ``model.language_model.*``            ``language_model.model.*``
LM head                ``lm_head.*``                         ``language_model.lm_head.*``
=====================  ====================================  ===========================

Qwen2-VL / Qwen2.5-VL checkpoints (``split_qwen_key``):

=====================  ====================================  ===========================
part                   transformers 5                        hub (legacy)
=====================  ====================================  ===========================
vision tower + merger  ``model.visual.<v>``                  ``visual.<v>``
LM decoder             ``model.language_model.*``            ``model.*``
LM head                ``lm_head.*``                         ``lm_head.*``
=====================  ====================================  ===========================

Qwen3-VL's published checkpoints use the transformers 5 column (the merger and
the DeepStack mergers are part of ``model.visual``); its MoE checkpoints hold
each layer's experts fused, the last two dimensions of ``QWEN3_MOE_EXPERT_TENSORS``
transposed against transformers' modules (``load_part``'s ``fit`` turns them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_IN_ERROR = 20


class Part(Enum):
    """The separately loadable parts of a checkpoint (Qwen's merger is part of its vision tower)."""

    VISION_TOWER = "vision_tower"
    PROJECTOR = "multi_modal_projector"
    LANGUAGE_MODEL = "language_model"


class MissingWeightsError(ValueError):
    """A checkpoint lacks tensors a module needs; the message lists their names."""

    def __init__(self, checkpoint: Path, names: Iterable[str]):
        self.names = sorted(names)
        shown = ", ".join(self.names[:_MAX_NAMES_IN_ERROR])
        more = len(self.names) - _MAX_NAMES_IN_ERROR
        suffix = f" (and {more} more)" if more > 0 else ""
        super().__init__(f"checkpoint {checkpoint} is missing {len(self.names)} tensor(s): {shown}{suffix}")


def split_checkpoint_key(key: str) -> tuple[Part, str] | None:
    """Map a checkpoint key to (part, name inside that part's module); ``None`` if in no part.

    Language-model names are those of a ``*ForCausalLM`` (``model.*``, ``lm_head.*``).
    """
    name = key.removeprefix("model.")
    for part in (Part.VISION_TOWER, Part.PROJECTOR):
        if name.startswith(part.value + "."):
            return part, name[len(part.value) + 1 :]
    if name.startswith("lm_head."):
        return Part.LANGUAGE_MODEL, name
    if name.startswith("language_model."):
        inner = name[len("language_model.") :]
        if inner.startswith(("model.", "lm_head.")):  # legacy: a whole *ForCausalLM under language_model
            return Part.LANGUAGE_MODEL, inner
        return Part.LANGUAGE_MODEL, "model." + inner
    return None


def split_qwen_key(key: str) -> tuple[Part, str] | None:
    """``split_checkpoint_key`` for Qwen2-VL-family checkpoints (see the module docstring)."""
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return Part.VISION_TOWER, key[len(prefix) :]
    if key.startswith("model.language_model."):
        return Part.LANGUAGE_MODEL, "model." + key[len("model.language_model.") :]
    if key.startswith(("lm_head.", "model.")):
        return Part.LANGUAGE_MODEL, key
    return None


KeySplitter = Callable[[str], "tuple[Part, str] | None"]
TensorFit = Callable[[str, torch.Tensor, torch.Size], torch.Tensor]
"""``fit(module name, tensor read, the module's shape)`` -> the tensor the module takes."""

QWEN3_MOE_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""Qwen3-VL-MoE's fused expert tensors: ``[experts, hidden, 2 * moe_intermediate]`` and ``[experts,
moe_intermediate, hidden]`` in the published checkpoints, the last two dimensions swapped in the modules."""


class SafetensorsCheckpoint:
    """The safetensors files of one checkpoint directory and which file holds each key."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.key_to_file = self._index()

    def _index(self) -> dict[str, Path]:
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            return {key: self.directory / file for key, file in weight_map.items()}
        files = [self.directory / SINGLE_FILE] if (self.directory / SINGLE_FILE).is_file() else []
        files = files or sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {self.directory}")
        key_to_file = {}
        for file in files:
            with safe_open(file, framework="pt") as handle:  # reads the header only
                key_to_file.update(dict.fromkeys(handle.keys(), file))
        return key_to_file

    def part_keys(self, part: Part, splitter: KeySplitter = split_checkpoint_key) -> dict[str, str]:
        """``{name inside the part: checkpoint key}`` for every tensor of ``part``."""
        names = {}
        for key in self.key_to_file:
            split = splitter(key)
            if split is not None and split[0] is part:
                names[split[1]] = key
        return names

    def read(self, keys: Iterable[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors for ``keys``, floating ones cast to ``dtype``, opening each file once."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.key_to_file[key], []).append(key)
        tensors = {}
        for file, file_keys in sorted(by_file.items()):
            with safe_open(file, framework="pt", device="cpu") as handle:
                for key in file_keys:
                    tensor = handle.get_tensor(key)
                    target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                    tensors[key] = tensor.to(device=device, dtype=target_dtype)
        return tensors


def _match_names(expected: set[str], available: dict[str, str]) -> dict[str, str]:
    """``{module name: checkpoint key}``, accepting a vision tower's optional ``vision_model.`` level."""
    matched = {}
    for name, key in available.items():
        if name in expected:
            matched[name] = key
        elif name.startswith("vision_model.") and name[len("vision_model.") :] in expected:
            matched[name[len("vision_model.") :]] = key
    return matched


def load_part(
    module: nn.Module,
    checkpoint: SafetensorsCheckpoint,
    parts: dict[str, Part],
    device: torch.device,
    dtype: torch.dtype,
    derive: Callable[[set[str]], dict[str, str]] | None = None,
    splitter: KeySplitter = split_checkpoint_key,
    fit: TensorFit | None = None,
) -> None:
    """Fill ``module`` (built on meta) from the checkpoint, strictly.

    ``parts`` maps a submodule prefix (``""`` for the whole module) to the
    checkpoint part that holds its tensors. ``derive`` may name, for missing
    module names, another module name to share (tied embeddings).
    ``splitter`` maps the family's checkpoint keys to parts; ``fit`` may turn a
    tensor stored in another layout into the module's (``TensorFit``).
    Raises ``MissingWeightsError`` listing every tensor that could not be found.
    """
    shapes = {name: tensor.shape for name, tensor in module.state_dict().items()}
    state_names = set(shapes)
    sources: dict[str, str] = {}  # module name -> checkpoint key
    for prefix, part in parts.items():
        dot = f"{prefix}." if prefix else ""
        expected = {n[len(dot) :] for n in state_names if n.startswith(dot)}
        matched = _match_names(expected, checkpoint.part_keys(part, splitter))
        sources.update({dot + name: key for name, key in matched.items()})
    missing = state_names - sources.keys()
    aliases = derive(missing) if derive and missing else {}
    missing -= aliases.keys()
    if missing:
        raise MissingWeightsError(checkpoint.directory, missing)
    tensors = checkpoint.read(sources.values(), device, dtype)
    state = {name: tensors[key] for name, key in sources.items()}
    if fit is not None:
        state = {name: fit(name, tensor, shapes[name]) for name, tensor in state.items()}
    state.update({name: state[alias] for name, alias in aliases.items()})
    module.load_state_dict(state, strict=True, assign=True)
    module.to(device)  # only the non-persistent buffers (RoPE, position ids) still live on CPU
    logger.debug("loaded %d tensors into %s", len(state), type(module).__name__)
