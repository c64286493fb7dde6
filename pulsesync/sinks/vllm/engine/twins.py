"""Module twins: how a post-processed module is recreated from model-format tensors beside the live one.

On vLLM's CPU build a linear layer keeps no usable weights (its forward pass calls a kernel packed
from them), so a changed module is rebuilt: a twin (a shallow copy with its own parameter tables)
is filled and post-processed while the engine still serves from the module, then installed, which
is only the engine's own writes (`install`). `VLLMRebuilder` recreates parameters from the
metadata vLLM's layerwise reload recorded; `LiveRebuilder` serves engines without it. The
applier (`applier.py`) decides what is rebuilt and when.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from pulsesync.sinks.vllm.engine.layout import ModelParams, UnknownLayout, live_params


class Rebuilder(Protocol):
    """How an engine recreates a post-processed module from model-format tensors, on a twin of it."""

    def model_params(self, name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The module's parameters as created, before post-load processing (maybe meta tensors)."""
        ...

    def prepare(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A twin of the module holding these model-format values, post-processed; the module is untouched."""
        ...

    def finish(self, module: torch.nn.Module, loaded: Mapping[str, torch.Tensor]) -> None:
        """Complete what the engine's post-load processing leaves undone when it runs a second time."""
        ...


class LiveRebuilder:
    """For engines without vLLM's reload metadata: set the parameters, then run the module's processing."""

    model_params: ModelParams = staticmethod(live_params)

    def prepare(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A twin of the module holding these model-format values, post-processed; the module is untouched."""
        twin = twin_of(module)
        for pname, tensor in tensors.items():
            old = getattr(module, pname)
            value = tensor.to(old.device, old.dtype).clone(memory_format=torch.contiguous_format)
            twin._parameters[pname] = torch.nn.Parameter(value, requires_grad=False)
        process(twin)
        return twin

    def finish(self, module: torch.nn.Module, loaded: Mapping[str, torch.Tensor]) -> None:
        """Nothing: the module's processing is all there is."""


_MODULE_STORES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def twin_of(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy with its own parameter and buffer tables: processing it leaves the module as it was."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return twin


def install(module: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Make the module compute as its prepared twin: the engine's own writes, no processing.

    Tensors of the same shape and dtype are copied into the module's own (the storage the
    forward pass, and any captured graph, holds); other tensors and the processing's other
    state (on vLLM's CPU build the packed `cpu_linear` kernel) are taken from the twin.
    """
    for store in ("_parameters", "_buffers"):
        own, new = getattr(module, store), getattr(twin, store)
        for name, tensor in new.items():
            mine = own.get(name)
            same_kind = mine is not None and tensor is not None and mine.shape == tensor.shape
            if same_kind and mine.dtype == tensor.dtype and mine.device == tensor.device:
                if mine is not tensor:
                    mine.data.copy_(tensor.data)
            else:
                own[name] = tensor
        for name in set(own) - set(new):
            del own[name]
    module._non_persistent_buffers_set = set(twin._non_persistent_buffers_set)
    state = module.__dict__
    for key in set(state) - set(twin.__dict__) - set(_MODULE_STORES):
        del state[key]
    for key, value in twin.__dict__.items():
        if key not in _MODULE_STORES and state.get(key) is not value:
            state[key] = value


def rebuild(rebuilder: Rebuilder, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Give the module these model-format values and redo its post-load processing."""
    install(module, rebuilder.prepare(module, tensors))


def process(module: torch.nn.Module) -> None:
    process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
    if callable(process):
        process(module)


class VLLMRebuilder:
    """Rebuilds a module as vLLM's layerwise reload does (vllm/model_executor/model_loader/reload, 0.32).

    On a twin of the module: the parameters are recreated in model format from the metadata vLLM
    recorded at load time, filled and post-processed (`process_weights_after_loading`); `install`
    then copies the results into the kernel tensors the forward pass holds.
    """

    def model_params(self, name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The module's parameters as created, before post-load processing (meta tensors with vLLM's attributes)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        params, buffers = get_layerwise_info(module).restore_metadata
        if buffers:
            raise UnknownLayout(f"{name} has buffers that its post-load processing may derive")
        live: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
        return live | dict(params)

    def prepare(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A twin of the module, recreated in model format from vLLM's metadata, filled, post-processed."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        info = get_layerwise_info(module)
        twin = twin_of(module)
        restore_layer_on_meta(twin, info)
        materialize_layer(twin, info)
        if "_already_called_process_weights_after_loading" in twin.__dict__:
            del twin.__dict__["_already_called_process_weights_after_loading"]
        for pname, tensor in tensors.items():
            getattr(twin, pname).data.copy_(tensor)
        process(twin)
        self.finish(twin, tensors)
        return twin

    def finish(self, module: torch.nn.Module, loaded: Mapping[str, torch.Tensor]) -> None:
        """Prepack a CPU MoE layer's experts when vLLM's processing left them as loaded.

        vLLM 0.32 runs the experts kernel's own processing (on CPU, `cpu_prepack_moe_weight` into
        the grouped-GEMM layout) only the first time a MoE layer is processed
        (`UnquantizedFusedMoEMethod._setup_kernel`, `is_weight_update`), so on a reload the CPU
        kernel would compute from unpacked weights. Weights still bit-equal to what was loaded were
        not packed (packing data that it leaves unchanged again leaves it unchanged).
        """
        experts = experts_kernel(module)
        if experts is None or type(experts).__name__ != "CPUUnquantizedExperts" or "w13_weight" not in loaded:
            return
        held = getattr(module, "w13_weight", None)
        if held is not None and same_bits(held.data, loaded["w13_weight"]):
            experts.process_weights_after_loading(module)


def experts_kernel(module: torch.nn.Module) -> Any:
    """A MoE layer's fused-experts kernel (shared with the layer's twins, which are shallow copies); None elsewhere."""
    return getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    b = b.to(a.device)  # engine parameters live on the GPU, update tensors on the host
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
