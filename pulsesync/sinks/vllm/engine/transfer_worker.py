"""pulsesync's side of vLLM's weight-transfer verbs on one engine rank (no vLLM import: `engine.backend` adapts it).

The sidecar (the vllm sink, or the in-process API) drives vLLM's own verbs:

- `init_weight_transfer_engine {"directory", "session"}`: each rank reports its layout, the state
  it holds and whether a session is still open;
- `start_weight_update`, then `update_weights` with one `{"action": "stage", "path"}` per rank
  (its own cut of a delta, or the whole full update: read, validated, rebuilt modules prepared on
  twins, all before the engine is paused), then, paused, `{"action": "apply"}` (the engine's own
  writes) and `{"action": "commit"}` once every rank applied;
- `finish_weight_update`: anything applied but not committed is rolled back, so a session that
  failed on any rank ends with every rank holding the previous state's exact bits.

No verb raises (see `wire.replies`): each writes this rank's reply file instead.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from safetensors import safe_open

from pulsesync.digest import state_digest
from pulsesync.sinks.vllm.engine.applier import WeightApplier
from pulsesync.sinks.vllm.wire.replies import check_session, write_reply
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate


@dataclass
class TransferInit:
    """Where replies go and whose session this is; optionally a digest of what each rank holds, or a drill."""

    directory: str
    session: str
    state_digest: bool = False  # also hash what this rank holds (tests, audits: reads every weight)
    drill_rank: int | None = None  # make this rank's next apply fail after `drill_after` tensors
    drill_after: int = 0


@dataclass
class TransferStep:
    """One verb of the session: stage this rank's update file, apply it, commit, or roll back."""

    session: str
    action: Literal["stage", "apply", "commit", "rollback"] = "apply"
    path: str | None = None


class TransferWorker:
    """Applies verified update files transactionally on one rank and answers through reply files."""

    def __init__(self, applier: Callable[[], WeightApplier], rank: int, world: int) -> None:
        self._make_applier = applier  # called once the model is loaded
        self._applier: WeightApplier | None = None
        self.rank, self.world = rank, world
        self.directory: Path | None = None
        self.session: str | None = None
        self.open = False  # between start and finish

    @property
    def applier(self) -> WeightApplier:
        if self._applier is None:
            self._applier = self._make_applier()
        return self._applier

    def init(self, info: TransferInit) -> None:
        try:
            self.session = check_session(info.session)
        except ValueError:
            return  # no reply: the sidecar that sent it cannot have made its own session id
        self.directory = Path(info.directory)
        if info.drill_rank == self.rank:
            self.applier.drill = info.drill_after
        reply: dict[str, Any] = {"layout": self.applier.layout.describe(), "open": self.open}
        if info.state_digest:
            reply["state_digest"] = state_digest(self.applier.engine_state()).root
        self._reply("init", reply)

    def start(self) -> None:
        self.applier.rollback()  # an apply left by a session that never finished
        self.open = True

    def step(self, step: TransferStep) -> None:
        if step.session != self.session or self.directory is None:
            return  # another session's: its sidecar reads no reply from this one
        try:
            if step.action == "stage":
                self._stage(step.path)
                self._reply("stage", {})
            elif step.action == "apply":
                self._reply("apply", {"result": self.applier.apply_staged(hold=True)})
            elif step.action == "commit":
                self.applier.commit()
                self._reply("commit", {})
            else:
                self.applier.rollback()
                self._reply("rollback", {})
        except Exception as e:  # reported, never raised (wire.replies); the applier restored its bits
            self._reply(step.action, {"error": f"{type(e).__name__}: {e}"[:2000], "where": _where(e)})

    def _stage(self, path: str | None) -> None:
        if path is None:
            raise ValueError("a stage names no update file")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        self.applier.stage(WeightUpdate.from_file(tensors, meta, path), path)

    def finish(self) -> None:
        self.applier.rollback()  # applied on this rank but not committed: another rank failed
        self.open = False
        if self.session is not None and self.directory is not None:
            self._reply("finish", {})

    def _reply(self, verb: str, fields: dict[str, Any]) -> None:
        assert self.directory is not None and self.session is not None
        held = self.applier.held()
        reply = {"session": self.session, "verb": verb, "rank": self.rank, "world": self.world, "held": held}
        write_reply(self.directory, self.rank, reply | fields)


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
