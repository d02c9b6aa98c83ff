"""Default-flags ``epd up``, side by side: a burst, and a steady mixed load.

``--workload burst``: ``--num-requests`` concurrent streamed text requests
(prompts of 8-120 words, ``--max-tokens`` new tokens each) through the proxy
of ``epd up`` with default PD flags, then through ``epd up`` with a fixed
step budget (``EPD_SLO_ITL_MS=0``: every step may prefill the whole cap), and
sequential ``transformers`` ``generate()`` on the same checkpoint and machine.
Reports tokens/s, TTFT and inter-token latency of each, and the ratios.

``--workload mixed``: text requests at ``--text-rate`` req/s beside 4-image
requests at ``--image-rate`` req/s for ``--seconds``, open loop, through
``epd up`` (disaggregated: encoder + PD) and ``epd up --colocated`` (one PD
that encodes in its step loop), both with default flags. Reports p99 and
median text inter-token latency, mean text TTFT and the ratios.

Each configuration starts its own ``epd up`` on free loopback ports, waits
until the proxy reports every backend ready, sends one untimed request of
each kind, measures, and stops it with SIGINT (Ctrl-C). Results go to
``--out`` (results.json, results.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from services.bench.serve.words import PROMPT_WORDS
from services.common import cli_args

if TYPE_CHECKING:
    from transformers import GenerationMixin

BURST_WORDS = (8, 120)
"""Prompt words of a burst request, drawn uniformly (the range a chat turn spans)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workload", choices=["burst", "mixed"], default="burst", help="what to run (see above)")
    add("--model", default="bench", help="checkpoint directory or preset (built on first use)")
    add("--num-requests", type=int, default=32, help="burst: concurrent requests")
    add("--max-tokens", type=int, default=48, help="new tokens per request (every request runs to it)")
    add("--hf-requests", type=int, default=4, help="burst: requests run through sequential generate()")
    add("--text-rate", type=float, default=1.0, help="mixed: text requests per second")
    add("--image-rate", type=float, default=0.25, help="mixed: 4-image requests per second")
    add("--seconds", type=float, default=60.0, help="mixed: length of the arrival schedule")
    add("--seed", type=int, default=0, help="prompts, images and arrivals are drawn from this seed")
    add("--out", type=Path, default=Path("results/slo"), help="where results.json and results.md go")
    cli_args.add_log_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    from services.bench.serve.command import _image_size, _model_dir

    model_dir = _model_dir(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.workload == "burst":
        results = _burst(args, model_dir)
    else:
        results = _mixed(args, model_dir, _image_size(model_dir))
    results["command"] = "epd bench slo " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "slo"] else ""
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


# ------------------------------------------------------------------ workloads
def _burst(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from services.bench.serve.workload import RequestSpec, encode_bodies

    rng = random.Random(f"epd-bench-slo:burst:{args.seed}")
    specs = [
        RequestSpec(
            i, " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(*BURST_WORDS))), (), None, args.max_tokens
        )
        for i in range(args.num_requests)
    ]
    bodies = encode_bodies(specs)
    arrivals = [0.0] * len(specs)
    configs = {
        "default": _serve(model_dir, [], {}, specs, bodies, arrivals),
        "fixed": _serve(model_dir, [], {"EPD_SLO_ITL_MS": "0"}, specs, bodies, arrivals),
    }
    hf = _hf_sequential(model_dir, [s.prompt for s in specs[: args.hf_requests]], args.max_tokens)
    return {"workload": "burst", "model": model_dir, "configs": configs, "hf_generate": hf}


def _jittered_size(rng: random.Random, size: int) -> tuple[int, int]:
    """A width and a height, each within 25% of ``size`` (drawn in that order)."""
    return round(size * rng.uniform(0.75, 1.25)), round(size * rng.uniform(0.75, 1.25))


def _mixed(args: argparse.Namespace, model_dir: str, image_size: int) -> dict[str, Any]:
    from services.bench.serve.workload import ImageRef, RequestSpec, encode_bodies

    rng = random.Random(f"epd-bench-slo:mixed:{args.seed}")
    arrivals: list[tuple[float, int]] = []  # (time, number of images)
    for rate, num_images in ((args.text_rate, 0), (args.image_rate, 4)):
        t = rng.expovariate(rate) if rate > 0 else args.seconds
        while t < args.seconds:
            arrivals.append((t, num_images))
            t += rng.expovariate(rate)
    arrivals.sort()
    specs = []
    for index, (_, num_images) in enumerate(arrivals):
        images = tuple(ImageRef((args.seed, index, k), *_jittered_size(rng, image_size)) for k in range(num_images))
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(*BURST_WORDS)))
        specs.append(RequestSpec(index, prompt, images, "first_seen" if images else None, args.max_tokens))
    bodies = encode_bodies(specs)
    times = [t for t, _ in arrivals]
    configs = {
        "disagg": _serve(model_dir, [], {}, specs, bodies, times),
        "colocated": _serve(model_dir, ["--colocated"], {}, specs, bodies, times),
    }
    return {"workload": "mixed", "model": model_dir, "configs": configs}


