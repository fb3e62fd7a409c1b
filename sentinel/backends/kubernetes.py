"""``backend = "kubernetes"`` (the optional extra ``pip install 'sentinel-gpu[kubernetes]'``):
the Node object says the node is bad, as NVSentinel does.

* **cordon** — ``spec.unschedulable = true`` (only when nobody had cordoned it; the annotation
  ``sentinel.dev/cordoned`` records that the cordon is Sentinel's), the taint
  ``<taint_key>=<rule>:NoSchedule`` (``sentinel.dev/gpu-failure`` by default), and the Node
  condition ``GPUHealthy=False`` (reason = the rule in CamelCase, message = GPU index and reading)
  through the ``status`` subresource.
* **uncordon** — removes Sentinel's taint, its annotations and, if the cordon was Sentinel's,
  the cordon; sets ``GPUHealthy=True``. An admin's cordon and every other taint stay.
* **spare** — the job's controller (JobSet, PyTorchJob, a StatefulSet) reschedules the drained
  agent's pod; Sentinel labels the waiting spare nearest the failing node (``[actions.topology]
  spare_selector``; same NVLink domain, else leaf, else spine, from the Node labels)
  ``sentinel.dev/preferred-spare=true``, which the pod template prefers (docs/topology.md).
* **fleet** (circuit breaker) — the nodes matching ``node_selector`` and, for each carrying
  Sentinel's taint, the taint's ``timeAdded``.
* **claim** (the breaker, atomically) — before its cordon, a node adds itself to the Lease
  ``<breaker_namespace>/<breaker_lease>`` (annotation ``sentinel.dev/breaker-cordons``: node ->
  time) with a resourceVersion-checked update, and only when the Lease's recent entries (and the
  recent Sentinel taints) leave room under ``breaker_max_fraction``. Of two daemons that read
  the same version, one update wins and the other re-reads and counts again: a burst of trips
  never cordons more than the fraction.

Every call has one **total** deadline (``command_timeout_seconds``), not a per-read timeout: an
API server that drips its answer a byte at a time is abandoned at the deadline (at most
:data:`MAX_HUNG` calls may still hang before the next is refused at once). A response missing a
field (a Node without ``spec``, an access review without ``status``) is read as absent, never an
exception.

Every write is a JSON patch that first tests ``metadata.resourceVersion`` (or the condition's
index): a concurrent change by the node controller or an admin is a conflict that is retried,
never a lost update. Each request has the backend's timeout; the client's own retries are off
(Sentinel retries with backoff itself). The ServiceAccount needs exactly: ``get``, ``list`` and
``patch`` on ``nodes``, ``patch`` on ``nodes/status`` (deploy/kubernetes/base/rbac.yaml); a 403 names
the verb that is missing.
"""

from __future__ import annotations

import calendar
import json
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from sentinel import settings
from sentinel.backends.base import (REASON_PREFIX, Backend, BackendError, CordonReason, CordonState, Fleet,
                                    PermissionDenied, Unreachable, UnknownNode, Verdict, with_deadline)
from sentinel.backends.breaker import in_window, slots

ANNOTATION = "sentinel.dev/cordoned"  # "true": spec.unschedulable was set by Sentinel
PREFERRED_SPARE_LABEL = "sentinel.dev/preferred-spare"  # "true" on the spare chosen for the departed node
PREFERRED_SPARE_FOR = "sentinel.dev/preferred-spare-for"  # annotation: the node it replaces
PREFERRED_SPARE_WHY = "sentinel.dev/preferred-spare-why"  # annotation: the distance and why
REASON_ANNOTATION = "sentinel.dev/reason"
BREAKER_ANNOTATION = "sentinel.dev/breaker-cordons"  # on the breaker's Lease: {"node": unix time, ...}
#: what the backend needs, as (verb, resource): checked at start with SelfSubjectAccessReview
NEEDED = (("get", "nodes"), ("list", "nodes"), ("patch", "nodes"), ("patch", "nodes/status"))
#: ... and on the breaker's Lease (coordination.k8s.io, in breaker_namespace)
NEEDED_LEASE = (("get", "leases"), ("update", "leases"), ("create", "leases"))
#: Calls abandoned at their deadline that may still hang before the next call is refused at once.
MAX_HUNG = 4
#: Conflicting Lease updates retried within one claim (each re-reads the Lease and counts again).
LEASE_ATTEMPTS = 8


