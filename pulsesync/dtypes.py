"""Dtype registry and raw-bit views of tensors, shared by the codec and the state digest.

Everything pulsesync compares or stores is a tensor's bit pattern, never its value, so
each supported dtype maps to a signed integer dtype of the same width.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pulsesync.errors import UnsupportedDtypeError

# Canonical serialization is little-endian; torch runs only on little-endian hosts today.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("pulsesync requires a little-endian host")

State = Mapping[str, torch.Tensor]
"""An ordered mapping name -> tensor; equality is bitwise."""


@dataclass(frozen=True)
class DTypeInfo:
    """How one torch dtype is named, coded and reinterpreted."""

    name: str  # safetensors' dtype name, the canonical name in manifests and digests
    code: int  # one byte in the patch format
    torch_dtype: torch.dtype
    int_dtype: torch.dtype  # signed integer dtype of the same width, for bit arithmetic
    is_float: bool  # sign-magnitude bit patterns: needs the order-preserving map

    @property
    def width(self) -> int:
        """Bytes per element."""
        return self.torch_dtype.itemsize


# Integer types by width in bytes: the one table the codec and the tests share.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_INT_OF_WIDTH: dict[int, type[np.integer]] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
NP_UINT_OF_WIDTH: dict[int, type[np.integer]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

_TABLE: list[tuple[str, int, torch.dtype, bool]] = [
    ("BOOL", 1, torch.bool, False),
    ("U8", 2, torch.uint8, False),
    ("I8", 3, torch.int8, False),
    ("I16", 4, torch.int16, False),
    ("U16", 5, torch.uint16, False),
    ("I32", 6, torch.int32, False),
    ("U32", 7, torch.uint32, False),
    ("I64", 8, torch.int64, False),
    ("U64", 9, torch.uint64, False),
    ("F16", 10, torch.float16, True),
    ("BF16", 11, torch.bfloat16, True),
    ("F32", 12, torch.float32, True),
    ("F64", 13, torch.float64, True),
    ("F8_E4M3", 14, torch.float8_e4m3fn, True),
    ("F8_E5M2", 15, torch.float8_e5m2, True),
]

DTYPES: tuple[DTypeInfo, ...] = tuple(
    DTypeInfo(name, code, dt, _INT_OF_WIDTH[dt.itemsize], is_float) for name, code, dt, is_float in _TABLE
)
_BY_TORCH = {d.torch_dtype: d for d in DTYPES}
_BY_CODE = {d.code: d for d in DTYPES}
_BY_NAME = {d.name: d for d in DTYPES}


def dtype_info(dtype: torch.dtype) -> DTypeInfo:
    """Registry entry of a torch dtype; raises UnsupportedDtypeError for others."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported (supported: {', '.join(_BY_NAME)})") from None


def dtype_by_code(code: int) -> DTypeInfo | None:
    """Registry entry of a patch-format dtype code, or None if unknown."""
    return _BY_CODE.get(code)


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """Flat C-order view of a tensor's bit patterns as a signed integer tensor.

    Copies only when the tensor is not contiguous.
    """
    info = dtype_info(t.dtype)
    if t.numel() == 0:  # empty tensors may carry strides that forbid reinterpreting views
        return torch.empty(0, dtype=info.int_dtype, device=t.device)
    return t.contiguous().reshape(-1).view(info.int_dtype)


def describe(t: torch.Tensor) -> str:
    """Short human description like 'BF16[4096, 11008]'."""
    info = _BY_TORCH.get(t.dtype)
    return f"{info.name if info else t.dtype}{list(t.shape)}"


def dense_bytes(state: State) -> int:
    """Bytes of a state's raw values."""
    return sum(t.numel() * t.element_size() for t in state.values())
