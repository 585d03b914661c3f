"""records -> tables (pandas) -> markdown between named markers; plots (matplotlib).

Every table and every number in the READMEs' results sections is written here from results/;
nothing is typed by hand. A generated block looks like

    <!-- lab:begin phase1.elementwise -->
    ...generated...
    <!-- lab:end phase1.elementwise -->

`lab report` rewrites every such block in README.md and phases/*/README.md and redraws the plots;
`lab report --check` changes nothing and fails if any block differs from what results/ gives.
"""
import os
import re
from pathlib import Path

import pandas as pd

from .errors import LabError
from .paths import REPO_ROOT, results_dir
from .records import load_records

BLOCK = re.compile(r"(<!-- lab:begin (?P<id>[\w.]+) -->\n)(?P<body>.*?)(<!-- lab:end (?P=id) -->)", re.S)


# ------------------------------------------------------------------------------ the frame
def frame(records: list[dict]) -> pd.DataFrame:
    """One row per result row, flattened (params.*, metrics.*, prediction.*, timing.*)."""
    flat = []
    for order, rec in enumerate(records):          # records come oldest first (records.order_key)
        meta = {
            "order": order,
            "exercise": rec["exercise"]["id"], "hardware": rec["hardware"]["key"],
            "hardware_name": (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"].get("name"),
            "source": rec.get("source", {}).get("kind", "measured"),
            "citation": rec.get("source", {}).get("citation"),
            "started": rec["provenance"].get("started_utc"), "commit": rec["provenance"].get("commit"),
            "path": rec["_path"], "record_status": rec["status"],
        }
        for r in rec["rows"]:
            item = dict(meta, variant=r["variant"], status=r["status"], reason=r["reason"])
            for block in ("params", "metrics", "prediction", "timing"):
                for k, v in (r.get(block) or {}).items():
                    item[f"{block}.{k}"] = v
            flat.append(item)
    return pd.DataFrame(flat)


def latest(df: pd.DataFrame, exercise: str) -> pd.DataFrame:
    """Rows of the newest non-skipped record of `exercise` for each hardware and source."""
    sub = df[(df.get("exercise") == exercise) & (df.get("record_status") != "skipped")] if len(df) else df
    if sub is None or not len(sub):
        return pd.DataFrame()
    newest = sub.groupby(["hardware", "source"])["order"].transform("max")
    return sub[sub["order"] == newest].sort_values(["source", "hardware"], kind="stable")


# ------------------------------------------------------------------------------ formatting
def num(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and pd.isna(x)):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) >= 999.5:                 # also 999.5..999.99, which "g" would print as 1e+03
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def pct(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{float(x):.1f}%"


def size_bytes(n) -> str:
    if n is None or (isinstance(n, float) and pd.isna(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024


def elements(n) -> str:
    n = int(n)
    for unit, scale in (("Gi", 2**30), ("Mi", 2**20)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n:,}"


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def g(r, key, default=None):
    v = r.get(key, default)
    return default if (v is None or (isinstance(v, float) and pd.isna(v))) else v


class View:
    """What a table builder needs: the frame, the raw records, and links relative to its README."""

    def __init__(self, df: pd.DataFrame, records: list[dict], readme: Path, results: Path):
        self.df, self.records, self.readme, self.results = df, records, readme, results

    def link(self, path: str) -> str:
        target = self.results / path
        return os.path.relpath(target, self.readme.parent).replace(os.sep, "/")

    def run_label(self, r) -> str:
        day = (g(r, "started") or "")[:10]
        commit = (g(r, "commit") or "")[:7]
        return f"[{day} {commit}]({self.link(r['path'])})"

    def hw(self, r) -> str:
        label = g(r, "hardware_name") or r["hardware"]
        if r["source"] == "measured":
            return label
        origin = (g(r, "citation") or "elsewhere").split(" (")[0]      # full citation is in the record
        return f"{label} (quoted from the {origin})"

    def record(self, path: str) -> dict:
        return next(rec for rec in self.records if rec["_path"] == path)


def prediction_cells(r) -> list[str]:
    return [num(g(r, "prediction.predicted_ms")), g(r, "prediction.bound", "-"),
            num(g(r, "prediction.measured_over_predicted"), 3)]


NO_RECORDS = "_No records yet: run `lab run {ex}` on a GPU, then `lab report`._"


# ------------------------------------------------------------------------------ tables
def t_gates(v: View) -> str:
    sub = latest(v.df, "phase0.gates")
    if not len(sub):
        return NO_RECORDS.format(ex="phase0.gates")
    rows = [[v.hw(r), r["variant"], r["status"], g(r, "metrics.observed") or g(r, "reason") or "-",
             v.run_label(r)] for _, r in sub.iterrows()]
    return markdown(rows, ["hardware", "gate", "status", "observed", "run"])


def t_matmul_baseline(v: View) -> str:
    sub = latest(v.df, "phase0.matmul_baseline")
    if not len(sub):
        return NO_RECORDS.format(ex="phase0.matmul_baseline")
    rows = []
    for _, r in sub.iterrows():
        if r["status"] != "ok":
            rows.append([v.hw(r), r["variant"], "-", "-", "-", "-", f"{r['status']}: {g(r, 'reason')}", "-", "-", "-", v.run_label(r)])
            continue
        allowed = g(r, "params.tf32_allowed")
        rows.append([v.hw(r), r["variant"], "not stated" if allowed is None else ("yes" if allowed else "no"),
                     num(g(r, "metrics.ms")), num(g(r, "metrics.tflops")), num(g(r, "metrics.best_tflops")),
                     f"{pct(g(r, 'metrics.pct_of_peak_tflops'))} of {num(g(r, 'metrics.peak_tflops'))}",
                     *prediction_cells(r), v.run_label(r)])
    return markdown(rows, ["hardware", "variant", "TF32 allowed", "ms (median)", "TFLOP/s", "best-sample TFLOP/s", "% of peak (TFLOP/s)",
                           "predicted ms", "bound", "measured/predicted", "run"])


def t_synchronize(v: View) -> str:
    sub = latest(v.df, "phase0.synchronize")
    if not len(sub):
        return NO_RECORDS.format(ex="phase0.synchronize")
    rows = [[v.hw(r), "with synchronize" if g(r, "params.synchronize") else "without synchronize",
             num(g(r, "metrics.ms")), num(g(r, "metrics.tflops")), pct(g(r, "metrics.pct_of_peak_tflops")),
             *prediction_cells(r), v.run_label(r)] for _, r in sub.iterrows() if r["status"] == "ok"]
    return markdown(rows, ["hardware", "timing", "ms per matmul", "implied TFLOP/s", "% of peak",
                           "predicted ms", "bound", "measured/predicted", "run"])


def t_timer_check(v: View) -> str:
    sub = latest(v.df, "phase0.timer_check")
    if not len(sub):
        return NO_RECORDS.format(ex="phase0.timer_check")
    rows = [[v.hw(r), r["variant"], num(g(r, "metrics.ms"), 4), num(g(r, "metrics.do_bench_ms"), 4),
             num(g(r, "metrics.harness_over_do_bench"), 4), r["status"], *prediction_cells(r), v.run_label(r)]
            for _, r in sub.iterrows()]
    return markdown(rows, ["hardware", "kernel", "harness ms", "do_bench ms", "harness/do_bench",
                           "within 5%", "predicted ms", "bound", "measured/predicted", "run"])


def t_elementwise(v: View) -> str:
    sub = latest(v.df, "phase1.elementwise")
    if not len(sub):
        return NO_RECORDS.format(ex="phase1.elementwise")
    rows = []
    for _, r in sub.iterrows():
        if r["status"] != "ok":
            continue
        rows.append([v.hw(r), r["variant"], elements(g(r, "params.n")), size_bytes(g(r, "params.working_set_bytes")),
                     num(g(r, "metrics.ms")), num(g(r, "metrics.gbps")), pct(g(r, "metrics.pct_of_peak_bandwidth")),
                     pct(g(r, "metrics.pct_of_copy_bandwidth")), num(g(r, "prediction.intensity_flop_per_byte")),
                     *prediction_cells(r), v.run_label(r)])
    return markdown(rows, ["hardware", "op", "elements", "working set", "ms", "GB/s", "% of spec BW",
                           "% of copy (same run)", "FLOP/byte", "predicted ms", "bound", "measured/predicted", "run"])


def _matmul_rows(v: View, sub: pd.DataFrame) -> list[list[str]]:
    rows = []
    for _, r in sub.iterrows():
        if r["status"] != "ok":
            rows.append([v.hw(r), num(g(r, "params.n")), "-", "-", "-", "-", "-", f"{r['status']}: {g(r, 'reason')}", "-", "-", "-", v.run_label(r)])
            continue
        rows.append([v.hw(r), num(g(r, "params.n")), g(r, "params.dtype"), num(g(r, "prediction.intensity_flop_per_byte")),
                     num(g(r, "metrics.ms"), 4), num(g(r, "metrics.tflops")), num(g(r, "metrics.best_tflops")),
                     pct(g(r, "metrics.pct_of_peak_tflops")), *prediction_cells(r), v.run_label(r)])
    return rows


MATMUL_HEADER = ["hardware", "N", "dtype", "FLOP/byte", "ms (median)", "TFLOP/s", "best-sample TFLOP/s", "% of peak",
                 "predicted ms", "predicted bound", "measured/predicted", "run"]


def t_matmul_fp16(v: View) -> str:
    sub = latest(v.df, "phase1.matmul_fp16")
    return markdown(_matmul_rows(v, sub), MATMUL_HEADER) if len(sub) else NO_RECORDS.format(ex="phase1.matmul_fp16")


def t_regime_sweep(v: View) -> str:
    sub = latest(v.df, "phase1.regime_sweep")
    if not len(sub):
        return NO_RECORDS.format(ex="phase1.regime_sweep")
    out = [markdown(_matmul_rows(v, sub), MATMUL_HEADER), ""]
    for path in dict.fromkeys(sub["path"]):
        rec, s = v.record(path), v.record(path)["summary"]
        name = (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]
        out.append(f"Ridge point on {name}: {num(s.get('spec_ridge_flop_per_byte'))} FLOP/byte from the spec sheet "
                   f"(crossover at N = {num(s.get('spec_crossover_n'))}); "
                   f"{num(s.get('measured_ridge_flop_per_byte'))} FLOP/byte from this run's own ceilings "
                   f"({num(s.get('measured_peak_tflops'))} TFLOP/s best matmul over {num(s.get('measured_copy_gbps'))} GB/s copy, "
                   f"crossover at N = {num(s.get('measured_crossover_n'))}). The smallest N reaching half the best "
                   f"rate was {num(s.get('smallest_n_at_half_of_best'))}.")
    return "\n".join(out)


def t_cache_sweep(v: View) -> str:
    sub = latest(v.df, "phase1.cache_sweep")
    if not len(sub):
        return NO_RECORDS.format(ex="phase1.cache_sweep")
    rows = [[v.hw(r), size_bytes(g(r, "params.working_set_bytes")), num(g(r, "metrics.gbps")),
             pct(g(r, "metrics.pct_of_peak_bandwidth")), num(g(r, "timing.graph_reps")),
             num(g(r, "prediction.measured_over_predicted"), 3), v.run_label(r)]
            for _, r in sub.iterrows() if r["status"] == "ok"]
    return markdown(rows, ["hardware", "working set", "GB/s", "% of spec HBM BW", "copies per graph replay",
                           "measured/predicted (HBM roof)", "run"])


def t_nsight(v: View) -> str:
    sub = latest(v.df, "phase1.nsight")
    if not len(sub):
        return NO_RECORDS.format(ex="phase1.nsight")
    rows = [[v.hw(r), r["variant"], num(g(r, "params.n")), pct(g(r, "metrics.dram_throughput_pct")),
             pct(g(r, "metrics.sm_throughput_pct")), size_bytes(g(r, "metrics.dram_bytes")),
             size_bytes(g(r, "metrics.ideal_bytes")), num(g(r, "metrics.dram_bytes_over_ideal"), 3),
             num(g(r, "metrics.intensity_measured_flop_per_byte")), v.run_label(r)]
            for _, r in sub.iterrows() if r["status"] == "ok"]
    return markdown(rows, ["hardware", "anchor", "N", "DRAM throughput", "SM throughput", "DRAM bytes (ncu)",
                           "ideal bytes", "ncu/ideal", "FLOP/byte (ncu bytes)", "run"])


TABLES = {
    "phase0.gates": t_gates, "phase0.matmul_baseline": t_matmul_baseline,
    "phase0.synchronize": t_synchronize, "phase0.timer_check": t_timer_check,
    "phase1.elementwise": t_elementwise, "phase1.matmul_fp16": t_matmul_fp16,
    "phase1.regime_sweep": t_regime_sweep, "phase1.cache_sweep": t_cache_sweep, "phase1.nsight": t_nsight,
}


def phase_report_modules() -> list:
    """Each phase may ship phases/phaseN_*/tables.py with TABLES = {block id: builder(View) -> str}
    and, optionally, draw(records, results) -> [paths] and expected(records, results) -> [paths]
    for its plots. Phases 0-1 live here in common/; later phases bring their own."""
    import importlib
    import pkgutil

    import phases
    mods = []
    for info in sorted(pkgutil.iter_modules(phases.__path__), key=lambda m: m.name):
        if re.fullmatch(r"phase\d_\w+", info.name) and (REPO_ROOT / "phases" / info.name / "tables.py").is_file():
            mods.append(importlib.import_module(f"phases.{info.name}.tables"))
    return mods


def builders() -> dict:
    from . import findings
    out = {**TABLES, **findings.BLOCKS}
    for mod in phase_report_modules():
        out.update(getattr(mod, "TABLES", {}))
    return out


# ------------------------------------------------------------------------------ regenerate
def readmes() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "phases").glob("phase*/README.md"))]


