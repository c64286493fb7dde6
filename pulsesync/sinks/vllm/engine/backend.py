"""pulsesync as a vLLM weight-transfer backend (vLLM 0.32+): `--weight-transfer-config '{"backend": "pulsesync"}'`.

Registered in every vLLM process by the `vllm.general_plugins` entry point (`engine.plugin`); no
worker extension. vLLM creates one engine per worker once the model is loaded; each hands the
verbs to a `TransferWorker` (the session, the transactional applies, the reply files).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from pulsesync.sinks.vllm.engine.applier import vllm_applier
from pulsesync.sinks.vllm.engine.transfer_worker import TransferInit, TransferStep, TransferWorker


class PulseSyncTransferEngine(WeightTransferEngine):  # type: ignore[misc]  # vLLM is not typed for mypy here
    """The worker side of the `pulsesync` backend."""

    init_info_cls = TransferInit
    update_info_cls = TransferStep
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rank = get_tensor_model_parallel_rank()
        self.worker = TransferWorker(
            lambda: vllm_applier(self.model, self.vllm_config, rank), rank, get_tensor_model_parallel_world_size()
        )

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        self.worker.init(init_info)

    def start_weight_update(self) -> None:
        self.worker.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: it raises on a malformed info, and nothing here is asynchronous.
        try:
            step = self.parse_update_info(update_info)
        except ValueError:
            return
        self.worker.step(step)

    def receive_weights(self, update_info: TransferStep) -> None:
        self.worker.step(update_info)

    def finish_weight_update(self) -> None:
        self.worker.finish()

    def shutdown(self) -> None:
        """Nothing to release: no connection to a trainer."""
