"""The Grafana dashboard (deploy/grafana/pulsesync.json) against what real daemons export.

A publisher, a subscriber and a retention daemon run as `pulsesync` processes over a filesystem
store, each serving /metrics; the test scrapes all three and checks every PromQL expression of
the dashboard names only metric series they export, with labels those metrics carry, and that
every exported pulsesync metric has a panel. A renamed metric or label fails here, not on a
blank panel in production.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from pulsesync import metrics
from pulsesync.protocol import signing
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "pulsesync.json"
# Labels Prometheus adds at scrape time (instance, job) or that histograms carry (le).
SCRAPE_LABELS = {"instance", "job", "le"}
METRIC_NAME = re.compile(r"\bpulsesync_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(pulsesync_[a-z0-9_]+)\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def expressions(dashboard: dict[str, object]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel."""
    for panel in dashboard["panels"]:  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def scrape(port: int) -> str:
    """One /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def series_and_labels(pages: list[str]) -> tuple[dict[str, set[str]], set[str]]:
    """Each series the pages define (counters' _total, histograms' _bucket/_sum/_count), its labels; those sampled.

    A labelled metric nothing has touched yet (no fallbacks in a healthy run) is exported without
    samples; its labels are then the ones pulsesync.metrics declares for it.
    """
    declared = {
        metric._name: set(metric._labelnames)
        for metric in vars(metrics).values()
        if isinstance(metric, MetricWrapperBase)
    }
    series: dict[str, set[str]] = {}
    sampled: set[str] = set()
    for page in pages:
        for family in text_string_to_metric_families(page):
            names = {
                "counter": [family.name + "_total"],
                "histogram": [family.name + s for s in ("_bucket", "_sum", "_count")],
            }.get(family.type, [family.name])
            for name in names:
                series.setdefault(name, set()).update(declared.get(family.name, set()))
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
                sampled.add(sample.name)
    return series, sampled


def _wait_for(port: int, done: re.Pattern[str], what: str, deadline: float, logs: list[Path]) -> str:
    """The page once it matches `done`; on timeout, fail with the daemons' log tails."""
    while True:
        try:
            page = scrape(port)
            if done.search(page):
                return page
        except OSError:
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)
            pytest.fail(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """/metrics of a publisher, a subscriber and a retention daemon that ran on one store."""
    tmp = tmp_path_factory.mktemp("dashboard")
    signing.write_keypair(tmp / "keys")
    store = ["--store", (tmp / "store").as_uri()]
    trusted = ["--trusted-key", str(tmp / "keys" / "publisher.pub")]
    (tmp / "subscriber.yaml").write_text("poll_seconds: 0.2\n")
    (tmp / "retention.yaml").write_text("interval_seconds: 0.5\n")
    ports = [free_port() for _ in range(3)]
    cli = [sys.executable, "-m", "pulsesync"]
    commands = [
        [
            *cli,
            "publish",
            *store,
            "--signing-key",
            str(tmp / "keys" / "publisher.key"),
            "--anchor-interval",
            "4",
            "--synthetic",
            "--interval",
            "0.3",
            "--metrics-port",
            str(ports[0]),
        ],
        [
            *cli,
            "subscribe",
            *store,
            *trusted,
            "--config",
            str(tmp / "subscriber.yaml"),
            "--metrics-port",
            str(ports[1]),
        ],
        [
            *cli,
            "retain",
            *store,
            *trusted,
            "--config",
            str(tmp / "retention.yaml"),
            "--keep-patches",
            "2",
            "--keep-anchors",
            "1",
            "--grace-seconds",
            "0",
            "--metrics-port",
            str(ports[2]),
        ],
    ]
    deadline = time.monotonic() + 120
    with ExitStack() as stack:
        logs = [tmp / f"{command[3]}.log" for command in commands]
        for command, log in zip(commands, logs, strict=True):
            output = stack.enter_context(log.open("wb"))
            process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
            stack.callback(process.wait, 30)
            stack.callback(process.terminate)
        # Each daemon has done its part once: the subscriber followed patches on the fast path,
        # retention deleted payloads (so every panel's series has samples to check labels on).
        sub = _wait_for(
            ports[1], re.compile(r'pulsesync_sync_seconds_count\{path="fast"\} [1-9]'), "fast syncs", deadline, logs
        )
        kept = _wait_for(
            ports[2],
            re.compile(r'pulsesync_retention_deleted_objects_total\{kind="payload"\} [1-9]'),
            "a purge",
            deadline,
            logs,
        )
        pub = _wait_for(
            ports[0], re.compile(r'pulsesync_published_total\{kind="anchor"\} [2-9]'), "anchors", deadline, logs
        )
        return [pub, sub, kept]


def test_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] == "pulsesync" and dashboard["templating"]["list"][0]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_every_expression_names_exported_series_and_labels(scraped: list[str]) -> None:
    series, _ = series_and_labels(scraped)
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in expressions(dashboard):
        names = METRIC_NAME.findall(expr)
        assert names, f"{title}: {expr} names no pulsesync metric"
        for name in names:
            assert name in series, f"{title}: {name} is not exported (known: {sorted(series)})"
        labels = {name: series[name] | SCRAPE_LABELS for name in names}
        for name, matchers in SELECTOR.findall(expr):
            for matcher in filter(None, (m.strip() for m in matchers.split(","))):
                label = re.split(r"[=!~]", matcher, maxsplit=1)[0].strip()
                assert label in labels[name], f"{title}: {name} has no label {label!r} ({sorted(labels[name])})"
        for grouping in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in grouping.split(","))):
                assert any(label in known for known in labels.values()), f"{title}: no metric of {expr} has {label!r}"


def test_every_exported_metric_has_a_panel(scraped: list[str]) -> None:
    series, _ = series_and_labels(scraped)
    used = {name for _, expr in expressions(json.loads(DASHBOARD.read_text())) for name in METRIC_NAME.findall(expr)}
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in series if n.startswith("pulsesync_")}
    shown = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in used}
    assert families - shown == set(), "exported metrics with no panel"


def test_the_runs_exported_the_labelled_series_the_panels_group_by(scraped: list[str]) -> None:
    """The daemons really ran: samples with the labels the main panels split by."""
    _, sampled = series_and_labels(scraped)
    for name in (
        "pulsesync_published_total",
        "pulsesync_wire_bytes_total",
        "pulsesync_publish_stage_seconds_count",
        "pulsesync_sync_seconds_count",
        "pulsesync_retention_deleted_objects_total",
        "pulsesync_retention_deleted_bytes_total",
        "pulsesync_subscriber_step",
    ):
        assert name in sampled, name
