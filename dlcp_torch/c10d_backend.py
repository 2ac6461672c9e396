"""The ``dlcp`` process group as a c10d ``Backend``: its C++ trampoline, compiled on first use.

torch gives every backend it knows a ``ProcessGroup`` of its own with a ``Backend`` per device;
that is where it looks for a group's name, its backend (``_get_backend``) and its options, and
DeviceMesh, DTensor and FSDP2 go through it. A Python object can be a ``ProcessGroup`` (torch
has a trampoline for that, and ``dlcp`` was one) but not a ``Backend``: its methods would never be
called. ``dlcp_torch/csrc/forwarding_backend.cc`` is the missing trampoline, a ``Backend`` whose
collectives are :class:`dlcp_torch.backend.DLCPProcessGroup`'s.

Why compiled here, not in the wheel: a torch extension must be built against the very torch that
loads it (its C++ ABI, its pybind11), and the wheel is built without torch. It is compiled once
per source, torch installation and Python (about a minute, ``torch.utils.cpp_extension``, g++ and ninja) into
``~/.cache/dlcp/c10d`` (``DLCP_C10D_CACHE`` moves it); ranks that start together wait for the
one compiling. ``make setup`` compiles it ahead. Where it cannot be built, :func:`load` says why
and the group runs as a Python ``ProcessGroup`` (everything but ``_get_backend`` works).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "csrc" / "forwarding_backend.cc"

_loaded: Any = None
_why_not: str | None = None


def cache_dir() -> Path:
    """Where the compiled extension is kept: one directory per source, torch installation and
    Python. Ninja rebuilds whenever its command line changes (the source's path, torch's and
    Python's include directories): two checkouts or two venvs with the same torch sharing one
    directory rebuilt it in turn, about 25 s at every first use (and under each other's feet)."""
    import sys

    import torch

    # (the environment's prefix, not its executable's name: `python` and `python3` of one venv agree)
    build = "\0".join([str(SOURCE), torch.__version__, str(Path(torch.__file__).resolve().parent),
                        sys.prefix, sys.version])
    digest = hashlib.sha256(SOURCE.read_bytes() + b"\0" + build.encode()).hexdigest()[:16]
    root = Path(os.environ.get("DLCP_C10D_CACHE", Path.home() / ".cache" / "dlcp" / "c10d"))
    return root / digest


def load(verbose: bool = False) -> Any:
    """The compiled module (its ``ForwardingBackend`` class), building it if needed; None when
    it cannot be built (:func:`why_not` says why). Loaded once per process."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    if os.environ.get("DLCP_C10D_BACKEND", "1") == "0":
        _why_not = "DLCP_C10D_BACKEND=0"
        return None
    try:
        from torch.utils import cpp_extension

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        _loaded = cpp_extension.load(name="dlcp_c10d", sources=[str(SOURCE)], build_directory=str(build),
                                     extra_cflags=["-O2"], verbose=verbose)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a torch without headers: say so, run on
        _why_not = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return _loaded


def why_not() -> str | None:
    """Why :func:`load` returned None (None if it loaded, or was not called)."""
    return _why_not


def wrap(impl: Any, rank: int, size: int) -> Any:
    """``impl`` (a DLCPProcessGroup) as a c10d ``Backend`` torch registers on its group; ``impl``
    itself when the extension cannot be built."""
    module = load()
    return impl if module is None else module.ForwardingBackend(rank, size, impl)


__all__ = ["SOURCE", "cache_dir", "load", "why_not", "wrap"]
