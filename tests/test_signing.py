"""Publisher keys: file modes, no silent overwrite, clear errors for bad key files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pulsesync.errors import ConfigError, ConflictError
from pulsesync.protocol import signing


def test_write_keypair_modes_and_key_id(tmp_path: Path) -> None:
    key_path, pub_path, kid = signing.write_keypair(tmp_path / "keys")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert key_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pub_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    private, public = signing.load_private_key(key_path), signing.load_public_key(pub_path)
    assert signing.key_id(private.public_key()) == signing.key_id(public) == kid
    assert len(kid) == 32
    assert list(signing.trusted_keys([pub_path])) == [kid]


def test_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    _, _, first = signing.write_keypair(tmp_path)
    with pytest.raises(ConflictError, match="already exists"):
        signing.write_keypair(tmp_path)
    assert signing.key_id(signing.load_public_key(tmp_path / "publisher.pub")) == first
    _, _, second = signing.write_keypair(tmp_path, force=True)
    assert second != first
    assert stat.S_IMODE((tmp_path / "publisher.key").stat().st_mode) == 0o600


def test_bad_key_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(ConfigError, match=r"junk\.pem"):
        signing.load_private_key(junk)
    with pytest.raises(ConfigError, match=r"junk\.pem"):
        signing.load_public_key(junk)
    with pytest.raises(ConfigError, match=r"missing\.pub"):
        signing.trusted_keys([tmp_path / "missing.pub"])
    key_path, _, _ = signing.write_keypair(tmp_path / "k")
    with pytest.raises(ConfigError, match=r"not an Ed25519 public key|cannot load"):
        signing.load_public_key(key_path)  # a private key where a public one belongs
