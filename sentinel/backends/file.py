"""``backend = "file"``: the node is cordoned by the local marker ``<state_dir>/cordon.json``
alone (``sentinel launch`` and the agent unit's ``ExecCondition=`` refuse to start while it
exists), the agent is stopped through its pidfile, and no spare is started: for clusters without
a scheduler Sentinel can talk to, and for drills."""

from sentinel.backends.base import Backend


class FileBackend(Backend):
    name = "file"


BACKEND = FileBackend
