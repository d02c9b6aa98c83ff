"""The proxy runs where torch cannot be imported: its modules, the processing half of the model and the wire."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# ``sys.modules["torch"] = None`` makes every ``import torch`` fail, and makes
# transformers (which checks with importlib.util.find_spec) treat torch as absent.
_CHILD = textwrap.dedent(
    """
    import base64, io, sys
    sys.modules["torch"] = None
    from PIL import Image

    import services.proxy.app, services.proxy.main
    from services.common.models.supported import load_processing
    from services.proxy.prompt.preprocess import Preprocessor

    adapter = load_processing(sys.argv[1])
    preprocessor = Preprocessor(adapter, adapter.load_processor(), max_images=2, max_image_pixels=512 * 512)
    buffer = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 90)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
    prompt = preprocessor.chat_prompt([{"role": "user", "content": content}])
    [item] = prompt.images
    message = item.encode_item_pb("reservation")
    assert message.image_file == item.image_file and message.ByteSize() > len(item.image_file)
    assert sys.modules["torch"] is None
    print(item.num_tokens, len(prompt.token_ids))
    """
)


def test_proxy_preprocesses_and_encodes_without_torch(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny_model_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    num_tokens, num_ids = (int(n) for n in done.stdout.split())
    assert num_tokens > 0 and num_ids > num_tokens


def test_importing_the_proxy_imports_neither_torch_nor_transformers():
    # transformers imports torch whenever it is installed, so the proxy loads it only with the checkpoint.
    check = "import sys, services.proxy.app, services.proxy.main; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
