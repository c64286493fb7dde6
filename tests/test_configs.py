"""Every YAML file in configs/ validates against its pydantic model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from pulsesync.config import Config, PublisherConfig, SubscriberConfig, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
MODELS: dict[str, type[BaseModel]] = {"publisher.yaml": PublisherConfig, "subscriber.yaml": SubscriberConfig}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_validates(path: Path) -> None:
    config = load_config(MODELS.get(path.name, Config), path)
    assert isinstance(config, Config) and config.store.url


@pytest.mark.parametrize("name", ["publisher.yaml", "subscriber.yaml"])
def test_daemon_examples_document_every_option(name: str) -> None:
    text = (Path(__file__).parent.parent / "configs" / name).read_text()
    model = MODELS[name]
    for field in model.model_fields:
        assert f"\n{field}:" in text, field
    if model is PublisherConfig:
        for field in PublisherConfig.model_fields["watch"].annotation.model_fields:  # type: ignore[union-attr]
            assert f"\n  {field}:" in text, field


def test_every_sink_type_is_documented() -> None:
    text = (Path(__file__).parent.parent / "configs" / "subscriber.yaml").read_text()
    for sink in ("directory", "sglang", "vllm", "command"):
        assert f"type: {sink}" in text, sink


def test_there_are_configs() -> None:
    assert {"pulsesync.yaml", "publisher.yaml", "subscriber.yaml"} <= {p.name for p in CONFIGS}
