"""Finds every exercise: each phases/phaseN_*/__init__.py names its exercise modules in
EXERCISE_MODULES, and each such module defines one `EXERCISE`."""
import importlib
import re
from functools import lru_cache

from .errors import LabError
from .exercise import Exercise
from .phase_discovery import phase_packages


@lru_cache(maxsize=1)
def all_exercises() -> tuple[Exercise, ...]:
    found = []
    for package in phase_packages():
        for name in getattr(package, "EXERCISE_MODULES", ()):
            found.append(importlib.import_module(f"{package.__name__}.{name}").EXERCISE)
    return tuple(found)


def select(selectors: list[str]) -> list[Exercise]:
    """'1', 'phase1', 'phase1.elementwise', 'elementwise' or 'all' -> exercises, in lab order."""
    exercises = all_exercises()
    chosen: list[Exercise] = []
    for sel in selectors:
        s = sel.strip().lower()
        if s == "all":
            hits = list(exercises)
        elif re.fullmatch(r"(phase)?\d", s):
            phase = int(s[-1])
            hits = [e for e in exercises if e.phase == phase]
            if not hits:
                raise LabError(f"phase {phase} has no exercises yet; see `lab list`")
        else:
            hits = [e for e in exercises if e.id == s or e.name == s]
            if not hits:
                raise LabError(f"unknown phase or exercise '{sel}'; see `lab list`")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen
