"""docs/reliability.md's fault table names only tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_test_the_fault_table_names_exists() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", "\n".join(rows))
    assert len(named) >= 45, named  # every row names its test
    for file, test in named:
        source = (ROOT / "tests" / file).read_text()
        assert re.search(rf"^(async )?def {test}\(", source, re.M), f"{file}::{test} does not exist"
    conformance = (ROOT / "pulsesync" / "store" / "testing.py").read_text()
    for test in re.findall(r"`pulsesync/store/testing.py` `(test_\w+)`", text):
        assert f"def {test}(" in conformance, test
