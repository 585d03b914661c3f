"""Finds what the phases contribute, by name, so that common/ never imports a phase: the phase
packages (phases/phaseN_*), and the `lab` commands a phase declares in its `__init__.py`:

    LAB_COMMANDS = (Command("serve", "engine.server", "one line for `lab --help`",
                            needs=("aiohttp",), extra="serve"),)

Importing a phase package must stay cheap (no torch): `lab --help` and `lab report` read them.
"""
import importlib
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

from .errors import LabError
from .paths import REPO_ROOT


@dataclass(frozen=True)
class Command:
    """`lab <name> [args]`: the phase's module `module` (relative to the phase package) parses its
    own args in `main(argv) -> exit code`; `needs` are Python modules checked before it is
    imported, refused with one line naming the pip extra that installs them."""
    name: str
    module: str
    help: str
    needs: tuple[str, ...] = ()
    extra: str | None = None


def phase_packages() -> list[ModuleType]:
    """Every phases/phaseN_* package, imported, in phase order."""
    folder = REPO_ROOT / "phases"
    names = sorted(p.name for p in folder.iterdir()
                   if re.fullmatch(r"phase\d_\w+", p.name) and (p / "__init__.py").is_file())
    return [importlib.import_module(f"phases.{name}") for name in names]


@lru_cache(maxsize=1)
def lab_commands() -> dict[str, Command]:
    """Command name -> its Command, `module` made absolute; two phases declaring one name is an error."""
    found: dict[str, Command] = {}
    for package in phase_packages():
        for command in getattr(package, "LAB_COMMANDS", ()):
            if command.name in found:
                raise LabError(f"`lab {command.name}` is declared by two phases")
            found[command.name] = Command(command.name, f"{package.__name__}.{command.module}", command.help,
                                          command.needs, command.extra)
    return found


def run_command(command: Command, argv: list[str]) -> int:
    """Check the command's needs, then hand it its arguments."""
    missing = [m for m in command.needs if importlib.util.find_spec(m) is None]
    if missing:
        extra = f': pip install -e ".[{command.extra}]"' if command.extra else ""
        raise LabError(f"lab {command.name} needs {', '.join(missing)}{extra}")
    return importlib.import_module(command.module).main(argv)
