"""Configuration: one TOML file read with tomllib into frozen dataclasses.

Every key is documented in ``systemd/sentinel.toml``, the default file; a test asserts that file
parses to exactly the defaults here. An unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` naming the key (``policy.lead_time_seconds``), and the daemon refuses to start
(or, on SIGHUP, keeps its old configuration). Every number has a finite range (TOML accepts
``inf`` and ``nan``), so a configuration that validates can always be applied; see
:func:`reload_plan` for which keys a SIGHUP applies and which need a restart.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from sentinel import backends, rules


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0

# The policy rules a config may name in ``policy.disabled_rules``: one module each in
# sentinel/rules/, found there by the registry. sentinel.rules imports neither this module nor the
# policy, so validating a config never imports the policy (which imports this module).
RULE_NAMES: frozenset[str] = rules.RULE_NAMES
XID_ACTIONS = ("migrate", "snapshot", "alert", "ignore")
XID_MIN, XID_MAX = 1, 65535


@dataclass(frozen=True)
class DaemonConfig:
    poll_interval_seconds: float = 1.0
    nvml_deadline_seconds: float = 2.0
    runtime_dir: str = "/run/sentinel"
    state_dir: str = "/var/lib/sentinel"
    node_name: str = ""
    log_level: str = "info"

    def validate(self, prefix: str) -> None:
        _number(prefix, "poll_interval_seconds", self.poll_interval_seconds, 0, DAY, low_open=True)
        _number(prefix, "nvml_deadline_seconds", self.nvml_deadline_seconds, 0, HOUR, low_open=True)
        _path(prefix, "runtime_dir", self.runtime_dir, required=True)
        _path(prefix, "state_dir", self.state_dir, required=True)
        _text(prefix, "node_name", self.node_name)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"{prefix}.log_level: must be one of debug, info, warning, error (got {self.log_level!r})")


@dataclass(frozen=True)
class MetricsConfig:
    listen_address: str = "0.0.0.0"
    # 9400 is dcgm-exporter's, 9100 node_exporter's; 9477 clashes with neither.
    port: int = 9477
    # HTTPS when both are set (PEM files); "" = plain HTTP.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Require client certificates signed by this CA (mTLS); needs tls_cert_file/tls_key_file.
    tls_client_ca_file: str = ""
    # user:pbkdf2_sha256$... lines (`python -m sentinel.exporter hash-password USER`); "" = no auth.
    basic_auth_users_file: str = ""
    # "fleet": NVLink summed per GPU (per link only where a counter is nonzero), field_supported and
    # rule_active only where 0; "full": also every link and every 1 (sentinel/metrics.py).
    detail: str = "fleet"

    def validate(self, prefix: str) -> None:
        if self.detail not in ("fleet", "full"):
            raise ConfigError(f"{prefix}.detail: must be one of fleet, full (got {_printable(self.detail)!r})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{prefix}.port: must be 0..65535 (got {self.port})")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError(f"{prefix}.{missing}: tls_cert_file and tls_key_file must be set together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(f"{prefix}.tls_client_ca_file: needs tls_cert_file and tls_key_file (mTLS is on top of TLS)")
        import ssl

        from sentinel import exporter  # imported here: config stays free of prometheus_client otherwise

        for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "basic_auth_users_file"):
            path = getattr(self, key)
            if path:
                try:
                    with open(path, "rb"):
                        pass
                except OSError as exc:
                    raise ConfigError(f"{prefix}.{key}: cannot read {path}: {exc.strerror}") from None
        if self.tls_cert_file:
            try:
                exporter.build_tls_context(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                keys = "tls_cert_file/tls_key_file" + ("/tls_client_ca_file" if self.tls_client_ca_file else "")
                raise ConfigError(f"{prefix}.{keys}: not a usable certificate, key (and CA): {exc}") from None
        if self.basic_auth_users_file:
            try:
                exporter.load_users(self.basic_auth_users_file)
            except exporter.UsersFileError as exc:
                raise ConfigError(f"{prefix}.basic_auth_users_file: {exc}") from None


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
        _number(prefix, "lead_time_seconds", self.lead_time_seconds, 0, 7 * DAY, low_open=True)
        _integer(prefix, "debounce_samples", self.debounce_samples, 1, 10_000)
        _number(prefix, "trend_window_seconds", self.trend_window_seconds, 0, 30 * DAY, low_open=True)
        _number(prefix, "cooldown_seconds", self.cooldown_seconds, 0, 30 * DAY)
        for key, action in self.xid_overrides.items():
            where = f"{prefix}.xid_overrides.{_printable(key)}"
            # str.isdigit() accepts "²" and "٣", which int() then rejects or misreads: ASCII only,
            # and one spelling per Xid ("079" would silently duplicate "79").
            if not (key.isascii() and key.isdigit() and key == str(int(key)) and XID_MIN <= int(key) <= XID_MAX):
                raise ConfigError(f"{where}: Xid keys are numbers {XID_MIN}..{XID_MAX} in plain ASCII digits, e.g. \"79\"")
            if action not in XID_ACTIONS:
                raise ConfigError(f"{where}: action must be migrate, snapshot, alert or ignore (got {action!r})")
        for i, xid in enumerate(self.xid_skip):
            _integer(prefix, f"xid_skip[{i}]", xid, XID_MIN, XID_MAX)
        _integer(prefix, "app_xid_max_per_hour", self.app_xid_max_per_hour, 0, 1_000_000)
        # A limit of 0 on a ">=" rule would fail every healthy GPU at the first poll.
        _integer(prefix, "retired_pages_limit", self.retired_pages_limit, 1, 1_000_000)
        _integer(prefix, "retired_dbe_limit", self.retired_dbe_limit, 0, 1_000_000)
        _integer(prefix, "remap_uncorrectable_limit", self.remap_uncorrectable_limit, 1, 1_000_000)
        _number(prefix, "nvlink_crc_per_second_limit", self.nvlink_crc_per_second_limit, 0, 1e12, low_open=True)
        _number(prefix, "pcie_replay_ber", self.pcie_replay_ber, 0, 1, low_open=True)
        for rule in self.disabled_rules:
            if rule not in RULE_NAMES:
                raise ConfigError(
                    f"{prefix}.disabled_rules: unknown rule {_printable(rule)!r} (known: {', '.join(sorted(RULE_NAMES))})"
                )


BACKENDS = backends.NAMES  # one module each in sentinel/backends/, found there
_K8S_NAME = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


@dataclass(frozen=True)
class SlurmConfig:
    # The Slurm client programs (PATH is searched); SLURM_CONF in the daemon's environment picks the cluster.
    scontrol: str = "scontrol"
    squeue: str = "squeue"
    scancel: str = "scancel"
    sinfo: str = "sinfo"
    # The circuit breaker's scope: this partition's nodes ("" = every partition this node is in).
    partition: str = ""
    # How a spare is started: this signal goes to the batch script of the job running on the node
    # (deploy/slurm/train.sbatch traps it and starts an agent on an idle node of its allocation).
    spare_signal: str = "USR1"

    def validate(self, prefix: str) -> None:
        for key in ("scontrol", "squeue", "scancel", "sinfo"):
            _text(prefix, key, getattr(self, key))
            if not getattr(self, key):
                raise ConfigError(f"{prefix}.{key}: must name the program, not be empty")
        _text(prefix, "partition", self.partition)
        if self.spare_signal not in ("USR1", "USR2", "URG", "CONT"):
            raise ConfigError(f"{prefix}.spare_signal: must be one of USR1, USR2, URG, CONT (got {_printable(self.spare_signal)!r})")


@dataclass(frozen=True)
class KubernetesConfig:
    # "" = in-cluster config (the DaemonSet's ServiceAccount token); a kubeconfig path otherwise.
    kubeconfig: str = ""
    # The taint Sentinel adds (value = the rule, effect NoSchedule) and the only one it removes.
    taint_key: str = "sentinel.dev/gpu-failure"
    # The Node condition Sentinel sets (status False while cordoned, True once uncordoned).
    condition_type: str = "GPUHealthy"
    # The circuit breaker's scope: nodes matching this label selector ("" = every node).
    node_selector: str = ""
    # The Lease the daemons take a place in, resourceVersion-checked, before they cordon (the breaker's atomic count).
    breaker_namespace: str = "sentinel"
    breaker_lease: str = "sentinel-breaker"

    def validate(self, prefix: str) -> None:
        import re

        _path(prefix, "kubeconfig", self.kubeconfig, required=False)
        if not re.match(_K8S_NAME, self.taint_key) or len(self.taint_key) > 316:
            raise ConfigError(f"{prefix}.taint_key: not a Kubernetes label key (prefix/name): {_printable(self.taint_key)!r}")
        if not re.match(r"^[A-Za-z][A-Za-z0-9]{0,62}$", self.condition_type):
            raise ConfigError(f"{prefix}.condition_type: must be a CamelCase word (got {_printable(self.condition_type)!r})")
        _text(prefix, "node_selector", self.node_selector)
        for key in ("breaker_namespace", "breaker_lease"):
            value = getattr(self, key)
            if not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", value):
                raise ConfigError(f"{prefix}.{key}: not a Kubernetes name (lowercase letters, digits, '-'): {_printable(value)!r}")


@dataclass(frozen=True)
class TopologyConfig:
    # A topology file read at each migration: Slurm topology.conf syntax, or TOML/JSON
    # [nodes.<name>] nvlink/switches/rack/power (docs/topology.md). "" = none.
    file: str = ""
    # Also read the scheduler's own topology: `scontrol show topology` (slurm), the Node labels of
    # Topograph, the GPU operator, GCP or AWS (kubernetes).
    from_scheduler: bool = True
    # Per-domain circuit breaker: refuse to drain (page instead) when, counting this node, more than
    # this share of one NVLink domain / one leaf switch's nodes would be Sentinel-cordoned within
    # breaker_window_seconds. 0 < x <= 1; 1 = off. Domains of one node are not limited.
    breaker_max_nvlink_fraction: float = 0.5
    breaker_max_leaf_fraction: float = 0.5
    # backend = "kubernetes": the Nodes that are waiting spares (a label selector); the chosen one
    # gets the label sentinel.dev/preferred-spare=true for the job's controller (docs/topology.md).
    spare_selector: str = "sentinel.dev/spare=true"

    def validate(self, prefix: str) -> None:
        _path(prefix, "file", self.file, required=False)
        _number(prefix, "breaker_max_nvlink_fraction", self.breaker_max_nvlink_fraction, 0, 1, low_open=True)
        _number(prefix, "breaker_max_leaf_fraction", self.breaker_max_leaf_fraction, 0, 1, low_open=True)
        _text(prefix, "spare_selector", self.spare_selector)


@dataclass(frozen=True)
class ActionsConfig:
    # Seconds to wait for the ranks' acknowledgement of a snapshot/migrate request.
    ack_timeout_seconds: float = 120.0
    # How a node is cordoned, uncordoned and drained, and a spare started: "file" | "command" | "slurm" | "kubernetes".
    backend: str = "file"
    # backend = "command": run (argv list) after cordoning, e.g. ["scontrol", "update", "nodename={node}", "state=drain"].
    cordon_command: tuple[str, ...] = ()
    # backend = "command": run by `sentinel uncordon`.
    uncordon_command: tuple[str, ...] = ()
    # How the node's torchrun agent is found: a pidfile the launcher writes ("" = <runtime_dir>/agent.pid).
    agent_pidfile: str = ""
    # backend = "command": a command that stops the agent, e.g. ["systemctl", "stop", "sentinel-agent@train.service"].
    agent_stop_command: tuple[str, ...] = ()
    # backend = "command": run when a migration begins, to bring a cold spare's agent up.
    spare_command: tuple[str, ...] = ()
    drain: bool = True
    # Each backend call (command, scontrol, API request) runs off the daemon's loop and is killed after this long.
    command_timeout_seconds: float = 30.0
    # A call the scheduler did not answer (timeout, refused, 5xx) is tried this often in all ...
    scheduler_attempts: int = 3
    # ... waiting this long before the second try, twice as long before each next one.
    scheduler_backoff_seconds: float = 1.0
    # Circuit breaker: refuse to cordon when that would put more than this fraction of the
    # job's / partition's nodes under a Sentinel cordon made in the last breaker_window_seconds.
    breaker_max_fraction: float = 0.5
    breaker_window_seconds: float = 300.0
    # Once every rank has staged its snapshot, the ack deadline grows by staged bytes / this rate
    # (the slowest per-node write bandwidth worth waiting for; 50 MB/s is a loaded shared filesystem).
    snapshot_min_bytes_per_second: float = 50e6
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    def validate(self, prefix: str) -> None:
        _number(prefix, "ack_timeout_seconds", self.ack_timeout_seconds, 0, HOUR, low_open=True)
        if self.backend not in BACKENDS:
            raise ConfigError(f"{prefix}.backend: must be one of {', '.join(BACKENDS)} (got {_printable(self.backend)!r})")
        _number(prefix, "command_timeout_seconds", self.command_timeout_seconds, 0, HOUR, low_open=True)
        _integer(prefix, "scheduler_attempts", self.scheduler_attempts, 1, 100)
        _number(prefix, "scheduler_backoff_seconds", self.scheduler_backoff_seconds, 0, HOUR)
        _number(prefix, "breaker_max_fraction", self.breaker_max_fraction, 0, 1, low_open=True)
        _number(prefix, "breaker_window_seconds", self.breaker_window_seconds, 0, DAY)
        _number(prefix, "snapshot_min_bytes_per_second", self.snapshot_min_bytes_per_second, 0, 1e13, low_open=True)
        for key in ("cordon_command", "uncordon_command", "agent_stop_command", "spare_command"):
            _command(prefix, key, getattr(self, key))
            if getattr(self, key) and self.backend != "command":
                raise ConfigError(f"{prefix}.{key}: commands run only with backend = \"command\" (backend is {self.backend!r})")
        _path(prefix, "agent_pidfile", self.agent_pidfile, required=False)
        self.slurm.validate(f"{prefix}.slurm")
        self.kubernetes.validate(f"{prefix}.kubernetes")
        self.topology.validate(f"{prefix}.topology")


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
        """Raise :class:`ConfigError` naming the first bad key. A Config that validates can be
        applied: nothing downstream (the policy, the actions, a reload) can fail on its values."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            # a safety net for float keys added later without a range: never inf or NaN
            for key in dataclasses.fields(section):
                value = getattr(section, key.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"{f.name}.{key.name}: must be a finite number (got {value})")
            section.validate(f.name)


