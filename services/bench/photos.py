"""Ordinary photos on Qwen2.5-VL with the real checkpoint's default ``max_pixels``, through ``epd up``.

Builds a copy of ``--model`` (a Qwen2-VL-family checkpoint or preset; the
tiny one by default) whose processor keeps images up to the real
Qwen2.5-VL's 12,845,056 pixels (``--max-pixels``) and whose LM has room for
the tokens that makes, starts ``epd up`` on it with PD room for
``--in-flight`` such images, then:

- sends each ``--sizes`` photo (a JPEG of smooth gradients, as a photo
  compresses) alone and reports its status, image tokens and timings;
- sends ``--in-flight`` photos at once and samples the proxy's resident
  memory (RSS, from /proc) every half second for ``--window-s`` seconds,
  reporting its peak and how the requests ended (still running when the
  window closes counts as in flight).

Results go to ``--out`` (results.json, results.md).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REAL_QWEN_SIZE = {"longest_edge": 12845056, "shortest_edge": 3136}
"""Qwen2.5-VL-7B-Instruct's preprocessor_config.json: images up to 12.8 MP keep their size."""
LM_POSITIONS = 65536
"""max_position_embeddings of the copy: a 12 MP photo is 47,000 tokens on the tiny preset (8 px patches)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="qwen2.5-vl-tiny", help="Qwen2-VL-family checkpoint directory or preset")
    add("--sizes", default="4000x3000,4032x3024", help="photos sent one at a time, WIDTHxHEIGHT, comma-separated")
    add("--max-pixels", type=int, default=REAL_QWEN_SIZE["longest_edge"], help="the processor's max_pixels")
    add("--in-flight", type=int, default=8, help="photos sent at once while the proxy's memory is sampled (0 = skip)")
    add("--window-s", type=float, default=150.0, help="how long the proxy's memory is sampled")
    add("--out", type=Path, default=Path("results/photos"), help="where results.json and results.md go")


def run(args: argparse.Namespace) -> int:
    from services.bench.serve.command import _model_dir
    from services.bench.serve.procs import epd_up

    sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",") if size]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = _real_pixels_copy(Path(_model_dir(args.model)), Path(scratch) / "qwen-real-pixels", args.max_pixels)
        room = str(max(1, args.in_flight) * 60000)  # embedding rows and waiting tokens for every photo at once
        env = {"EPD_EMBEDDING_CACHE_TOKENS": room, "EPD_MAX_WAITING_TOKENS": room}
        results: dict[str, Any] = {"model": args.model, "max_pixels": args.max_pixels, "alone": []}
        with epd_up(str(model), env=env) as base_url:
            results["proxy_rss_idle_mb"] = _proxy_rss_mb()
            for index, (width, height) in enumerate(sizes):
                print(f"[photos] {width}x{height} alone", file=sys.stderr, flush=True)
                outcome = _ask(base_url, model.name, width, height, seed=index)
                results["alone"].append({"size": f"{width}x{height}", **outcome, "proxy_rss_mb": _proxy_rss_mb()})
            if args.in_flight:
                print(f"[photos] {args.in_flight} at once", file=sys.stderr, flush=True)
                results["in_flight"] = _in_flight(base_url, model.name, sizes[0], args.in_flight, args.window_s)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


def _real_pixels_copy(source: Path, target: Path, max_pixels: int) -> Path:
    """A copy of ``source`` whose image processor keeps images up to ``max_pixels``."""
    shutil.copytree(source, target)
    size = {**REAL_QWEN_SIZE, "longest_edge": max_pixels}
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = target / name
        if path.is_file():
            config = json.loads(path.read_text())
            (config.get(key, {}) if key else config)["size"] = size
            path.write_text(json.dumps(config))
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    text["max_position_embeddings"] = max(text.get("max_position_embeddings", 0), LM_POSITIONS)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _photo(width: int, height: int, seed: int) -> bytes:
    """A JPEG of smooth gradients (a photo-like size on disk for its pixel count)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y + 97 * seed) % 256], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def _ask(base_url: str, model: str, width: int, height: int, seed: int) -> dict[str, Any]:
    image_url = "data:image/jpeg;base64," + base64.b64encode(_photo(width, height, seed)).decode()
    content = [
        {"type": "text", "text": "What is in this photo?"},
        {"type": "image_url", "image_url": {"url": image_url}},
    ]
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=900) as reply:
            usage = json.loads(reply.read())["usage"]
            status = reply.status
    except urllib.error.HTTPError as error:
        code = json.loads(error.read() or b"{}").get("error", {}).get("code")
        return {"status": error.code, "error": code, "seconds": round(time.perf_counter() - started, 1)}
    except OSError as error:  # cut off when the cluster stops
        return {"status": None, "error": type(error).__name__, "seconds": round(time.perf_counter() - started, 1)}
    timings = usage.get("epd", {}).get("timings_ms", {})
    return {
        "status": status,
        "image_tokens": usage.get("epd", {}).get("image_tokens"),
        "seconds": round(time.perf_counter() - started, 1),
        "preprocess_ms": timings.get("preprocess"),
        "encode_ms": timings.get("encode"),
    }


def _in_flight(base_url: str, model: str, size: tuple[int, ...], count: int, window_s: float) -> dict[str, Any]:
    outcomes: list[dict[str, Any]] = []
    width, height = size
    threads = [
        threading.Thread(
            target=lambda k=k: outcomes.append(_ask(base_url, model, width, height, seed=100 + k)), daemon=True
        )
        for k in range(count)
    ]
    for thread in threads:
        thread.start()
    peak, started = 0, time.monotonic()
    while any(t.is_alive() for t in threads) and time.monotonic() - started < window_s:
        peak = max(peak, _proxy_rss_mb())
        time.sleep(0.5)
    statuses = [o["status"] for o in outcomes]
    return {
        "count": count,
        "size": "x".join(map(str, size)),
        "window_s": window_s,
        "proxy_rss_peak_mb": peak,
        "answered_200": statuses.count(200),
        "refused": [o for o in outcomes if o["status"] not in (200, None)][:3],
        "in_flight_at_window_end": count - len(outcomes),
    }


def _proxy_rss_mb() -> int:
    """Largest resident set, in MiB, of this machine's EPD proxy processes (``/proc``)."""
    best = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"services.cli" not in command or b"proxy" not in command:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    best = max(best, int(line.split()[1]) // 1024)
        except OSError:
            continue
    return best


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"# epd bench photos (model {results['model']}, max_pixels {results['max_pixels']})", ""]
    lines += [f"Proxy RSS idle: {results.get('proxy_rss_idle_mb')} MiB", ""]
    lines += ["| photo | status | image tokens | seconds | proxy preprocess ms | encode ms | proxy RSS MiB |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for row in results["alone"]:
        status = row["status"] if row["status"] == 200 else f"{row['status']} {row.get('error')}"
        lines.append(
            f"| {row['size']} | {status} | {row.get('image_tokens')} | {row['seconds']} | "
            f"{row.get('preprocess_ms')} | {row.get('encode_ms')} | {row['proxy_rss_mb']} |"
        )
    if flight := results.get("in_flight"):
        lines += [
            "",
            f"{flight['count']} x {flight['size']} at once: proxy RSS peak {flight['proxy_rss_peak_mb']} MiB "
            f"within {flight['window_s']:g} s; {flight['answered_200']} answered 200, "
            f"{len(flight['refused'])} refused, {flight['in_flight_at_window_end']} still in flight at the window's end",
        ]
    return "\n".join(lines) + "\n"
