"""Serving benchmark: colocated vs data-parallel colocated replicas vs disaggregated EPD, side by side.

``epd bench serve`` starts the cluster itself in each configuration, on the
same checkpoint, the same machine and the same cores, and drives the same
open-loop Poisson workload against each:

- (a) ``colocated``: one PD that runs the vision tower in its own step loop
  (``epd pd --encoder local``), on all cores;
- (b) ``replicas``: K colocated PDs (default: one per core), each pinned to
  its own cores (the method of vLLM's published EPD comparison);
- (c) ``disagg``: E encoders + P PDs splitting the cores (default on 2 cores:
  1 encoder on one core, 1 PD on the other), or with ``--encoder-placement
  shared`` one PD per core and the encoders pinned over them;
- (d) ``epd`` (not in the default ``--configs``): E+P+D, the encoders of (c)
  with prefill PDs (``--prefills``) and decode PDs (``--decodes``) instead of
  PDs that do both; the prefill PDs push each request's KV to a decode PD.
  With ``--encoder-placement shared`` the encoders sit over the prefill
  cores only (on 2 cores: 1 prefill PD + the encoders on one core, 1 decode
  PD on the other); ``own`` needs a core per process.

``--workload long-mixed`` (20% long text prompts, 10% image requests, the
rest short text) is the workload (d) is for: its report compares (d) with (c)
on the p99 ITL and TTFT of the short text requests and on goodput.

Each process is pinned (CPU affinity) and runs one torch thread per core it
owns; the proxy is pinned to ``--proxy-core`` and shares it (recorded).
Requests stream over SSE; the client timestamps every token and reports
TTFT, TPOT, inter-token latency and end-to-end latency (mean, median, p90,
p99; text vs image requests; first-seen vs repeated images), request and
token throughput, ratios to (c), and goodput: the highest swept rate at
which p99 TTFT and p99 TPOT stay within the SLO. Outputs in ``--out``:
results.json, results.md, requests.jsonl (every request), and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.common import cli_args

WORKLOAD_NAMES = ("mixed", "long-mixed", "multi-image", "repeat", "text", "video")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("every value must be positive")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated CPU ids, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = cli_args.add_flag
    work = parser.add_argument_group("workload")
    add(
        work,
        "--workload",
        default="mixed",
        choices=list(WORKLOAD_NAMES),
        help="mixed: 10%% of requests carry 1-4 images; long-mixed: 20%% have a long text prompt (420-840 words, "
        "~1-2k tokens; reported as 'long', the short ones as 'text'), 10%% carry 1-2 images, the rest short text; "
        "multi-image: 4 images each; repeat: 1 image each, 50%% repeat an earlier one; text: no images; video: "
        "half the requests carry a 2-4 s clip, 50%% repeated (Qwen2-VL family models)",
    )
    add(
        work,
        "--model",
        default="bench",
        help="checkpoint directory, preset (tiny, bench, qwen2.5-vl-bench, ...; built on first use) or hub id",
    )
    add(work, "--num-requests", type=int, default=100, help="requests per rate (and per repeat)")
    add(work, "--max-tokens", type=int, default=64, help="output tokens of every request (ignore_eos)")
    add(work, "--prompt-words", type=int, default=32, help="words of random text in each (short) prompt")
    add(
        work,
        "--long-prompt-words",
        type=_ints,
        default=(),
        help="long-mixed: MIN,MAX words of a long prompt ('' = 420,840: ~1-2k tokens with the bench checkpoint's "
        "tokenizer, about 2.4 tokens a word). Keep MAX x tokens-a-word + --max-tokens within the model's context "
        "(tiny: 2048 positions, 2.8 tokens a word; bench: 4096)",
    )
    add(
        work,
        "--images-first",
        default=False,
        help="put the images before the text in each message (the text "
        "comes first by default, as in OpenAI's examples); then a repeated image is a prompt prefix PD can reuse",
    )
    add(work, "--seed", type=int, default=0, help="seed of prompts, images and arrivals")
    add(
        work,
        "--rates",
        type=_floats,
        default=(),
        help="comma-separated request rates (req/s); empty = --rate-multipliers x the capacity measured with a "
        "burst on the first configuration",
    )
    add(
        work,
        "--rate-multipliers",
        type=_floats,
        default=(0.5, 1.0, 1.5, 2.0, 3.0),
        help="automatic sweep: multiples of the measured capacity",
    )
    add(work, "--repeats", type=int, default=1, help="repeat every configuration x rate (order rotates); pooled")
    add(
        work,
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="goodput SLO on p99 TTFT (0 = --slo-factor x a lone "
        "request's TTFT with the workload's most images, measured)",
    )
    add(
        work,
        "--slo-tpot-ms",
        type=float,
        default=0.0,
        help="goodput SLO on p99 TPOT (0 = --slo-factor x a lone text request's TPOT, i.e. one decode step, measured)",
    )
    add(work, "--slo-factor", type=float, default=3.0, help="multiplier of the measured lone-request times")
    add(work, "--calibration-requests", type=int, default=3, help="lone requests of each kind for calibration")
    add(work, "--burst-requests", type=int, default=24, help="requests of the capacity burst (automatic rates)")
    lay = parser.add_argument_group("layout")
    add(
        lay,
        "--configs",
        default="colocated,replicas,disagg",
        help="configurations to run, comma-separated: colocated (a), replicas (b), disagg (c, E+PD), epd (d, "
        "E+P+D: prefill and decode in separate PDs, KV handed over)",
    )
    add(
        lay, "--cores", type=_ints, default=(), help="CPU ids every configuration shares ('' = this process's affinity)"
    )
    add(lay, "--replicas", type=int, default=0, help="(b): colocated PD replicas (0 = one per core)")
    add(lay, "--encoders", type=int, default=0, help="(c), (d): encoder processes (0 = max(1, cores // 4))")
    add(lay, "--pds", type=int, default=0, help="(c): PD processes (0 = the remaining cores, one each)")
    add(
        lay,
        "--prefills",
        type=int,
        default=0,
        help="(d): prefill PDs (0 = 1). The PD cores (all cores with --encoder-placement shared, else those "
        "the encoders leave) are split between prefills and decodes, extra cores to the decodes",
    )
    add(
        lay,
        "--decodes",
        type=int,
        default=0,
        help="(d): decode PDs (0 = 1). On 2 cores use --encoder-placement shared: 1 prefill PD with the encoders "
        "over its core, 1 decode PD alone on the other (own placement needs a core per process)",
    )
    add(
        lay,
        "--encoder-placement",
        default="own",
        choices=["own", "shared"],
        help="(c), (d): encoders on cores of their own (split with the PDs), or pinned over the PDs' cores (PDs "
        "then default to one per core and the kernel time-slices encoding against decoding; (d): over the "
        "prefill PDs' cores only)",
    )
    add(
        lay,
        "--encoder-threads",
        type=int,
        default=0,
        help="(c), (d): torch threads per encoder (0 = one per core it is pinned to)",
    )
    add(lay, "--proxy-core", type=int, default=-1, help="CPU id the proxy is pinned to (-1 = the first core)")
    add(lay, "--proxy-threads", type=int, default=1, help="proxy preprocessing threads")
    add(
        lay,
        "--replica-proxy",
        default="shared",
        choices=["shared", "per-replica"],
        help="(b): one proxy in front of every replica (each image is encoded by the PD that reserved it), or one "
        "proxy per replica with the client balancing over them",
    )
    svc = parser.add_argument_group("services")
    add(svc, "--pd-args", default="", help="extra flags for every PD (shell syntax), e.g. '--max-num-seqs 32'")
    add(svc, "--encoder-args", default="", help="extra flags for every encoder (shell syntax)")
    add(svc, "--proxy-args", default="", help="extra flags for every proxy (shell syntax)")
    add(
        svc, "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="services' log level"
    )
    add(svc, "--startup-timeout", type=float, default=300.0, help="seconds for a configuration to become ready")
    add(svc, "--request-timeout", type=float, default=600.0, help="client timeout of one request, seconds")
    out = parser.add_argument_group("output")
    add(out, "--out", default="", help="output directory ('' = results/serve-<workload>, git-ignored)")
    add(out, "--plots", default=True, help="write PNG plots (needs matplotlib: pip install 'epd-cluster[bench]')")
    add(out, "--progress", default=True, help="progress bar on stderr")


def _machine(cores: tuple[int, ...]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "cores": list(cores),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        # The client is not pinned: it is the same for every configuration.
        "client_affinity": sorted(os.sched_getaffinity(0)),
    }


def _image_size(model_dir: str) -> int:
    """The vision tower's input size (noise images are drawn around it).

    Dynamic-resolution checkpoints (Qwen2-VL family) have none: their images
    are drawn around 336 pixels too and each keeps its own size and token count.
    """
    try:
        with open(Path(model_dir) / "config.json") as file:
            return int(json.load(file)["vision_config"]["image_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return 336  # llava-1.5's; only the image sizes depend on it


def _model_type(model_dir: str) -> str:
    """The checkpoint's ``model_type`` ('' when its config cannot be read)."""
    try:
        with open(Path(model_dir) / "config.json") as file:
            return str(json.load(file).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def _model_dir(model: str) -> str:
    """A checkpoint directory as is (the client never needs torch); otherwise a preset built on first use."""
    if model and (Path(model) / "config.json").is_file():
        return str(Path(model).resolve())
    from services.common.models import ensure_model

    return str(ensure_model(model or None, progress=lambda msg: print(f"  {msg}", file=sys.stderr)))


def _command() -> str:
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "serve"]:
        return shlex.join(["epd", *argv])
    return "epd bench serve (called in-process)"


