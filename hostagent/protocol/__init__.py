"""DLCP's protocol without I/O: message state, completion, recovery, feedback and rates.

:class:`~dlcp.hostagent.protocol.core.ProtocolCore` is driven by the endpoint's threads and drives a
data path through :class:`~dlcp.hostagent.protocol.port.DataPort`; see :mod:`dlcp.hostagent.protocol.core`.
"""

from dlcp.hostagent.protocol.core import ProtocolCore
from dlcp.hostagent.protocol.port import DataPort, Event, EventKind, Progress, RxBuffers, RxSpec, TxInfo, TxSpec

__all__ = ["DataPort", "Event", "EventKind", "Progress", "ProtocolCore", "RxBuffers", "RxSpec", "TxInfo", "TxSpec"]