# ------------------------------------------------------------------ one epd up
def _serve(model_dir, up_args, env, specs, bodies, arrivals) -> dict[str, Any]:
    """Starts ``epd up``, warms it, runs the schedule, stops it; the run's summary."""
    from services.bench.serve.client import run_schedule
    from services.bench.serve.procs import epd_up

    label = " ".join(["epd up", *up_args, *(f"{k}={v}" for k, v in env.items())])
    with epd_up(model_dir, up_args, env) as base_url:
        print(f"[slo] {label}: ready, warming up", file=sys.stderr)
        warm = sorted({0, *(i for i, s in enumerate(specs) if s.images)})[:2]
        asyncio.run(
            run_schedule(
                [base_url], [_renumbered(specs[i]) for i in warm], [bodies[i] for i in warm], [0.0] * len(warm)
            )
        )
        print(f"[slo] {label}: measuring {len(specs)} requests", file=sys.stderr)
        started = time.perf_counter()
        records = asyncio.run(run_schedule([base_url], specs, bodies, arrivals))
        wall_s = time.perf_counter() - started
    return {"label": label, **_summary(records, wall_s)}


def _renumbered(spec):
    return replace(spec, index=-1)


def _summary(records, wall_s: float) -> dict[str, Any]:
    from services.bench.serve.stats import percentile

    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {"num_requests": len(records), "num_ok": len(ok), "wall_s": round(wall_s, 3)}
    tokens = sum(r.num_tokens for r in ok)
    last_s = max((r.start_s + r.e2e for r in ok), default=0.0)
    out["tokens"] = tokens
    out["tokens_per_s"] = round(tokens / last_s, 2) if last_s else None
    for kind in ("all", "text", "image"):
        group = [r for r in ok if kind == "all" or r.kind == kind]
        if not group:
            continue
        ttfts = [r.ttft for r in group]
        itls = [gap for r in group for gap in r.itls]
        out[kind] = {
            "count": len(group),
            "ttft_mean_ms": round(1000 * sum(ttfts) / len(ttfts), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
            "itl_median_ms": round(1000 * percentile(itls, 50), 1) if itls else None,
            "itl_p99_ms": round(1000 * percentile(itls, 99), 1) if itls else None,
        }
    return out


# ------------------------------------------------------------------ baseline
def _hf_sequential(model_dir: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Sequential greedy ``generate()`` of the burst's first prompts, chat template applied as the proxy does."""
    import torch

    from services.common.models import load_adapter

    adapter = load_adapter(model_dir)
    # The families' full models are *ForConditionalGeneration: a PreTrainedModel that is also a GenerationMixin.
    model = cast("GenerationMixin", adapter.load_full_model(torch.device("cpu"), torch.float32))
    tokenizer = adapter.load_tokenizer()
    print(f"[slo] transformers generate(): {len(prompts)} requests, one at a time", file=sys.stderr)
    total_tokens, total_s = 0, 0.0
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            started = time.perf_counter()
            out = model.generate(input_ids=ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            total_s += time.perf_counter() - started
            total_tokens += out.shape[1] - ids.shape[1]
    return {"num_requests": len(prompts), "tokens": total_tokens, "tokens_per_s": round(total_tokens / total_s, 2)}


# ------------------------------------------------------------------ report
def _markdown(results: dict[str, Any]) -> str:
    configs = results["configs"]
    lines = [f"# epd bench slo --workload {results['workload']}", "", f"`{results.get('command', '')}`", ""]
    lines += ["| configuration | ok | tok/s | mean TTFT ms | p99 TTFT ms | median ITL ms | p99 ITL ms |"]
    lines += ["|---|---|---|---|---|---|---|"]
    group = "all" if results["workload"] == "burst" else "text"
    for c in configs.values():
        g = c.get(group, {})
        lines.append(
            f"| {c['label']} ({group}) | {c['num_ok']}/{c['num_requests']} | {c['tokens_per_s']} | "
            f"{g.get('ttft_mean_ms')} | {g.get('ttft_p99_ms')} | {g.get('itl_median_ms')} | {g.get('itl_p99_ms')} |"
        )
    lines.append("")
    if results["workload"] == "burst":
        default, fixed, hf = configs["default"], configs["fixed"], results["hf_generate"]
        lines.append(f"sequential generate(): {hf['tokens_per_s']} tok/s ({hf['num_requests']} requests)")
        lines.append(f"default / generate(): {_ratio(default['tokens_per_s'], hf['tokens_per_s'])}x (goal >= 3)")
        lines.append(f"default / fixed budget: {_ratio(default['tokens_per_s'], fixed['tokens_per_s'])}x (goal >= 0.9)")
    else:
        disagg, coloc = configs["disagg"]["text"], configs["colocated"]["text"]
        lines.append(
            f"p99 text ITL, disagg / colocated: {_ratio(disagg['itl_p99_ms'], coloc['itl_p99_ms'])} (goal <= 0.25)"
        )
        lines.append(
            f"mean text TTFT, disagg / colocated: {_ratio(disagg['ttft_mean_ms'], coloc['ttft_mean_ms'])} (goal <= 0.5)"
        )
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"
