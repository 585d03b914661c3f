"""`lab report`: records -> the READMEs' generated blocks and the plots; `--check` changes nothing.

A generated block in README.md, phases/*/README.md or a further page phases/*/*.md looks like

    <!-- lab:begin phase1.elementwise -->
    ...generated...
    <!-- lab:end phase1.elementwise -->

Each phase declares its blocks in `phases/<phase>/report.py` (a `PHASE`, see common/spec.py);
`common/render.py` writes them. The top README's phase table is built here from every phase's
headline. Nothing here imports torch or an exercise module.
"""
import importlib
import re
from pathlib import Path

from . import accuracy, accuracy_goals, render
from .errors import LabError
from .formats import markdown
from .frame import Frame
from .paths import REPO_ROOT, results_dir
from .records import is_smoke, load_records
from .spec import Phase, Plot, Table, Text

BLOCK = re.compile(r"(<!-- lab:begin (?P<id>[\w.]+) -->\n)(?P<body>.*?)(<!-- lab:end (?P=id) -->)", re.S)
BEGIN = re.compile(r"<!-- lab:begin ([\w.]+) -->")
CODE_ROOT = Path(__file__).resolve().parents[1]        # where the phases' code is (REPO_ROOT: their READMEs)
PLANNED: dict[int, str] = {}                           # phase number -> title, for phases not built yet


def phases() -> list[Phase]:
    """Every phase's declared report (`phases/<phase>/report.py`'s PHASE), in phase order. Phase
    packages import no exercise on their own, so this pulls in no torch."""
    out = [importlib.import_module(f"phases.{path.parent.name}.report").PHASE
           for path in sorted((CODE_ROOT / "phases").glob("phase*/report.py"))]
    return sorted(out, key=lambda p: p.number)


def frame_of(records: list[dict]) -> Frame:
    """The frame as the report sees it: every phase's lesson rows and own calibrators applied."""
    declared = phases()
    return Frame.of(records, excluded={k: v for p in declared for k, v in p.excluded.items()},
                    calibrators={k: v for p in declared for k, v in p.calibrators.items()})


def phase_table(view: render.View) -> str:
    """The top README's table: each phase's status and headline result per GPU, from records."""
    declared = {p.number: p for p in phases()}
    df = view.frame.df
    rows = []
    for n in sorted({*declared, *PLANNED}):
        p = declared.get(n)
        if p is None:
            rows.append([str(n), PLANNED[n], "planned", "-"])
            continue
        key = list(p.headline(view)) if p.headline else []
        measured = len(df) and ((df["phase"] == n) & (df["record_status"] != "skipped") & (df["source"] == "measured")).any()
        status = "measured" if measured else "built, not yet measured"      # a headline may quote others
        rows.append([str(n), f"[{p.title}](phases/{p.folder}/README.md)", status, "; ".join(key) or "-"])
    return markdown(rows, ["phase", "topic", "status", "headline result (from results/)"])


def blocks() -> dict:
    """Block id -> spec: every phase's, each phase's accuracy table, and the top README's phase
    table, lab-wide accuracy and its goals."""
    out = {"phases": Text("phases", phase_table), "accuracy": Text("accuracy", accuracy.table),
           "accuracy.misses": Text("accuracy.misses", accuracy.misses),
           "accuracy.goals": accuracy_goals.GOALS}
    for p in phases():
        out[f"phase{p.number}.accuracy"] = Text(f"phase{p.number}.accuracy",
                                                lambda v, n=p.number: accuracy.table(v, (n,)))
    for p in phases():
        for b in p.blocks:
            if b.id in out:
                raise LabError(f"generated block '{b.id}' is declared twice")
            out[b.id] = b
    return out


def readmes() -> list[Path]:
    """The pages that hold generated blocks: the top README, each phase's README and the further
    pages a phase splits its topics into (phases/phaseN_*/*.md, linked from its README)."""
    pages = sorted((REPO_ROOT / "phases").glob("phase*/*.md"), key=lambda p: (p.parent.name, p.name != "README.md", p.name))
    return [REPO_ROOT / "README.md", *pages]


def render_readme(text: str, view: render.View, known: dict) -> str:
    closed = {m.group("id") for m in BLOCK.finditer(text)}
    unclosed = [b for b in BEGIN.findall(text) if b not in closed]
    if unclosed:
        raise LabError(f"generated block '{unclosed[0]}' has no matching '<!-- lab:end {unclosed[0]} -->'")

    def sub(m):
        block_id = m.group("id")
        if block_id not in known:
            raise LabError(f"unknown generated block '{block_id}' in a README")
        return f"{m.group(1)}{render.block(view, known[block_id])}\n{m.group(4)}"

    return BLOCK.sub(sub, text)


def plots(view: render.View, known: dict) -> list[tuple[Plot, str, Path]]:
    """(spec, hardware, path) of every plot the records call for."""
    return [(b, hw, render.plot_path(view, b, hw)) for b in known.values() if isinstance(b, Plot)
            for hw in render.plot_hardware(view, b)]


