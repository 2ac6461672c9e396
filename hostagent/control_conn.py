"""One control connection and its writer thread (the control path's I/O primitive)."""

from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Callable

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
    connection (it owns the selector).
    """

    def __init__(self, sock: socket.socket, rank: int | None, wake: Callable[[], None]) -> None:
        self.sock = sock
        self.rank = rank
        self.wlock = threading.Lock()  # serialises take-records-then-send in Endpoint._flush
        self.buf = bytearray()
        self.error: str | None = None
        self._wake = wake
        self._frames: deque[bytes] = deque()
        self._pending = 0
        self._writing = False  # the writer is sending a frame outside the lock
        self._closing = False
        self._cv = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name=f"ctl-writer-{rank}", daemon=True)
        self._writer.start()

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
        self._writer.join(timeout)
