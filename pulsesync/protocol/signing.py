"""Ed25519 publisher keys: generation, PEM files, key ids (fingerprints), trusted-key sets."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsesync.atomic_files import write_file
from pulsesync.errors import ConfigError, ConflictError, SignatureError

PRIVATE_KEY_FILE = "publisher.key"
PUBLIC_KEY_FILE = "publisher.pub"


def key_id(public_key: Ed25519PublicKey) -> str:
    """Fingerprint of a public key: first 16 bytes of SHA-256 over its raw bytes, hex."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def sign(private_key: Ed25519PrivateKey, payload: bytes) -> str:
    """Base64 Ed25519 signature of payload."""
    return base64.b64encode(private_key.sign(payload)).decode("ascii")


def is_valid(public_key: Ed25519PublicKey, payload: bytes, signature: str) -> bool:
    """Whether signature (base64) is a valid Ed25519 signature of payload."""
    try:
        public_key.verify(base64.b64decode(signature.encode("ascii"), validate=True), payload)
    except (InvalidSignature, ValueError, UnicodeEncodeError):
        return False
    return True


def verify(public_key: Ed25519PublicKey, payload: bytes, signature: str, what: str) -> None:
    """Raise SignatureError unless signature is a valid Ed25519 signature of payload."""
    if not is_valid(public_key, payload, signature):
        raise SignatureError(
            f"{what}: signature does not verify against key {key_id(public_key)} "
            "(content was modified or signed by another key)"
        )


def _write_new(path: Path, data: bytes, mode: int, force: bool) -> None:
    try:
        write_file(path, data, exclusive=not force, mode=mode)
    except FileExistsError:
        raise ConflictError(f"{path} already exists (pass --force to overwrite)") from None


def write_keypair(out_dir: Path, force: bool = False) -> tuple[Path, Path, str]:
    """Generate a keypair into out_dir (private key mode 0600); returns both paths and the key id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    private_key = Ed25519PrivateKey.generate()
    key_path, pub_path = out_dir / PRIVATE_KEY_FILE, out_dir / PUBLIC_KEY_FILE
    if not force:
        for p in (key_path, pub_path):
            if p.exists():
                raise ConflictError(f"{p} already exists (pass --force to overwrite)")
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(key_path, private_pem, 0o600, force)
    _write_new(pub_path, public_pem, 0o644, force)
    return key_path, pub_path, key_id(private_key.public_key())


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key; ConfigError naming the file on any problem."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"signing key {path}: cannot load ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path}: not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read a PEM Ed25519 public key; ConfigError naming the file on any problem."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"trusted key {path}: cannot load ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"trusted key {path}: not an Ed25519 public key")
    return key


def trusted_keys(keys: Iterable[Ed25519PublicKey | Path | str]) -> Mapping[str, Ed25519PublicKey]:
    """Key id -> public key, from key objects or PEM file paths."""
    loaded = [k if isinstance(k, Ed25519PublicKey) else load_public_key(Path(k)) for k in keys]
    return {key_id(k): k for k in loaded}
