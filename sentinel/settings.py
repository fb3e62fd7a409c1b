"""Checks for configuration values, and the error that names the key.

:mod:`sentinel.config` and the plugins that declare their own settings (the backends'
``[actions.<name>]`` tables in ``sentinel/backends/``, the rules' ``ConfigKey``s in
``sentinel/rules/``) validate with these. This module imports nothing of Sentinel's, so a plugin
can declare settings without importing ``sentinel.config`` (which imports the plugins).
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0


def printable(text: str) -> str:
    """A key or value as it can appear in a one-line message: non-ASCII and control characters escaped."""
    return text if text.isascii() and text.isprintable() else ascii(text)[1:-1]


def number(prefix: str, key: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """A finite float in [low, high] (or (low, high] when ``low_open``)."""
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{prefix}.{key}: must be a finite number in {bounds} (got {value})")


def integer(prefix: str, key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{prefix}.{key}: must be an integer in {low}..{high} (got {value})")


def text(prefix: str, key: str, value: str) -> None:
    if "\0" in value:
        raise ConfigError(f"{prefix}.{key}: must not contain a NUL character")


def path(prefix: str, key: str, value: str, *, required: bool) -> None:
    text(prefix, key, value)
    if required and not value:
        raise ConfigError(f"{prefix}.{key}: must be a path, not empty")


def command(prefix: str, key: str, argv: tuple[str, ...]) -> None:
    """An argv list: empty (no command) or a program name followed by its arguments."""
    for i, arg in enumerate(argv):
        text(prefix, f"{key}[{i}]", arg)
    if argv and not argv[0]:
        raise ConfigError(f"{prefix}.{key}[0]: the program to run must not be empty")


def parse_address(text: str) -> tuple[str, int]:
    """``"address:port"`` (an IPv6 address in brackets) -> (address, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not address:port")
    return host.strip("[]"), int(port)
