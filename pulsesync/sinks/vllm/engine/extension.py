"""The worker-extension engine path: pulsesync's methods inside every vLLM worker, called through collective_rpc.

For engines started with `--worker-extension-cls pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension`
(any vLLM from 0.10; the weight-transfer backend in `engine.backend` is the path from 0.32). The
sidecar calls the `pulsesync_*` methods through `POST /collective_rpc`; each apply is committed
at once (the extension has no session to span ranks), and a failure restores the bits held before.
"""

from __future__ import annotations

from typing import Any

from safetensors import safe_open

from pulsesync.digest import state_digest
from pulsesync.digest_algorithms import DEFAULT_ALGORITHM, DigestAlgorithm
from pulsesync.sinks.vllm.engine.applier import WeightApplier, vllm_applier
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate


class PulseSyncWorkerExtension:
    """vLLM worker extension (`--worker-extension-cls`): its methods run on every worker via collective_rpc."""

    model_runner: Any  # set by vLLM's worker

    def _pulsesync(self) -> WeightApplier:
        applier: WeightApplier | None = getattr(self, "_pulsesync_applier", None)
        if applier is None:
            runner, rank = self.model_runner, int(getattr(self, "rank", 0))
            applier = vllm_applier(runner.get_model(), runner.vllm_config, rank, runner.reload_weights)
            self._pulsesync_applier = applier
        return applier

    def pulsesync_layout(self) -> dict[str, Any]:
        """Checkpoint names this worker holds, their aliases, which are written in place, its regions and rank."""
        applier = self._pulsesync()
        return applier.layout.describe() | {"rank": applier.rank}

    def pulsesync_held(self) -> dict[str, Any]:
        """The step and state digest this worker holds; None for both when unknown."""
        return self._pulsesync().held()

    def pulsesync_apply(self, path: str | list[str]) -> dict[str, Any]:
        """Apply an update file from the vllm sink (of a list, this rank's); EngineError before any change."""
        if isinstance(path, list):
            path = path[self._pulsesync().rank]
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        return self._pulsesync().apply(WeightUpdate.from_file(tensors, meta, path), path)

    def pulsesync_digest(self, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM) -> dict[str, Any]:
        """State digest of what this worker holds (tied names included), to compare with the published one."""
        applier = self._pulsesync()
        digest = state_digest(applier.engine_state(), algorithm)
        return {"root": digest.root, "held": applier.held_digest}