# Keys a running daemon applies on SIGHUP (a section name covers all its keys). Any other key
# that changed needs a restart: listeners, directories and sources are set up once, at start.
LIVE_ON_RELOAD = frozenset({
    "policy", "actions", "daemon.poll_interval_seconds", "daemon.nvml_deadline_seconds", "daemon.log_level",
})
# Keys inside a live section that still need a restart: the backend is built and checked
# against the scheduler (node known, permissions) once, at start.
RESTART_ONLY = frozenset({"actions.backend", "actions.slurm", "actions.kubernetes", "actions.topology"})


def _changed(old: Config, new: Config) -> list[tuple[str, bool]]:
    """(name, applies live) for each changed section (when the whole section applies live) or key."""
    out = []
    for f in dataclasses.fields(Config):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            continue
        restart = [k.name for k in dataclasses.fields(before) if f"{f.name}.{k.name}" in RESTART_ONLY
                   and getattr(before, k.name) != getattr(after, k.name)]
        if f.name in LIVE_ON_RELOAD:
            if dataclasses.replace(before, **{k: getattr(after, k) for k in restart}) != after:
                out.append((f.name, True))
            out.extend((f"{f.name}.{k}", False) for k in restart)
            continue
        for key in dataclasses.fields(before):
            if getattr(before, key.name) != getattr(after, key.name):
                name = f"{f.name}.{key.name}"
                out.append((name, name in LIVE_ON_RELOAD))
    return out


