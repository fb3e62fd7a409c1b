"""``backend = "command"``: the local marker plus site commands (argv lists, ``{node}`` replaced
by this node's name): ``cordon_command`` after the marker, ``uncordon_command`` by
``sentinel uncordon``, ``agent_stop_command`` instead of the pidfile signal, ``spare_command``
when a migration begins. A command that exits non-zero is a failure with its stderr; one that
does not finish within ``command_timeout_seconds`` is killed and retried like an unreachable
scheduler."""

from __future__ import annotations

from sentinel.backends.base import Backend, BackendError, CordonReason, CordonState, replace_node


class CommandBackend(Backend):
    name = "command"

    @property
    def has_scheduler(self) -> bool:  # type: ignore[override]
        return bool(self.cfg.cordon_command or self.cfg.uncordon_command)

    def _run(self, what: str, argv: tuple[str, ...]) -> str:
        args = replace_node(argv, self.node)
        r = self.command(args, f"{what} command")
        if r.returncode != 0:
            raise BackendError(f"{what} command {args[0]} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
        return f"{what} command {args[0]} ok"

    def cordon_scheduler(self, reason: CordonReason) -> None:
        if self.cfg.cordon_command:
            self._run("cordon", self.cfg.cordon_command)

    def uncordon_scheduler(self) -> str:
        return self._run("uncordon", self.cfg.uncordon_command) if self.cfg.uncordon_command else ""

    def scheduler_state(self) -> CordonState:  # a command cannot be asked: the marker says
        return self.marker_state()

    def stop_agent(self) -> str:
        if self.cfg.agent_stop_command:
            return self._run("agent_stop", self.cfg.agent_stop_command)
        return super().stop_agent()

    def start_spare(self) -> str:
        """Run ``spare_command``. A line ``sentinel-spare-choice {"node": ..., "distance": ...,
        "why": ...}`` in its output (the drill's claim-spare with a topology) is recorded as the
        choice (:class:`sentinel.topology.SpareChoice`)."""
        self.spare_choice = None
        if not self.cfg.spare_command:
            return "no spare_command configured"
        args = replace_node(self.cfg.spare_command, self.node)
        r = self.command(args, "spare command")
        if r.returncode != 0:
            raise BackendError(f"spare command {args[0]} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
        for line in r.stdout.splitlines():
            if line.startswith(CHOICE_PREFIX):
                self.spare_choice = _parse_choice(line[len(CHOICE_PREFIX):])
        if self.spare_choice is not None:
            c = self.spare_choice
            return f"spare command {args[0]} ok: {c.node} ({c.distance}: {c.why})"
        return f"spare command {args[0]} ok"


CHOICE_PREFIX = "sentinel-spare-choice "


def _parse_choice(text: str):
    """A SpareChoice from the command's JSON line, or None when it is not one (never raises)."""
    import json

    from sentinel.topology import SpareChoice

    try:
        d = json.loads(text)
        if not (isinstance(d, dict) and all(isinstance(d.get(k), str) for k in ("node", "distance", "why"))
                and isinstance(d.get("rank"), int)):
            return None
        return SpareChoice(d["node"][:253], d["distance"][:32], d["rank"], d["why"][:1024])
    except ValueError:
        return None


BACKEND = CommandBackend
