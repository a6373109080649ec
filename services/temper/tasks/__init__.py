"""Task domains: what the scheduler asks and the reward service checks.

Families by prefix: ``toy.*`` (tiny-vocabulary exact answers, ``toy``), ``math.*`` (LaTeX
answers, ``math_problems``), ``code.*`` (test suites run in the sandbox, ``code_problems``),
``chain.*`` (multi-step arithmetic, one step per line, ``chain``), ``rg.<family>`` (reasoning-gym's
procedural tasks, ``gym``), ``data.<name>`` (the rows of a dataset file the job
declares in its domain_config, ``data``). Modules are imported on first use
(reasoning-gym and sympy take a second to import).
"""

from __future__ import annotations

import importlib
import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

FAMILIES = {"toy": "temper.tasks.toy", "math": "temper.tasks.math_problems", "code": "temper.tasks.code_problems",
            "chain": "temper.tasks.chain", "rg": "temper.tasks.gym", "data": "temper.tasks.data"}
CONFIGURABLE = ("rg", "data")  # families that take options of their own


def _module(domain: str):
    family = domain.split(".", 1)[0]
    if family not in FAMILIES:
        raise InvalidArgument(f"unknown domain {domain!r}; families: {sorted(FAMILIES)}", field="domains")
    return importlib.import_module(FAMILIES[family])


def domains() -> list[str]:
    """Every concrete domain name (``data.*`` domains are named by the jobs that declare them)."""
    out = []
    for family, name in FAMILIES.items():
        if family == "data":
            continue
        module = importlib.import_module(name)
        out += [f"rg.{f}" for f in module.families()] if family == "rg" else sorted(module.GENERATORS)
    return out


def configurable(domain: str) -> bool:
    """Whether the domain's family takes options of its own (reasoning-gym families and datasets do)."""
    return domain.split(".", 1)[0] in CONFIGURABLE


def declared(domain: str) -> bool:
    """Whether ``domain`` is a dataset domain, ``data.<name>``, which its domain_config table declares."""
    from temper.tasks import data

    return data.declared(domain)


def describe(domain: str, config: dict | None) -> str | None:
    """One line on what ``domain`` draws from (a dataset: its file, rows, fields, verifier); None for a
    procedural family."""
    return _module(domain).describe(domain, config) if declared(domain) and config else None


def resolve_paths(domain_config: dict, base) -> dict:
    """``domain_config`` with the dataset paths relative to ``base`` (the job file's folder) made absolute."""
    from temper.tasks import data

    return data.resolve_paths(domain_config, base)


def check_config(domain: str, config: dict, field: str = "domain_config") -> None:
    """InvalidArgument naming ``field`` unless ``config`` is a valid option set of ``domain``'s family."""
    if not configurable(domain):
        raise InvalidArgument(f"{domain!r} takes no options (only rg.<family> and data.<name> domains do)",
                              field=field)
    _module(domain).check_config(domain, config, field)


def make_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """One task of ``domain``; ``config``: the family's own options (see ``check_config``)."""
    if config or declared(domain):
        if not configurable(domain):
            raise InvalidArgument(f"{domain!r} takes no options (only rg.<family> and data.<name> domains do)",
                                  field="domain_config")
        return _module(domain).make_task(domain, rng, task_id, config)
    return _module(domain).make_task(domain, rng, task_id)


def make_eval_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """One held-out task of ``domain``: a dataset's held-out rows only (training never draws them); a
    procedural family's tasks are drawn as for training (the eval set's own seed keeps them apart)."""
    if declared(domain):
        return _module(domain).make_eval_task(domain, rng, task_id, config)
    return make_task(domain, rng, task_id, config)


def difficulty_ladder(domain: str) -> list[dict] | None:
    """The domain family's own difficulty levels (level -> options), or None where it has none
    (only reasoning-gym families with a curriculum do)."""
    return _module(domain).difficulty_ladder(domain) if configurable(domain) else None
