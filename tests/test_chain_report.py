"""`pulsesync inspect --html`: the report's content, its escaping, and the page in a real headless Chromium.

The browser test needs Chromium (Debian's `chromium` package, or PULSESYNC_CHROMIUM) and the
playwright package; it is skipped without them unless PULSESYNC_REQUIRE_BROWSER=1 (CI sets it,
after installing Chromium). Its screenshot is kept in PULSESYNC_TEST_ARTIFACTS (default
test-artifacts/).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.chain_report import chains, render
from pulsesync.cli import main
from pulsesync.inspect_chain import ChainRow, RetiredRow, chain_rows, retired_rows
from pulsesync.protocol import layout, signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.retention import RetentionWorker
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store import FileStore
from tests.support.helpers import publisher_config, trainer_states

STEPS = 50  # anchors at 0, 10, 20, 30, 40


def _row(step: int, kind: str, **fields: object) -> ChainRow:
    values: dict[str, object] = {
        "base_step": None if kind == "anchor" else step - 1,
        "chains_from": None,
        "wire_bytes": 1000,
        "dense_bytes": 10_000,
        "changed_elements": 50,
        "ratio": 10.0,
        "signer": "abcd" * 4,
        "verified": True,
        "age_seconds": 1.0,
    }
    return ChainRow(step, kind, **(values | fields))  # type: ignore[arg-type]


def test_chains_reach_from_each_anchor_to_its_last_patch() -> None:
    rows = [_row(0, "anchor"), _row(1, "patch", chains_from=0), _row(2, "patch", chains_from=0)]
    rows += [_row(3, "anchor"), _row(4, "patch", chains_from=3), _row(5, "patch", chains_from=None)]
    assert chains(rows) == {0: (0, 2), 3: (3, 4)}


def test_untrusted_strings_are_escaped() -> None:
    evil = '<script>alert("x")</script>'
    rows = [_row(0, "anchor", signer=evil, verified=False, error=evil)]
    retired = [RetiredRow(1, "patch", dt.datetime.now(dt.timezone.utc), 0, False, evil)]
    page = render(rows, retired, f"s3://bucket/{evil}/")
    assert "<script" not in page and "&lt;script&gt;" in page


FORGED_TOMBSTONES = {  # bodies a hostile store may hold under tombstone keys
    3: b'{"marker": "{}"}',  # no removed_at
    4: b'{"marker": "{}", "removed_at": ["2000-01-01"]}',  # not a string
    5: b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the JSON parser recurses
    6: b"\xff\xfe not json",
}


def test_forged_tombstones_are_reported_not_a_crash(tmp_path: Path) -> None:
    """`inspect --html` on a store holding forged tombstones: each one a row with its error, exit 0."""
    _, public, _ = signing.write_keypair(tmp_path / "keys")
    store = FileStore(tmp_path / "store")
    for step, body in FORGED_TOMBSTONES.items():
        asyncio.run(store.put(layout.tombstone_key(step, "patch"), body))
    retired = asyncio.run(retired_rows(store, signing.trusted_keys([public])))
    assert [(t.step, t.verified) for t in retired] == [(step, False) for step in FORGED_TOMBSTONES]
    assert all(t.error for t in retired)
    page = tmp_path / "chain.html"
    store_url = (tmp_path / "store").as_uri()
    assert main(["inspect", "--store", store_url, "--trusted-key", str(public), "--html", str(page)]) == 0
    assert page.read_text().count('<tr class="retired"') == len(FORGED_TOMBSTONES)


async def _pruned_store(root: Path, key: Ed25519PrivateKey) -> None:
    """50 steps, anchors every 10; retention purged steps 0-9 and tombstoned 10-19: 30 patches and 3 anchors stay."""
    store = FileStore(root)
    states = trainer_states(STEPS)
    async with AsyncPublisher(publisher_config(), store=store, signing_key=key) as pub:
        for step in range(STEPS):
            await pub.publish(step, states[step])
        await pub.flush()
    trusted = signing.trusted_keys([key.public_key()])
    gone = RetentionPolicy(keep_patches=40, keep_anchors=4, grace_seconds=0)
    await RetentionWorker(store, gone, trusted).run_once()  # tombstones the oldest
    await RetentionWorker(store, gone, trusted).run_once()  # and deletes them
    tombstoned = RetentionPolicy(keep_patches=30, keep_anchors=3, grace_seconds=3600)
    await RetentionWorker(store, tombstoned, trusted).run_once()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ChainRow], list[RetiredRow]]:
    """The HTML report of a pruned store, written by the CLI, and the rows it shows."""
    tmp = tmp_path_factory.mktemp("report")
    private, public, _ = signing.write_keypair(tmp / "keys")
    key = signing.load_private_key(private)
    asyncio.run(_pruned_store(tmp / "store", key))
    page = tmp / "chain.html"
    assert (
        main(["inspect", "--store", (tmp / "store").as_uri(), "--trusted-key", str(public), "--html", str(page)]) == 0
    )
    store, trusted = FileStore(tmp / "store"), signing.trusted_keys([public])
    return page, asyncio.run(chain_rows(store, trusted)), asyncio.run(retired_rows(store, trusted))


def test_report_shows_every_step_anchor_and_retired_step(report: tuple[Path, list[ChainRow], list[RetiredRow]]) -> None:
    page, rows, retired = report
    html = page.read_text()
    assert len({r.step for r in rows}) >= 30 and sum(r.kind == "anchor" for r in rows) >= 3 and retired
    assert all(r.verified for r in rows) and all(t.verified for t in retired)
    shown = {int(s) for s in re.findall(r'<tr class="[^"]*" data-step="(\d+)"', html)}
    assert shown == {r.step for r in rows} | {t.step for t in retired}
    assert html.count('<rect class="anchor"') == sum(r.kind == "anchor" for r in rows)
    assert html.count('<rect class="retired"') == len(retired)
    assert min(r.step for r in rows) > 0  # steps 0..9 were purged, markers and payloads
    assert "http://" not in html and "https://" not in html and "<script" not in html  # self-contained


def _chromium() -> str | None:
    return os.environ.get("PULSESYNC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
def test_report_renders_in_headless_chromium(report: tuple[Path, list[ChainRow], list[RetiredRow]]) -> None:
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        executable = None
    if executable is None:
        if os.environ.get("PULSESYNC_REQUIRE_BROWSER") == "1":
            pytest.fail("PULSESYNC_REQUIRE_BROWSER=1 but no Chromium (apt-get install chromium) or playwright")
        pytest.skip("no Chromium or playwright here (CI installs them: PULSESYNC_REQUIRE_BROWSER=1)")
    page_file, rows, retired = report
    artifacts = Path(os.environ.get("PULSESYNC_TEST_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    requests: list[str] = []
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=flags)
        try:
            page = browser.new_page(viewport={"width": 1180, "height": 900})
            page.on(
                "console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri(), wait_until="load")
            steps = {int(s) for s in page.locator("#steps tbody tr").evaluate_all("rs => rs.map(r => r.dataset.step)")}
            anchors = page.locator("svg rect.anchor").count()
            chain_items = page.locator("#chains li").all_inner_texts()
            box = page.locator("svg").bounding_box()
            page.screenshot(path=str(artifacts / "chain-report.png"), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert requests == [page_file.as_uri()]  # nothing fetched but the page itself
    assert steps == {r.step for r in rows} | {t.step for t in retired}
    assert anchors == sum(r.kind == "anchor" for r in rows)
    assert len(chain_items) == anchors and all("from anchor" in item for item in chain_items)
    assert box is not None and box["width"] > 1000 and box["height"] > 200
    assert (artifacts / "chain-report.png").stat().st_size > 10_000