def reload_plan(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """What a reload from ``old`` to ``new`` does: (applied live, needing a restart).

    Each list names changed sections (``"policy"``, ``"actions"``, applied as a whole) or keys
    (``"daemon.poll_interval_seconds"``, ``"metrics.port"``); both are empty when nothing changed.
    """
    changed = _changed(old, new)
    return [name for name, live in changed if live], [name for name, live in changed if not live]


def live_part(old: Config, new: Config) -> Config:
    """``new`` with every key that needs a restart kept at its ``old`` value: the configuration a
    running daemon actually has after reloading ``new``, so the next reload still reports them."""
    sections = {}
    for f in dataclasses.fields(Config):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            sections[f.name] = after
            continue
        if f.name in LIVE_ON_RELOAD:
            keep = {k.name: getattr(before, k.name) for k in dataclasses.fields(before) if f"{f.name}.{k.name}" in RESTART_ONLY}
            sections[f.name] = dataclasses.replace(after, **keep)
            continue
        keep = {k.name: getattr(after, k.name) for k in dataclasses.fields(after) if f"{f.name}.{k.name}" in LIVE_ON_RELOAD}
        sections[f.name] = dataclasses.replace(before, **keep)
    return Config(**sections)


def _printable(text: str) -> str:
    """A key or value as it can appear in a one-line message: non-ASCII and control characters escaped."""
    return text if text.isascii() and text.isprintable() else ascii(text)[1:-1]


def _number(prefix: str, key: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """A finite float in [low, high] (or (low, high] when ``low_open``)."""
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{prefix}.{key}: must be a finite number in {bounds} (got {value})")


def _integer(prefix: str, key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{prefix}.{key}: must be an integer in {low}..{high} (got {value})")


def _text(prefix: str, key: str, value: str) -> None:
    if "\0" in value:
        raise ConfigError(f"{prefix}.{key}: must not contain a NUL character")


def _path(prefix: str, key: str, value: str, *, required: bool) -> None:
    _text(prefix, key, value)
    if required and not value:
        raise ConfigError(f"{prefix}.{key}: must be a path, not empty")


def _command(prefix: str, key: str, argv: tuple[str, ...]) -> None:
    """An argv list: empty (no command) or a program name followed by its arguments."""
    for i, arg in enumerate(argv):
        _text(prefix, f"{key}[{i}]", arg)
    if argv and not argv[0]:
        raise ConfigError(f"{prefix}.{key}[0]: the program to run must not be empty")


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
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (invalid byte at offset {exc.start})") from None
    return parse(text, str(path))
