"""/dev/kmsg reader: the Xid fallback when eBPF is unavailable.

Opens /dev/kmsg non-blocking, seeks to the end (only new records), and reads whole records on a
thread of its own. Records overwritten before they were read (EPIPE) are counted as lost.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
from typing import Callable

log = logging.getLogger("sentinel.kmsg")


class KmsgUnavailable(RuntimeError):
    pass


class KmsgReader:
    def __init__(self, on_line: Callable[[str], None], *, path: str = "/dev/kmsg", poll_ms: int = 250) -> None:
        self.on_line = on_line
        self.path = path
        self.poll_ms = poll_ms
        self.lost = 0
        self.lines = 0
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as exc:
            raise KmsgUnavailable(f"{self.path}: {exc.strerror}") from None
        self._thread = threading.Thread(target=self._run, name="sentinel-kmsg", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self.poll_ms):
                continue
            while True:
                try:
                    record = os.read(self._fd, 8192)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # the ring overwrote records we had not read
                        self.lost += 1
                        continue
                    log.error("reading %s failed: %s", self.path, exc)
                    self._stop.wait(1.0)
                    break
                self.lines += 1
                text = record.decode("utf-8", "replace")
                # "<prio>,<seq>,<usec>,<flags>[,...];message\n"
                _, _, message = text.partition(";")
                self.on_line(message.split("\n", 1)[0])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