class Conflict(Unreachable):
    """409/422: a resourceVersion or JSON-patch test failed (someone else changed the object)."""


class NotFound(BackendError):
    """404 on an object other than this node."""


def _field(obj: Any, *path: str) -> Any:
    """``obj.a.b...``, or None where any step is missing: an API server may leave fields out."""
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _camel(rule: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", rule) if part) or "Sentinel"


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return value or "sentinel"


def _printable(text: str) -> str:
    """One line with no control characters: a kernel line can carry a task name the user chose,
    and `kubectl describe node` prints the message to an operator's terminal as it is."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _escape(key: str) -> str:  # a JSON pointer path segment
    return key.replace("~", "~0").replace("/", "~1")


K8S_NAME = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


@dataclass(frozen=True)
class KubernetesSettings:
    """``[actions.kubernetes]``: how the daemon reaches the API server (read when ``actions.backend = \"kubernetes\"``)."""

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
        settings.path(prefix, "kubeconfig", self.kubeconfig, required=False)
        if not re.match(K8S_NAME, self.taint_key) or len(self.taint_key) > 316:
            raise settings.ConfigError(f"{prefix}.taint_key: not a Kubernetes label key (prefix/name): "
                                       f"{settings.printable(self.taint_key)!r}")
        if not re.match(r"^[A-Za-z][A-Za-z0-9]{0,62}$", self.condition_type):
            raise settings.ConfigError(f"{prefix}.condition_type: must be a CamelCase word "
                                       f"(got {settings.printable(self.condition_type)!r})")
        settings.text(prefix, "node_selector", self.node_selector)
        for key in ("breaker_namespace", "breaker_lease"):
            value = getattr(self, key)
            if not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", value):
                raise settings.ConfigError(f"{prefix}.{key}: not a Kubernetes name (lowercase letters, digits, '-'): "
                                           f"{settings.printable(value)!r}")


SETTINGS = KubernetesSettings


class KubernetesBackend(Backend):
    name = "kubernetes"
    has_scheduler = True
    has_fleet = True

    def __init__(self, actions, ctx) -> None:
        super().__init__(actions, ctx)
        self.k = actions.kubernetes
        try:
            from kubernetes import client, config
            from kubernetes.client.exceptions import ApiException
        except ImportError as exc:
            raise BackendError(f"the kubernetes Python client is not installed ({exc}); "
                               f"pip install 'sentinel-gpu[kubernetes]'") from None
        self._client = client
        self._api_exception = ApiException
        cfg = client.Configuration()
        try:
            if self.k.kubeconfig:
                config.load_kube_config(config_file=self.k.kubeconfig, client_configuration=cfg)
            else:
                config.load_incluster_config(client_configuration=cfg)
        except (config.ConfigException, OSError, ValueError, TypeError) as exc:
            where = self.k.kubeconfig or "the in-cluster ServiceAccount (KUBERNETES_SERVICE_HOST, token)"
            raise BackendError(f"cannot load the Kubernetes client configuration from {where}: {exc}") from None
        cfg.retries = 0  # Sentinel retries with backoff; the client must not multiply the timeout
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self._hung: list[threading.Thread] = []

    # -- requests -----------------------------------------------------------------------------
    def _do(self, verb: str, resource: str, fn, *args: Any, **kw: Any) -> Any:
        """One API call under one total deadline (:func:`with_deadline`); every failure is a
        :class:`BackendError` of the right kind."""
        limit = self.ctx.timeout
        kw["_request_timeout"] = (limit, limit)
        self._hung = [t for t in self._hung if t.is_alive()]
        if len(self._hung) >= MAX_HUNG:
            raise Unreachable(f"`{verb} {resource}` for {self.node!r} not sent: {len(self._hung)} earlier calls to the "
                              f"API server still hang past their deadline")
        try:
            return with_deadline(lambda: fn(*args, **kw), limit, f"the Kubernetes API server (`{verb} {resource}`)",
                                 self._hung)
        except self._api_exception as exc:
            status = exc.status or 0
            detail = (exc.reason or "").strip()
            if status == 403:
                raise PermissionDenied(
                    f"Kubernetes refused `{verb} {resource}` for node {self.node!r} (403 Forbidden): the ServiceAccount "
                    f"needs the RBAC verb '{verb}' on '{resource}' (deploy/kubernetes/base/rbac.yaml)") from None
            if status == 401:
                raise PermissionDenied(f"Kubernetes did not accept the credentials for `{verb} {resource}` "
                                       f"(401 Unauthorized): check the ServiceAccount token or kubeconfig") from None
            if status == 404 and resource in ("nodes", "nodes/status"):
                raise UnknownNode(f"node {self.node!r} is not known to the Kubernetes API server (404 on `get nodes`); "
                                  f"set daemon.node_name to the Node's name (the DaemonSet passes spec.nodeName)") from None
            if status == 404:
                raise NotFound(f"`{verb} {resource}`: 404 {detail}") from None
            if status in (409, 422):  # the resourceVersion or index test failed (someone else changed it)
                raise Conflict(f"`{verb} {resource}` for {self.node!r}: {status} {detail}") from None
            if status == 429 or status >= 500:
                raise Unreachable(f"`{verb} {resource}` for {self.node!r}: {status} {detail}") from None
            raise BackendError(f"`{verb} {resource}` for {self.node!r} failed: {status} {detail}") from None
        except BackendError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise Unreachable(f"the Kubernetes API server answered `{verb} {resource}` with a response that cannot be "
                              f"read: {type(exc).__name__}: {str(exc)[:200]}") from None
        except Exception as exc:  # noqa: BLE001 - urllib3/socket errors: the API server did not answer
            raise Unreachable(f"the Kubernetes API server did not answer `{verb} {resource}` within "
                              f"{self.ctx.timeout:g} s: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _node(self):
        return self._do("get", "nodes", self.core.read_node, self.node)

    def _patch(self, ops: list[dict]) -> None:
        self._do("patch", "nodes", self.core.patch_node, self.node, ops)

    def _patch_status(self, ops: list[dict]) -> None:
        self._do("patch", "nodes/status", self.core.patch_node_status, self.node, ops)

    def _condition_ops(self, node, condition: dict) -> list[dict]:
        conditions = _as_list(_field(node, "status", "conditions"))
        for i, c in enumerate(conditions):
            if getattr(c, "type", None) == self.k.condition_type:
                if getattr(c, "status", None) == condition["status"]:
                    last = getattr(c, "last_transition_time", None)
                    if hasattr(last, "strftime"):
                        condition["lastTransitionTime"] = last.strftime("%Y-%m-%dT%H:%M:%SZ")
                return [{"op": "test", "path": f"/status/conditions/{i}/type", "value": self.k.condition_type},
                        {"op": "replace", "path": f"/status/conditions/{i}", "value": condition}]
        if _field(node, "status", "conditions") is None:
            return [{"op": "add", "path": "/status/conditions", "value": [condition]}]
        return [{"op": "add", "path": "/status/conditions/-", "value": condition}]

    def _meta_spec(self, node) -> tuple[str, dict | None, bool, list]:
        """(resourceVersion, annotations or None, unschedulable, taints) of a Node, fields left
        out read as absent. A Node with no resourceVersion cannot be patched safely."""
        rv = _field(node, "metadata", "resource_version")
        if not isinstance(rv, str) or not rv:
            raise BackendError(f"the API server returned node {self.node!r} without metadata.resourceVersion")
        annotations = _field(node, "metadata", "annotations")
        return rv, dict(annotations) if isinstance(annotations, dict) else None, \
            _field(node, "spec", "unschedulable") is True, _as_list(_field(node, "spec", "taints"))

    # -- the interface ------------------------------------------------------------------------
    def check(self) -> None:
        self._node()
        missing = []
        api = self._client.AuthorizationV1Api(self.api)
        needed = [(v, r, "", None) for v, r in NEEDED] + \
                 [(v, r, "coordination.k8s.io", self.k.breaker_namespace) for v, r in NEEDED_LEASE]
        for verb, resource, group, namespace in needed:
            res, _, sub = resource.partition("/")
            name = None if verb in ("list", "create") else (self.k.breaker_lease if res == "leases" else self.node)
            review = self._client.V1SelfSubjectAccessReview(spec=self._client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=self._client.V1ResourceAttributes(verb=verb, resource=res, subresource=sub or None,
                                                                      group=group, name=name, namespace=namespace)))
            out = self._do("create", "selfsubjectaccessreviews", api.create_self_subject_access_review, review)
            allowed = _field(out, "status", "allowed")
            if not isinstance(allowed, bool):
                raise Unreachable(f"the Kubernetes API server answered the access review for '{verb}' on '{resource}' "
                                  f"without status.allowed; cannot tell whether the ServiceAccount may act")
            if not allowed:
                where = f" in namespace {namespace!r}" if namespace else ""
                missing.append(f"'{verb}' on '{resource}'{where}")
        if missing:
            raise PermissionDenied(f"the ServiceAccount lacks the RBAC verb(s) {', '.join(missing)} that the "
                                   f"kubernetes backend needs for node {self.node!r} (deploy/kubernetes/base/rbac.yaml)")

    def cordon_scheduler(self, reason: CordonReason) -> None:
        rv, annotations, unschedulable, taints = self._meta_spec(self._node())
        ops: list[dict] = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}]
        new_annotations = {REASON_ANNOTATION: reason.short(256)}
        if not unschedulable:
            ops.append({"op": "add", "path": "/spec/unschedulable", "value": True})
            new_annotations[ANNOTATION] = "true"
        elif (annotations or {}).get(ANNOTATION) != "true":
            self.notes.append(f"kubernetes: {self.node} was already cordoned by someone else; that cordon stays theirs")
        if not any(getattr(t, "key", None) == self.k.taint_key for t in taints):
            taint = {"key": self.k.taint_key, "value": _label_value(reason.rule), "effect": "NoSchedule",
                     "timeAdded": _now()}
            ops.append({"op": "add", "path": "/spec/taints/-" if taints else "/spec/taints",
                        "value": taint if taints else [taint]})
        if annotations is None:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": new_annotations})
        else:
            ops += [{"op": "add", "path": f"/metadata/annotations/{_escape(k)}", "value": v} for k, v in new_annotations.items()]
        self._patch(ops)
        where = "node" if reason.gpu < 0 else f"GPU {reason.gpu}" + (f" ({reason.uuid})" if reason.uuid else "")
        condition = {"type": self.k.condition_type, "status": "False", "reason": _camel(reason.rule),
                     "message": _printable(f"{REASON_PREFIX} {where}: {reason.message}")[:1024],
                     "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
        self._patch_status(self._condition_ops(self._node(), condition))
        self.notes.append(f"kubernetes: cordoned {self.node}, tainted {self.k.taint_key}:NoSchedule, "
                          f"{self.k.condition_type}=False")

    def uncordon_scheduler(self) -> str:
        rv, annotations, unschedulable, taints = self._meta_spec(self._node())
        annotations = annotations or {}
        ours_cordon = annotations.get(ANNOTATION) == "true"
        ops: list[dict] = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}]
        done = []
        keep = [t for t in taints if getattr(t, "key", None) != self.k.taint_key]
        if len(keep) != len(taints):
            ops.append({"op": "replace", "path": "/spec/taints", "value": self.api.sanitize_for_serialization(keep)})
            done.append(f"taint {self.k.taint_key} removed")
        if ours_cordon and unschedulable:
            ops.append({"op": "remove", "path": "/spec/unschedulable"})
            done.append("uncordoned")
        elif unschedulable:
            done.append("cordoned by someone else; that cordon stays")
        for key in (ANNOTATION, REASON_ANNOTATION):
            if key in annotations:
                ops.append({"op": "remove", "path": f"/metadata/annotations/{_escape(key)}"})
        if len(ops) > 1:
            self._patch(ops)
        fresh = self._node()
        if any(getattr(c, "type", None) == self.k.condition_type for c in _as_list(_field(fresh, "status", "conditions"))):
            condition = {"type": self.k.condition_type, "status": "True", "reason": "Uncordoned",
                         "message": f"{REASON_PREFIX} uncordoned by an operator", "lastHeartbeatTime": _now(),
                         "lastTransitionTime": _now()}
            self._patch_status(self._condition_ops(fresh, condition))
            done.append(f"{self.k.condition_type}=True")
        try:
            if self._release_claim():
                done.append("breaker lease entry removed")
        except BackendError as exc:
            done.append(f"breaker lease entry left (it expires with the window): {exc}")
        return f"kubernetes: {self.node}: " + (", ".join(done) if done else "nothing of Sentinel's to remove")

    def scheduler_state(self) -> CordonState:
        node = self._node()
        taints = _as_list(_field(node, "spec", "taints"))
        ours_taint = [t for t in taints if getattr(t, "key", None) == self.k.taint_key]
        annotations = _field(node, "metadata", "annotations")
        annotations = annotations if isinstance(annotations, dict) else {}
        cordoned = _field(node, "spec", "unschedulable") is True or bool(ours_taint)
        by_sentinel = bool(ours_taint) or annotations.get(ANNOTATION) == "true"
        return CordonState(cordoned, by_sentinel, str(annotations.get(REASON_ANNOTATION, ""))[:512])

    def start_spare(self) -> str:
        """Label the waiting spare (``[actions.topology] spare_selector``) nearest this node
        ``sentinel.dev/preferred-spare=true`` (and annotate whom it replaces): the job's pod
        template prefers such Nodes (a preferred node affinity, docs/topology.md), so the
        controller's replacement pod lands there. No spare matches, or the topology cannot be
        read: the controller places the pod as before."""
        from sentinel import topology

        self.spare_choice = None
        base = "kubernetes: the job's controller reschedules the agent's pod onto an untainted node"
        selector = self.cfg.topology.spare_selector
        if not selector:
            return base
        spares = _as_list(_field(self._do("list", "nodes", self.core.list_node, label_selector=selector), "items"))
        waiting = []
        for n in spares:  # an API server may leave any field out: such a Node is not a waiting spare
            name = _field(n, "metadata", "name")
            if (not isinstance(name, str) or name == self.node or _field(n, "spec") is None
                    or _field(n, "spec", "unschedulable") is True):
                continue
            if any(getattr(t, "key", None) == self.k.taint_key or getattr(t, "effect", None) in ("NoSchedule", "NoExecute")
                   for t in _as_list(_field(n, "spec", "taints"))):
                continue
            waiting.append(name)
        if not waiting:
            return f"{base}; no waiting spare matches {selector!r}"
        try:
            topo = self.topology()
        except topology.TopologyError as exc:
            self.notes.append(f"kubernetes: spare not chosen by topology: {exc}")
            return base
        choice = topology.choose_spare(topo, self.node, waiting)  # the API server lists by name
        assert choice is not None  # waiting is not empty
        self._do("patch", "nodes", self.core.patch_node, choice.node, {"metadata": {
            "labels": {PREFERRED_SPARE_LABEL: "true"},
            "annotations": {PREFERRED_SPARE_FOR: self.node, PREFERRED_SPARE_WHY: _printable(choice.why)[:1024]}}})
        self.spare_choice = choice
        return f"kubernetes: labelled {choice.node} {PREFERRED_SPARE_LABEL}=true ({choice.distance}: {choice.why})"

    def scheduler_topology(self) -> list:
        """Every Node's topology labels (Topograph, GPU operator, GCP, AWS, Sentinel's own)."""
        from sentinel import topology

        out = []
        for n in _as_list(_field(self._do("list", "nodes", self.core.list_node), "items")):
            name, labels = _field(n, "metadata", "name"), _field(n, "metadata", "labels")
            if isinstance(name, str):
                out += topology.from_labels(name, labels if isinstance(labels, dict) else {}, "kubernetes")
        return out

    def fleet(self, now: float) -> Fleet:
        kw = {"label_selector": self.k.node_selector} if self.k.node_selector else {}
        nodes = _as_list(_field(self._do("list", "nodes", self.core.list_node, **kw), "items"))
        cordons = []
        for n in nodes:
            name = _field(n, "metadata", "name")
            for t in _as_list(_field(n, "spec", "taints")):
                if isinstance(name, str) and getattr(t, "key", None) == self.k.taint_key:
                    added = getattr(t, "time_added", None)
                    cordons.append((name, calendar.timegm(added.utctimetuple()) if hasattr(added, "utctimetuple") else now))
        return Fleet(len(nodes), tuple(sorted(cordons)))

    # -- the breaker's Lease ------------------------------------------------------------------
    def _read_lease(self, create: bool = True) -> tuple[Any, dict[str, float]]:
        """The breaker's Lease (created when missing, if ``create``; else :class:`NotFound`) and its
        entries; entries that are not ``node: finite time`` are dropped (65,536 entries at most)."""
        ns, name = self.k.breaker_namespace, self.k.breaker_lease
        try:
            lease = self._do("get", "leases", self.coordination.read_namespaced_lease, name, ns)
        except NotFound:
            if not create:
                raise
            body = self._client.V1Lease(metadata=self._client.V1ObjectMeta(name=name, namespace=ns, annotations={
                BREAKER_ANNOTATION: "{}"}), spec=self._client.V1LeaseSpec(holder_identity="sentinel-breaker"))
            try:
                lease = self._do("create", "leases", self.coordination.create_namespaced_lease, ns, body)
            except Conflict:
                lease = self._do("get", "leases", self.coordination.read_namespaced_lease, name, ns)
        raw = (_field(lease, "metadata", "annotations") or {}).get(BREAKER_ANNOTATION, "{}")
        entries: dict[str, float] = {}
        try:
            data = json.loads(raw[:1 << 20]) if isinstance(raw, str) else {}
        except (ValueError, RecursionError):
            data = {}
        if isinstance(data, dict):
            for node, t in list(data.items())[:65536]:
                if isinstance(node, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
                    entries[node[:253]] = float(t)
        return lease, entries

    def _write_lease(self, lease: Any, entries: dict[str, float]) -> None:
        """Replace the Lease's entries, only if nobody changed it since it was read (:class:`Conflict`)."""
        rv = _field(lease, "metadata", "resource_version")
        if not isinstance(rv, str) or not rv:
            raise BackendError("the API server returned the breaker's Lease without metadata.resourceVersion")
        annotations = dict(_field(lease, "metadata", "annotations") or {})
        annotations[BREAKER_ANNOTATION] = json.dumps(entries, sort_keys=True)
        body = self._client.V1Lease(metadata=self._client.V1ObjectMeta(
            name=self.k.breaker_lease, namespace=self.k.breaker_namespace, resource_version=rv, annotations=annotations),
            spec=_field(lease, "spec") or self._client.V1LeaseSpec(holder_identity="sentinel-breaker"))
        self._do("update", "leases", self.coordination.replace_namespaced_lease, self.k.breaker_lease,
                 self.k.breaker_namespace, body)

    def claim_cordon(self, reason: CordonReason) -> Verdict:
        """Take a place in the breaker's Lease (resourceVersion-checked), then cordon. A node
        already in the Lease within the window keeps its place (a retry, a restart)."""
        window, fraction = self.cfg.breaker_window_seconds, self.cfg.breaker_max_fraction
        verdict = None
        topo = self.breaker_topology()
        for _ in range(LEASE_ATTEMPTS):
            fleet = self.fleet(self.ctx.wall())
            lease, entries = self._read_lease()
            now = self.ctx.wall()
            recent = {n: t for n, t in entries.items() if in_window(t, now, window)}
            for n, t in fleet.sentinel_cordons:  # taints from before the Lease: counted too
                if in_window(t, now, window):
                    recent.setdefault(n, t)
            others = len(set(recent) - {self.node})
            n_slots = slots(fleet.nodes, fraction)
            if self.node not in entries or not in_window(entries[self.node], now, window):
                if fleet.nodes > 0 and others + 1 > n_slots:  # no nodes in scope: the breaker does not apply
                    return Verdict(False, others, fleet.nodes,
                                   f"{others} of {fleet.nodes} nodes were cordoned by Sentinel in the last {window:g} s; "
                                   f"cordoning this one would make {(others + 1) / max(fleet.nodes, 1):.0%} > {fraction:.0%}")
                if topo is not None:  # and no more than a share of its NVLink domain / leaf (same Lease, same count)
                    from sentinel.topology import domain_breaker

                    d = domain_breaker(topo, self.node, recent.items(), now, window_seconds=window,
                                       max_fraction=self.domain_limits())
                    if not d.allowed:
                        self.domain_refusal = d.level
                        return Verdict(False, others, fleet.nodes, d.why)
                kept = {n: t for n, t in entries.items() if in_window(t, now, window)}
                kept[self.node] = now
                try:
                    self._write_lease(lease, kept)
                except Conflict:
                    continue  # another daemon took a place first: read and count again
            verdict = Verdict(True, others, fleet.nodes,
                              f"{others} of {fleet.nodes} nodes cordoned by Sentinel in the last {window:g} s; "
                              f"{(others + 1) / max(fleet.nodes, 1):.0%} <= {fraction:.0%}")
            break
        if verdict is None:
            raise Unreachable(f"the breaker's Lease {self.k.breaker_namespace}/{self.k.breaker_lease} changed under "
                              f"{LEASE_ATTEMPTS} updates in a row")
        self.cordon_scheduler(reason)
        return verdict

    def _release_claim(self) -> bool:
        for _ in range(LEASE_ATTEMPTS):
            try:
                lease, entries = self._read_lease(create=False)
            except NotFound:
                return False
            if self.node not in entries:
                return False
            entries.pop(self.node)
            try:
                self._write_lease(lease, entries)
                return True
            except Conflict:
                continue
        raise Unreachable("the breaker's Lease kept changing")

BACKEND = KubernetesBackend
