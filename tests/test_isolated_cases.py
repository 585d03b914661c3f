"""scripts/isolated_cases.py, the smoke scripts' harness, on CPU: a child that dies inside a case
costs that case only; the run goes on in a fresh child at the next one."""
import sys
import textwrap

from common.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import isolated_cases  # noqa: E402

CHILD = textwrap.dedent('''
    import os, sys
    sys.path.insert(0, {scripts!r})
    from isolated_cases import report
    for i in range(int(sys.argv[1]), 4):
        report(i, status="started")
        if i == 1:
            os._exit(7)                       # a fault: the process dies mid-case
        report(i, status="ok" if i != 2 else "FAIL", value=i)
''')


def test_a_dead_child_costs_one_case(tmp_path, capsys):
    child = tmp_path / "child.py"
    child.write_text(CHILD.format(scripts=str(REPO_ROOT / "scripts")))
    shown = []
    failures = isolated_cases.run_in_children(
        [{"n": i} for i in range(4)], lambda start: [sys.executable, str(child), str(start)], 30,
        lambda case, status, fields: shown.append((case["n"], status, fields)), lambda case: f"case {case['n']}")
    assert shown == [(0, "ok", {"value": 0}), (2, "FAIL", {"value": 2}), (3, "ok", {"value": 3})]
    assert failures == 2                      # case 1 died, case 2 failed
    assert "[DIED ] case 1: child rc=7" in capsys.readouterr().out
