"""An S3 server inside this process (moto's server mode on 127.0.0.1): the demo's store, no install needed.

Real HTTP S3 on a free port, spoken to by the same aiobotocore client as any S3; objects live in
memory and vanish when the server stops. For demos and tests, never for data worth keeping.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from pulsesync.errors import ConfigError

# moto accepts any credentials; these only keep the AWS credential chain from looking elsewhere.
_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "pulsesync-embedded",
    "AWS_SECRET_ACCESS_KEY": "pulsesync-embedded",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def embedded_s3(bucket: str) -> Iterator[str]:
    """Run an S3 server on 127.0.0.1 with `bucket` created; yields its endpoint URL."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ConfigError(
            "the embedded S3 server needs moto: pip install 'pulsesync[demo]' (or pass --store)"
        ) from None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in [*_CREDENTIALS, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(_CREDENTIALS)
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        # A session of its own: boto3's default session would cache these credentials for the process.
        session = boto3.session.Session(
            aws_access_key_id=_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=_CREDENTIALS["AWS_DEFAULT_REGION"],
        )
        session.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
