"""Action backends, one module each (see :mod:`sentinel.backends.base` for the interface).

The registry is the modules listed here; ``[actions] backend`` names one. A backend module is
imported only when chosen, so ``backend = "file"`` never imports the Kubernetes client.
"""

from __future__ import annotations

import importlib

from sentinel.backends.base import Backend, BackendContext

NAMES: tuple[str, ...] = ("file", "command", "slurm", "kubernetes")


def make_backend(actions, ctx: BackendContext) -> Backend:
    """The configured backend. Raises :class:`sentinel.backends.base.BackendError` when its
    module cannot be loaded (e.g. the ``kubernetes`` extra is not installed)."""
    if actions.backend not in NAMES:
        raise ValueError(f"unknown backend {actions.backend!r}")
    module = importlib.import_module(f"sentinel.backends.{actions.backend}")
    return module.BACKEND(actions, ctx)
