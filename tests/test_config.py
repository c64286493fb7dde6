"""Config files: validated at start, flags override, unknown keys and bad values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pulsesync.config import Config, load_config
from pulsesync.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_file_and_flag_override(tmp_path: Path) -> None:
    assert load_config(Config).codec.zstd_level == 1
    path = _write(tmp_path, "store:\n  url: s3://bucket/run1\ncodec:\n  zstd_level: 3\n")
    config = load_config(Config, path, {"store.url": "file:///srv/pulse", "store.endpoint_url": None})
    assert config.store.url == "file:///srv/pulse"  # the flag wins
    assert config.store.endpoint_url is None
    assert config.codec.zstd_level == 3  # the file wins over the default


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("store:\n  urll: s3://b/p\n", r"store.urll: not a setting \(did you mean store.url\?\)"),
        ("codec:\n  zstd_level: 99\n", "codec.zstd_level"),
        ("codec:\n  value_coding: fancy\n", "codec.value_coding"),
        ("store:\n  url: http://example.com/x\n", "store.url: .*is an endpoint; pass --store s3://x/prefix"),
        ("store:\n  url: gs://b/x\n", "store.url: .*must start with s3:// or file://"),
        ("store:\n  url: s3:///nobucket\n", "names no bucket"),
        ("- a list\n", "top level must be a mapping"),
        ("store: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_config(Config, _write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_config(Config, tmp_path / "nope.yaml")


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_config(Config, _write(tmp_path, "")) == Config()
