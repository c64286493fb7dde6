"""`pulsesync publish` as a process beside the trainer: watch a checkpoint directory, publish one
checkpoint, or (for demos such as docker-compose's) publish a synthetic trainer's steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
from pathlib import Path

import torch

from pulsesync.errors import ConfigError, PulseSyncError
from pulsesync.publisher.checkpoints import check_checkpoint, find_checkpoints, incomplete_reason, load_checkpoint
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.pipeline import AsyncPublisher
from pulsesync.publisher.report import StepReport
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes

log = logging.getLogger("pulsesync.publisher")


async def publish_checkpoint(config: PublisherConfig, path: Path, step: int) -> list[StepReport]:
    """Publish one checkpoint as `step` against the newest committed step (resuming), then exit."""
    config = config.model_copy(update={"resume": True})
    check_checkpoint(path)  # before the baseline is rebuilt from the store
    publisher = AsyncPublisher(config)
    await publisher.start(first_step=step)  # a step the store holds already is refused before the rebuild
    async with publisher:
        state, files = await asyncio.to_thread(load_checkpoint, path, config.anchor_files)
        await publisher.publish(step, state, files)
        del state
    return _outcome(publisher, [step])


async def watch(
    config: PublisherConfig, root: Path, once: bool = False, stop: asyncio.Event | None = None
) -> list[StepReport]:
    """Publish each complete checkpoint under root in step order until `stop` is set (after one last scan).

    With once: the checkpoints complete now, then return.
    """
    stop = stop or asyncio.Event()
    if once:  # a backfill publishes every checkpoint: wait for uploads instead of skipping
        if not root.is_dir():
            raise ConfigError(f"--watch {root}: no such directory")
        config = config.model_copy(update={"on_backpressure": "block"})
    async with AsyncPublisher(config) as publisher:
        published: list[int] = []
        last = -1
        if not root.is_dir():
            log.warning("watching %s, which does not exist yet", root)
        while True:
            for ckpt in find_checkpoints(root):
                if ckpt.step <= last:
                    continue
                if reason := await asyncio.to_thread(incomplete_reason, ckpt.path, config.watch):
                    if not once:
                        log.debug("checkpoint %s: waiting (%s)", ckpt.path, reason)
                        break  # strictly in step order: wait for this one
                    log.warning("checkpoint %s: skipped, not complete (%s)", ckpt.path, reason)
                    continue
                last = ckpt.step
                if ckpt.step <= publisher.last_step:
                    log.warning("checkpoint %s: skipped, step %d is already published", ckpt.path, ckpt.step)
                    continue
                state, files = await asyncio.to_thread(load_checkpoint, ckpt.path, config.anchor_files)
                await publisher.publish(ckpt.step, state, files)
                del state
                published.append(ckpt.step)
                if config.watch.delete_consumed:
                    await asyncio.to_thread(shutil.rmtree, ckpt.path)
                    log.info("checkpoint %s: deleted after reading", ckpt.path)
            if once or stop.is_set():
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), config.watch.poll_seconds)
    return _outcome(publisher, published) if once else list(publisher.reports)


async def publish_synthetic(
    config: PublisherConfig,
    interval: float,
    max_steps: int | None = None,
    stop: asyncio.Event | None = None,
    hidden: int = 256,
    layers: int = 4,
) -> list[StepReport]:
    """Train the demo's synthetic model (pulsesync.synthetic) and publish a step every `interval` seconds.

    Numbering continues after the newest step in the store, so a restarted publisher anchors anew.
    """
    stop = stop or asyncio.Event()
    trainer = SyntheticTrainer(llm_like_shapes(hidden, layers, vocab=96 * hidden), lr=1e-6)
    async with AsyncPublisher(config) as publisher:
        step = publisher.last_step + 1
        for _ in range(max_steps if max_steps is not None else sys.maxsize):
            await publisher.publish(step, await asyncio.to_thread(_next_state, trainer))
            step += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                break
    return list(publisher.reports)


def _next_state(trainer: SyntheticTrainer) -> dict[str, torch.Tensor]:
    trainer.step()
    return trainer.state()


def _outcome(publisher: AsyncPublisher, steps: list[int]) -> list[StepReport]:
    """The reports of the given steps; raises the last error if one of them did not commit."""
    reports = [r for r in publisher.reports if r.step in steps]
    committed = {r.step for r in reports if r.ok}
    failed = [s for s in steps if s not in committed]
    if failed and publisher.last_error is not None:
        raise publisher.last_error
    if failed:
        raise PulseSyncError(f"steps {failed} were not published")
    return reports
