"""The policy's rules, one module each. The registry is derived from this package's contents.

Every module here except ``base`` defines ``RULE`` (see :mod:`sentinel.rules.base` for what a rule
declares). :data:`REGISTRY` holds them in their declared ``order``; ``sentinel.policy`` runs them
and ``sentinel.config`` validates ``policy.disabled_rules`` against :data:`RULE_NAMES` and makes
``PolicyConfig`` from :data:`CONFIG_KEYS`. Adding a rule
is adding a module (and a scenario under ``tests/scenarios/`` that trips it); nothing else lists
rules. Discovery imports this package's own modules only; it registers nothing anywhere else.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Iterable

from sentinel.rules.base import ConfigKey, GpuRule, NodeRule, Rule

NOT_RULES = frozenset({"base"})  # modules of this package that hold shared code, not a rule


def discover(package: str = __name__, path: Iterable[str] = __path__) -> tuple[Rule, ...]:
    """Import every rule module of ``package`` (at ``path``); return their ``RULE``s sorted by ``order``.

    Raises ``ImportError`` for a module without a ``RULE`` and ``ValueError`` for two rules with the
    same name or order, so a mistake fails at import (and in the tests), never at a trip."""
    rules = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name in NOT_RULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        rule = getattr(module, "RULE", None)
        if not isinstance(rule, (GpuRule, NodeRule)):
            raise ImportError(f"{module.__name__} defines no RULE (a GpuRule or NodeRule instance)")
        rules.append(rule)
    for attr in ("name", "order"):
        seen: dict[object, Rule] = {}
        for rule in rules:
            other = seen.setdefault(getattr(rule, attr), rule)
            if other is not rule:
                raise ValueError(f"rules {other.name!r} and {rule.name!r} have the same {attr} {getattr(rule, attr)!r}")
    return tuple(sorted(rules, key=lambda r: r.order))


def config_keys(registry: Iterable[Rule]) -> tuple[ConfigKey, ...]:
    """The ``[policy]`` keys the rules declare, each once, in rule order. Raises ValueError for
    two different declarations of one key (its default and range are written in one place)."""
    keys: dict[str, ConfigKey] = {}
    for rule in registry:
        for key in rule.config:
            if keys.setdefault(key.name, key) != key:
                raise ValueError(f"rule {rule.name!r} declares [policy] {key.name} differently from another rule: "
                                 "import the one declaration instead")
    return tuple(keys.values())


REGISTRY: tuple[Rule, ...] = discover()
RULE_NAMES: frozenset[str] = frozenset(r.name for r in REGISTRY)
CONFIG_KEYS: tuple[ConfigKey, ...] = config_keys(REGISTRY)
