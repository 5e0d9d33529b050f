"""The import graph of dsconv/ is acyclic and follows the layers of docs/architecture.md; no module is over 500 lines;
nothing in the repository points at a file outside it.

Every import counts, function-level ones included: a cycle hidden inside a function still means neither module can be
read, tested or moved without the other. Run as a script for the figures:
    python tests/test_architecture.py
prints the strongly connected components, the layer violations and the long modules.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dsconv"
MAX_LINES = 500

# Layer of each module or package (longest dotted prefix wins): docs/architecture.md's layers. A module imports only
# from layers below its own, from its own unit (the same key here), or from another unit of its layer, except that
# layer-4 stages never import another stage (the acyclicity check keeps same-layer imports one-way). A module matching
# no key fails the test: say where a new module belongs.
LAYERS: dict[str, int] = {
    # 0 vocabulary and data, and the running process (runtime: working directory, gc, peak RSS, a thread pool)
    "dsconv": 0, "dsconv.errors": 0, "dsconv.tensors": 0, "dsconv.soc": 0, "dsconv.bundled": 0,
    "dsconv.calib_data": 0, "dsconv.atc_profiles": 0, "dsconv.runtime": 0,
    # data to dsconv: the scripts that run in the engines' own environments (they import nothing from dsconv)
    "dsconv.engine_check": 0,
    # 1 files and formats, no model knowledge: io (safetensors bytes, the one writer, planned parts, a checkpoint
    # tensor copied into a writer in bounded chunks, the ONNX external-data writer), validated readers of inputs, the
    # quantized-tensor format math, the workspace file
    "dsconv.io": 1, "dsconv.schemas": 1, "dsconv.qformat": 1, "dsconv.workspace": 1,
    # 2 the model: the family tables, the checkpoint (which classifies every tensor through its family), the torch
    # model builder, tiny models
    "dsconv.families": 2, "dsconv.checkpoint": 2, "dsconv.model": 2, "dsconv.tiny": 2,
    # 3 engine profiles, executor, and what quantize and eval share (the layer runner, texts and tokenizer, metrics)
    "dsconv.engines": 3, "dsconv.executor": 3, "dsconv.runner": 3,
    # 4 stages
    "dsconv.convert": 4, "dsconv.quant": 4, "dsconv.shard": 4, "dsconv.atc": 4,
    # 5 the top: CLI, commands, demo, the stage table verify reads, inspect (a command's report)
    "dsconv.cli": 5, "dsconv.commands": 5, "dsconv.demo": 5, "dsconv.stages": 5, "dsconv.inspect": 5,
    "dsconv.__main__": 5,
}
STAGE_LAYER = 4


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _targets(node: ast.AST, mod: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The dsconv modules one import statement loads (a `from pkg import sub` loads the submodule sub)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "dsconv"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    if src.split(".")[0] != "dsconv":
        return []
    out = []
    for a in node.names:
        sub = f"{src}.{a.name}"
        out.append(sub if sub in known else src)
    return out


def graph() -> dict[str, set[str]]:
    """module -> the dsconv modules it imports (the nearest existing module for each dotted name)."""
    mods = modules()
    known = set(mods)
    g: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, mod, path.name == "__init__.py", known):
                    while t not in known and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in known and t != mod:
                        g[mod].add(t)
    return g


def sccs(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


def a_cycle(g: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One concrete cycle inside a strongly connected component, to name in the failure."""
    inside = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(g[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    return comp


def unit(mod: str) -> str | None:
    best = None
    for key in LAYERS:
        inside = mod == key or (key != "dsconv" and mod.startswith(key + "."))  # "dsconv" is the package root alone
        if inside and (best is None or len(key) > len(best)):
            best = key
    return best


def layer_violations(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    out = []
    for mod in sorted(g):
        um = unit(mod)
        if um is None:
            out.append(("unplaced", mod))
            continue
        for dep in sorted(g[mod]):
            ud = unit(dep)
            if ud is None or ud == um or ud == "dsconv":
                continue
            lm, ld = LAYERS[um], LAYERS[ud]
            if ld > lm or (ld == lm == STAGE_LAYER):
                out.append(("layer", f"{mod} ({lm}) imports {dep} ({ld})"))
    return out


def long_modules() -> dict[str, int]:
    out = {}
    for mod, path in modules().items():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            out[mod] = n
    return out


def problems() -> dict[tuple[str, str], str]:
    """(kind, key) -> what to read in the failure message."""
    g = graph()
    out: dict[tuple[str, str], str] = {}
    for comp in sccs(g):
        units = {unit(m) for m in comp}
        key = f"within {units.pop()}" if len(units) == 1 else ", ".join(comp)
        out[("cycle", key)] = f"{len(comp)} modules, e.g. " + " -> ".join(a_cycle(g, comp))
    for kind, detail in layer_violations(g):
        out[(kind, detail)] = detail
    for mod, n in long_modules().items():
        out[("long", mod)] = f"{mod} has {n} lines (limit {MAX_LINES})"
    return out


def report() -> str:
    g = graph()
    comps = sccs(g)
    lines = [f"{len(g)} modules, {sum(len(v) for v in g.values())} import edges",
             f"strongly connected components (size > 1): {len(comps)}, sizes {[len(c) for c in comps]}"]
    lines += [f"  {len(c)}: {', '.join(c)}" for c in comps]
    lv = layer_violations(g)
    lines.append(f"layer violations: {len(lv)}")
    lines += [f"  {d}" for _, d in lv]
    lm = long_modules()
    lines.append(f"modules over {MAX_LINES} lines: {len(lm)}")
    lines += [f"  {m} has {n} lines" for m, n in lm.items()]
    return "\n".join(lines)


def test_no_violations():
    found = problems()
    assert not found, ("architecture violations (see docs/architecture.md):\n"
                       + "\n".join(f"{k}: {v}" for (k, _), v in sorted(found.items())) + "\n\n" + report())


def test_graph_sees_function_level_imports():
    """The parser must count an import inside a function body (the kind that hid the cli <-> commands cycle)."""
    tree = ast.parse("def f():\n    from dsconv.cli import warn\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, "dsconv.shard.write", False, {"dsconv.cli"}) == ["dsconv.cli"]
    assert layer_violations({"dsconv.io.writer": {"dsconv.quant.plan.plan"}, "dsconv.quant.plan.plan": set()}) == [
        ("layer", "dsconv.io.writer (1) imports dsconv.quant.plan.plan (4)")]
    assert layer_violations({"dsconv.shard.plan": {"dsconv.atc.profiles"}, "dsconv.atc.profiles": set()}) == [
        ("layer", "dsconv.shard.plan (4) imports dsconv.atc.profiles (4)")]  # a stage importing another stage
    assert layer_violations({"dsconv.newthing": set()}) == [("unplaced", "dsconv.newthing")]
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sccs(g) == [["a", "b", "c"]]
    assert a_cycle(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]


# ------------------------------------------------------------------------------------ the repository stands alone
# Someone who clones the repository has nothing beside it: no notes directory, no sibling checkout, not our home
# directories. A fact the code relies on is written in docs/ (or where it is used), in our words; a pointer names a
# file of the repository or an upstream project's path. (The patterns are spelt so that this file does not match
# them itself.)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".json", ".cfg", ".sh", ".yml", ".yaml", ".ini", ".jsonl"}
TEXT_NAMES = {"Makefile", "run", ".gitignore"}
NOT_SCANNED = {"tests/golden_outputs.json"}  # sha256 hashes only
# the one allowed reference: CI hands make engine-check the MindIE-LLM source archive kept beside the checkout
ALLOWED_OUTSIDE = {".ci/run": re.compile(r"\.\./shared/engines\b")}
OUTSIDE = [
    (re.compile(r"\.\./+(?:shared|notes|reference)\b"), "a directory beside the checkout"),
    (re.compile(r"(?<![\w.-])/(?:work|home|root|Users)/\w"), "a path on a developer's machine"),
    (re.compile(r"(?<![\w./-])(?:shared|notes|reference)/[\w./-]*\.(?:md|py|json|txt)\b"),
     "the notes beside the checkout"),
]
BARE_DOC = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")   # a markdown file named without a directory: must be ours
DOCS_PATH = re.compile(r"(?<![\w.-])(docs/[\w./-]*\.md)\b")   # docs/...: must exist

def repo_files() -> list[str]:
    """The repository's text files (tracked, or new and not ignored), relative to its root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, timeout=60, check=True).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an sdist): every file but caches
        names = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                            for part in p.relative_to(ROOT).parts[:-1])]
    return sorted(n for n in names if (Path(n).suffix in TEXT_SUFFIXES or Path(n).name in TEXT_NAMES)
                  and n not in NOT_SCANNED and (ROOT / n).is_file())


def outside_references(files: list[str] | None = None) -> dict[str, list[str]]:
    """file -> the lines that point outside the repository (with what they point at)."""
    files = repo_files() if files is None else files
    doc_names = {Path(n).name for n in repo_files() if n.endswith(".md")}
    found: dict[str, list[str]] = defaultdict(list)
    for name in files:
        for no, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            allowed = ALLOWED_OUTSIDE.get(name)
            hits = [why for rx, why in OUTSIDE if rx.search(line) and not (allowed and allowed.search(line))]
            hits += [f"{m} is not a file of the repository" for m in BARE_DOC.findall(line) if m not in doc_names]
            hits += [f"{m} does not exist" for m in DOCS_PATH.findall(line) if not (ROOT / m).is_file()]
            found[name] += [f"{name}:{no}: {why}: {line.strip()[:160]}" for why in hits]
    return {k: v for k, v in found.items() if v}


def test_nothing_points_outside_the_repository():
    unexpected = [line for _, lines in sorted(outside_references().items()) for line in lines]
    assert not unexpected, "references to files outside the repository (state the fact in docs/ instead):\n" + \
        "\n".join(unexpected)


def test_the_outside_check_sees_what_it_must(tmp_path, monkeypatch):
    """The patterns catch each way a pointer has leaked before, and leave upstream paths and our docs alone."""
    bad = ["see ../" + "sha" + "red/fixtures/x.py", "(/" + "work/notes/rules" + ".md A.1)",
           "shared" + "/reference/socs" + ".md", "the layers of " + "DESIGN" + ".md", "reference" + "/format" + ".md",
           "(cluster_config" + ".md)", "docs/" + "missing_page" + ".md"]
    good = ["MindIE-LLM examples/models/deepseek-v3/README.md", "docs/architecture.md", "a shared/routed expert",
            "an fp32 reference/emulation", "~/.cache/dsconv-fixtures", "/tmp/dsconv-demo", "README.md"]
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text("")
    (tmp_path / "README.md").write_text("")
    for i, text in enumerate(bad + good):
        (tmp_path / f"f{i}.py").write_text(text + "\n")
    found = outside_references([f"f{i}.py" for i in range(len(bad + good))])
    assert sorted(found) == sorted(f"f{i}.py" for i in range(len(bad))), found


# ---------------------------------------------------------------------------------------------- test markers
def module_marks(path: Path) -> set[str]:
    """The `pytest.mark.X` names of a test module's `pytestmark`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                    marks.add(sub.attr)
    return marks


def test_every_test_module_has_one_category():
    """`unit` or `cli` (exactly one) on every test module, so `-m unit`, `-m cli`, `make test` and `make test-slow`
    see them all; the markers are registered in pyproject.toml."""
    wrong = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        marks = module_marks(path)
        if len(marks & {"unit", "cli"}) != 1:
            wrong[path.relative_to(ROOT).as_posix()] = sorted(marks)
    assert not wrong, f"test modules without exactly one of unit/cli in pytestmark: {wrong}"


if __name__ == "__main__":
    print(report())
    sys.exit(0)


def model_type_literals(paths: dict[str, Path] | None = None) -> list[str]:
    """String constants equal to a registered model_type anywhere in dsconv/ outside families/: a family decision
    made elsewhere (the family table and its attributes are the one place that knows model types)."""
    from dsconv.families import supported_model_types

    types = set(supported_model_types())
    found = []
    for mod, path in (modules() if paths is None else paths).items():
        if mod.startswith("dsconv.families"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in types:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_no_model_type_decisions_outside_families():
    assert model_type_literals() == []


def test_model_type_literal_check_sees_one(tmp_path):
    """The check above would catch a literal: a module comparing against "deepseek_v3" is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text('def f(c):\n    return c.model_type == "deepseek_v3"\n')
    assert model_type_literals({"dsconv.shard.probe": probe}) == ["probe.py:2: 'deepseek_v3'"]


def private_imports(paths: dict[str, Path] | None = None) -> list[str]:
    """`from dsconv.x import _name` anywhere in dsconv/: a module reaching into another's private parts (make the
    name public, with a docstring saying what it is for, or move the code)."""
    found = []
    for mod, path in (modules() if paths is None else paths).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsconv"):
                found += [f"{path.name}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_names_imported_across_modules(tmp_path):
    assert private_imports() == []
    probe = tmp_path / "probe.py"
    probe.write_text("from dsconv.quant.algorithms.schemes import _MIN_SCALE\n")
    assert private_imports({"dsconv.probe": probe}) == ["probe.py:1: dsconv.quant.algorithms.schemes._MIN_SCALE"]


# quant/'s subpackages that must not see each other: what both need lives in dsconv.runner (the layer runner, texts
# and tokenizer, the metrics), so a change to calibration cannot move an eval figure through a shared private path
APART = (("dsconv.quant.evaluate", "dsconv.quant.calibrate"), ("dsconv.quant.calibrate", "dsconv.quant.evaluate"))


def crossings(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{mod} imports {dep}" for mod, deps in g.items() for dep in deps for a, b in APART
                  if (mod == a or mod.startswith(a + ".")) and (dep == b or dep.startswith(b + ".")))


def test_eval_and_calibration_share_only_the_runner():
    assert crossings(graph()) == []
    assert crossings({"dsconv.quant.evaluate.fidelity": {"dsconv.quant.calibrate.data"}}) == [
        "dsconv.quant.evaluate.fidelity imports dsconv.quant.calibrate.data"]
