"""``epd bench grammar`` on the tiny tokenizer: a row per schema for each library installed, none for the others."""

from __future__ import annotations

import argparse
import importlib.util

from services.bench import grammar


def test_the_bench_reports_every_schema_of_every_installed_library(tiny_model_dir, capsys):
    parser = argparse.ArgumentParser()
    grammar.add_arguments(parser)
    assert grammar.run(parser.parse_args(["--model", str(tiny_model_dir), "--steps", "4", "--walks", "1"])) == 0
    lines = capsys.readouterr().out.splitlines()
    for library in grammar.LIBRARIES:
        rows = [line for line in lines if line.startswith(f"| {library} |")]
        installed = importlib.util.find_spec(library) is not None
        assert len(rows) == (len(grammar.SCHEMAS) if installed else 0)
        assert installed or f"{library}: not installed, skipped" in lines
