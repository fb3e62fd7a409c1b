"""Configuration: one TOML file read with tomllib into frozen dataclasses.

Every key is documented in ``systemd/sentinel.toml``, the default file; a test asserts that file
parses to exactly the defaults here. An unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` naming the key (``policy.lead_time_seconds``), and the daemon refuses to start
(or, on SIGHUP, keeps its old configuration).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


@dataclass(frozen=True)
class DaemonConfig:
    poll_interval_seconds: float = 1.0
    nvml_deadline_seconds: float = 2.0
    runtime_dir: str = "/run/sentinel"
    state_dir: str = "/var/lib/sentinel"
    node_name: str = ""
    log_level: str = "info"

    def validate(self, prefix: str) -> None:
        _positive(prefix, "poll_interval_seconds", self.poll_interval_seconds)
        _positive(prefix, "nvml_deadline_seconds", self.nvml_deadline_seconds)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"{prefix}.log_level: must be one of debug, info, warning, error (got {self.log_level!r})")


@dataclass(frozen=True)
class MetricsConfig:
    listen_address: str = "0.0.0.0"
    # 9400 is dcgm-exporter's, 9100 node_exporter's; 9477 clashes with neither.
    port: int = 9477

    def validate(self, prefix: str) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{prefix}.port: must be 0..65535 (got {self.port})")


@dataclass(frozen=True)
class PolicyConfig:
    lead_time_seconds: float = 600.0
    # Trend prediction: a rate needs this many agreeing samples (debounce) before it can trip.
    debounce_samples: int = 3
    trend_window_seconds: float = 3600.0
    cooldown_seconds: float = 3600.0
    # Xid number (as a string key) -> "migrate" | "snapshot" | "alert" | "ignore"
    xid_overrides: Mapping[str, str] = field(default_factory=dict)
    xid_skip: tuple[int, ...] = ()
    # Application Xids (13, 31, 43, 45) migrate only when they repeat this often.
    app_xid_max_per_hour: int = 30
    retired_pages_limit: int = 63
    retired_dbe_limit: int = 15
    remap_uncorrectable_limit: int = 512
    nvlink_crc_per_second_limit: float = 100.0
    pcie_replay_ber: float = 1e-12
    disabled_rules: tuple[str, ...] = ()

    def validate(self, prefix: str) -> None:
        _positive(prefix, "lead_time_seconds", self.lead_time_seconds)
        _positive(prefix, "trend_window_seconds", self.trend_window_seconds)
        if self.debounce_samples < 1:
            raise ConfigError(f"{prefix}.debounce_samples: must be >= 1 (got {self.debounce_samples})")
        if self.cooldown_seconds < 0:
            raise ConfigError(f"{prefix}.cooldown_seconds: must be >= 0 (got {self.cooldown_seconds})")
        for key, action in self.xid_overrides.items():
            if not key.isdigit():
                raise ConfigError(f"{prefix}.xid_overrides.{key}: Xid keys are numbers, e.g. \"79\"")
            if action not in ("migrate", "snapshot", "alert", "ignore"):
                raise ConfigError(
                    f"{prefix}.xid_overrides.{key}: action must be migrate, snapshot, alert or ignore (got {action!r})"
                )
        from sentinel.policy import RULES  # late: policy imports config for its types

        for rule in self.disabled_rules:
            if rule not in RULES:
                raise ConfigError(f"{prefix}.disabled_rules: unknown rule {rule!r} (known: {', '.join(sorted(RULES))})")


@dataclass(frozen=True)
class ActionsConfig:
    # Seconds to wait for the ranks' acknowledgement of a snapshot/migrate request.
    ack_timeout_seconds: float = 120.0
    # Shell command run (argv list) after cordoning, e.g. ["scontrol", "update", "nodename={node}", "state=drain"].
    cordon_command: tuple[str, ...] = ()
    # How the node's torchrun agent is found: a pidfile the launcher writes ("" = <runtime_dir>/agent.pid).
    agent_pidfile: str = ""
    # Alternatively a command that stops the agent, e.g. ["systemctl", "stop", "sentinel-agent@train.service"].
    agent_stop_command: tuple[str, ...] = ()
    # Command run when a migration begins, to bring a cold spare's agent up, e.g. a Slurm or Kubernetes call.
    spare_command: tuple[str, ...] = ()
    drain: bool = True

    def validate(self, prefix: str) -> None:
        _positive(prefix, "ack_timeout_seconds", self.ack_timeout_seconds)


@dataclass(frozen=True)
class EbpfConfig:
    enabled: bool = True
    # Fall back to /dev/kmsg when the eBPF path cannot load.
    kmsg_fallback: bool = True
    rank_signals: bool = True

    def validate(self, prefix: str) -> None:
        return None


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    ebpf: EbpfConfig = field(default_factory=EbpfConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)


def _positive(prefix: str, key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{prefix}.{key}: must be > 0 (got {value})")


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Convert one TOML value to the dataclass field type, or raise naming the key."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table")
        return _build(hint, value, key)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: must be a number (got {type(value).__name__} {value!r})")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer (got {type(value).__name__} {value!r})")
        return value
    if hint in (str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{key}: must be a {hint.__name__} (got {type(value).__name__} {value!r})")
        return value
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list")
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict):
        _, vt = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table")
        return types.MappingProxyType({k: _coerce(f"{key}.{k}", vt, v) for k, v in value.items()})
    raise ConfigError(f"{key}: unsupported type {hint}")  # a programming error, surfaced clearly


def _build(cls: type, table: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in table.items():
        where = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(where, hints[key], value)
    return cls(**kwargs)


def parse(text: str, source: str = "<config>") -> Config:
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    config = _build(Config, table, "")
    config.validate()
    return config


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    return parse(text, str(path))
