"""Where a PD step's time goes, on one device: decode steps per batch size, a mixed step, the encoder.

``python -m services.bench.step_profile --model DIR --out DIR`` builds the PD
engine the way ``epd pd`` does (default flags, ``--max-num-seqs`` the largest
batch asked for), drives its core directly (no engine thread, no gRPC) and:

- for each ``--batches`` size B: admits B requests of ``--prompt-len``
  random tokens, runs them until every one decodes, then times
  ``--steps`` decode-only steps (wall clock around ``EngineCore.step``,
  which reads the sampled tokens back, so the device work is inside);
- times the step that carries a ``--mixed-prompt``-token prefill chunk
  beside min(16, largest batch - 1) decoding requests (a mixed step);
- profiles three decode steps and the mixed step with ``torch.profiler``
  (CPU and CUDA): the top operators and kernels by device time, and the
  number of kernel launches per step;
- times the vision tower + projector on ``--image-size`` images at
  batch 1 and ``--encoder-batch`` (images/s).

Everything is printed and written to ``--out`` (``summary.json``,
``profile-*.txt``). On a CPU it runs too (small models), which is how it is
tested; its figures matter on a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="checkpoint dir or preset (default: tiny)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto = float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decoding request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument(
        "--mixed-prompt", type=int, default=1024, help="prompt of the request prefilled in the mixed step"
    )
    parser.add_argument("--image-size", type=int, default=336, help="side of the encoder's test image")
    parser.add_argument("--encoder-batch", type=int, default=16, help="images per encoder batch")
    parser.add_argument("--block-size", type=int, default=0, help="KV block size (0 = epd pd's default)")
    parser.add_argument("--enforce-eager", action="store_true", help="as epd pd --enforce-eager")
    parser.add_argument("--no-mixed", action="store_true", help="leave out the mixed step")
    parser.add_argument("--no-encoder", action="store_true", help="leave out the encoder")
    parser.add_argument("--no-profile", action="store_true", help="time only; no torch.profiler tables")
    parser.add_argument("--out", type=Path, default=Path("results/step-profile"), help="output directory")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _requests(n: int, prompt_len: int, vocab: int, tag: str, max_tokens: int) -> list:
    from services.pd.engine.request import Request, SamplingParams

    rng = random.Random(tag)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Ids from the low end of the vocabulary: every checkpoint's tokenizer has them.
    return [
        Request(f"{tag}-{i}", [rng.randrange(10, min(vocab, 4000)) for _ in range(prompt_len)], sampling)
        for i in range(n)
    ]


def _run_until_decoding(core, requests: list) -> None:
    for request in requests:
        core.add_request(request)
    deadline = time.monotonic() + 600
    while any(not r.output_token_ids for r in requests):
        core.step()
        if time.monotonic() > deadline:
            raise RuntimeError("requests did not reach decode within 600 s")


def _timed_steps(core, device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        _sync(device)
        started = time.perf_counter()
        core.step()
        _sync(device)
        times.append((time.perf_counter() - started) * 1000)
    return times


def _profile(core, device, steps: int, out: Path, name: str) -> dict[str, Any]:
    """Profiles ``steps`` core steps; writes the operator table; returns kernel counts per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        _sync(device)
    averages = prof.key_averages()
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = averages.table(sort_by=sort, row_limit=40, max_name_column_width=90)
    (out / f"profile-{name}.txt").write_text(table + "\n")
    events = prof.events()
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")]
    graphs = [e for e in events if e.name == "cudaGraphLaunch"]
    return {
        "kernels_per_step": round(len(kernels) / steps, 1),
        "launches_per_step": round(len(launches) / steps, 1),
        "graph_launches_per_step": round(len(graphs) / steps, 1),
        "device_ms_per_step": round(sum(e.device_time for e in kernels) / 1000 / steps, 3) if kernels else None,
    }


def _decode(core, device, batch: int, args, vocab: int, out: Path) -> dict[str, Any]:
    requests = _requests(batch, args.prompt_len, vocab, f"decode{batch}", max_tokens=10_000)
    _run_until_decoding(core, requests)
    _timed_steps(core, device, 3)  # first replays out of the way
    times = _timed_steps(core, device, args.steps)
    result: dict[str, Any] = {
        "batch": batch,
        "step_ms_p50": round(statistics.median(times), 3),
        "step_ms_min": round(min(times), 3),
        "step_ms_max": round(max(times), 3),
        "tok_s": round(batch * 1000 / statistics.median(times), 1),
    }
    if not args.no_profile:
        result["profile"] = _profile(core, device, 3, out, f"decode-b{batch}")
    for request in requests:
        core.abort(request.request_id)
    core.step()
    return result


