"""The per-packet path of an endpoint, behind :class:`~dlcp.hostagent.protocol.port.DataPort`.

Two implementations with the same behaviour, chosen by ``TransportConfig.datapath``:

* ``"native"`` (default): :mod:`dlcp.hostagent.datapath.native`, the compiled path
  (``hostagent/native/``, C++ built by ``make setup``), whose threads never take the interpreter
  lock;
* ``"numpy"``: :mod:`dlcp.hostagent.datapath.numpy_path`, the same in Python and numpy: slower, kept as
  the readable reference and as a fallback where the extension cannot be built.

The transport tests run against both and expect identical outcomes.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from dlcp.hostagent.transport_config import DATAPATHS

if TYPE_CHECKING:
    from dlcp.hostagent.datapath.native import NativeDatapath
    from dlcp.hostagent.datapath.numpy_path import NumpyDatapath
    from dlcp.hostagent.transport_config import TransportConfig


def native_available() -> str | None:
    """None when the compiled data path imports, else why not (for messages and test skips)."""
    try:
        from dlcp.hostagent import _datapath  # noqa: F401
    except ImportError as exc:
        return (f"the compiled data path is not built ({exc}); run `make setup` (or `pip install .`), "
                f"or use TransportConfig(datapath='numpy')")
    return None


def open_datapath(config: TransportConfig, udp: socket.socket, gro: bool) -> NativeDatapath | NumpyDatapath:
    """The data path ``config.datapath`` names, on the bound data socket ``udp``.

    Raises:
        RuntimeError: the native path was asked for and is not built (says how to build it).
    """
    if config.datapath == "native":
        why = native_available()
        if why is not None:
            raise RuntimeError(why)
        from dlcp.hostagent.datapath.native import NativeDatapath

        return NativeDatapath(config, udp, gro)
    from dlcp.hostagent.datapath.numpy_path import NumpyDatapath

    return NumpyDatapath(config, udp, gro)


__all__ = ["DATAPATHS", "native_available", "open_datapath"]
