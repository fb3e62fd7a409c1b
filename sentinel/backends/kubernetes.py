"""``backend = "kubernetes"`` (the optional extra ``pip install 'sentinel-gpu[kubernetes]'``):
the Node object says the node is bad, as NVSentinel does.

* **cordon** — ``spec.unschedulable = true`` (only when nobody had cordoned it; the annotation
  ``sentinel.dev/cordoned`` records that the cordon is Sentinel's), the taint
  ``<taint_key>=<rule>:NoSchedule`` (``sentinel.dev/gpu-failure`` by default), and the Node
  condition ``GPUHealthy=False`` (reason = the rule in CamelCase, message = GPU index and reading)
  through the ``status`` subresource.
* **uncordon** — removes Sentinel's taint, its annotations and, if the cordon was Sentinel's,
  the cordon; sets ``GPUHealthy=True``. An admin's cordon and every other taint stay.
* **spare** — nothing to start here: the job's controller (JobSet, PyTorchJob, a StatefulSet)
  reschedules the drained agent's pod onto an untainted node.
* **fleet** (circuit breaker) — the nodes matching ``node_selector`` and, for each carrying
  Sentinel's taint, the taint's ``timeAdded``.

Every write is a JSON patch that first tests ``metadata.resourceVersion`` (or the condition's
index): a concurrent change by the node controller or an admin is a conflict that is retried,
never a lost update. Each request has the backend's timeout; the client's own retries are off
(Sentinel retries with backoff itself). The ServiceAccount needs exactly: ``get``, ``list`` and
``patch`` on ``nodes``, ``patch`` on ``nodes/status`` (deploy/kubernetes/rbac.yaml); a 403 names
the verb that is missing.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass
from typing import Any

from sentinel import settings
from sentinel.backends.base import (REASON_PREFIX, Backend, BackendError, CordonReason, CordonState, Fleet,
                                    PermissionDenied, Unreachable, UnknownNode)

ANNOTATION = "sentinel.dev/cordoned"  # "true": spec.unschedulable was set by Sentinel
REASON_ANNOTATION = "sentinel.dev/reason"
#: what the backend needs, as (verb, resource): checked at start with SelfSubjectAccessReview
NEEDED = (("get", "nodes"), ("list", "nodes"), ("patch", "nodes"), ("patch", "nodes/status"))


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

    def validate(self, prefix: str) -> None:
        settings.path(prefix, "kubeconfig", self.kubeconfig, required=False)
        if not re.match(K8S_NAME, self.taint_key) or len(self.taint_key) > 316:
            raise settings.ConfigError(f"{prefix}.taint_key: not a Kubernetes label key (prefix/name): "
                                       f"{settings.printable(self.taint_key)!r}")
        if not re.match(r"^[A-Za-z][A-Za-z0-9]{0,62}$", self.condition_type):
            raise settings.ConfigError(f"{prefix}.condition_type: must be a CamelCase word "
                                       f"(got {settings.printable(self.condition_type)!r})")
        settings.text(prefix, "node_selector", self.node_selector)


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

    # -- requests -----------------------------------------------------------------------------
    def _do(self, verb: str, resource: str, fn, *args: Any, **kw: Any) -> Any:
        kw["_request_timeout"] = self.ctx.timeout
        try:
            return fn(*args, **kw)
        except self._api_exception as exc:
            status = exc.status or 0
            detail = (exc.reason or "").strip()
            if status == 403:
                raise PermissionDenied(
                    f"Kubernetes refused `{verb} {resource}` for node {self.node!r} (403 Forbidden): the ServiceAccount "
                    f"needs the RBAC verb '{verb}' on '{resource}' (deploy/kubernetes/rbac.yaml)") from None
            if status == 401:
                raise PermissionDenied(f"Kubernetes did not accept the credentials for `{verb} {resource}` "
                                       f"(401 Unauthorized): check the ServiceAccount token or kubeconfig") from None
            if status == 404 and resource in ("nodes", "nodes/status"):
                raise UnknownNode(f"node {self.node!r} is not known to the Kubernetes API server (404 on `get nodes`); "
                                  f"set daemon.node_name to the Node's name (the DaemonSet passes spec.nodeName)") from None
            if status in (409, 422) or status == 429 or status >= 500:
                # 409/422: the resourceVersion or index test failed (someone else changed the node)
                raise Unreachable(f"`{verb} {resource}` for {self.node!r}: {status} {detail}") from None
            raise BackendError(f"`{verb} {resource}` for {self.node!r} failed: {status} {detail}") from None
        except BackendError:
            raise
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
        conditions = node.status.conditions or [] if node.status else []
        for i, c in enumerate(conditions):
            if c.type == self.k.condition_type:
                if c.status == condition["status"]:
                    condition["lastTransitionTime"] = c.last_transition_time.strftime("%Y-%m-%dT%H:%M:%SZ") \
                        if c.last_transition_time else condition["lastTransitionTime"]
                return [{"op": "test", "path": f"/status/conditions/{i}/type", "value": self.k.condition_type},
                        {"op": "replace", "path": f"/status/conditions/{i}", "value": condition}]
        if not conditions and (node.status is None or node.status.conditions is None):
            return [{"op": "add", "path": "/status/conditions", "value": [condition]}]
        return [{"op": "add", "path": "/status/conditions/-", "value": condition}]

    # -- the interface ------------------------------------------------------------------------
    def check(self) -> None:
        self._node()
        missing = []
        for verb, resource in NEEDED:
            res, _, sub = resource.partition("/")
            review = self._client.V1SelfSubjectAccessReview(spec=self._client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=self._client.V1ResourceAttributes(verb=verb, resource=res, subresource=sub or None,
                                                                      group="", name=None if verb == "list" else self.node)))
            api = self._client.AuthorizationV1Api(self.api)
            out = self._do("create", "selfsubjectaccessreviews", api.create_self_subject_access_review, review)
            if not out.status.allowed:
                missing.append(f"'{verb}' on '{resource}'")
        if missing:
            raise PermissionDenied(f"the ServiceAccount lacks the RBAC verb(s) {', '.join(missing)} that the "
                                   f"kubernetes backend needs for node {self.node!r} (deploy/kubernetes/rbac.yaml)")

    def cordon_scheduler(self, reason: CordonReason) -> None:
        node = self._node()
        meta, spec = node.metadata, node.spec
        annotations = dict(meta.annotations or {})
        ops: list[dict] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta.resource_version}]
        new_annotations = {REASON_ANNOTATION: reason.short(256)}
        if not spec.unschedulable:
            ops.append({"op": "add", "path": "/spec/unschedulable", "value": True})
            new_annotations[ANNOTATION] = "true"
        elif annotations.get(ANNOTATION) != "true":
            self.notes.append(f"kubernetes: {self.node} was already cordoned by someone else; that cordon stays theirs")
        if not any(t.key == self.k.taint_key for t in spec.taints or []):
            taint = {"key": self.k.taint_key, "value": _label_value(reason.rule), "effect": "NoSchedule",
                     "timeAdded": _now()}
            ops.append({"op": "add", "path": "/spec/taints/-" if spec.taints else "/spec/taints",
                        "value": taint if spec.taints else [taint]})
        if meta.annotations is None:
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
        node = self._node()
        meta, spec = node.metadata, node.spec
        annotations = meta.annotations or {}
        ours_cordon = annotations.get(ANNOTATION) == "true"
        taints = spec.taints or []
        ops: list[dict] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta.resource_version}]
        done = []
        keep = [t for t in taints if t.key != self.k.taint_key]
        if len(keep) != len(taints):
            ops.append({"op": "replace", "path": "/spec/taints", "value": self.api.sanitize_for_serialization(keep)})
            done.append(f"taint {self.k.taint_key} removed")
        if ours_cordon and spec.unschedulable:
            ops.append({"op": "remove", "path": "/spec/unschedulable"})
            done.append("uncordoned")
        elif spec.unschedulable:
            done.append("cordoned by someone else; that cordon stays")
        for key in (ANNOTATION, REASON_ANNOTATION):
            if key in annotations:
                ops.append({"op": "remove", "path": f"/metadata/annotations/{_escape(key)}"})
        if len(ops) > 1:
            self._patch(ops)
        fresh = self._node()
        if any(c.type == self.k.condition_type for c in (fresh.status.conditions or [])):
            condition = {"type": self.k.condition_type, "status": "True", "reason": "Uncordoned",
                         "message": f"{REASON_PREFIX} uncordoned by an operator", "lastHeartbeatTime": _now(),
                         "lastTransitionTime": _now()}
            self._patch_status(self._condition_ops(fresh, condition))
            done.append(f"{self.k.condition_type}=True")
        return f"kubernetes: {self.node}: " + (", ".join(done) if done else "nothing of Sentinel's to remove")

    def scheduler_state(self) -> CordonState:
        node = self._node()
        ours_taint = [t for t in (node.spec.taints or []) if t.key == self.k.taint_key]
        annotations = node.metadata.annotations or {}
        cordoned = bool(node.spec.unschedulable) or bool(ours_taint)
        by_sentinel = bool(ours_taint) or annotations.get(ANNOTATION) == "true"
        return CordonState(cordoned, by_sentinel, annotations.get(REASON_ANNOTATION, ""))

    def start_spare(self) -> str:
        return "kubernetes: the job's controller reschedules the agent's pod onto an untainted node"

    def fleet(self, now: float) -> Fleet:
        kw = {"label_selector": self.k.node_selector} if self.k.node_selector else {}
        nodes = self._do("list", "nodes", self.core.list_node, **kw).items
        cordons = []
        for n in nodes:
            for t in n.spec.taints or []:
                if t.key == self.k.taint_key:
                    cordons.append((n.metadata.name, calendar.timegm(t.time_added.utctimetuple()) if t.time_added else now))
        return Fleet(len(nodes), tuple(sorted(cordons)))


BACKEND = KubernetesBackend
