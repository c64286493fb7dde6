"""Host snapshot of a state: the only work publish() does on the trainer's thread.

CPU tensors are cloned contiguous. CUDA tensors are copied into pinned host buffers with
non-blocking copies and one synchronize at the end, so the copies overlap and publish() returns
only once every byte is on the host (the trainer may overwrite its weights right after).
"""

from __future__ import annotations

import torch

from pulsesync.tensors import State


def snapshot(state: State) -> dict[str, torch.Tensor]:
    """A contiguous host copy of every tensor, complete when this returns."""
    out: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, t in state.items():
        t = t.detach()
        if t.device.type == "cpu":
            out[name] = t.clone(memory_format=torch.contiguous_format)
            continue
        pinned = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        out[name] = host
        devices.add(t.device)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out


def dense_bytes(state: State) -> int:
    """Bytes of a state's raw values."""
    return sum(t.numel() * t.element_size() for t in state.values())
