"""Ordinary photos on Qwen2.5-VL: 12 MP with the real checkpoint's default ``max_pixels`` (tiny model, in-process).

The real Qwen2.5-VL processor keeps a 4000x3000 photo at full size (its
``max_pixels`` is 12,845,056). Its processed patches are ~290 MB of float32,
far over gRPC's 64 MiB message cap; the proxy sends the image file as the
client sent it and the encoder decodes and processes it. The tiny checkpoint's patches are
smaller than the real one's (8 px, not 14), so the same photo is 47,000 image
tokens here, which is why one photo runs. Its vision tower windows every
block: the tiny checkpoint's one full-attention block over the photo's
188,000 patches took a minute and a half on two cores, and attention's reach
is not what this test is about (the oracle tests keep it).
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from cluster_support import InProcessCluster
from PIL import Image

pytestmark = pytest.mark.e2e

REAL_SIZE = {"longest_edge": 12845056, "shortest_edge": 3136}  # Qwen2.5-VL-7B-Instruct's preprocessor_config.json
GRPC_MESSAGE_CAP = 64 * 1024 * 1024
PHOTO = (4000, 3000)


@pytest.fixture(scope="module")
def photo_model(build_model, tmp_path_factory):
    """qwen2.5-vl-tiny with the real processor size limits, positions for a 47k-token image, windowed vision."""
    import shutil

    model = tmp_path_factory.mktemp("photo") / "qwen2.5-vl-tiny-real-pixels"
    shutil.copytree(build_model("qwen2.5-vl-tiny"), model)
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = model / name
        config = json.loads(path.read_text())
        (config[key] if key else config)["size"] = REAL_SIZE
        path.write_text(json.dumps(config))
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 65536
    config["vision_config"]["fullatt_block_indexes"] = []  # windowed everywhere (module docstring)
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


def _photo_jpeg(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x * 7 + y * 3) % 256], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def test_a_12_mp_photo_answers_200_with_the_real_default_max_pixels(photo_model):
    from services.common.models import load_adapter

    adapter = load_adapter(photo_model)
    width, height = PHOTO
    shape = adapter.image_shape(height, width)
    assert shape.patch_grid == (1, 3008 // 8, 4000 // 8)  # kept at full size: 12.03 MP <= max_pixels
    processed_bytes = shape.patch_grid[1] * shape.patch_grid[2] * adapter.pixel_layout().patch_dim * 4
    photo = _photo_jpeg(*PHOTO)
    assert processed_bytes > 4 * GRPC_MESSAGE_CAP > 100 * len(photo)  # what used to travel, and what does

    cluster = InProcessCluster(photo_model, proxy={"request_timeout_s": 600}).start()
    try:
        body = {
            "model": adapter.model_id,
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this photo?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(photo).decode()},
                        },
                    ],
                }
            ],
        }
        reply = httpx.post(f"{cluster.base_url}/chat/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["epd"]["image_tokens"] == shape.num_tokens == 47000
        assert usage["completion_tokens"] == 1
        assert cluster.leaks() == {}
    finally:
        cluster.stop()
