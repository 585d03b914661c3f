"""Finds every exercise: each phases/phaseN_*/__init__.py lists its own in EXERCISES."""
import importlib
import pkgutil
import re
from functools import lru_cache

from .errors import LabError
from .exercise import Exercise


@lru_cache(maxsize=1)
def all_exercises() -> tuple[Exercise, ...]:
    import phases
    found = []
    for info in sorted(pkgutil.iter_modules(phases.__path__), key=lambda m: m.name):
        if re.fullmatch(r"phase\d_\w+", info.name):
            module = importlib.import_module(f"phases.{info.name}")
            found.extend(getattr(module, "EXERCISES", ()))
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
