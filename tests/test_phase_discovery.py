"""Commands phases add to `lab` (common/phase_discovery.py): found without common/ naming a phase,
listed in `lab --help`, refused in one line when their packages are missing, never declared twice."""
import importlib.util
import types

import pytest

from common import phase_discovery
from common.cli import build_parser, main
from common.errors import LabError
from common.phase_discovery import Command, lab_commands, run_command


def test_lab_serve_is_phase_5s_command():
    serve = lab_commands()["serve"]
    assert serve.module == "phases.phase5_inference.engine.server"
    assert serve.needs == ("aiohttp", "safetensors", "tokenizers") and serve.extra == "serve"
    assert "serve" in build_parser().format_help()


def test_a_missing_package_is_one_line_naming_the_extra_and_exit_2(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    assert main(["serve", "--model", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == 'lab: lab serve needs aiohttp: pip install -e ".[serve]"'


def test_the_command_gets_its_arguments_and_its_exit_code(monkeypatch):
    seen = []
    module = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 7)
    monkeypatch.setattr(phase_discovery.importlib, "import_module", lambda name: module)
    assert run_command(Command("x", "phases.p.x", "help"), ["--a", "1"]) == 7
    assert seen == [["--a", "1"]]


def test_two_phases_declaring_one_command_is_refused(monkeypatch):
    twice = [types.SimpleNamespace(__name__=f"phases.p{n}", LAB_COMMANDS=(Command("serve", "m", "h"),)) for n in (1, 2)]
    monkeypatch.setattr(phase_discovery, "phase_packages", lambda: twice)
    lab_commands.cache_clear()
    try:
        with pytest.raises(LabError, match="declared by two phases"):
            lab_commands()
    finally:
        lab_commands.cache_clear()