def run(args: argparse.Namespace) -> int:
    from services.bench.serve.layout import LayoutConfig, build_topologies
    from services.bench.serve.output import write_outputs
    from services.bench.serve.procs import ServiceArgs
    from services.bench.serve.runner import Runner, RunPlan

    cores = tuple(args.cores) or tuple(sorted(os.sched_getaffinity(0)))
    layout = LayoutConfig(
        cores=cores,
        replicas=args.replicas,
        encoders=args.encoders,
        pds=args.pds,
        proxy_core=None if args.proxy_core < 0 else args.proxy_core,
        proxy_threads=args.proxy_threads,
        replica_proxy=args.replica_proxy,
        encoder_placement=args.encoder_placement,
        encoder_threads=args.encoder_threads,
        prefills=args.prefills,
        decodes=args.decodes,
    )
    problem = _usage_problem(args)
    try:
        topologies = build_topologies(layout, tuple(n.strip() for n in args.configs.split(",") if n.strip()))
    except ValueError as error:
        problem = problem or str(error)
    if problem:
        print(f"epd bench serve: {problem}", file=sys.stderr, flush=True)
        return 2
    model_dir = _model_dir(args.model)
    if args.workload == "video" and _model_type(model_dir) not in ("qwen2_vl", "qwen2_5_vl"):
        print(
            "epd bench serve: --workload video needs a Qwen2-VL family model (--model qwen2.5-vl-bench)",
            file=sys.stderr,
        )
        return 2
    plan = RunPlan(
        workload=args.workload,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        images_first=args.images_first,
        long_words=(args.long_prompt_words[0], args.long_prompt_words[1]) if args.long_prompt_words else None,
        seed=args.seed,
        image_size=_image_size(model_dir),
        rates=tuple(args.rates),
        rate_multipliers=tuple(args.rate_multipliers),
        repeats=args.repeats,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_factor=args.slo_factor,
        calibration_requests=args.calibration_requests,
        burst_requests=args.burst_requests,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        progress=args.progress,
    )
    service = ServiceArgs(
        model_dir=model_dir,
        log_level=args.log_level,
        pd_args=tuple(shlex.split(args.pd_args)),
        encoder_args=tuple(shlex.split(args.encoder_args)),
        proxy_args=tuple(shlex.split(args.proxy_args)),
    )
    out_dir = Path(args.out or f"results/serve-{args.workload}")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runner = Runner(plan, topologies, service, out_dir / "logs")
    runner.run()
    context = {
        "command": _command(),
        "machine": _machine(cores),
        "plan": asdict(plan),
        "model": {"path": model_dir, "image_size": plan.image_size},
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        "service_args": {
            "pd": list(service.pd_args),
            "encoder": list(service.encoder_args),
            "proxy": list(service.proxy_args),
            "log_level": service.log_level,
        },
    }
    summary = write_outputs(out_dir, runner, context, plots=args.plots)
    print(summary, flush=True)
    return 1 if any(result.error for result in runner.results.values()) else 0


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.num_requests < 1 or args.repeats < 1 or args.calibration_requests < 1 or args.burst_requests < 1:
        return "--num-requests, --repeats, --calibration-requests and --burst-requests must be >= 1"
    if args.max_tokens < 2:
        return "--max-tokens must be >= 2 (TPOT needs two tokens)"
    if args.prompt_words < 1 or args.slo_factor <= 0:
        return "--prompt-words must be >= 1 and --slo-factor > 0"
    if args.slo_ttft_ms < 0 or args.slo_tpot_ms < 0:
        return "--slo-ttft-ms and --slo-tpot-ms must be >= 0"
    words = tuple(args.long_prompt_words)
    if words and (len(words) != 2 or not 1 <= words[0] <= words[1]):
        return "--long-prompt-words must be MIN,MAX with 1 <= MIN <= MAX"
    return None