def regenerate(check: bool = False, results: str | None = None, echo=print) -> int:
    res = results_dir(results)
    if not res.exists():
        raise LabError(f"results folder '{res.name}' does not exist")
    if not res.is_dir():
        raise LabError(f"results folder '{res.name}' is not a folder")
    records = load_records(res, strict=True)
    if not any(not is_smoke(rec) for rec in records):
        smoke = " other than `--quick` smoke runs (never reported)" if records else ""
        raise LabError(f"no records under results folder '{res.name}'{smoke}: nothing to report "
                       "(the READMEs' tables are left as they are)")
    frame = frame_of(records)
    known = blocks()
    missing_blocks = blocks_missing(known)
    if missing_blocks:
        gone = (f"generated block '{missing_blocks[0]}' is in no README: put back "
                f"<!-- lab:begin {missing_blocks[0]} --> ... <!-- lab:end {missing_blocks[0]} --> where it belongs")
        if check:
            echo(f"stale: {gone}")
            return 1
        raise LabError(gone)
    if check and res.resolve() == (REPO_ROOT / "results").resolve():
        rewritten = records_rewritten()
        if rewritten:
            echo(f"append-only broken: {rewritten[0]} ({len(rewritten)} in all); records are never "
                 "deleted or rewritten: restore them from git")
            return 1
    stale = []
    for readme in readmes():
        if not readme.is_file():
            continue
        text = readme.read_text()
        new = render_readme(text, render.View(frame, readme, res), known)
        if new != text:
            stale.append(readme.relative_to(REPO_ROOT).as_posix())
            if not check:
                readme.write_text(new)
    view = render.View(frame, REPO_ROOT / "README.md", res)
    wanted = plots(view, known)
    tables = {render.csv_path(view, b): content for b in known.values() if isinstance(b, Table)
              for content in [render.table_csv(view, b)] if content is not None}
    left_over = leftovers(res, {path for _, _, path in wanted} | set(tables))
    if check:
        absent = [path for _, _, path in wanted if not path.is_file()]
        stale += [f"results/{p.relative_to(res).as_posix()}" for p, content in tables.items()
                  if not p.is_file() or p.read_text() != content]
        if stale or absent or left_over:
            what = ([f"{s} tables" if s.endswith(".md") else s for s in stale] + [f"plot {p.name}" for p in absent]
                    + [f"results/{p.relative_to(res).as_posix()} (no table or plot makes it any more)" for p in left_over])
            echo(f"stale: {', '.join(what)}; run `lab report` (or python scripts/report.py) and commit")
            return 1
        echo("README tables and plots match results/")
        return 0
    for path in left_over:
        path.unlink()
    for path, content in tables.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    for spec, hw, path in wanted:
        path.parent.mkdir(parents=True, exist_ok=True)
        spec.draw(view, hw, path)
    removed = f"; removed {len(left_over)} file(s) no block makes any more" if left_over else ""
    echo(f"rewrote {len(stale)} README(s); drew {len(wanted)} plot(s) from {len(records)} record(s){removed}")
    return 0


def leftovers(res: Path, wanted: set[Path]) -> list[Path]:
    """Plots and table CSVs in the results folder that no block makes any more (a renamed plot, a
    removed table): `lab report` deletes them, `--check` calls them stale. Only those two folders,
    which the report alone writes."""
    made = [*(res / "plots").glob("*.png"), *(res / "tables").glob("*.csv")]
    return sorted(p for p in made if p not in wanted)


def blocks_missing(known: dict | None = None) -> list[str]:
    """Generated blocks that no README holds any more (someone deleted one by hand). Only the
    lab's own READMEs must hold every block; a stand-in README (in a test) holds what it holds."""
    from . import paths
    if Path(REPO_ROOT).resolve() != paths.REPO_ROOT.resolve():
        return []
    present = set()
    for readme in readmes():
        if readme.is_file():
            present |= set(BEGIN.findall(readme.read_text()))
    return sorted(set(known if known is not None else blocks()) - present)


def records_rewritten(root: Path = REPO_ROOT) -> list[str]:
    """Committed records that are gone or changed: in the working tree against HEAD, and in the
    history (a commit that deleted or modified a record). Empty where git or history is absent."""
    from .git import lab_git, run_quiet
    git = lab_git(root)
    if git is None:
        return []
    spec = ["--", "results/phase*/*/*/*.json"]
    out = []
    now = run_quiet([*git, "diff", "--name-status", "HEAD", *spec]) or ""
    out += [f"{line.split()[-1]} {'deleted' if line[0] == 'D' else 'changed'} in the working tree"
            for line in now.splitlines() if line[:1] in ("D", "M", "R", "T")]
    past = run_quiet([*git, "log", "--format=%h", "--name-status", "--diff-filter=DMRT", *spec], timeout=60) or ""
    commit = None
    for line in past.splitlines():
        if not line.strip():
            continue
        if "\t" not in line:
            commit = line.strip()
            continue
        status, name = line.split("\t", 1)
        out.append(f"{name.split(chr(9))[0]} {'deleted' if status[0] == 'D' else 'changed'} by commit {commit}")
    return out
