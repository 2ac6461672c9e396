"""One control connection: its handshake state and its writer (the control path's I/O primitive)."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable

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
        self.authenticated = False
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
        no hand-over to the writer thread; order is kept because the writer is idle then."""
        with self._cv:
            if self._closing or self.error or self._pending + len(frame) > CTL_WRITE_LIMIT:
                return False
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
