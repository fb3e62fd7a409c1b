"""sd_notify in a few dozen lines: READY, STATUS, WATCHDOG, STOPPING.

No-op without ``NOTIFY_SOCKET``; abstract socket names (``@...``) handled; never raises —
a notification that cannot be delivered must not take the daemon down.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("sentinel.systemd")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address: str | None = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self.failures = 0

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(lines).encode())
            return True
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("sd_notify to %s failed: %s", self._address.replace("\0", "@"), exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"STATUS={status}") if status else self.notify("READY=1")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
