"""Linear layers under serving-like batch sizes: torch against oneDNN (raw and row-bucketed) and the kernel.

``epd bench linear`` runs the bench checkpoint's language-model linear
shapes (q/k/v, o, gate/up, down, lm_head) on random row counts, the way a
serving batch changes size from step to step, once per backend, each in a
fresh process (so one backend's resident memory cannot hide another's).
Every backend sees the same seeded sequence of row counts. Reported per
backend: wall time, resident memory after warm-up and at the end, and the
growth in between; plus each backend's time relative to torch.

- ``torch``: ``F.linear`` (MKL sgemm), the PD's ``--linear-backend torch``;
- ``onednn-raw``: oneDNN's matmul on the raw row count (one primitive per
  shape it has ever seen);
- ``onednn``: rows padded with ``padded_rows``, the PD's fallback;
- ``kernel``: the PD's default, the C kernel over weights packed once
  (``cpu_kernels/linear.c``).

The weights of one batch fit in a large last-level cache, so this measures
the arithmetic and the per-shape memory more than the memory reads a real
model's decode step is bound by (``epd bench step-profile`` times those).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from services.bench.serve.report import markdown_table
from services.bench.soak.report import rss_bytes
from services.common import cli_args

BACKENDS = ("torch", "onednn-raw", "onednn", "kernel")
SHAPES = ((768, 768), (3072, 768), (768, 3072), (8192, 768))
"""(out, in) of the bench LM's linears: q/k/v/o, gate/up, down, lm_head."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = cli_args.add_flag
    add(parser, "--iterations", type=int, default=3000, help="batches per backend (each runs every shape once)")
    add(parser, "--warmup", type=int, default=500, help="batches before resident memory is first read")
    add(parser, "--max-rows", type=int, default=600, help="largest row count (a prefill chunk)")
    add(parser, "--threads", type=int, default=1, help="torch threads")
    add(parser, "--seed", type=int, default=0, help="seed of the row counts")
    add(parser, "--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ", ".join(BACKENDS))
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)


def _rss_mib() -> float:
    return (rss_bytes(os.getpid()) or 0) / 2**20


def _rows(rng: random.Random, max_rows: int) -> int:
    # Mostly decode-sized batches, sometimes a prefill chunk.
    return rng.randint(1, max_rows) if rng.random() < 0.3 else rng.randint(1, 48)


def _child(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from services.common.cpu_kernels import load_linear
    from services.common.cpu_linear import onednn_linear

    torch.set_num_threads(args.threads)
    backend = args.child
    generator = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(out, inp, generator=generator) for out, inp in SHAPES]
    kernel = load_linear() if backend == "kernel" else None
    if backend == "kernel" and kernel is None:
        print("the CPU linear kernel could not be built here", file=sys.stderr)
        return 1
    packed = [kernel.pack(weight) for weight in weights] if kernel is not None else []
    rng = random.Random(args.seed)
    rss_warm, start = 0.0, 0.0
    with torch.inference_mode():
        for index in range(args.warmup + args.iterations):
            if index == args.warmup:
                rss_warm, start = _rss_mib(), time.perf_counter()
            rows = _rows(rng, args.max_rows)
            for position, weight in enumerate(weights):
                x = torch.randn(rows, weight.shape[1], generator=generator)
                if backend == "torch":
                    F.linear(x, weight)
                elif kernel is not None:
                    kernel.linear(x, packed[position], weight.shape[0], None)
                else:
                    onednn_linear(x, weight, None, bucketed=backend == "onednn")
    seconds = time.perf_counter() - start
    print(json.dumps({"backend": backend, "seconds": seconds, "rss_warm_mib": rss_warm, "rss_end_mib": _rss_mib()}))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends or args.iterations < 1 or args.warmup < 0 or args.max_rows < 1:
        print(
            f"epd bench linear: choose backends from {', '.join(BACKENDS)}; --iterations >= 1, --warmup >= 0, "
            "--max-rows >= 1",
            file=sys.stderr,
        )
        return 2
    results = []
    for backend in backends:
        print(
            f"epd bench linear: {backend} ({args.iterations} batches after {args.warmup} warm-up)...",
            file=sys.stderr,
            flush=True,
        )
        command = [
            sys.executable,
            "-m",
            "services.cli",
            "bench",
            "linear",
            "--child",
            backend,
            "--iterations",
            str(args.iterations),
            "--warmup",
            str(args.warmup),
            "--max-rows",
            str(args.max_rows),
            "--threads",
            str(args.threads),
            "--seed",
            str(args.seed),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"epd bench linear: {backend} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    torch_s = next((r["seconds"] for r in results if r["backend"] == "torch"), None)
    rows = [
        [
            r["backend"],
            f"{r['seconds']:.1f}",
            f"{torch_s / r['seconds']:.2f}x faster" if torch_s else "-",
            f"{r['rss_warm_mib']:.0f}",
            f"{r['rss_end_mib']:.0f}",
            f"{r['rss_end_mib'] - r['rss_warm_mib']:+.0f}",
        ]
        for r in results
    ]
    header = ["backend", "seconds", "vs torch", "RSS after warm-up (MiB)", "at end (MiB)", "growth (MiB)"]
    print("\n".join(markdown_table(header, rows)).rstrip())
    return 0
