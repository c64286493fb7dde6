"""Store transfer benchmark: pulsesync's transfers vs a single plain S3 request, same object, same run.

Through a real S3 server on 127.0.0.1 in its own process (moto's server, or SeaweedFS with
--server seaweedfs; or --endpoint URL with AWS credentials in the environment), one random object:
  plain_put       one put_object of the whole body (aiobotocore, same client settings)
  multipart_put   Store.upload_file: multipart, `concurrency` parts in flight, SHA-256 while reading
  plain_get       one get_object, body read into memory
  plain_get_to_file  one get_object streamed to a file with SHA-256, fsync, rename (download_file's work)
  parallel_get    Store.download_file: parallel ranged GETs (If-Match), in-order write + SHA-256,
                  fsync, atomic rename
Throughput is the best of `--reps` runs, in MB/s (10^6 bytes).

    python bench/store.py                         # 256 MiB object
    python bench/store.py --quick --json out.json # 64 MiB, < 60 s: the automation contract
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pulsesync.store import S3Store
from pulsesync.store.base import write_atomically
from tests.support.servers import BUCKET, make_bucket, moto_server_process, seaweedfs_server


async def best_mbps(fn: Callable[[], Awaitable[object]], size: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e6


async def run(endpoint: str, size: int, reps: int, part_size: int, concurrency: int, workdir: Path) -> dict[str, float]:
    data = os.urandom(size)
    src = workdir / "object.bin"
    src.write_bytes(data)
    store = S3Store(BUCKET, "bench", endpoint_url=endpoint, part_size=part_size, concurrency=concurrency)
    s3 = await store._s3()  # the same client (and settings) for the plain requests
    key = store._key("object.bin")

    async def plain_put() -> None:
        await s3.put_object(Bucket=BUCKET, Key=key, Body=data)

    async def plain_get() -> None:
        resp = await s3.get_object(Bucket=BUCKET, Key=key)
        async with resp["Body"] as body:
            assert len(await body.read()) == size

    async def plain_get_to_file() -> None:  # the same work as download_file, in one request
        resp = await s3.get_object(Bucket=BUCKET, Key=key)
        async with resp["Body"] as body:
            await write_atomically(key, workdir / "plain.bin", body.iter_chunks(1 << 20), size, None)

    try:
        results = {
            "plain_put_mbps": await best_mbps(plain_put, size, reps),
            "multipart_put_mbps": await best_mbps(lambda: store.upload_file("object.bin", src), size, reps),
            "plain_get_mbps": await best_mbps(plain_get, size, reps),
            "plain_get_to_file_mbps": await best_mbps(plain_get_to_file, size, reps),
            "parallel_get_mbps": await best_mbps(
                lambda: store.download_file("object.bin", workdir / "copy.bin"), size, reps
            ),
        }
        assert (workdir / "copy.bin").read_bytes() == data  # byte for byte
    finally:
        await store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB object, 2 repetitions")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots there (matplotlib)")
    parser.add_argument("--endpoint", metavar="URL", help="an S3 endpoint to use instead of a local server")
    parser.add_argument(
        "--server",
        choices=["seaweedfs", "moto"],
        default="seaweedfs",
        help="local server to start (default seaweedfs; moto copies the whole object for every ranged GET)",
    )
    parser.add_argument("--size-mib", type=int, help="object size (default 256; quick 64)")
    parser.add_argument("--reps", type=int, help="repetitions, best kept (default 3; quick 2)")
    parser.add_argument("--part-mib", type=int, default=8, help="part / range size (default 8)")
    parser.add_argument("--concurrency", type=int, default=8, help="parts or ranges in flight (default 8)")
    args = parser.parse_args()
    size = (args.size_mib or (64 if args.quick else 256)) << 20
    reps = args.reps or (2 if args.quick else 3)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.endpoint:
            endpoint = args.endpoint
            make_bucket(endpoint)
        elif args.server == "seaweedfs":
            endpoint = stack.enter_context(seaweedfs_server(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        else:
            endpoint = stack.enter_context(moto_server_process())
        results = asyncio.run(run(endpoint, size, reps, args.part_mib << 20, args.concurrency, workdir))
    server = args.endpoint or f"{args.server} (its own process, 127.0.0.1)"
    print(f"{size >> 20} MiB object through {server}; part {args.part_mib} MiB x {args.concurrency} in flight")
    print(f"{'transfer':<16} {'MB/s':>8}")
    for name, value in results.items():
        print(f"{name.removesuffix('_mbps'):<16} {value:>8.0f}")
    for plain in ("plain_get", "plain_get_to_file"):
        better = max(results[f"{plain}_mbps"], results["parallel_get_mbps"])
        print(f"parallel_get / better of it and {plain}: {results['parallel_get_mbps'] / better:.0%}")
    doc = {**results, "size_bytes": size, "endpoint": server, "part_size": args.part_mib << 20}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plots:
        import plots

        print("\n".join(str(p) for p in plots.store(doc, args.plots)))


if __name__ == "__main__":
    main()