def _mixed(core, device, batch: int, args, vocab: int, out: Path) -> dict[str, Any]:
    decoding = _requests(batch, args.prompt_len, vocab, "mixed-decode", max_tokens=10_000)
    _run_until_decoding(core, decoding)
    _timed_steps(core, device, 3)
    decode_ms = statistics.median(_timed_steps(core, device, 8))
    result: dict[str, Any] = {
        "batch": batch,
        "decode_step_ms": round(decode_ms, 3),
        "prefill_tokens": args.mixed_prompt,
    }
    # Round 0 compiles what is new, round 1 is timed, round 2 profiled (the profiler slows what it watches).
    for round_index in range(2 if args.no_profile else 3):
        (long,) = _requests(1, args.mixed_prompt, vocab, f"mixed-long-{round_index}", max_tokens=4)
        core.add_request(long)
        if round_index == 2:
            result["profile"] = _profile(core, device, 1, out, f"mixed-b{batch}")
        steps = []
        while not long.output_token_ids:
            _sync(device)
            started = time.perf_counter()
            core.step()
            _sync(device)
            steps.append((time.perf_counter() - started) * 1000)
        core.abort(long.request_id)
        if round_index == 1:
            result["mixed_step_ms"] = [round(s, 3) for s in steps]  # the steps until its first token
    for request in decoding:
        core.abort(request.request_id)
    core.step()
    return result


def _encoder(args, out: Path) -> dict[str, Any]:
    """The vision tower + projector as the encoder runs them (``vision_io.encode_images``), loaded once."""
    import numpy as np
    import torch
    from PIL import Image

    from services.common.devices import exact_float32, resolve_device, resolve_dtype
    from services.common.models.builder import ensure_model
    from services.common.models.families import load_adapter
    from services.common.models.vision_io import encode_images

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    exact_float32(device, dtype)
    adapter = load_adapter(str(ensure_model(args.model)))
    module = adapter.load_vision(device, dtype).eval()
    pixels_rgb = np.random.default_rng(0).integers(0, 256, size=(args.image_size, args.image_size, 3), dtype=np.uint8)
    sample = adapter.process_image(adapter.load_processor().image_processor, Image.fromarray(pixels_rgb))
    pixels = torch.from_numpy(sample.pixel_values)
    result: dict[str, Any] = {"image_size": args.image_size, "tokens_per_image": sample.num_tokens}
    with torch.inference_mode():
        for batch in sorted({1, args.encoder_batch}):
            items = [(pixels, sample.patch_grid)] * batch
            for _ in range(2):
                encode_images(module, items, device, dtype)
            _sync(device)
            rounds = 5
            started = time.perf_counter()
            for _ in range(rounds):
                encode_images(module, items, device, dtype)
            _sync(device)
            seconds = (time.perf_counter() - started) / rounds
            result[f"batch{batch}"] = {"ms": round(seconds * 1000, 2), "images_s": round(batch / seconds, 1)}
    return result


def run(args: argparse.Namespace) -> int:
    import torch

    from services.pd.config import PdConfig
    from services.pd.server import build_engine

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    config = PdConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(batches),
        enforce_eager=args.enforce_eager,
        **({"block_size": args.block_size} if args.block_size else {}),
    )
    started = time.perf_counter()
    engine, facts = build_engine(config)
    summary: dict[str, Any] = {
        "model": args.model,
        "device": facts["device"],
        "device_name": torch.cuda.get_device_name() if facts["device"].startswith("cuda") else "cpu",
        "dtype": facts["dtype"],
        "block_size": config.block_size,
        "torch": torch.__version__,
        "start_s": round(time.perf_counter() - started, 1),
        "num_cuda_graphs": facts["num_cuda_graphs"],
        "decode_paths": facts["decode_paths"],
        "num_kv_blocks": facts["num_kv_blocks"],
        "decode": [],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "decode"}), flush=True)
    core = engine.core
    device = torch.device(facts["device"])
    vocab = facts["vocab_size"]
    try:
        for batch in batches:
            summary["decode"].append(_decode(core, device, batch, args, vocab, out))
            print(json.dumps(summary["decode"][-1]), flush=True)
        if not args.no_mixed:
            # One row of --max-num-seqs stays free for the request that is prefilled.
            summary["mixed"] = _mixed(core, device, max(1, min(16, max(batches) - 1)), args, vocab, out)
            print(json.dumps(summary["mixed"]), flush=True)
    finally:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.no_encoder:
        return 0
    del engine, core
    if device.type == "cuda":
        torch.cuda.empty_cache()
    summary["encoder"] = _encoder(args, out)
    print(json.dumps(summary["encoder"]), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.step_profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
