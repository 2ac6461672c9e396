"""One control connection: its handshake state and its writer (the control path's I/O primitive)."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dlcp.hostagent import wire

#: Bytes queued on a control connection before its peer counts as not reading.
CTL_WRITE_LIMIT = 4 << 20


class ControlConn:
    """One control connection: a socket, a read buffer, and a bounded queue of the frames the
    socket did not take at once, which its own writer thread sends.

    Why a writer per connection: a peer that stops reading fills its TCP window, and a blocking
    send would then stall whoever sends, the control loop included, and with it every message
    of the endpoint. Here only this connection's writer waits; :meth:`send` never blocks, and
    refuses once more than ``CTL_WRITE_LIMIT`` bytes wait, so a dead or hostile peer costs only
    its own messages. A send error is recorded in :attr:`error`; the control loop drops the
    connection (it owns the selector). The writer thread starts only when a frame first has to
    wait, so a connection that never gets that far (a stranger's) costs no thread.

    Handshake state (:mod:`dlcp.hostagent.auth`): ``rank`` is who the peer claims to be (or whom we
    called); nothing but HELLO records is accepted until :attr:`authenticated`, which is when
    :attr:`settled` is set; a failed handshake sets it too, with :attr:`error`.
    """

    def __init__(self, sock: socket.socket, rank: int | None, wake: Callable[[], None], initiator: bool = False,
                 peer_ip: str = "") -> None:
        self.sock = sock
        self.rank = rank
        self.initiator = initiator
        self.peer_ip = peer_ip
        self.opened_at = time.monotonic()
        self.step = 0  # last handshake step seen or sent
        self.nonce_i = b""
        self.nonce_a = b""
        self.key_nonce = b""  # ours, sent in this handshake (dlcp.hostagent.auth)
        self.peer_key_nonce = b""  # the peer's, from its proof-bound HELLO
        self.authenticated = False
        # After the handshake (dlcp.hostagent.auth, "Control frames"): our sealer for what we send,
        # the opener for what we read, and the index the next frame read must carry. None: the
        # job authenticates nothing (TransportConfig.authenticate False), frames go bare.
        self.ctl_keys: tuple[bytes, bytes] | None = None  # (ours, the peer's) for this connection
        self.tx_sealer: Any = None
        self.rx_sealer: Any = None
        self.rx_pn = 0
        self.auth_failed = False  # the peer answered with a wrong proof (a wrong secret; not retried)
        self.settled = threading.Event()
        self.wlock = threading.Lock()  # serialises take-records-then-send in Endpoint._flush
        self.buf = bytearray()
        self.error: str | None = None
        self._wake = wake
        self._frames: deque[bytes] = deque()
        self._pending = 0
        self._writing = False  # the writer is sending a frame outside the lock
        self._closing = False
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None

    def send(self, frame: bytes) -> bool:
        """Send ``frame``, or queue what the socket does not take at once; False when the peer
        has more than CTL_WRITE_LIMIT bytes unread (or the connection failed): it is not reading.

        With nothing queued the caller writes directly (non-blocking), so the common case costs
        no hand-over to the writer thread; order is kept because the writer is idle then.
        After the handshake the frame is sealed here, under the lock, so its index is its place
        on the wire."""
        with self._cv:
            if self._closing or self.error or self._pending + len(frame) > CTL_WRITE_LIMIT:
                return False
            if self.tx_sealer is not None:
                frame = seal_frame(self.tx_sealer, frame)
            if not self._frames and not self._writing:
                try:
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self.error = f"control send failed: {exc}"
                    self._wake()
                    return False
                if sent == len(frame):
                    return True
                frame = frame[sent:]
            self._frames.append(frame)
            self._pending += len(frame)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=f"ctl-writer-{self.rank}", daemon=True)
                self._writer.start()
            self._cv.notify()
        return True

    def open_frame(self, frame: bytes) -> bytes | None:
        """A frame read after the handshake (its length prefix included), checked and without its
        trailer; None when its tag is wrong or its index is not the next one (changed, dropped,
        replayed or inserted on the way). Bare frames pass when the job authenticates nothing."""
        if self.rx_sealer is None:
            return frame
        if len(frame) < wire.FRAME_PREFIX.size + wire.TRAILER_SIZE:
            return None
        row = np.frombuffer(_CONTROL_DOMAIN + frame, np.uint8).copy().reshape(1, -1)
        found = np.zeros(1, np.uint8)
        self.rx_sealer.open_rows(row, np.array([row.shape[1]], np.int64), np.zeros(1, np.int64), 1, 0, found)
        pn = int.from_bytes(frame[-wire.TRAILER_SIZE : -wire.TRAILER_SIZE + 8], "big")
        if found[0] != 1 or pn != self.rx_pn:  # (1: authentic and not seen before, seal.h's Opened::OK)
            return None
        self.rx_pn += 1
        body = frame[wire.FRAME_PREFIX.size : -wire.TRAILER_SIZE]
        return wire.FRAME_PREFIX.pack(len(body)) + body

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._frames and not self._closing:
                    self._cv.wait()
                if not self._frames:
                    return
                frame = self._frames.popleft()
                self._writing = True
            try:
                self.sock.sendall(frame)
            except OSError as exc:
                self.error = f"control send failed: {exc}"
                self._wake()
                return
            finally:
                with self._cv:
                    self._pending -= len(frame)
                    self._writing = False
                    self._cv.notify_all()

    def finish(self, timeout: float) -> None:
        """Let the writer send what is queued (for up to ``timeout`` s), then stop it."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def fail(self, why: str) -> None:
        """Mark the connection failed (the control loop closes it) and release its waiters."""
        self.error = self.error or why
        self.settled.set()
        self._wake()


#: What a sealed control frame's additional data starts with: the nonce's type byte of control
#: frames (no data-path packet type has it; their keys differ anyway).
_CONTROL_DOMAIN = b"\xc0"


def seal_frame(sealer: Any, frame: bytes) -> bytes:
    """``frame`` (length prefix, header, body) with a trailer: its prefix counts the trailer, and
    the tag covers the prefix and everything after it (dlcp.hostagent.auth, "Control frames")."""
    body = frame[wire.FRAME_PREFIX.size :]
    prefixed = wire.FRAME_PREFIX.pack(len(body) + wire.TRAILER_SIZE) + body
    row = np.zeros((1, 1 + len(prefixed) + wire.TRAILER_SIZE), np.uint8)
    row[0, : 1 + len(prefixed)] = np.frombuffer(_CONTROL_DOMAIN + prefixed, np.uint8)
    sealer.seal_rows(row, np.array([1 + len(prefixed)], np.int64), 1 + len(prefixed), 0)
    return row[0, 1:].tobytes()
