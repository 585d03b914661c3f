"""The lab's shape, read from its source without importing it: no import circles between modules, and
`common/` never imports a phase (phases contribute exercises and `lab` commands; common finds them).

Every `import` and `from ... import` counts, at module level or inside a function (a lazy import
that closes a circle is still a circle, one a reader has to hold in mind), except those under
`if TYPE_CHECKING:` (never executed). Importing a submodule is an edge to that submodule only, not
to the packages above it: a package's `__init__` re-exporting its modules is not a circle.
"""
import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("common", "phases")

# Circles another branch removes; delete each pair once its branch is merged.
KNOWN_CIRCLES: set = set()           # none: a circle found here is a defect


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the given top-level packages."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported(module: str, is_package: bool, node, known: set[str]) -> set[str]:
    """The known modules one import statement names: `import a.b` -> a.b; `from a import b` -> a.b
    where b is a module, else a; relative forms resolved against `module`."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in known:
            out.add(f"{source}.{alias.name}")
        elif source in known:
            out.add(source)
    return out


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of these packages it imports (anywhere in its body)."""
    files = module_files(root, packages)
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _import_nodes(tree):
            edges |= _imported(module, is_package, node, known)
        edges.discard(module)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(common module, phase module) for every import from common/ into phases/."""
    return sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == "common"
                  for t in targets if t.split(".")[0] == "phases")


def _describe(circles) -> str:
    return "; ".join(" <-> ".join(sorted(c)) for c in circles)


# ------------------------------------------------------------------------------ the lab itself
def test_the_lab_has_no_import_circles():
    circles = [c for c in import_circles(import_graph(REPO)) if c not in KNOWN_CIRCLES]
    assert not circles, f"import circles: {_describe(circles)}"


def test_common_never_imports_a_phase():
    upward = upward_imports(import_graph(REPO))
    assert not upward, "common/ imports phases/: " + ", ".join(f"{m} -> {t}" for m, t in upward)


def test_a_module_importing_another_phase_says_which_lesson_it_builds_on():
    """Phases import each other only where an exercise is built on another phase's lesson, and the
    importing module's docstring says so in a line "Built on phase N: ..."."""
    files = module_files(REPO)
    silent = []
    for module, targets in import_graph(REPO).items():
        if not module.startswith("phases.phase"):
            continue
        doc = ast.get_docstring(ast.parse(files[module].read_text())) or ""
        for phase in sorted({t.split(".")[1] for t in targets if t.startswith("phases.phase")} - {module.split(".")[1]}):
            if f"Built on phase {phase[5]}:" not in doc:
                silent.append(f"{module} -> {phase}")
    assert not silent, "cross-phase imports without a 'Built on phase N:' line: " + ", ".join(silent)


def test_no_two_phase5_modules_share_a_name():
    names = [p.stem for p in (REPO / "phases" / "phase5_inference").rglob("*.py") if p.stem != "__init__"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# ------------------------------------------------------------------------------ the checker, tested
def _fake_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_circle_through_from_dot_import(tmp_path):
    _fake_package(tmp_path, {"phases/__init__.py": "", "phases/p/__init__.py": "",
                             "phases/p/a.py": "from . import b\n",
                             "phases/p/b.py": "def f():\n    from .c import g\n",
                             "phases/p/c.py": "import phases.p.a\n",
                             "phases/p/d.py": "from .a import x\n"})
    circles = import_circles(import_graph(tmp_path, ("phases",)))
    assert circles == [frozenset({"phases.p.a", "phases.p.b", "phases.p.c"})]


def test_the_checker_skips_type_checking_imports_and_package_parents(tmp_path):
    _fake_package(tmp_path, {"phases/__init__.py": "", "phases/p/__init__.py": "from .a import x\n",
                             "phases/p/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from .b import y\nx = 1\n",
                             "phases/p/b.py": "from phases.p.a import x\n"})
    graph = import_graph(tmp_path, ("phases",))
    assert graph["phases.p.a"] == set() and graph["phases.p.b"] == {"phases.p.a"}
    assert import_circles(graph) == []


def test_the_checker_finds_common_importing_a_phase(tmp_path):
    _fake_package(tmp_path, {"common/__init__.py": "", "common/cli.py": "def serve():\n"
                                                                         "    from phases.p import server\n",
                             "phases/__init__.py": "", "phases/p/__init__.py": "", "phases/p/server.py": ""})
    assert upward_imports(import_graph(tmp_path)) == [("common.cli", "phases.p.server")]
