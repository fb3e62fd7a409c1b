"""Action backends, one module each (see :mod:`sentinel.backends.base` for the interface).

The registry is the package itself: every module here other than ``base`` and ``breaker`` is a
backend whose ``BACKEND`` class ``[actions] backend = "<module>"`` picks (``config.BACKENDS`` is
this list). A backend with settings of its own declares them in its module as ``SETTINGS``, a
frozen dataclass with a ``validate(prefix)`` method; ``sentinel.config`` makes it the
``[actions.<module>]`` table (:data:`SETTINGS`). So a new backend is its module and its test.

Reading the registry imports every backend module, so a module imports its scheduler's client
library inside the backend, when chosen: ``backend = "file"`` never imports the Kubernetes client.
"""

from __future__ import annotations

import importlib
import pkgutil

from sentinel.backends.base import Backend, BackendContext

_NOT_BACKENDS = frozenset({"base", "breaker"})
NAMES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BACKENDS))


def discover_settings(package: str = __name__, names: tuple[str, ...] = NAMES) -> dict[str, type]:
    """backend name -> its ``SETTINGS`` dataclass, for each backend module of ``package`` that has one."""
    out = {}
    for name in names:
        module = importlib.import_module(f"{package}.{name}")
        cls = getattr(module, "SETTINGS", None)
        if cls is not None:
            out[name] = cls
    return out


SETTINGS: dict[str, type] = discover_settings()


def make_backend(actions, ctx: BackendContext) -> Backend:
    """The configured backend. Raises :class:`sentinel.backends.base.BackendError` when its
    module cannot be loaded (e.g. the ``kubernetes`` extra is not installed)."""
    if actions.backend not in NAMES:
        raise ValueError(f"unknown backend {actions.backend!r}")
    module = importlib.import_module(f"sentinel.backends.{actions.backend}")
    return module.BACKEND(actions, ctx)
