"""Action backends, one module each (see :mod:`sentinel.backends.base` for the interface).

The registry is the package itself: every module here other than ``base`` and ``breaker`` is a
backend whose ``BACKEND`` class ``[actions] backend = "<module>"`` picks (``config.BACKENDS`` is
this list). A backend module is imported only when chosen, so ``backend = "file"`` never imports
the Kubernetes client.
"""

from __future__ import annotations

import importlib
import pkgutil

from sentinel.backends.base import Backend, BackendContext

_NOT_BACKENDS = frozenset({"base", "breaker"})
NAMES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BACKENDS))


def make_backend(actions, ctx: BackendContext) -> Backend:
    """The configured backend. Raises :class:`sentinel.backends.base.BackendError` when its
    module cannot be loaded (e.g. the ``kubernetes`` extra is not installed)."""
    if actions.backend not in NAMES:
        raise ValueError(f"unknown backend {actions.backend!r}")
    module = importlib.import_module(f"sentinel.backends.{actions.backend}")
    return module.BACKEND(actions, ctx)
