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

from sentinel import backends, rules, settings


ConfigError = settings.ConfigError
MINUTE, HOUR, DAY = settings.MINUTE, settings.HOUR, settings.DAY

# The policy rules a config may name in ``policy.disabled_rules``: one module each in
# sentinel/rules/, found there by the registry. sentinel.rules imports neither this module nor the
# policy, so validating a config never imports the policy (which imports this module).
RULE_NAMES: frozenset[str] = rules.RULE_NAMES


@dataclass(frozen=True)
class DaemonConfig:
    poll_interval_seconds: float = 1.0
    nvml_deadline_seconds: float = 2.0
    runtime_dir: str = "/run/sentinel"
    state_dir: str = "/var/lib/sentinel"
    node_name: str = ""
    log_level: str = "info"
    # /livez and /readyz fail once the last completed poll is older than this many poll intervals
    # (at least one interval plus the NVML deadline a slow poll may spend): a hung loop shows in a pod
    liveness_polls: float = 2.0

    def validate(self, prefix: str) -> None:
        _number(prefix, "poll_interval_seconds", self.poll_interval_seconds, 0, DAY, low_open=True)
        _number(prefix, "liveness_polls", self.liveness_polls, 1, 1000)
        _number(prefix, "nvml_deadline_seconds", self.nvml_deadline_seconds, 0, HOUR, low_open=True)
        _path(prefix, "runtime_dir", self.runtime_dir, required=True)
        _path(prefix, "state_dir", self.state_dir, required=True)
        _text(prefix, "node_name", self.node_name)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"{prefix}.log_level: must be one of debug, info, warning, error (got {self.log_level!r})")


