"""DLCP's protocol without I/O: message state, completion, recovery, feedback and rates.

:class:`~hostagent.protocol.core.ProtocolCore` is driven by the endpoint's threads and drives a
data path through :class:`~hostagent.protocol.port.DataPort`; see :mod:`hostagent.protocol.core`.
"""

from hostagent.protocol.core import ProtocolCore
from hostagent.protocol.port import DataPort, Event, EventKind, Progress, RxBuffers, RxSpec, TxInfo, TxSpec

__all__ = ["DataPort", "Event", "EventKind", "Progress", "ProtocolCore", "RxBuffers", "RxSpec", "TxInfo", "TxSpec"]
