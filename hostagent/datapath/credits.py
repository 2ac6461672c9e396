"""Receiver-driven credits: how big a sender's window is, and the settings of the rules that grant it.

A receiver counts each sender's packets it took from its socket (``consumed``) and, in a
CREDIT, tells the sender that count and a window: the sender may have that many packets beyond
the count unconsumed. The window keeps a receiver's socket buffer from overflowing when its
receive thread is descheduled; it is not congestion control.

The rules themselves run once, in the compiled data path (``Datapath::due_credits`` and
``on_credit``, hostagent/native/rx.cc; ``window_full``, tx.cc), and its tests drive them on a
fake clock (tests/transport/test_core_rules.py):

* **when a credit goes**: a quarter of the window was used since the sender's last credit, or
  its packets stopped coming for CREDIT_QUIET with some consumed (it may be held by its window).
  Not whenever the socket runs dry (the rule before): a receiver reading a slow stream finds
  its socket dry after nearly every packet and sent a credit per data packet; on the testbed,
  where a switch port serves packets, not bytes, those credits took half the reverse path's
  capacity, and the control connection's segments, lost in the tail drops they caused, waited
  out TCP's 200 ms retransmission timer;
* **RELEASE** (:data:`dlcp.hostagent.wire.Flags.RELEASE`): the sender counts all it sent as done
  with, what was not consumed as lost. It goes when a message of the sender is incomplete and
  either our socket dropped datagrams since its last credit (an overrun: its whole window may be
  gone) and it went quiet, or nothing of it arrived for CREDIT_QUIET up to the time the receive
  thread has read everything that reached the host (arrival stamps: a reader that was
  descheduled does not take its own delay for the sender's silence), once per silence. Why: a
  packet lost on the way is never consumed; a few percent lost of several long passes to one
  receiver filled the window, the sender stopped, its passes could not end, and only
  CREDIT_TIMEOUT let it go on (the parameter server's replies under 2 % loss stalled so once or
  twice an iteration);
* **the sender** takes the larger of its count and the credit's (a late credit takes nothing
  back; a replayed one is older than the newest seen and grants nothing), and after a window
  full and CREDIT_TIMEOUT without a credit takes its packets as lost.
"""

from __future__ import annotations

from dlcp.hostagent import wire
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.transport_config import TransportConfig

#: The windows of all senders together fill at most this fraction of the receiver's socket
#: memory limit. Why so little: the kernel counts a queued datagram at up to twice its bytes
#: (more for the short runs a tight window makes) and releases what was read only in steps of a
#: quarter of the limit; in a 4-to-1 incast on a loaded host a datagram in flight held up to
#: 47 KB of a 9 KB datagram's memory, and windows of a quarter, then an eighth, still overflowed.
CREDIT_SHARE = 16
#: The smallest window granted, in packets.
MIN_WINDOW = 8
#: A sender whose packets stopped coming for this long is granted what it has consumed, however
#: little: it may be held by its window (its packets lost, or the rest of its window in flight).
#: Longer than the gap between a paced stream's packets, so a stream earns credits only by the
#: quarter rule; far shorter than the sender's last-resort timeout (CREDIT_TIMEOUT).
CREDIT_QUIET = 0.005
#: A sender whose window is full and that got no credit for this long takes its packets as lost
#: and sends on: the last resort for a lost credit. (A receiver counts the transmissions a
#: finished message will never bring as read, and all of a window is released when nothing is
#: in flight to the receiver; a short timeout fired whenever a receiver was descheduled, and its
#: reset overran the receiver.)
CREDIT_TIMEOUT = 0.2


def credit_window(socket_memory: int, max_datagram: int, senders: int) -> int:
    """Packets each sender may have unconsumed: ``socket_memory`` bytes (the kernel's limit,
    twice the buffer asked for) / CREDIT_SHARE, in datagrams of ``max_datagram``, shared among
    ``senders`` (every authenticated peer, so the windows together fit even in an incast)."""
    n = socket_memory // CREDIT_SHARE // max(1, max_datagram) // max(1, senders)
    return int(max(MIN_WINDOW, min(wire.MAX_CREDIT_WINDOW, n)))


def max_datagram(config: TransportConfig) -> int:
    """Bytes of the largest datagram an endpoint sends or receives: a full packet of the element
    type that fills the most of the MTU's room, and its trailer. (Not always float32: where the
    room is no multiple of 4, a half-precision packet is 2 bytes longer.)"""
    payload = max(elems_per_packet(config.mtu, d) * d.itemsize for d in wire.NUMPY_DTYPES.values())
    return wire.HEADER_SIZE + payload + wire.TRAILER_SIZE


def initial_window(config: TransportConfig) -> int:
    """Packets a sender may have unconsumed at a receiver before the receiver's first credit: as
    a receiver grants, with the kernel's limit at twice the buffer asked for, shared by every
    other rank, as if all sent to one."""
    return credit_window(2 * config.socket_buffer, max_datagram(config), len(config.peers) - 1)


__all__ = ["CREDIT_QUIET", "CREDIT_SHARE", "CREDIT_TIMEOUT", "MIN_WINDOW", "credit_window", "initial_window",
           "max_datagram"]
