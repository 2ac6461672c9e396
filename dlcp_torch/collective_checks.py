"""The ``dlcp`` backend's argument checks: pure functions that raise ``ValueError`` naming the
call and what is wrong, run in the caller's thread before anything is sent, so a bad call fails
at the call (as gloo's do) and leaves the group usable.

What they cannot see is a mismatch *between* ranks (one rank's 4 elements against another's
5): that shows as a collective that never completes, and fails at the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

#: Element types a reduction takes (the types gloo reduces, and int16). Data movement
#: (broadcast, gathers, scatters, all-to-all, send/recv) carries any type's bytes.
ARITHMETIC_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                     torch.int16, torch.int32, torch.int64)
#: Of those, the ones bitwise ops apply to; bool takes the bitwise ops, MIN and MAX, and SUM
#: (any) and PRODUCT (all), as gloo's do.
BITWISE_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
#: Complex tensors take SUM and AVG (elementwise on the real and imaginary parts), as gloo's do.
COMPLEX_DTYPES = (torch.complex64, torch.complex128)

_ARITHMETIC_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
_BITWISE_OPS = ("BAND", "BOR", "BXOR")


class InvalidCall(ValueError, RuntimeError):
    """A collective refused at the call for its arguments. A ``ValueError`` (what it is) and a
    ``RuntimeError`` (what gloo raises for the same calls), so code written against gloo
    (``except RuntimeError``) catches it as well as code that expects ``ValueError``."""


def op_name(op: Any) -> str:
    """The name of a reduce op (``"SUM"``, ...), from a ``ReduceOp`` or its ``RedOpType``.

    Why names: ``AllreduceOptions.reduceOp`` is a ``ReduceOp`` object, ``dist.ReduceOp.SUM`` a
    ``RedOpType``, and ``op in (ReduceOp.SUM, ReduceOp.AVG)`` compares the tuple's members
    first, which says False: every float32 ``dist.all_reduce`` took the gather path (n times
    the bytes, and never the ring or the loss bound) until ops were compared by name.
    """
    if isinstance(op, str):
        return op.upper()
    for name in (*_ARITHMETIC_OPS, *_BITWISE_OPS, "PREMUL_SUM"):
        member = getattr(dist.ReduceOp, name, None)
        if member is not None and op == member:
            return name
    return str(op)


def reduce_op(op: Any, dtypes: Sequence[torch.dtype], what: str) -> None:
    """``op`` applies to every one of ``dtypes``.

    Example: ``reduce_op(dist.ReduceOp.BAND, [torch.float32], "all_reduce")`` raises.
    """
    name = op_name(op)
    if name not in _ARITHMETIC_OPS and name not in _BITWISE_OPS:
        raise InvalidCall(f"dlcp backend: {what}: reduce op {name} is not supported "
                         f"(supported: {', '.join(_ARITHMETIC_OPS + _BITWISE_OPS)})")
    for dtype in dtypes:
        why = ""
        if name in _BITWISE_OPS:
            ok = dtype in BITWISE_DTYPES
        elif dtype == torch.bool:
            ok = name in ("MIN", "MAX", "SUM", "PRODUCT")
        elif dtype in COMPLEX_DTYPES:
            ok = name in ("SUM", "AVG")
        elif name == "AVG" and dtype in ARITHMETIC_DTYPES and not dtype.is_floating_point:
            # (gloo raises too; a floor-divided average would differ from the average silently)
            ok, why = False, " (an average of integers is not an integer: SUM, then divide)"
        else:
            ok = dtype in ARITHMETIC_DTYPES
        if not ok:
            raise InvalidCall(f"dlcp backend: {what}: reduce op {name} does not apply to {dtype} tensors{why}")


def tensors(ts: Sequence[torch.Tensor], what: str) -> None:
    """Dense tensors on the CPU or a CUDA device (staged through host memory)."""
    for t in ts:
        if not isinstance(t, torch.Tensor):
            raise InvalidCall(f"dlcp backend: {what}: expected tensors, got {type(t).__name__}")
        if t.is_sparse:
            raise InvalidCall(f"dlcp backend: {what}: sparse tensors are not supported")
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidCall(f"dlcp backend: {what}: tensors on {t.device.type} are not supported (cpu, cuda)")


def root(rank: int, world: int, what: str) -> None:
    if not 0 <= rank < world:
        raise InvalidCall(f"dlcp backend: {what}: root rank {rank} is not in this group of {world} (0..{world - 1})")


def one_tensor(ts: Sequence[torch.Tensor], what: str, which: str) -> None:
    if len(ts) != 1:
        raise InvalidCall(f"dlcp backend: {what}: expects one {which} tensor per call, got {len(ts)}")


def same_numel(a: int, b: int, what: str, name_a: str, name_b: str) -> None:
    if a != b:
        raise InvalidCall(f"dlcp backend: {what}: {name_a} has {a} elements, {name_b} {b}")


def gather_lists(lists: Sequence[Sequence[torch.Tensor]], singles: Sequence[torch.Tensor], world: int,
                 what: str) -> None:
    """Each of ``singles`` has a list of ``world`` tensors of its size and type beside it (an
    all-gather's outputs, a reduce-scatter's inputs)."""
    if len(lists) != len(singles):
        raise InvalidCall(f"dlcp backend: {what}: {len(lists)} tensor lists for {len(singles)} tensors")
    for i, (ts, one) in enumerate(zip(lists, singles)):
        if len(ts) != world:
            raise InvalidCall(f"dlcp backend: {what}: list {i} has {len(ts)} tensors for a group of {world}")
        for r, t in enumerate(ts):
            if t.dtype != one.dtype or t.numel() != one.numel():
                raise InvalidCall(f"dlcp backend: {what}: tensor {r} of list {i} is {t.numel()} x {t.dtype}; "
                                 f"expected {one.numel()} x {one.dtype}")
