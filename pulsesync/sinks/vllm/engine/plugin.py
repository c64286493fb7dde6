"""The `vllm.general_plugins` entry point: registers the `pulsesync` weight-transfer backend in each vLLM process.

vLLM calls `register()` in its API server, its engine process and every worker. The backend
module (`backend`) loads only when an engine is created with
`--weight-transfer-config '{"backend": "pulsesync"}'`; importing this module needs no vLLM.
"""

from __future__ import annotations

BACKEND = "pulsesync"


def register() -> None:
    """Add the backend to vLLM's registry (once per process; vLLM may call plugins again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "pulsesync.sinks.vllm.engine.backend", "PulseSyncTransferEngine"
        )
