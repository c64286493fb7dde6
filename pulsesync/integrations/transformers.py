"""Publish from inside a `transformers.Trainer`: `trainer.add_callback(PulseSyncCallback(config))`.

Each optimizer step (`on_step_end`) the main process publishes the model's weights as step
`global_step` and returns as soon as they are copied to host memory; `on_train_end` flushes. A run
that starts from step 0 first publishes the initial weights as step 0 (`on_train_begin`), so
engines launched from any checkpoint converge to a known policy before the first update. Anchors
carry the model's config.json and generation_config.json, so they open with `from_pretrained`.
Weights go out under their checkpoint names, as `save_pretrained` writes them (transformers 5 fuses a
MoE layer's experts in memory; engines load one tensor per expert).

A PEFT model (LoRA) publishes its adapter only: `get_peft_model_state_dict` and the adapter's
`adapter_config.json`, the directory the `vllm_lora` sink serves (docs/engines.md).

Several ranks (FSDP2, data parallel): every rank publishes its own `model.state_dict()` through a
sharded Publisher: each uploads what it owns (FSDP2's DTensor shards; one replica of a replicated
tensor) and rank 0 commits the step, so no rank gathers the model (docs/sharding.md). Layouts the
state dict does not describe (FSDP1's flat parameters, DeepSpeed ZeRO-3) gather instead: pass
`state_dict_fn`, which the callback calls on every rank, e.g. `state_dict_fn=lambda model:
trainer.accelerator.get_state_dict(model)`; only the world main process publishes what it returns.

Requires the `transformers` extra: `pip install 'pulsesync[transformers]'`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from pulsesync.publisher import Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.coordinator import multi_rank

StateDictFn = Callable[[torch.nn.Module], dict[str, torch.Tensor]]


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint of the model holds, by its names: a PEFT model's adapter, or the weights as
    `save_pretrained` names them (`revert_weight_conversion` undoes transformers' in-memory fusing)."""
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        return dict(get_peft_model_state_dict(model))
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: its state dict is in checkpoint names
        return dict(state)
    return dict(revert_weight_conversion(model, state))


class PulseSyncCallback(TrainerCallback):
    """Publishes the model every optimizer step through a pulsesync Publisher."""

    def __init__(
        self,
        config: PublisherConfig | None = None,
        *,
        publisher: Publisher | None = None,
        state_dict_fn: StateDictFn | None = None,
        every: int = 1,
        publish_initial: bool = True,
    ) -> None:
        if (config is None) == (publisher is None):
            raise ValueError("pass exactly one of config or publisher")
        self._config = config
        self._publisher = publisher
        self._owns_publisher = publisher is None
        self._state_dict_fn = state_dict_fn
        self._every = every
        self._publish_initial = publish_initial
        self._files_dir = tempfile.TemporaryDirectory(prefix="pulsesync-hf-")
        self._files: dict[str, Path] | None = None

    @property
    def publisher(self) -> Publisher:
        """The publisher (created on first use: on every rank when sharded, else on the main process only)."""
        if self._publisher is None:
            assert self._config is not None
            self._publisher = Publisher(self._config, sharded=self._sharded)
        return self._publisher

    @property
    def _sharded(self) -> bool:
        """Every rank publishes what it owns (several ranks, and no gathering state_dict_fn)."""
        return self._state_dict_fn is None and multi_rank()

    def _model_files(self, model: Any) -> dict[str, Path]:
        """config.json and generation_config.json of the model (a PEFT model: adapter_config.json), written once."""
        if self._files is None:
            out = Path(self._files_dir.name)
            self._files = {}
            if _is_peft(model):
                model.peft_config[model.active_adapter].save_pretrained(out)
            else:
                for attr in ("config", "generation_config"):
                    if (cfg := getattr(model, attr, None)) is not None and hasattr(cfg, "save_pretrained"):
                        cfg.save_pretrained(out)
            self._files = {p.name: p for p in out.glob("*.json")}
        return self._files

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Publish the initial weights as step 0 (not when resuming: that step is in the store already)."""
        if self._publish_initial and state.global_step == 0:
            self._publish(state, kwargs.get("model"))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Publish the weights of this optimizer step (every rank when sharded; else the main process)."""
        if state.global_step % self._every == 0:
            self._publish(state, kwargs.get("model"))

    def _publish(self, state: TrainerState, model: Any) -> None:
        if model is None:
            return
        if self._state_dict_fn is not None:
            weights = self._state_dict_fn(model)  # collective: every rank takes part
        elif self._sharded:
            weights = model.state_dict()
        elif state.is_world_process_zero:
            weights = checkpoint_state(model)
        else:
            return
        if self._sharded or state.is_world_process_zero:
            self.publisher.publish(state.global_step, weights, self._model_files(model))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Wait for the last steps to commit; stop the publisher if this callback created it."""
        if (self._sharded or state.is_world_process_zero) and self._publisher is not None:
            (self._publisher.close if self._owns_publisher else self._publisher.flush)()
