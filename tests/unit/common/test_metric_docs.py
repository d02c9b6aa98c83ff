"""The docs' metric table (docs/operations/metrics.md) documents exactly what each service's ``METRICS`` declares
(name, type, labels)."""

from __future__ import annotations

import re
from pathlib import Path

from services.encoder.metrics import METRICS as ENCODER_METRICS
from services.launcher.metrics import METRICS as LAUNCHER_METRICS
from services.pd.metrics import METRICS as PD_METRICS
from services.proxy.metrics import METRICS as PROXY_METRICS

METRICS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "operations" / "metrics.md"
ROW = re.compile(r"^\| (proxy|encoder|pd|launcher) \| (`[^|]+?) \| (counter|gauge|histogram) \|([^|]*)\|")


def _names(cell: str) -> list[str]:
    """``epd_a_hits_total` / `_misses_total``: a name starting with ``_`` replaces as many trailing parts."""
    names: list[str] = []
    for name in re.findall(r"`([^`]+)`", cell):
        if name.startswith("_"):
            stem = names[0].split("_")[: -(name.count("_"))]
            name = "_".join(stem) + name
        names.append(name)
    return names


def _documented_rows() -> set[tuple[str, str, str, tuple[str, ...]]]:
    rows = set()
    for line in METRICS_PAGE.read_text().splitlines():
        match = ROW.match(line)
        if match:
            service, cell, kind, labels = match.groups()
            label_names = tuple(label.strip() for label in labels.split(",") if label.strip())
            rows.update((service, name, kind, label_names) for name in _names(cell))
    return rows


def test_the_docs_metric_table_matches_every_services_metric_docs():
    declared = {
        (service, doc.name, doc.type, tuple(doc.labels))
        for service, docs in (
            ("proxy", PROXY_METRICS),
            ("encoder", ENCODER_METRICS),
            ("pd", PD_METRICS),
            ("launcher", LAUNCHER_METRICS),
        )
        for doc in docs
    }
    documented = _documented_rows()
    assert declared - documented == set(), "declared in METRICS but missing from the docs' table"
    assert documented - declared == set(), "in the docs' table but not declared in METRICS"
