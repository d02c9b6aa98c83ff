"""``epd bench <name>``: dispatches to ``services.bench.<name>``.

A benchmark is a module here, or a package whose ``command`` module is its
entry point. Either exposes ``add_arguments(parser)`` and ``run(args)`` and
keeps heavy imports (torch, models) inside ``run``, so listing them is cheap.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import services.bench as package
from services.common import cli_args


def _benchmarks() -> dict[str, str]:
    """Benchmark name -> entry module: every public module here but this one, and every package's ``command``."""
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "main" or info.name.startswith("_"):
            continue
        module = f"{package.__name__}.{info.name}"
        found[info.name.replace("_", "-")] = f"{module}.command" if info.ispkg else module
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = _benchmarks()
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    sub.required = True
    for name, module_name in sorted(benchmarks.items()):
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or "").strip().splitlines()[0]
        # Docstrings as help: their paragraphs and lists kept, their ``literals`` printed plain.
        bench = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=cli_args.HelpFormatter,
            usage="%(prog)s [options]",
        )
        module.add_arguments(bench)
        bench.set_defaults(bench_module=module_name)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args.bench_module).run(args) or 0)
