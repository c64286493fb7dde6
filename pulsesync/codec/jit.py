"""numba for the codec's kernels: whether it is here, how a kernel is compiled, and the intrinsics they use.

Each coding compiles its kernels where it defines them (`kernel`: an entry point, cached on disk,
None without numba; `inline` and `compiled`: helpers the kernels call, plain functions without
numba). Without numba every kernel is None and the numpy path runs: the results, errors
included, are bit-identical, which the tests check by running both (they switch `enabled` off).
numba's disk cache is keyed by the file that defines a kernel: after editing a helper another
file's kernel inlines, clear the `__pycache__` folders (a reinstall rewrites every file, so users
never meet a stale kernel).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

try:
    import numba as numba  # (re-exported: bench/scale.py compiles its floor with it)
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]

enabled = numba is not None  # tests switch it off to compare with the numpy path
Function = TypeVar("Function", bound=Callable[..., Any])


def kernel(function: Callable[..., Any]) -> Any:
    """An entry point, compiled on its first call (cached on disk, the GIL released); None without numba."""
    return numba.njit(cache=True, nogil=True, boundscheck=False)(function) if numba is not None else None


def inline(function: Function) -> Function:
    """A helper the kernels inline (compiled into each caller); the function itself without numba."""
    return numba.njit(inline="always", boundscheck=False)(function) if numba is not None else function  # type: ignore[return-value]


def compiled(function: Function) -> Function:
    """A helper the kernels call (compiled once, not inlined); the function itself without numba."""
    return numba.njit(boundscheck=False)(function) if numba is not None else function  # type: ignore[return-value]


def _element_address(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """In an intrinsic's codegen for (array, index) arguments: the element's address (no wraparound)."""
    from numba.core import cgutils

    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, array_type, array, [args[1]])  # type: ignore[no-untyped-call]


def _prefetch_intrinsic() -> Any:
    """numba's prefetch(chunk, index): llvm.prefetch of the element's address, for writing, into every cache level."""
    from llvmlite import binding, ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    # LLVM 15 made pointers opaque, and the intrinsic's name followed.
    name = "llvm.prefetch.p0" if binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"

    @intrinsic
    def prefetch(typingctx: Any, chunk: Any, index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            address = _element_address(context, builder, signature, args)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name
            )
            write, locality, data = ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)
            builder.call(fn, [builder.bitcast(address, i8p), write, locality, data])
            return context.get_dummy_value()

        return numba.types.void(chunk, index), codegen

    return prefetch


def _load_le64(payloads: Any, j: Any) -> Any:
    """The 8 bytes payloads[j : j + 8] as a little-endian int64 (numba: one unaligned load)."""
    return np.int64(int.from_bytes(bytes(payloads[j : j + 8]), "little", signed=True))


def _load_le64_intrinsic() -> Any:
    """numba's _load_le64: one load of 8 bytes at any address, where five byte loads and their shifts took
    a third of a bit reader's time (byte-swapped on a big-endian host)."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def load_le64(typingctx: Any, payloads: Any, j: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            address = _element_address(context, builder, signature, args)
            i64 = ir.IntType(64)
            value = builder.load(builder.bitcast(address, i64.as_pointer()), align=1)
            if sys.byteorder == "big":
                value = builder.call(builder.module.declare_intrinsic("llvm.bswap", [i64]), [value])
            return value

        return numba.types.int64(payloads, j), codegen

    return load_le64


def _pointer_intrinsic() -> Any:
    """numba's pointer(address): an int64 address as a void pointer (for numba.carray)."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def pointer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

        return numba.types.voidptr(address), codegen

    return pointer


def _float_bits(value: Any) -> Any:
    """A float64's bits as an int64 (numba: a bitcast)."""
    return np.int64(np.float64(value).view(np.int64))


def _float_bits_intrinsic() -> Any:
    """numba's _float_bits: the float64 reinterpreted, one instruction."""
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def float_bits(typingctx: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(64))

        return numba.types.int64(numba.types.float64), codegen

    return float_bits


def _prefetch(chunk: Any, index: Any) -> None:
    """A hint to load chunk[index] into the cache for writing (numba: llvm.prefetch; here nothing)."""


carray: Any = numba.carray if numba is not None else None  # type: ignore[attr-defined]
pointer: Any = _pointer_intrinsic() if numba is not None else None
prefetch: Any = _prefetch_intrinsic() if numba is not None else _prefetch
load_le64: Any = _load_le64_intrinsic() if numba is not None else _load_le64
float_bits: Any = _float_bits_intrinsic() if numba is not None else _float_bits
