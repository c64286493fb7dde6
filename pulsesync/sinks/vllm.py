"""The `vllm` sink and the worker extension it drives.

Engine side: start vLLM with the extension and the dev-mode endpoints,

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls pulsesync.sinks.vllm.PulseSyncWorkerExtension

(targets vLLM's V1 engine, 0.10 and later: `--worker-extension-cls`, `POST /collective_rpc`,
`POST /reset_prefix_cache`). Sidecar side: after each verified step the sink writes one update file
(safetensors) under `update_dir` and calls `POST /collective_rpc {"method": "pulsesync_apply",
"args": [path]}`, then `POST /reset_prefix_cache`. The update holds only the tensors whose
per-tensor digest changed; for a tensor the workers hold whole under its checkpoint name (asked
once with `pulsesync_param_shapes`) it holds just the changed positions (known from the applied
patches, Update.changes) and values, written with `index_copy_` (sparse, in checkpoint
coordinates); after a slow path, and for other tensors (fused or tensor-parallel shards)
go whole through `model.load_weights`, which maps checkpoint names to vLLM's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import aiohttp
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from pulsesync.atomic_files import replace_with
from pulsesync.digest import StateDigest
from pulsesync.dtypes import State
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.http import post_json


class VLLMSinkConfig(BaseModel):
    """Apply each update to a vLLM server through pulsesync's worker extension (collective_rpc)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["vllm"] = "vllm"
    url: str = Field(description="the vLLM server, e.g. http://127.0.0.1:8000 (started with VLLM_SERVER_DEV_MODE=1)")
    update_dir: Path = Field(description="where update files are written; the vLLM workers must read this path")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")


INDEX_SUFFIX = "::pulsesync_index"  # int64 flat positions of the changed elements
VALUE_SUFFIX = "::pulsesync_values"  # their new values, same dtype as the tensor


def build_update(
    state: State,
    digest: StateDigest,
    previous_digest: StateDigest | None,
    changes: Mapping[str, torch.Tensor | None] | None,
    sparse_ok: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor]:
    """Tensors of an update file: changed tensors only; positions + values where sparse_ok has the same shape."""
    out: dict[str, torch.Tensor] = {}
    for name, new in state.items():
        before = previous_digest.tensors.get(name) if previous_digest is not None else None
        if before is not None and before == digest.tensors.get(name):
            continue
        positions = changes.get(name) if changes is not None and before is not None else None
        if positions is not None and sparse_ok.get(name) == tuple(new.shape):
            out[name + INDEX_SUFFIX] = positions
            out[name + VALUE_SUFFIX] = new.reshape(-1)[positions].contiguous()
        else:
            out[name] = new.contiguous()
    return out


def apply_update(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Apply an update to a model in place: sparse entries by index_copy_, whole ones by load_weights (or copy)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    sparse = 0
    full: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for key, t in tensors.items():
            if key.endswith(VALUE_SUFFIX):
                continue
            if key.endswith(INDEX_SUFFIX):
                name = key.removesuffix(INDEX_SUFFIX)
                target = params.get(name)
                values = tensors[name + VALUE_SUFFIX]
                if target is None or target.dtype != values.dtype:
                    raise EngineError(f"update names {name!r}, which this model does not hold as {values.dtype}")
                flat = target.data.view(-1)
                flat.index_copy_(0, t.to(flat.device), values.to(flat.device))
                sparse += 1
            else:
                full.append((key, t))
        load_weights = getattr(model, "load_weights", None)
        if callable(load_weights):  # vLLM models map checkpoint names to fused / sharded parameters
            load_weights(full)
        else:
            for name, t in full:
                if name not in params:
                    raise EngineError(f"update names {name!r}, which this model does not have")
                params[name].data.copy_(t)
    return {"sparse": sparse, "whole": len(full)}


class PulseSyncWorkerExtension:
    """vLLM worker extension (`--worker-extension-cls`): its methods run on every worker via collective_rpc."""

    model_runner: Any  # set by vLLM's worker

    def pulsesync_param_shapes(self) -> dict[str, list[int]]:
        """Shapes of the parameters this worker holds, by name."""
        return {n: list(p.shape) for n, p in self.model_runner.model.named_parameters()}

    def pulsesync_apply(self, path: str) -> dict[str, int]:
        """Apply an update file written by the vllm sink."""
        return apply_update(self.model_runner.model, load_file(path))


class VLLMSink(Sink):
    """Applies each verified step to a vLLM server through PulseSyncWorkerExtension."""

    name = "vllm"

    def __init__(self, config: VLLMSinkConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self._sparse_ok: dict[str, tuple[int, ...]] | None = None

    async def _rpc(self, session: aiohttp.ClientSession, method: str, *args: Any) -> list[Any]:
        body = {"method": method, "args": list(args), "kwargs": {}, "timeout": self.config.timeout_seconds}
        reply = await post_json(session, f"{self.url}/collective_rpc", body, self.config.timeout_seconds)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EngineError(f"vllm sink: {method} on {self.url} answered {str(reply)[:200]!r}")
        return results

    async def deliver(self, update: Update) -> None:
        """Write the update file, apply it on every worker, reset the prefix cache."""
        async with aiohttp.ClientSession() as session:
            if self._sparse_ok is None:  # names every worker holds whole, with their shapes
                shapes = await self._rpc(session, "pulsesync_param_shapes")
                common = set.intersection(*(set(s) for s in shapes))
                self._sparse_ok = {n: tuple(shapes[0][n]) for n in common if all(s[n] == shapes[0][n] for s in shapes)}
            tensors = build_update(update.state, update.digest, update.previous_digest, update.changes, self._sparse_ok)
            self.config.update_dir.mkdir(parents=True, exist_ok=True)
            path = update_file_path(self.config.update_dir, update.step)
            replace_with(path, lambda p: save_file(tensors, str(p)))
            try:
                await self._rpc(session, "pulsesync_apply", str(path))
                await post_json(session, f"{self.url}/reset_prefix_cache", {}, self.config.timeout_seconds)
            finally:
                for old in self.config.update_dir.glob("update-*.safetensors"):
                    if old != path:
                        old.unlink(missing_ok=True)


def update_file_path(update_dir: Path, step: int) -> Path:
    """Where the sink writes the update of a step."""
    return update_dir / f"update-{step:012d}.safetensors"
