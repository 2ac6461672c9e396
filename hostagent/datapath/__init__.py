"""The per-packet path of an endpoint, behind :class:`~dlcp.hostagent.protocol.port.DataPort`.

One implementation: :mod:`dlcp.hostagent.datapath.native`, the compiled path
(``hostagent/native/``, C++ built by ``make setup`` or ``pip install``), whose threads never
take the interpreter lock. :mod:`dlcp.hostagent.datapath.credits` holds the credit rules it
follows, as a table its tests read.

The numpy path that was a second choice here is a reference model in the tests now
(``tests/reference/numpy_path.py``: why, in its docstring).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from dlcp.hostagent.transport_config import DATAPATHS

if TYPE_CHECKING:
    from dlcp.hostagent.datapath.native import NativeDatapath
    from dlcp.hostagent.transport_config import TransportConfig


def native_available() -> str | None:
    """None when the compiled data path imports, else why not (for messages and test skips)."""
    try:
        from dlcp.hostagent import _datapath  # noqa: F401
    except ImportError as exc:
        return f"the compiled data path is not built ({exc}); run `make setup` (or `pip install .`)"
    return None


def open_datapath(config: TransportConfig, udp: socket.socket, gro: bool) -> NativeDatapath:
    """The compiled data path, on the bound data socket ``udp``.

    Raises:
        RuntimeError: it is not built (says how to build it).
    """
    why = native_available()
    if why is not None:
        raise RuntimeError(why)
    from dlcp.hostagent.datapath.native import NativeDatapath

    return NativeDatapath(config, udp, gro)


__all__ = ["DATAPATHS", "native_available", "open_datapath"]
