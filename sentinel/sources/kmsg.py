"""/dev/kmsg reader: the Xid fallback when eBPF is unavailable.

Opens /dev/kmsg non-blocking and reads whole records on a thread of its own. Each record is
``<prio>,<seq>,<usec>,<flags>[,...];message`` followed by optional `` KEY=value`` lines; the
message text (newlines escaped by the kernel) goes to ``on_line``.

Loss is counted in records, from the sequence numbers: a record whose seq is more than one past
the previous record's means exactly that many records were overwritten before they were read.
An EPIPE from read() only says that some were; the next record's seq says how many. At start the
records already in the buffer are read and skipped (not handed on), which gives the first seq to
compare with; only records that arrive later reach ``on_line`` (a record logged during that
start-up read, milliseconds, is skipped too, as one logged before start is).

``read`` is injectable (``os.read`` by default) so tests can drive a fake device (a FIFO) that
produces gaps and EPIPEs.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
from typing import Callable

log = logging.getLogger("sentinel.kmsg")

READ_SIZE = 8192  # a record is at most 1 KiB of text plus its dictionary; one read returns one record
MAX_SKIPPED_READS = 1 << 20  # bounds the start-up read even if the log is flooded while it runs


class KmsgUnavailable(RuntimeError):
    pass


def split_record(record: bytes) -> tuple[int, str] | None:
    """``(seq, message)`` of one record line (``prio,seq,usec,flags[,...];message``), or None."""
    header, sep, message = record.partition(b";")
    if not sep:
        return None
    fields = header.split(b",")
    if len(fields) < 4 or not fields[1].isdigit():
        return None
    return int(fields[1]), message.decode("utf-8", "replace")


class KmsgReader:
    """Reads /dev/kmsg (or ``path``) on a thread; ``lost`` is the exact number of records that
    were overwritten before they could be read, ``skipped_at_start`` the records already there."""

    def __init__(self, on_line: Callable[[str], None], *, path: str = "/dev/kmsg", poll_ms: int = 250,
                 read: Callable[[int, int], bytes] = os.read) -> None:
        self.on_line = on_line
        self.path = path
        self.poll_ms = poll_ms
        self.read = read
        self.lost = 0
        self.overruns = 0  # EPIPEs seen (each says "some records were lost")
        self.skipped_at_start = 0
        self.last_seq: int | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise KmsgUnavailable(f"{self.path}: {exc.strerror}") from None
        # Instead of seeking to the end (which hides the seq we start from), read what is there.
        self._read_available(deliver=False, max_reads=MAX_SKIPPED_READS)
        self._thread = threading.Thread(target=self._run, name="sentinel-kmsg", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            if poller.poll(self.poll_ms) and self._read_available(deliver=True) == "eof":
                self._stop.wait(self.poll_ms / 1000)  # a fake device without a writer polls as ready

    def _read_available(self, *, deliver: bool, max_reads: int | None = None) -> str:
        """Read until the device has nothing more; returns why it stopped."""
        reads = 0
        while not self._stop.is_set():
            reads += 1
            if max_reads is not None and reads > max_reads:
                return "bounded"
            try:
                data = self.read(self._fd, READ_SIZE)
            except BlockingIOError:
                return "empty"
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring overwrote records we had not read
                    self.overruns += 1
                    continue
                log.error("reading %s failed: %s", self.path, exc)
                self._stop.wait(1.0)
                return "error"
            if not data:  # end of file (a fake device whose writer went away)
                return "eof"
            self._records(data, deliver)
        return "stopped"

    def _records(self, data: bytes, deliver: bool) -> None:
        # One read of /dev/kmsg is one record; a FIFO may carry several. Dictionary lines
        # (" KEY=value") start with a space and belong to the record before them.
        for line in data.split(b"\n"):
            if not line or line.startswith(b" "):
                continue
            parsed = split_record(line)
            if parsed is None:
                continue
            seq, message = parsed
            if deliver and self.last_seq is not None and seq > self.last_seq + 1:
                self.lost += seq - self.last_seq - 1  # records from before start were never due
            if self.last_seq is None or seq > self.last_seq:
                self.last_seq = seq
            if deliver:
                self.on_line(message)
            else:
                self.skipped_at_start += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