BEGIN = re.compile(r"<!-- lab:begin ([\w.]+) -->")


def render(text: str, view_for) -> str:
    known = builders()
    closed = {m.group("id") for m in BLOCK.finditer(text)}
    unclosed = [b for b in BEGIN.findall(text) if b not in closed]
    if unclosed:
        raise LabError(f"generated block '{unclosed[0]}' has no matching '<!-- lab:end {unclosed[0]} -->'")

    def sub(m):
        block_id = m.group("id")
        if block_id not in known:
            raise LabError(f"unknown generated block '{block_id}' in a README")
        return f"{m.group(1)}{known[block_id](view_for()).rstrip()}\n{m.group(4)}"

    return BLOCK.sub(sub, text)


def regenerate(check: bool = False, results: str | None = None, echo=print) -> int:
    res = results_dir(results)
    if not res.exists():
        raise LabError(f"results folder '{res.name}' does not exist")
    if not res.is_dir():
        raise LabError(f"results folder '{res.name}' is not a folder")
    records = load_records(res, strict=True)
    if not records:
        raise LabError(f"no records under results folder '{res.name}': nothing to report "
                       "(the READMEs' tables are left as they are)")
    df = frame(records)
    stale = []
    missing_blocks = blocks_missing()
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
    for readme in readmes():
        if not readme.is_file():
            continue
        text = readme.read_text()
        new = render(text, lambda: View(df, records, readme, res))
        rel = readme.relative_to(REPO_ROOT).as_posix()
        if new != text:
            stale.append(rel)
            if not check:
                readme.write_text(new)
    if check:
        missing = [p for p in expected_plots(records, res) if not p.is_file()]
        if stale or missing:
            what = [f"{s} tables" for s in stale] + [f"plot {p.name}" for p in missing]
            echo(f"stale: {', '.join(what)}; run `lab report` (or python scripts/report.py) and commit")
            return 1
        echo("README tables and plots match results/")
        return 0
    from . import plots
    made = plots.draw_all(records, res)
    for mod in phase_report_modules():
        if hasattr(mod, "draw"):
            made += mod.draw(records, res)
    echo(f"rewrote {len(stale)} README(s); drew {len(made)} plot(s) from {len(records)} record(s)")
    return 0


def blocks_missing() -> list[str]:
    """Generated blocks that no README holds any more (someone deleted one by hand). Only the
    lab's own READMEs must hold every block; a stand-in README (in a test) holds what it holds."""
    from . import paths
    if Path(REPO_ROOT).resolve() != paths.REPO_ROOT.resolve():
        return []
    present = set()
    for readme in readmes():
        if readme.is_file():
            present |= set(BEGIN.findall(readme.read_text()))
    return sorted(set(builders()) - present)


def records_rewritten(root: Path = REPO_ROOT) -> list[str]:
    """Committed records that are gone or changed: in the working tree against HEAD, and in the
    history (a commit that deleted or modified a record). Empty where git or history is absent."""
    from .env import lab_git, run_quiet
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


def expected_plots(records: list[dict], res: Path) -> list[Path]:
    from . import plots
    out = plots.expected(records, res)
    for mod in phase_report_modules():
        if hasattr(mod, "expected"):
            out += mod.expected(records, res)
    return out
