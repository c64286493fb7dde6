"""The `pulsesync` command line. Errors become one line on stderr and a documented exit code."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsesync import __version__
from pulsesync.errors import PulseSyncError

# What a command needs is imported where it runs: `--help` and usage errors load no torch, S3 client or numba.
if TYPE_CHECKING:
    from pulsesync.config import Config

log = logging.getLogger("pulsesync")


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, metavar="FILE", help="YAML config file (flags override it)")
    common.add_argument("--store", metavar="URL", help="s3://bucket/prefix or file:///path")
    common.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint (R2, MinIO, any S3-compatible server)")
    _log_flags(common, "")
    return common


def _log_flags(parser: argparse.ArgumentParser, dest: str) -> None:
    """-v/-q/--log-format, before the command (dest "top_") or after it (dest "")."""
    parser.add_argument(
        "-v", "--verbose", dest=f"{dest}verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("-q", "--quiet", dest=f"{dest}quiet", action="store_true", help="errors only")
    parser.add_argument(
        "--log-format", dest=f"{dest}log_format", choices=["text", "json"], help="stderr log lines (default text)"
    )


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(args: argparse.Namespace) -> None:
    """The root log on stderr at the level -v/-q ask for, text or JSON, credentials redacted."""
    from pulsesync.store.redaction import RedactCredentials

    verbose, quiet = args.verbose + args.top_verbose, args.quiet or args.top_quiet
    level = logging.ERROR if quiet else [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    terminal = sys.stderr.isatty()
    handler = _AroundBars() if terminal else logging.StreamHandler()
    if terminal:
        from pulsesync import progress

        progress.show_bars(sys.stderr)
    if (args.log_format or args.top_log_format) == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactCredentials())  # -vv turns on botocore's debug log, which prints headers
    logging.basicConfig(level=level, handlers=[handler])  # none if the root logs already (an embedding program)
    logging.getLogger("pulsesync.progress").setLevel(min(level, logging.INFO))  # progress lines off a terminal
    args.verbose, args.quiet = verbose, quiet


class _AroundBars(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines on a terminal that shows progress bars: each printed above the bars, which are redrawn."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _StepLines(logging.Handler):
    """Each published object set's line on stdout as it happens (not once more on stderr)."""

    def emit(self, record: logging.LogRecord) -> None:
        from pulsesync import progress

        if progress.showing_bars():  # print above the bars
            from tqdm import tqdm

            tqdm.write(record.getMessage(), file=sys.stdout)
        else:
            print(record.getMessage(), flush=True)


def load_config(model: Any, path: Path | None, overrides: dict[str, Any]) -> Any:
    """`pulsesync.config.load_config`, imported when a command runs."""
    from pulsesync.config import load_config as load

    return load(model, path, overrides)


def _config(args: argparse.Namespace) -> Config:
    """The shared config from --config and the common flags."""
    from pulsesync.config import Config

    flags = {"store.url": args.store, "store.endpoint_url": args.endpoint_url}
    config: Config = load_config(Config, args.config, flags)
    return config


def _stop_on_signals() -> Any:
    """An asyncio.Event that SIGTERM and SIGINT set: commands finish their current work and exit 0."""
    import asyncio

    stop = asyncio.Event()

    def stopping(name: str) -> None:
        log.warning("%s: finishing the work under way, then exiting", name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping, sig.name)
    return stop


