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
        if self.cfg.spare_command:
            return self._run("spare", self.cfg.spare_command)
        return "no spare_command configured"


BACKEND = CommandBackend
