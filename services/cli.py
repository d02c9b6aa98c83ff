"""The ``epd`` command: run the cluster, one service, or build a model.

Every flag also reads an ``EPD_<FLAG>`` environment variable; ``epd <command>
--help`` shows defaults. Service modules are imported only for the command
that runs, and a command's flags import nothing heavy (torch, transformers),
so ``--help`` of every command stays fast.

``python -m services.cli``, how ``epd up`` starts its children, ends the
process without the interpreter's teardown once the command has returned
(``_run_as_process``).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys

from services.common import cli_args

COMMANDS = {
    "up": ("services.launcher.command", "start proxy + encoders + PDs as local processes (the whole cluster)"),
    "encoder": ("services.encoder.main", "run one encoder (vision tower) service"),
    "pd": ("services.pd.main", "run one PD (language model) service"),
    "proxy": ("services.proxy.main", "run the OpenAI-compatible HTTP proxy"),
    "make-model": ("services.common.models.cli", "build a random-weight checkpoint (LLaVA or Qwen-VL) offline"),
    "bench": (
        "services.bench.main",
        "side-by-side benchmarks: compare, engine, grammar, linear, multiturn, photos, serve, slo, soak, step-profile, transfer",
    ),
    "health": ("services.common.healthcheck", "check a service's readiness (gRPC health or HTTP); exit 0 when ready"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd",
        description="EPD cluster: encode-prefill-decode disaggregated serving for vision-language models.",
        formatter_class=cli_args.HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=cli_args.HelpFormatter,
            # The flags are listed below it, in groups: a usage line of all of them reads as noise.
            usage=None if name == "bench" else "%(prog)s [options]",
        )
        # Only the chosen command's module is imported (and reads its env defaults).
        if name == wanted:
            importlib.import_module(module).add_arguments(command)
            command.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


def _run_as_process() -> None:
    """``main()`` as the whole process, which ends without the interpreter's teardown once it returned.

    A service that has drained and stopped has nothing left to clean up, but tearing down an
    interpreter that imported torch and transformers takes seconds (collecting the module graph,
    then libtorch's static destructors deregistering its kernels): under ``epd up`` that was most
    of the time Ctrl-C took. Threads are still joined and ``atexit`` handlers still run (the exit
    below is registered first, so it runs last); only the teardown after them is skipped. An
    exception leaves the process the ordinary way.
    """
    status = {"code": 1}

    def end() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status["code"])

    atexit.register(end)
    try:
        status["code"] = main()
    except SystemExit as stop:  # --help, a usage error: exit codes as usual
        if stop.code is None or isinstance(stop.code, int):
            status["code"] = stop.code or 0
        else:
            atexit.unregister(end)
        raise
    except BaseException:
        atexit.unregister(end)
        raise
    sys.exit(status["code"])


if __name__ == "__main__":
    _run_as_process()
