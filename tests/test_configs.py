"""Every YAML file in configs/ validates against its pydantic model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from pulsesync.config import Config, load_config
from pulsesync.mirror.config import MirrorConfig
from pulsesync.publisher.config import PublisherConfig
from pulsesync.retention.policy import RetentionConfig
from pulsesync.subscriber.config import SubscriberConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
MODELS: dict[str, type[BaseModel]] = {
    "publisher.yaml": PublisherConfig,
    "subscriber.yaml": SubscriberConfig,
    "retention.yaml": RetentionConfig,
    "mirror.yaml": MirrorConfig,
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_validates(path: Path) -> None:
    config = load_config(MODELS.get(path.name, Config), path)
    assert isinstance(config, Config) and config.store.url


@pytest.mark.parametrize("name", ["publisher.yaml", "subscriber.yaml", "retention.yaml", "mirror.yaml"])
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
    assert {"pulsesync.yaml", "publisher.yaml", "subscriber.yaml", "retention.yaml", "minio-local.yaml"} <= {
        p.name for p in CONFIGS
    }


DEPLOY = Path(__file__).parent.parent / "deploy"


def test_deploy_examples_parse_and_point_at_configs_that_exist() -> None:
    import re

    import yaml

    manifests = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    units = sorted((DEPLOY / "systemd").iterdir())
    assert len(manifests) == 4 and len(units) == 4
    referenced = set()
    for path in [*manifests, *units]:
        text = path.read_text()
        if path.suffix == ".yaml":
            docs = [d for d in yaml.safe_load_all(text) if d]
            assert docs and all("kind" in d and "apiVersion" in d for d in docs), path
        referenced |= set(re.findall(r"/etc/pulsesync/([a-z-]+\.yaml)", text))
    compose = (Path(__file__).parent.parent / "docker-compose.yml").read_text()
    referenced |= set(re.findall(r"/etc/pulsesync/([a-z-]+\.yaml)", compose))
    assert referenced == {"subscriber.yaml", "publisher.yaml", "retention.yaml", "mirror.yaml", "minio-local.yaml"}
    assert referenced <= {p.name for p in CONFIGS}


def test_the_kubernetes_mirror_runs_a_command_the_cli_takes() -> None:
    import yaml

    from pulsesync.cli import build_parser

    deployment = yaml.safe_load((Path(__file__).parent.parent / "deploy/kubernetes/mirror.yaml").read_text())
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "mirror" and parsed.to and parsed.config == Path("/etc/pulsesync/mirror.yaml")
    assert isinstance(
        load_config(MirrorConfig, Path(__file__).parent.parent / "configs" / parsed.config.name), MirrorConfig
    )
