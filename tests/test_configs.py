"""Every YAML file in configs/ validates against the pydantic models."""

from __future__ import annotations

from pathlib import Path

import pytest

from pulsesync.config import Config, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_validates(path: Path) -> None:
    config = load_config(Config, path)
    assert config.store.url


def test_there_are_configs() -> None:
    assert CONFIGS