AGENT_REGISTRATION = ("slurm", "kubernetes")


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

        from sentinel import httpauth  # the files' checks only: not the HTTP server, not prometheus_client

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
                httpauth.build_tls_context(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                keys = "tls_cert_file/tls_key_file" + ("/tls_client_ca_file" if self.tls_client_ca_file else "")
                raise ConfigError(f"{prefix}.{keys}: not a usable certificate, key (and CA): {exc}") from None
        if self.basic_auth_users_file:
            try:
                httpauth.load_users(self.basic_auth_users_file)
            except httpauth.UsersFileError as exc:
                raise ConfigError(f"{prefix}.basic_auth_users_file: {exc}") from None


@dataclass(frozen=True)
class _PolicyCore:
    """``[policy]`` keys of the policy's own machinery; :data:`PolicyConfig` adds the rules' keys."""

    cooldown_seconds: float = 3600.0
    disabled_rules: tuple[str, ...] = ()

    def validate(self, prefix: str) -> None:
        _number(prefix, "cooldown_seconds", self.cooldown_seconds, 0, 30 * DAY)
        for key in rules.CONFIG_KEYS:
            key.validate(prefix, getattr(self, key.name))
        for rule in self.disabled_rules:
            if rule not in RULE_NAMES:
                raise ConfigError(
                    f"{prefix}.disabled_rules: unknown rule {_printable(rule)!r} (known: {', '.join(sorted(RULE_NAMES))})"
                )


def _with_rule_keys(core: type, keys: tuple[rules.ConfigKey, ...]) -> type:
    """``core`` plus one field per rule key (:class:`sentinel.rules.base.ConfigKey`): its default,
    type and range are the declaration's, written nowhere else."""
    fields = []
    for key in keys:
        default = key.default
        spec = field(default_factory=lambda d=default: type(d)(d)) if isinstance(default, (dict, list)) else field(default=default)
        fields.append((key.name, key.hint, spec))
    return dataclasses.make_dataclass("PolicyConfig", fields, bases=(core,), frozen=True,
                                      namespace={"__module__": __name__, "__doc__": "``[policy]``: the policy's and the rules' keys."})


PolicyConfig = _with_rule_keys(_PolicyCore, rules.CONFIG_KEYS)


BACKENDS = backends.NAMES  # one module each in sentinel/backends/, found there
# Each backend declares its own [actions.<name>] table (sentinel/backends/<name>.py: SETTINGS).
SlurmConfig = backends.SETTINGS["slurm"]  # the names tests and tools know
KubernetesConfig = backends.SETTINGS["kubernetes"]


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
class _ActionsCore:
    """``[actions]`` without the backends' own tables (:data:`ActionsConfig` adds them)."""

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
    # A launcher that is not root (an ordinary user's Slurm job, a non-root pod) asks the daemon to
    # record it; the daemon does when the kernel-verified sender is a job process of one of these
    # kinds: "slurm" (a task of a Slurm job step: under a root slurmstepd), "kubernetes" (in a pod's
    # kubepods cgroup). [] = only root's launcher (which writes the pidfile itself) is recorded.
    agent_registration: tuple[str, ...] = ("slurm", "kubernetes")
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
    # Where nodes sit: the nearest spare, cross-rack replicas, the per-domain breaker (docs/topology.md).
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
        for i, kind in enumerate(self.agent_registration):
            if kind not in AGENT_REGISTRATION:
                raise ConfigError(f"{prefix}.agent_registration[{i}]: must be one of {', '.join(AGENT_REGISTRATION)} "
                                  f"(got {_printable(kind)!r})")
        for name in backends.SETTINGS:
            getattr(self, name).validate(f"{prefix}.{name}")
        self.topology.validate(f"{prefix}.topology")


def _with_backend_tables(core: type, tables: Mapping[str, type]) -> type:
    """``core`` plus one field per backend that declares settings: ``[actions.<backend>]``."""
    clash = set(tables) & {f.name for f in dataclasses.fields(core)}
    if clash:
        raise TypeError(f"backend settings {sorted(clash)} would replace [actions] keys of the same name")
    return dataclasses.make_dataclass(
        "ActionsConfig", [(name, cls, field(default_factory=cls)) for name, cls in tables.items()], bases=(core,),
        frozen=True, namespace={"__module__": __name__, "__doc__": "``[actions]``, with each backend's own table."})


ActionsConfig = _with_backend_tables(_ActionsCore, backends.SETTINGS)


@dataclass(frozen=True)
class EbpfConfig:
    enabled: bool = True
    # Fall back to /dev/kmsg when the eBPF path cannot load.
    kmsg_fallback: bool = True
    rank_signals: bool = True

    def validate(self, prefix: str) -> None:
        return None


@dataclass(frozen=True)
class JobConfig:
    """What the job's own reports (hangs, stragglers; see sentinel.jobhealth) may trigger."""

    # The measured cost of handing a node over (trip to the first step on the spare, plus the
    # steps redone): a straggler is handed over only when keeping it costs more over the steps
    # left. bench/migration.py measures it (docs/measured.json: warm_spare_trip_to_first_step_seconds);
    # a large job's restart is longer (docs/goodput.md), hence the conservative default.
    handover_seconds: float = 60.0
    # Hang verdicts between the job's daemons (sentinel.peers): a verdict naming another node is
    # forwarded to that node's daemon, signed with this key (root's, mode 0600, the same on every
    # node of the job). Empty: verdicts stay on the node that heard them.
    peer_key_file: str = ""
    # JSON: node name -> "address:port" of its daemon's peer listener; read at each forward
    peers_file: str = ""
    # "address:port" this daemon's peer listener binds (UDP)
    peer_listen_address: str = ""
    # The job's etcd rendezvous (--rdzv-backend sentinel-etcd), shown in `sentinel status` and on
    # /metrics (sentinel.rdzv_store): its members' "host:port", the job's CA and a client
    # certificate of it (read only; empty: not shown)
    rendezvous_etcd_endpoints: tuple[str, ...] = ()
    rendezvous_etcd_cacert: str = ""
    rendezvous_etcd_cert: str = ""
    rendezvous_etcd_key: str = ""
    rendezvous_check_seconds: float = 10.0

    def validate(self, prefix: str) -> None:
        _number(prefix, "handover_seconds", self.handover_seconds, 0, DAY)
        for key in ("peer_key_file", "peers_file", "peer_listen_address", "rendezvous_etcd_cacert",
                    "rendezvous_etcd_cert", "rendezvous_etcd_key"):
            _text(prefix, key, getattr(self, key))
        _number(prefix, "rendezvous_check_seconds", self.rendezvous_check_seconds, 1, DAY)
        for ep in self.rendezvous_etcd_endpoints:
            try:
                settings.parse_address(ep)
            except ValueError as exc:
                raise ConfigError(f"{prefix}.rendezvous_etcd_endpoints: {exc}") from None
        if bool(self.rendezvous_etcd_cert) != bool(self.rendezvous_etcd_key):
            raise ConfigError(f"{prefix}.rendezvous_etcd_cert and rendezvous_etcd_key go together")
        if self.peer_key_file:
            _path(prefix, "peers_file", self.peers_file, required=True)
            try:
                settings.parse_address(self.peer_listen_address)
            except ValueError as exc:
                raise ConfigError(f"{prefix}.peer_listen_address: {exc}") from None


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    ebpf: EbpfConfig = field(default_factory=EbpfConfig)
    job: JobConfig = field(default_factory=JobConfig)

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
    "policy", "actions", "job", "daemon.poll_interval_seconds", "daemon.nvml_deadline_seconds", "daemon.log_level",
})
# Keys inside a live section that still need a restart: the backend is built and checked
# against the scheduler (node known, permissions) once, at start.
RESTART_ONLY = frozenset({"actions.backend", "job.peer_key_file", "job.peer_listen_address"}
                         | {f"actions.{name}" for name in backends.SETTINGS})


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


# The value checks live in sentinel.settings (plugins use them too); these names stay for config's own sections.
_printable, _number, _integer, _text, _path, _command = (settings.printable, settings.number, settings.integer,
                                                         settings.text, settings.path, settings.command)


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
