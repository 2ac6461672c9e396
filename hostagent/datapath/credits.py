"""Receiver-driven credits: how big a sender's window is, and when a receiver grants more.

Pure rules, read by both data paths (the compiled one mirrors them in ``send_credits`` and is
tested against them). A receiver counts each sender's packets it took from its socket
(``consumed``) and, in a CREDIT, tells the sender that count and a window: the sender may have
that many packets beyond the count unconsumed. The window keeps a receiver's socket buffer from
overflowing when its receive thread is descheduled; it is not congestion control.
"""

from __future__ import annotations

import numpy as np

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
    """Bytes of the largest datagram an endpoint sends or receives: a full packet of float32."""
    return wire.HEADER_SIZE + elems_per_packet(config.mtu, np.float32) * 4


def initial_window(config: TransportConfig) -> int:
    """Packets a sender may have unconsumed at a receiver before the receiver's first credit: as
    a receiver grants, with the kernel's limit at twice the buffer asked for, shared by every
    other rank, as if all sent to one."""
    return credit_window(2 * config.socket_buffer, max_datagram(config), len(config.peers) - 1)


def credit_due(pending: int, window: int, quiet_for: float, overrun: bool = False) -> bool:
    """Whether a sender gets a credit now: ``pending`` of its packets were consumed since its last
    credit, and either a quarter of its ``window`` was used or nothing of it came for
    CREDIT_QUIET (``quiet_for`` seconds since its last packet). Also, with nothing consumed,
    when the receiver's socket overran since the sender's last credit (``overrun``: the kernel
    dropped datagrams, and a message from this sender is incomplete) and the sender went quiet:
    that credit carries :data:`dlcp.hostagent.wire.Flags.RELEASE`, and the sender counts what it sent
    and was not consumed as lost (:func:`acked_after_credit`); :func:`release_due` says when a
    quiet sender's packets were lost on the way instead.

    Why not a credit whenever the socket runs dry (the rule before): a receiver reading a slow
    stream finds its socket dry after nearly every packet, and sent a credit per data packet.
    On the testbed, where a switch port serves packets, not bytes, those credits took half the
    reverse path's capacity; with the tail drops they caused, the control connection's
    segments were lost and waited out TCP's 200 ms retransmission timer.
    """
    if overrun and quiet_for >= CREDIT_QUIET:
        return True
    return pending > 0 and (pending >= max(1, window // 4) or quiet_for >= CREDIT_QUIET)


def release_due(incomplete: bool, released: bool, last_arrival: float, seen_until: float) -> bool:
    """Whether a sender's next credit releases all it sent (:data:`dlcp.hostagent.wire.Flags.RELEASE`)
    because its packets stopped coming while a message of its is incomplete: nothing of it
    arrived for CREDIT_QUIET up to ``seen_until``, the time up to which the receive thread has
    read everything that reached the host (arrival stamps, so a reader that was descheduled does
    not take its own delay for the sender's silence), and no release went since its last packet.

    Why: a sender counts each packet it sent as unconsumed until a credit says otherwise, and a
    packet lost on the way is never consumed. The loss of a few percent of several long passes
    in flight to one receiver fills its window, the sender stops, its passes cannot end, and
    only CREDIT_TIMEOUT (200 ms) let it go on: the parameter server's replies under 2 % loss
    stalled so once or twice an iteration. A receiver that has read everything and heard nothing
    for CREDIT_QUIET knows those packets are not coming (or are still on the way: at most a
    window, which its drained socket has room for, as after an overrun).
    """
    return incomplete and not released and last_arrival >= 0 and seen_until - last_arrival >= CREDIT_QUIET


def acked_after_credit(acked: int, sent: int, consumed: int, release: bool) -> int:
    """A sender's count of its packets a receiver has done with, after a credit saying it
    ``consumed`` that many (counts only grow: a late credit takes nothing back).

    A RELEASE credit also releases everything sent before it: the receiver's socket dropped
    datagrams (an overrun) or this sender's packets stopped coming while a message of its is
    incomplete (:func:`release_due`), so what was not consumed was lost (or is still in the
    network, at most a window, which a drained socket has room for). Why: without it a sender
    whose whole window the kernel dropped, or the network lost, waits out CREDIT_TIMEOUT.
    """
    return max(acked, sent if release else consumed)


__all__ = ["CREDIT_QUIET", "CREDIT_SHARE", "CREDIT_TIMEOUT", "MIN_WINDOW", "acked_after_credit", "credit_due",
           "credit_window", "initial_window", "max_datagram", "release_due"]