def _subscriber_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """A SubscriberConfig from --config, the common flags, `overrides` and --trusted-key (added to the file's)."""
    from pulsesync.subscriber.config import SubscriberConfig

    flags = {"store.url": args.store, "store.endpoint_url": args.endpoint_url} | overrides
    config = load_config(SubscriberConfig, args.config, flags)
    if args.trusted_key:
        config = config.model_copy(update={"trusted_keys": [*config.trusted_keys, *args.trusted_key]})
    return config


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pulsesync.protocol.signing import write_keypair

    key_path, pub_path, kid = write_keypair(args.out, force=args.force)
    print(f"wrote {key_path} (private, mode 0600) and {pub_path}; key id {kid}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    config = _config(args)
    from pulsesync.demo import run_demo  # after the config: a config error answers without torch

    if not args.verbose:  # the table says where subscribers fell back; -v adds the log lines
        logging.getLogger("pulsesync.subscriber").setLevel(logging.ERROR)
    ok = run_demo(
        steps=args.steps,
        anchor_interval=args.anchor_interval,
        hidden=args.hidden,
        layers=args.layers,
        lr=args.lr,
        seed=args.seed,
        params=config.codec,
        store=config.store,
    )
    return 0 if ok else 1


def _cmd_publish(args: argparse.Namespace) -> int:
    from pulsesync.publisher.config import PublisherConfig

    config = load_config(
        PublisherConfig,
        args.config,
        {
            "store.url": args.store,
            "store.endpoint_url": args.endpoint_url,
            "signing_key": args.signing_key,
            "anchor_interval": args.anchor_interval,
            "metrics_port": args.metrics_port,
            "cache_dir": args.cache_dir,
            "take_over_prefix": args.take_over_prefix or None,
        },
    )
    steps = logging.getLogger("pulsesync.publisher.steps")
    lines = _StepLines()
    steps.addHandler(lines)
    steps.setLevel(logging.INFO)
    steps.propagate = False
    try:
        return _publish(args, config)
    finally:
        steps.removeHandler(lines)
        steps.propagate = True


def _publish(args: argparse.Namespace, config: Any) -> int:
    import asyncio

    from pulsesync.errors import ConfigError
    from pulsesync.publisher import StepReport
    from pulsesync.publisher.sources import publish_checkpoint, publish_synthetic, watch

    if args.checkpoint is not None and args.step is None:
        raise ConfigError("--checkpoint needs --step N: the step number to publish it as")
    if args.watch is None and args.once:
        raise ConfigError("--once applies to --watch DIR")
    if args.checkpoint is not None:

        async def one_checkpoint() -> list[StepReport]:
            _stop_on_signals()  # a signal lets the step finish: committed, then exit 0
            return await publish_checkpoint(config, args.checkpoint, args.step)

        asyncio.run(one_checkpoint())
    else:

        async def until_signal() -> list[StepReport]:
            stop = _stop_on_signals()  # publish what is complete, flush, exit 0
            if args.synthetic:
                return await publish_synthetic(config, args.interval, args.max_steps, stop)
            return await watch(config, args.watch, once=args.once, stop=stop)

        asyncio.run(until_signal())
    return 0


def _cmd_subscribe(args: argparse.Namespace) -> int:
    import asyncio

    config = _subscriber_config(
        args,
        cache_dir=args.cache_dir,
        out_dir=args.out_dir,
        step=args.step,
        metrics_port=args.metrics_port,
        reset_stream=args.reset_stream or None,
    )
    if args.fallback_store:
        config = _with_fallback_stores(config, args.fallback_store, args.fallback_endpoint_url or [])
    from pulsesync.subscriber import Subscriber, daemon  # after the config: a config error answers without torch

    logging.getLogger("pulsesync.subscriber").setLevel(logging.INFO)  # one line per served step

    async def run() -> None:
        subscriber = Subscriber(config)
        try:
            if args.once:
                await subscriber.start()
                print((await daemon.sync_with_retries(subscriber, config.once_attempts)).to_json())
                return
            await subscriber.run(_stop_on_signals())  # finishes the sync in progress
        finally:
            await subscriber.close()

    asyncio.run(run())
    return 0


def _with_fallback_stores(config: Any, urls: list[str], endpoints: list[str]) -> Any:
    """The config with `stores`: its store first, then each --fallback-store with its --fallback-endpoint-url."""
    from pulsesync.errors import ConfigError

    if len(endpoints) not in (0, 1, len(urls)):
        raise ConfigError(
            f"--fallback-endpoint-url: give one for every --fallback-store ({len(urls)}), or one for all of them"
        )
    from pulsesync.store.config import StoreConfig

    first = config.store_list
    fallbacks = []
    for i, url in enumerate(urls):
        endpoint = endpoints[min(i, len(endpoints) - 1)] if endpoints else None
        fallbacks.append(StoreConfig.model_validate(first[-1].model_dump() | {"url": url, "endpoint_url": endpoint}))
    return config.model_copy(update={"store": StoreConfig(), "stores": [*first, *fallbacks]})


def _cmd_retain(args: argparse.Namespace) -> int:
    import asyncio

    from pulsesync.retention.policy import RetentionConfig

    config = load_config(
        RetentionConfig,
        args.config,
        {
            "store.url": args.store,
            "store.endpoint_url": args.endpoint_url,
            "keep_patches": args.keep_patches,
            "keep_anchors": args.keep_anchors,
            "grace_seconds": args.grace_seconds,
            "dry_run": True if args.dry_run else None,
            "metrics_port": args.metrics_port,
        },
    )
    if args.trusted_key:
        config = config.model_copy(update={"trusted_keys": [*config.trusted_keys, *args.trusted_key]})
    from pulsesync import metrics  # after the config: a config error answers without torch
    from pulsesync.protocol import signing
    from pulsesync.retention import RetentionWorker
    from pulsesync.store import open_store

    trusted = signing.trusted_keys(config.trusted_keys)
    logging.getLogger("pulsesync.retention").setLevel(logging.INFO)  # one summary line per run

    async def run() -> None:
        metrics.serve(config.metrics_port)
        async with open_store(config.store) as store:
            worker = RetentionWorker(store, config, trusted)
            if args.once or config.dry_run:
                plan = await worker.run_once()
                if config.dry_run:
                    print("\n".join(plan.lines()) or "nothing to delete")
                print(("would have: " if config.dry_run else "") + plan.summary())
                return
            await worker.run(_stop_on_signals())

    asyncio.run(run())
    return 0


def _cmd_mirror(args: argparse.Namespace) -> int:
    import asyncio

    from pulsesync.mirror.config import MirrorConfig

    flags = {
        "store.url": args.store,
        "store.endpoint_url": args.endpoint_url,
        "target.url": args.to,
        "target.endpoint_url": args.to_endpoint_url,
        "interval_seconds": args.interval,
        "metrics_port": args.metrics_port,
    }
    config = load_config(MirrorConfig, args.config, flags)
    if args.trusted_key:
        config = config.model_copy(update={"trusted_keys": [*config.trusted_keys, *args.trusted_key]})
    from pulsesync.errors import ConfigError

    if config.target.url is None:
        raise ConfigError("target.url: a mirror needs a store to copy to (--to)")
    from pulsesync import metrics  # after the config: a config error answers without torch
    from pulsesync.mirror import Mirror
    from pulsesync.protocol import signing
    from pulsesync.store import open_store

    trusted = signing.trusted_keys(config.trusted_keys)
    logging.getLogger("pulsesync.mirror").setLevel(logging.INFO)  # one line per pass that copied

    async def run() -> None:
        metrics.serve(config.metrics_port)
        async with open_store(config.store) as origin, open_store(config.target) as target:
            mirror = Mirror(origin, target, config, trusted)
            if args.once:
                print((await mirror.run_once()).summary())
                return
            await mirror.run(_stop_on_signals())

    asyncio.run(run())
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    import asyncio
    import datetime as dt
    import json

    config = _subscriber_config(args)  # first: a config error answers without torch
    from pulsesync.errors import IntegrityError
    from pulsesync.inspect_chain import (
        chain_rows,
        fleet_as_json,
        format_fleet,
        format_table,
        retired_rows,
        rows_as_json,
    )
    from pulsesync.protocol import signing
    from pulsesync.protocol.fleet import read_fleet
    from pulsesync.store import open_store

    trusted = signing.trusted_keys(config.trusted_keys) if config.trusted_keys else None

    async def run() -> None:
        async with open_store(config.store) as store:
            rows = await chain_rows(store, trusted)
            retired = await retired_rows(store, trusted) if args.html else []
            fleet = await read_fleet(store)
            url = store.url
        now, ttl = dt.datetime.now(dt.timezone.utc), args.fleet_ttl
        if args.html:
            from pulsesync.chain_report import render

            args.html.write_text(render(rows, retired, url, fleet=fleet, fleet_ttl=ttl), encoding="utf-8")
            print(
                f"wrote {args.html} ({len(rows)} steps, {len(retired)} removed by retention, {len(fleet)} subscribers)"
            )
            return
        if args.json:
            print(json.dumps({"steps": rows_as_json(rows), "fleet": fleet_as_json(fleet, now, ttl)}))
        else:
            print(format_table(rows) + "\n" + format_fleet(fleet, now, ttl))
        if bad := [r for r in rows if r.verified is False]:  # shown above, and a failure of the command
            raise IntegrityError(
                f"{url}: {len(bad)} of {len(rows)} ready markers do not verify against the trusted keys "
                f"(step {bad[0].step}: {bad[0].error})"
            )

    asyncio.run(run())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from pulsesync.errors import ConfigError

    config = _subscriber_config(args)
    if not config.trusted_keys:
        raise ConfigError("trusted_keys: verify needs at least one trusted public key (--trusted-key)")
    from pulsesync.protocol import signing  # after the config: a config error answers without torch
    from pulsesync.protocol.chain import ChainClient
    from pulsesync.rebuild import reconstruct
    from pulsesync.store import open_store

    async def run() -> None:
        async with open_store(config.store) as store:
            reader = ChainClient(store, signing.trusted_keys(config.trusted_keys), threads=config.codec.threads or 1)
            rebuilt = await reconstruct(reader, args.step)
            report = {
                "step": rebuilt.step,
                "anchor_step": rebuilt.anchor_step,
                "patches_applied": rebuilt.patches_applied,
                "digest": rebuilt.digest.root,
                "manifests_verified": reader.manifests_verified,
                "bytes_downloaded": reader.fetcher.bytes_downloaded,
            }
            print(json.dumps(report))

    asyncio.run(run())
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    import asyncio

    from pulsesync.progress import phase
    from pulsesync.store import open_store

    config = _config(args)

    async def run() -> None:
        async with open_store(config.store) as store:
            if args.action == "ls":
                async for info in store.list(args.prefix):
                    print(f"{info.size:>15,}  {info.key}")
            elif args.action == "put":
                with phase(f"upload {args.key}", args.file.stat().st_size) as shown:
                    done = await store.upload_file(args.key, args.file, progress=shown.transfer)
                print(f"uploaded {store.url}{done.key}: {done.size:,} bytes, sha256 {done.sha256}")
            else:
                with phase(f"download {args.key}", None) as shown:
                    done = await store.download_file(
                        args.key, args.file, progress=shown.transfer, expected_sha256=args.sha256
                    )
                print(f"downloaded {store.url}{done.key} to {args.file}: {done.size:,} bytes, sha256 {done.sha256}")

    asyncio.run(run())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command."""
    common = _common_flags()
    parser = argparse.ArgumentParser(
        prog="pulsesync",
        description="Lossless sparse weight sync from RL trainers to inference servers through an object store.",
    )
    parser.add_argument("--version", action="version", version=f"pulsesync {__version__}")
    _log_flags(parser, "top_")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keygen = commands.add_parser("keygen", parents=[common], help="generate a publisher signing keypair")
    keygen.add_argument("--out", type=Path, required=True, metavar="DIR", help="writes DIR/publisher.key and .pub")
    keygen.add_argument("--force", action="store_true", help="overwrite existing key files")
    keygen.set_defaults(run=_cmd_keygen)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="run trainer, publisher and two subscribers on this machine (or --store); check bit-exactness",
    )
    demo.add_argument("--steps", type=int, default=30, help="training steps to publish (default 30)")
    demo.add_argument("--anchor-interval", type=int, default=10, metavar="K", help="anchor every K steps (default 10)")
    demo.add_argument("--hidden", type=int, default=256, help="model width (default 256; ~9M parameters)")
    demo.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    demo.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_cmd_demo)

    publish = commands.add_parser(
        "publish", parents=[common], help="publish checkpoints as signed patches and anchors (beside the trainer)"
    )
    publish.add_argument("--signing-key", type=Path, metavar="PATH", help="Ed25519 private key (pulsesync keygen)")
    publish.add_argument("--anchor-interval", type=int, metavar="K", help="an anchor every K published steps")
    source = publish.add_mutually_exclusive_group(required=True)
    source.add_argument("--watch", type=Path, metavar="DIR", help="publish each new checkpoint-<step>/ under DIR")
    source.add_argument(
        "--checkpoint", type=Path, metavar="PATH", help="publish one checkpoint (safetensors directory or file)"
    )
    source.add_argument(
        "--synthetic", action="store_true", help="publish the demo's synthetic trainer (docker-compose, smoke tests)"
    )
    publish.add_argument("--step", type=int, metavar="N", help="step number of --checkpoint")
    publish.add_argument("--interval", type=float, default=5.0, help="--synthetic: seconds between steps (default 5)")
    publish.add_argument("--max-steps", type=int, metavar="N", help="--synthetic: stop after N steps (default: never)")
    publish.add_argument("--once", action="store_true", help="with --watch: publish the checkpoints there now, exit")
    publish.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on PORT")
    publish.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="keep the baseline here between runs: a restart (each --checkpoint) resumes from it, not the store",
    )
    publish.add_argument(
        "--take-over-prefix",
        action="store_true",
        help="publish into a prefix that holds another stream's markers (another key or job): a new stream starts",
    )
    publish.set_defaults(run=_cmd_publish)

    trusted_flag = argparse.ArgumentParser(add_help=False)
    trusted_flag.add_argument(
        "--trusted-key", type=Path, action="append", metavar="PATH", help="a trusted publisher.pub (repeatable)"
    )
    subscribe = commands.add_parser(
        "subscribe", parents=[common, trusted_flag], help="keep verified weights up to date beside an inference server"
    )
    subscribe.add_argument("--cache-dir", type=Path, metavar="DIR", help="persist the verified state here")
    subscribe.add_argument("--out-dir", type=Path, metavar="DIR", help="write HF model directories here (+ current)")
    subscribe.add_argument("--once", action="store_true", help="sync once, print one JSON line, exit")
    subscribe.add_argument("--step", type=int, metavar="N", help="sync to step N instead of the newest")
    subscribe.add_argument("--metrics-port", type=int, metavar="PORT", help="serve /metrics and /healthz on PORT")
    subscribe.add_argument(
        "--fallback-store",
        action="append",
        metavar="URL",
        help="a store to read when --store lags, withholds or fails verification (repeatable, in order; --store is "
        "then a mirror and the origin comes last)",
    )
    subscribe.add_argument(
        "--fallback-endpoint-url", action="append", metavar="URL", help="S3 endpoint of each --fallback-store"
    )
    subscribe.add_argument(
        "--reset-stream",
        action="store_true",
        help="follow the store's newest publishing stream, not the one --cache-dir learned (a deliberate switch)",
    )
    subscribe.set_defaults(run=_cmd_subscribe)

    retain = commands.add_parser(
        "retain",
        parents=[common, trusted_flag],
        help="prune old patches and anchors by policy, never breaking a kept chain (markers verified)",
    )
    retain.add_argument("--keep-patches", type=int, metavar="N", help="newest patches kept (default 100)")
    retain.add_argument("--keep-anchors", type=int, metavar="M", help="newest anchors kept (default 10)")
    retain.add_argument("--grace-seconds", type=float, metavar="S", help="payloads go this long after their marker")
    retain.add_argument("--once", action="store_true", help="run once and exit (default: every interval_seconds)")
    retain.add_argument("--dry-run", action="store_true", help="print exactly what would be deleted, delete nothing")
    retain.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on PORT")
    retain.set_defaults(run=_cmd_retain)

    mirror = commands.add_parser(
        "mirror",
        parents=[common, trusted_flag],
        help="copy each committed step from --store to --to, verified, in commit order (a regional relay)",
    )
    mirror.add_argument("--to", metavar="URL", help="the store to copy to (s3://bucket/prefix or file:///path)")
    mirror.add_argument("--to-endpoint-url", metavar="URL", help="S3 endpoint of --to")
    mirror.add_argument("--once", action="store_true", help="copy what is missing now, print one line, exit")
    mirror.add_argument("--interval", type=float, metavar="S", help="seconds between passes (default 1)")
    mirror.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on PORT")
    mirror.set_defaults(run=_cmd_mirror)

    inspect = commands.add_parser(
        "inspect", parents=[common, trusted_flag], help="show the chain in a store (verified with --trusted-key)"
    )
    inspect.add_argument(
        "--json", action="store_true", help='one JSON object instead of the tables: {"steps": [...], "fleet": [...]}'
    )
    inspect.add_argument(
        "--fleet-ttl",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a subscriber whose status is older than this is shown as gone (default 600)",
    )
    inspect.add_argument(
        "--html", type=Path, metavar="FILE", help="write a self-contained HTML report (timeline, chains, table)"
    )
    inspect.set_defaults(run=_cmd_inspect)
    verify = commands.add_parser(
        "verify", parents=[common, trusted_flag], help="rebuild a step from the store and check every digest"
    )
    verify.add_argument("--step", type=int, metavar="N", help="the step to rebuild (default: the newest)")
    verify.set_defaults(run=_cmd_verify)

    store = commands.add_parser("store", help="list, upload or download objects in the configured store")
    actions = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("ls", parents=[common], help="list keys under a prefix, in order, with sizes")
    ls.add_argument("prefix", nargs="?", default="", help="key prefix, e.g. ready/")
    put = actions.add_parser("put", parents=[common], help="upload a file (multipart on S3), with progress")
    put.add_argument("file", type=Path)
    put.add_argument("key")
    get = actions.add_parser("get", parents=[common], help="download to a file atomically, with progress")
    get.add_argument("key")
    get.add_argument("file", type=Path)
    get.add_argument("--sha256", help="refuse the download unless its SHA-256 matches")
    store.set_defaults(run=_cmd_store)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pulsesync` console script."""
    args = build_parser().parse_args(argv)
    with _loggers_restored():
        return _run(args)


# The loggers a command quiets or raises for its own lines: put back when it returns, so that a
# program (or test) that calls main() in process logs as it did before.
_COMMAND_LOGGERS = (
    *("pulsesync.subscriber", "pulsesync.retention", "pulsesync.mirror"),
    *("pulsesync.progress", "pulsesync.publisher.steps"),
)


@contextlib.contextmanager
def _loggers_restored() -> Iterator[None]:
    levels = {name: logging.getLogger(name).level for name in _COMMAND_LOGGERS}
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace) -> int:
    _setup_logging(args)
    try:
        result: Any = args.run(args)
        return int(result)
    except PulseSyncError as e:
        # Exactly one line, printable whatever bytes the message quotes from the store.
        message = " ".join(str(e).split()).encode("utf-8", "backslashreplace").decode("utf-8")
        print(f"pulsesync: error: {type(e).__name__}: {message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("pulsesync: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
