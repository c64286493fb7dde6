"""Every YAML file in configs/ validates against its pydantic model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from pulsesync.config import Config, PublisherConfig, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
MODELS: dict[str, type[BaseModel]] = {"publisher.yaml": PublisherConfig}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_validates(path: Path) -> None:
    config = load_config(MODELS.get(path.name, Config), path)
    assert isinstance(config, Config) and config.store.url


def test_publisher_example_documents_every_option() -> None:
    text = (Path(__file__).parent.parent / "configs" / "publisher.yaml").read_text()
    for name in PublisherConfig.model_fields:
        assert f"\n{name}:" in text, name
    for name in PublisherConfig.model_fields["watch"].annotation.model_fields:  # type: ignore[union-attr]
        assert f"\n  {name}:" in text, name


def test_there_are_configs() -> None:
    assert {"pulsesync.yaml", "publisher.yaml"} <= {p.name for p in CONFIGS}
