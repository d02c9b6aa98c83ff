"""The ``epd`` command: run the cluster, one service, or build a model.

Every flag also reads an ``EPD_<FLAG>`` environment variable; ``epd <command>
--help`` shows defaults. Service modules are imported only for the command
that runs, so ``epd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "up": ("services.launcher.command", "start proxy + encoders + PDs as local processes (the whole cluster)"),
    "encoder": ("services.encoder.main", "run one encoder (vision tower) service"),
    "pd": ("services.pd.main", "run one PD (language model) service"),
    "proxy": ("services.proxy.main", "run the OpenAI-compatible HTTP proxy"),
    "make-model": ("services.common.models.cli", "build a random-weight checkpoint (LLaVA or Qwen-VL) offline"),
    "bench": ("services.bench.main", "side-by-side benchmarks (engine, transfer, serve)"),
    "health": ("services.common.healthcheck", "check a service's readiness (gRPC health or HTTP); exit 0 when ready"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd",
        description="EPD cluster: encode-prefill-decode disaggregated serving for vision-language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen command's module is imported (and reads its env defaults).
        if name == wanted:
            importlib.import_module(module).add_arguments(command)
            command.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
