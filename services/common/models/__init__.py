"""Model checkpoints: the offline builder and the per-family split loaders.

Every service codes against ``load_adapter(path_or_hub_id)`` (see ``ModelAdapter``);
``build_checkpoint``/``ensure_model`` make the random-weight demo checkpoints.
"""

from .adapter import LlavaAdapter, ModelAdapter, count_parameters, load_adapter
from .builder import build_checkpoint, default_model_dir, ensure_model
from .loading import MissingWeightsError, Part, split_checkpoint_key
from .presets import PRESETS, Preset, get_preset
from .vision import VisionEncoder

__all__ = [
    "PRESETS",
    "LlavaAdapter",
    "MissingWeightsError",
    "ModelAdapter",
    "Part",
    "Preset",
    "VisionEncoder",
    "build_checkpoint",
    "count_parameters",
    "default_model_dir",
    "ensure_model",
    "get_preset",
    "load_adapter",
    "split_checkpoint_key",
]
