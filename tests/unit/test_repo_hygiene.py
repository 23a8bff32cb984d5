"""The repository reads as a product: no development machine's paths in its code and docs, every tool in
scripts/ named in the code map and answering --help, and no import circle in the engine package."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine" / "src"

# A development machine's places: a checkout or a user's home there. The product's own absolute paths are not
# these: the images' user (/home/expresslane), BuildKit's pip cache in the image builds (/root/.cache), /tmp, and
# the container and host paths compose and the docs name (/opt/expresslane, /etc/..., /srv/models, ...).
MACHINE_PATH = re.compile(r"(?<![\w.~/$-])/(?:work|Users|mnt|scratch|workspace|nfs|home/(?!expresslane\b)[\w.-]+"
                          r"|root/(?!\.cache/))(?:/|\b)[^\s'\"`)\]]*")


def machine_paths(text: str) -> list[str]:
    return [m.group(0) for m in MACHINE_PATH.finditer(text)]


def test_the_pattern_finds_a_machine_path_and_leaves_the_products_own() -> None:
    slash = "/"  # the examples are built, so that this file holds no machine path itself
    assert machine_paths(f"# packages from {slash}work/tools/KINDS.md.") == [f"{slash}work/tools/KINDS.md."]
    assert machine_paths(f"see {slash}home/alice/src/x.py and {slash}Users/bob/x, {slash}root/out") == \
        [f"{slash}home/alice/src/x.py", f"{slash}Users/bob/x,", f"{slash}root/out"]
    assert machine_paths("vllm-cache:/home/expresslane/.cache/vllm /root/.cache/pip /tmp/site /opt/expresslane/x "
                         "MODELS_HOST_DIR=/srv/models docs/bench/x/gpu_lean.py https://example.com/work/x") == []


def _code_and_docs() -> list[Path]:
    """Every tracked text file but the raw output of recorded runs (docs/bench/<note>/: what a run printed, kept
    as it was); a lab note's README and its probes are docs and code like any other."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    out = []
    for name in filter(None, names.decode().split("\0")):
        path = REPO / name
        if name.startswith("docs/bench/") and path.suffix not in (".md", ".py", ".sh"):
            continue
        if path.is_file() and not path.is_symlink():
            out.append(path)
    return out


def test_no_machine_paths_in_code_and_docs() -> None:
    """Comments and docs cite repo files and public documents: a reader has neither the development machine's
    checkout nor its home directories."""
    found = []
    for path in _code_and_docs():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file (an image, a plot)
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {p}" for p in machine_paths(line)]
    assert not found, "machine paths (cite a repo file or a public document instead):\n" + "\n".join(found)


def test_scripts_holds_the_tools_the_code_map_names_and_each_answers_help() -> None:
    """scripts/ is what users and operators run (plus launch/ and bench_lib/): each entry is named in
    docs/architecture.md's code map, and each Python tool prints its --help."""
    code_map = (REPO / "docs" / "architecture.md").read_text()
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "scripts"], capture_output=True, text=True,
                             check=True).stdout.split()
    entries = sorted({Path(name).parts[1] for name in tracked})
    unnamed = [name for name in entries if f"scripts/{name}" not in code_map and f"`{name}`" not in code_map]
    assert not unnamed, f"in scripts/ but not in docs/architecture.md's code map: {unnamed}"
    for tool in sorted(REPO / "scripts" / name for name in entries if name.endswith(".py")):
        out = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
        assert out.returncode == 0 and "usage" in out.stdout.lower(), (tool.name, out.stderr[-2000:])


# ------------------------------------------------------------------------------------------------ import circles


def _modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package)} of expresslane.engine."""
    out = {}
    for path in (ENGINE / "expresslane" / "engine").rglob("*.py"):
        parts = list(path.relative_to(ENGINE).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Which engine module imports which, every import counted: at module level, inside functions and under
    TYPE_CHECKING alike (a type is a dependency too). `from pkg import name` is an edge to pkg.name where that is
    a module, else to pkg."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = module.split(".") if package else module.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[module] |= {t for t in map(known, targets) if t and t != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))
    return circles


def test_the_circle_finder_finds_a_circle_and_only_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set(), "f": {"g"}, "g": {"f"}}
    assert import_circles(graph) == [["a", "b", "c"], ["f", "g"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


SUBPACKAGES = sorted(p.name for p in (ENGINE / "expresslane" / "engine").iterdir() if (p / "__init__.py").exists())


def _group(module: str) -> str:
    """A module's subpackage of expresslane.engine (decode, transfer, ...), or "(top level)"."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in SUBPACKAGES else "(top level)"


KNOWN: dict[str, str] = {}  # subpackage -> why a circle is known (none now)


@pytest.mark.parametrize("subpackage", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN[name])) if name in KNOWN else name
    for name in [*SUBPACKAGES, "(top level)", "(across subpackages)"]])
def test_no_import_circle_in_the_engine(subpackage: str) -> None:
    """What a module needs is passed in or lives below it: no module of the engine imports, through any chain,
    one that imports it back (one case per subpackage, one for the package's own modules, one for circles that
    cross subpackages)."""
    circles = import_circles(import_graph())
    groups = [(c, {_group(m) for m in c}) for c in circles]
    here = [c for c, g in groups if (g == {subpackage} if subpackage != "(across subpackages)" else len(g) > 1)]
    assert not here, f"import circles: {here}"
