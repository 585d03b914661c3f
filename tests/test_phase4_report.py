"""Phase 4's report: every declared block renders from the committed records, without torch, and
the README holds each block exactly once; analysis.py is torch-free too."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RENDER = """
import sys
from common import render
from common.frame import Frame
from common.paths import REPO_ROOT
from common.records import load_records
from common.spec import Table
from phases.phase4_distributed import analysis, report
res = REPO_ROOT / "results"                 # the committed records, not the tests' guard folder
view = render.View(Frame.of(load_records(res, strict=True)), REPO_ROOT / "phases/phase4_distributed/README.md", res)
for b in report.PHASE.blocks:
    text = render.block(view, b)
    assert text.strip(), b.id
    if isinstance(b, Table) and b.brief is not None:
        assert render.table_csv(view, b), b.id
print("|".join(report.PHASE.headline(view)))
assert "torch" not in sys.modules, "the phase 4 report imported torch"
"""


def test_report_renders_every_block_from_committed_records_without_torch():
    proc = subprocess.run([sys.executable, "-c", RENDER],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NCCL all-reduce busbw" in proc.stdout


def test_readme_holds_every_declared_block_once():
    sys.path.insert(0, str(REPO))
    from phases.phase4_distributed import report
    text = (REPO / "phases/phase4_distributed/README.md").read_text()
    found = re.findall(r"<!-- lab:begin ([\w.]+) -->", text)
    assert sorted(found) == sorted(report.PHASE.block_ids() + ["phase4.accuracy"])    # the lab adds its accuracy
    assert len(text.splitlines()) <= 300
