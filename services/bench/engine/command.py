"""Offline generation throughput of the PD engine against transformers, side by side, in one run.

The workload: ``--num-requests`` prompts of random token ids (seeded), each
``--min-prompt``..``--max-prompt`` tokens long, each generating exactly
``--output-len`` tokens (greedy, EOS ignored). Every system gets the same
prompts, the same weights (the LM half of ``--model``), the same device and
dtype (``--device``, ``--dtype``) and the same torch thread count, in the same
process:

- ``engine``: this repository's PD engine (scheduler + model runner, the
  engine thread and its asyncio API; no gRPC), all requests submitted at once.
- ``engine_torch_linear``: the same, with PyTorch's own (MKL) linear layers
  instead of oneDNN's (``--linear-backend torch``): what the engine gains
  without the faster matmul.
- ``engine_structured`` (only with ``--structured-share``): the engine with
  that share of the requests constrained by a JSON schema (``runner.py``:
  integers, enums, an array, then a string long enough that no constrained
  request ends before ``--output-len``), so every request still generates
  exactly ``--output-len`` tokens and the two rows compare like for like.
- ``generate_batch``: ``transformers`` continuous batching
  (``model.generate_batch``) with HF's own paged cache.
- ``generate``: ``model.generate()`` one request after another.
- ``static``: the machine's limit for plain HF code: one left-padded batch of
  all requests, one prefill forward (sdpa, ``DynamicCache``), then greedy
  decode steps; no scheduler, no per-request bookkeeping.

The three ``transformers`` baselines live in ``hf.py``.

Output tokens/s = generated tokens / wall seconds (from submission of the
first request to the last token, model loading and warm-up excluded). With
``--repeat`` the systems are interleaved round by round and medians reported.
``match`` is the share of requests whose tokens equal those of ``generate()``.

Then the prefix-cache experiment: a long prompt with an image (a random
embedding handed over through Preallocate + PushEmbedding on the engine) is
sent twice; the repeat's Preallocate answers READY from the cached KV and its
time to first token is compared with the first one's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict
from typing import Any

from services.bench.engine.runner import EngineRunner, Result, Workload

ENGINE_SYSTEMS = ("engine", "engine_torch_linear", "engine_structured")
HF_SYSTEMS = ("generate_batch", "generate", "static")
SYSTEMS = ENGINE_SYSTEMS + HF_SYSTEMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="bench", help="checkpoint dir or preset (default: bench, built on first use)"
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the batch (default: 64)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    parser.add_argument("--min-prompt", type=int, default=64, help="shortest prompt in tokens (default: 64)")
    parser.add_argument("--max-prompt", type=int, default=512, help="longest prompt in tokens (default: 512)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the image (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: 0 = torch's choice)")
    parser.add_argument(
        "--device",
        default="auto",
        help="where every system runs: auto (cuda when present, else cpu), cpu, cuda, cuda:N (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations of every system: auto = float32 on cpu, bfloat16 on cuda (default: auto)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="engine step budget, also generate_batch's max_batch_tokens (default: 2048)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="engine KV block size (default: 16)")
    parser.add_argument("--ttft-prompt", type=int, default=1024, help="prefix-cache experiment prompt length")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; medians are reported (default: 1)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=[*SYSTEMS, "ttft"],
        help="leave out a system or the prefix-cache experiment (repeatable)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small run: 8 requests, 16-64 token prompts, 16 output tokens, 256-token TTFT prompt",
    )
    parser.add_argument(
        "--structured-share",
        type=float,
        default=0.0,
        help="also measure engine_structured: this share of the requests (0-1) under a JSON schema (default: 0, off)",
    )
    parser.add_argument("--json", default="", help="also write the results as JSON to this path")


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    if args.quick:
        args = argparse.Namespace(
            **{
                **vars(args),
                "num_requests": 8,
                "output_len": 16,
                "min_prompt": 16,
                "max_prompt": 64,
                "ttft_prompt": 256,
            }
        )
    if not 0 < args.min_prompt <= args.max_prompt or args.num_requests <= 0 or args.output_len <= 0:
        raise SystemExit("need 0 < --min-prompt <= --max-prompt, --num-requests > 0 and --output-len > 0")
    if not 0.0 <= args.structured_share <= 1.0:
        raise SystemExit("need 0 <= --structured-share <= 1")
    return args


def make_workload(args: argparse.Namespace, vocab_size: int, avoid: set[int]) -> Workload:
    """Random prompts (seeded); ``avoid`` keeps special and image tokens out."""
    rng = random.Random(args.seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    prompts = [
        [rng.choice(allowed) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]
    return Workload(prompts, args.output_len)


# ----------------------------------------------------------------------------- report


def format_report(results: dict[str, Result], ttft: list[dict[str, Any]], notes: dict[str, Any]) -> str:
    reference = results.get("generate") or results.get("static")
    lines = [
        "| system | requests | output tokens | seconds | output tok/s | engine speed-up | match |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    engine = results.get("engine")
    for name in SYSTEMS:
        result = results.get(name)
        if result is None:
            continue
        speedup = f"{engine.tokens_per_s / result.tokens_per_s:.2f}x" if engine else "-"
        match = _match(result, reference) if reference else "-"
        lines.append(
            f"| {name} | {len(result.outputs)} | {result.num_tokens} | {result.median_s:.1f} | "
            f"{result.tokens_per_s:.1f} | {speedup} | {match} |"
        )
    lines.append("")
    structured = results.get("engine_structured")
    if engine and structured:
        lines.append(
            f"structured outputs on {notes['structured_share']:.0%} of the requests: "
            f"{structured.tokens_per_s / engine.tokens_per_s:.2f}x the engine's output tok/s"
        )
    lines.append("machine: " + ", ".join(f"{k}={v}" for k, v in notes.items()))
    for name in ("engine", "engine_torch_linear"):
        details = results[name].details if name in results else None
        if details:
            busy = sum(details[f"{stage}_ms"] for stage in ("schedule", "execute", "update")) or 1
            lines.append(
                f"{name}: {details['num_steps']} steps, {details['num_preemptions']} preemptions; step time "
                f"{100 * details['execute_ms'] / busy:.1f}% model runner, "
                f"{100 * details['schedule_ms'] / busy:.1f}% scheduling, "
                f"{100 * details['update_ms'] / busy:.1f}% accounting + detokenizing"
            )
    for pair in ttft:
        first, repeat = pair["first"], pair["repeat"]
        lines.append(
            f"prefix cache, {pair['prompt_tokens']}-token prompt with a {pair['image_tokens']}-token image: "
            f"TTFT first {first['ttft_ms']:.0f} ms ({first['preallocate']}), repeat {repeat['ttft_ms']:.0f} ms "
            f"({repeat['preallocate']}{' from cached KV' if repeat['via_prefix_cache'] else ''}, "
            f"{repeat['cached_tokens']} cached tokens): {first['ttft_ms'] / max(repeat['ttft_ms'], 1e-3):.1f}x faster"
        )
    return "\n".join(lines)


def _match(result: Result, reference: Result) -> str:
    same = sum(a == b for a, b in zip(result.outputs, reference.outputs))
    return f"{same}/{len(reference.outputs)}"


def run(args: argparse.Namespace) -> int:
    import transformers

    args = _settings(args)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate_batch warns about CPU at every call
    try:
        return _run(args)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _machine_notes(device, dtype) -> dict[str, Any]:
    import torch

    notes = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    return notes | {"loadavg_before": f"{os.getloadavg()[0]:.1f}"}


def _run(args: argparse.Namespace) -> int:
    import torch

    from services.bench.engine.hf import (
        generate_batch_unsupported,
        load_hf_model,
        run_generate_batch,
        run_sequential,
        run_static,
    )
    from services.common.devices import exact_float32, resolve_device, resolve_dtype
    from services.common.models import ensure_model, load_adapter

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as error:  # e.g. --device cuda on a machine without CUDA
        raise SystemExit(f"epd bench engine: {error}") from None
    exact_float32(device, dtype)
    model_dir = str(ensure_model(args.model))
    adapter = load_adapter(model_dir)
    tokenizer = adapter.load_tokenizer()
    avoid = set(tokenizer.all_special_ids) | {adapter.image_token_id}
    workload = make_workload(args, len(tokenizer), avoid)
    vocab = [t for t in range(len(tokenizer)) if t not in avoid]
    wanted = [s for s in SYSTEMS if s not in args.skip and (s != "engine_structured" or args.structured_share > 0)]
    notes = _machine_notes(device, dtype)
    if "engine_structured" in wanted:
        notes["structured_share"] = args.structured_share
    hf = load_hf_model(model_dir, device, dtype) if set(wanted) & set(HF_SYSTEMS) else None
    if "generate_batch" in wanted and (why := generate_batch_unsupported(hf)):
        # A baseline this transformers cannot run is left out, said so, and the rest still measured.
        wanted.remove("generate_batch")
        notes["generate_batch"] = f"skipped ({why})"
        print(f"generate_batch skipped: {why}", flush=True)
    results = {name: Result(name) for name in wanted}
    ttft: list[dict[str, Any]] = []
    image = (adapter.image_token_id, adapter.num_image_tokens(224, 224), adapter.hidden_size, vocab)

    def measure_engine(name: str, round_index: int) -> tuple[float, list[list[int]]]:
        # Built per measurement (loading is not timed) so that only one KV pool is alive at a time.
        engine = EngineRunner(
            args,
            model_dir,
            workload,
            "torch" if name == "engine_torch_linear" else "auto",
            structured_share=args.structured_share if name == "engine_structured" else 0.0,
        )
        try:
            seconds, outputs, details = engine.measure()
            results[name].details = details
            if name == "engine" and "ttft" not in args.skip:
                ttft.append(engine.prefix_cache_ttft(args, *image, round_index))
            return seconds, outputs
        finally:
            engine.close()

    runners = {
        "generate_batch": lambda: run_generate_batch(hf, workload, args.max_num_batched_tokens),
        "generate": lambda: run_sequential(hf, workload),
        "static": lambda: run_static(hf, workload),
    }
    for round_index in range(max(args.repeat, 1)):  # interleaved: one of each per round
        for name in wanted:
            if name in runners:
                seconds, outputs = runners[name]()
            else:
                seconds, outputs = measure_engine(name, round_index)
            results[name].seconds.append(seconds)
            results[name].outputs = outputs
            results[name].num_tokens = sum(map(len, outputs))
            print(f"round {round_index + 1}: {name} {seconds:.1f}s", flush=True)
    notes["loadavg_after"] = f"{os.getloadavg()[0]:.1f}"
    print(format_report(results, ttft, notes))
    if args.json:
        _write_json(args, notes, results, ttft)
    return 0


def _write_json(
    args: argparse.Namespace, notes: dict[str, Any], results: dict[str, Result], ttft: list[dict[str, Any]]
) -> None:
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": notes,
        "results": {
            n: {
                **{k: v for k, v in asdict(r).items() if k != "outputs"},
                "median_s": r.median_s,
                "tokens_per_s": r.tokens_per_s,
            }
            for n, r in results.items()
        },
        "prefix_cache_ttft": ttft,
    }
    with open(args.json, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2, default=str)
