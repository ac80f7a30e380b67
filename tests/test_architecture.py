"""The package's shape: imports point one way between layers, no module imports itself back, functions do one
thing, and the model's forwards read no flags."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from cflib.paths import project_root

PACKAGE = project_root() / "cflib"
# Higher may import lower, never the other way; model and data share a rank and import neither each other.
# jobs, the skeleton every job shares, and schema, the parameter schema, are foundation too, built on errors
# (and paths, yamlio); locks, one writer per folder, builds on atomic; yamlio reads its files through jsonio's
# bounded file reader.
LAYERS = {"errors": 0, "atomic": 0, "paths": 0, "yamlio": 0.25, "jsonio": 0, "locks": 0.25, "jobs": 0.5, "schema": 0.5,
          "lazy": 0, "progress": 0, "seeds": 0,
          "ops": 1, "model": 2, "data": 2, "export": 3, "train": 4, "bench": 5, "lab": 6}
# A function longer than this does more than one thing: split it. The few that are longer today may not grow,
# and leave this list when they are split.
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS = {"cflib.bench.decode.run_bench": 74}
# Where the fast paths live as module classes (cflib.model.fast): no forward may branch on a string flag.
MODEL_PACKAGE = "cflib.model"
# Copied verbatim into exported bundles and run by transformers there: they import no cflib code.
NOT_CFLIB_CODE = ("export/hub_modules",)
TESTS = project_root() / "tests"
# Research probes beside the package, not in it: they import cflib, cflib never imports them.
BENCHMARKS = project_root() / "benchmarks"
# Two modules of one name in the package (cflib/x/name.py and cflib/y/name.py) read as one in a traceback or a
# search; none may.
SHARED_MODULE_NAMES: set[str] = set()
# Each op is tested beside its reference alone: what measures or trains with the ops is tested with them.
NOT_IN_OP_TESTS = ("cflib.bench", "cflib.train")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cflib_sources() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))
            if not any(part in path.relative_to(PACKAGE).as_posix() for part in NOT_CFLIB_CODE)}


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Every cflib module `path` imports, at its top, inside a function or for type checkers only (a type names
    its module as an import does), resolved to a module (not a name)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                       for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: relative import; cflib imports by absolute module path")
        else:
            continue
        found.update(target for target in targets if target in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules loading it loads. A module in another package also loads that package's face."""
    sources = cflib_sources()
    graph = {}
    for name, path in sources.items():
        edges = set()
        for target in imported_modules(path, set(sources)):
            edges.add(target)
            package = ".".join(target.split(".")[:2])
            if package != ".".join(name.split(".")[:2]) and package in sources:
                edges.add(package)
        graph[name] = edges - {name}
    for name in sources:  # a package's face loads its submodules only through its own imports, counted above
        graph.setdefault(name, set())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer(module: str) -> tuple[str, float]:
    top = module.split(".")[1] if "." in module else "cflib"
    return top, LAYERS.get(top, 0)


def test_no_import_cycle_inside_cflib():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}) == ["a2", "b", "a2"]


def test_imports_point_down_the_layers():
    wrong = []
    for module, targets in import_graph().items():
        package, rank = layer(module)
        for target in targets:
            target_package, target_rank = layer(target)
            if target_package != package and target_rank >= rank:
                wrong.append(f"{module} imports {target} ({package} is layer {rank}, {target_package} {target_rank})")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_placed_in_a_layer():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    top_modules = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    assert packages | top_modules <= set(LAYERS), f"not in LAYERS: {sorted(packages | top_modules - set(LAYERS))}"


def function_lengths(path: Path, module: str) -> dict[str, int]:
    """module.function (methods by their class: module.Class.method) -> its length in lines."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{prefix}.{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
    visit(ast.parse(path.read_text()), module)
    return found


def test_functions_do_one_thing():
    too_long = {}
    for module, path in cflib_sources().items():
        for name, lines in function_lengths(path, module).items():
            limit = LONG_FUNCTIONS.get(name, MAX_FUNCTION_LINES)
            if lines > limit:
                too_long[name] = f"{lines} lines (at most {limit})"
    assert not too_long, f"split these by what they do: {too_long}"


def test_benchmark_functions_do_one_thing_too():
    too_long = {f"{path.relative_to(BENCHMARKS.parent)}:{name}": lines
                for path in sorted(BENCHMARKS.rglob("*.py"))
                for name, lines in function_lengths(path, path.stem).items() if lines > MAX_FUNCTION_LINES}
    assert not too_long, f"split these by what they do: {too_long}"


def test_the_long_function_list_names_only_long_functions():
    lengths = {name: lines for module, path in cflib_sources().items()
               for name, lines in function_lengths(path, module).items()}
    stale = {name: lengths.get(name) for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES}
    assert not stale, f"no longer long (or gone): take them off LONG_FUNCTIONS: {stale}"


def string_flag_branches(path: Path) -> list[str]:
    """`self.<attr> == "..."` (or !=, in) inside a forward-path method: a flag read where a class should choose."""
    found = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or method.name.startswith("__"):
                continue
            for node in ast.walk(method):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                reads_self = any(isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name)
                                 and side.value.id == "self" for side in sides)
                names_string = any(isinstance(side, ast.Constant) and isinstance(side.value, str) for side in sides)
                if reads_self and names_string:
                    found.append(f"{path.name}:{node.lineno} {cls.name}.{method.name}")
    return found


def test_no_model_method_branches_on_a_string_flag():
    found = [hit for name, path in cflib_sources().items() if name.startswith(MODEL_PACKAGE)
             for hit in string_flag_branches(path)]
    assert not found, f"choose the implementation by class (cflib.model.fast.use_kernels), not by flag: {found}"


def test_the_flag_check_finds_the_old_pattern(tmp_path):
    source = tmp_path / "old.py"
    source.write_text("class Norm:\n    def forward(self, x):\n        if self.backend == 'liger':\n"
                      "            return x\n        return -x\n")
    assert string_flag_branches(source) == ["old.py:3 Norm.forward"]
    source.write_text("class Norm:\n    def forward(self, x):\n        return x if x.dtype == 'x' else -x\n")
    assert string_flag_branches(source) == []


def test_cflib_never_imports_the_benchmarks():
    probes = {"benchmarks", *(path.stem for path in BENCHMARKS.rglob("*.py"))}
    assert len(probes) > 2, "no probes found under benchmarks/"
    wrong = {name: sorted(found) for name, path in cflib_sources().items()
             if (found := {target.split(".")[0] for target in imported_names(path)} & probes)}
    assert not wrong, f"cflib imports research probes (benchmarks/ imports cflib, never the other way): {wrong}"


def test_no_two_modules_of_the_package_share_a_name():
    names: dict[str, list[str]] = {}
    for module, path in cflib_sources().items():
        if path.stem not in ("__init__", "__main__"):  # a package's face and its command share by design
            names.setdefault(path.stem, []).append(module)
    shared = {name: modules for name, modules in names.items() if len(modules) > 1}
    assert set(shared) <= SHARED_MODULE_NAMES, f"rename one of each: {dict(sorted(shared.items()))}"
    assert SHARED_MODULE_NAMES <= set(shared), (
        f"no longer shared: take them off SHARED_MODULE_NAMES: {sorted(SHARED_MODULE_NAMES - set(shared))}")


ARCHITECTURE_PAGE = project_root() / "docs" / "architecture.md"
FOUNDATION = ("errors", "atomic", "paths", "yamlio", "jsonio", "locks", "jobs", "schema", "lazy", "progress", "seeds")


def layer_table(text: str) -> dict[str, tuple[str, str]]:
    """The architecture page's table of packages: its first cell (`cflib.ops`, foundation) -> (owns, may import)."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("package", "---"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def undocumented_modules(text: str) -> dict[str, list[str]]:
    """Each package's modules its row of the page does not name (as `module`)."""
    table = layer_table(text)
    missing = {}
    packages = {"foundation": list(FOUNDATION)} | {
        f"cflib.{path.name}": sorted(p.stem for p in path.glob("*.py") if p.stem not in ("__init__", "__main__"))
        for path in sorted(PACKAGE.iterdir()) if (path / "__init__.py").is_file()}
    for package, modules in packages.items():
        named = set(re.findall(r"`([a-z_]+)(?:/|`)", table.get(package, ("", ""))[0]))
        if absent := [module for module in modules if module not in named]:
            missing[package] = absent
    return missing


def test_the_architecture_page_names_every_module_of_every_package():
    assert not undocumented_modules(ARCHITECTURE_PAGE.read_text()), undocumented_modules(ARCHITECTURE_PAGE.read_text())


def test_the_architecture_page_says_what_each_package_may_import_as_the_layers_and_the_imports_do():
    """What the page lets a package import lies below it, and holds every package it does import."""
    table, graph = layer_table(ARCHITECTURE_PAGE.read_text()), import_graph()
    for package, (_, may_import) in table.items():
        if package == "foundation" or "every layer below" in may_import:
            continue
        top, rank = layer(package)
        below = {name for name, other in LAYERS.items() if other < rank and name not in FOUNDATION} - {top}
        said = set(re.findall(r"\b[a-z]+\b", may_import)) - {"foundation"}
        imported = {layer(target)[0] for module, targets in graph.items() if layer(module)[0] == top
                    for target in targets} - {top, "cflib", *FOUNDATION}
        assert imported <= said <= below, (f"{package} imports {sorted(imported)} and may import {sorted(below)}; "
                                           f"the page says {may_import!r}")


def test_the_page_check_finds_an_unnamed_module():
    page = "| package | owns | may import |\n| --- | --- | --- |\n| `cflib.ops` | `loss`, `attention` | foundation |\n"
    assert "dispatch" in undocumented_modules(page)["cflib.ops"] and "loss" not in undocumented_modules(page)["cflib.ops"]


def test_each_package_says_what_it_owns_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc.lower(), f"{init}: the docstring says what the package owns and what it may import"


def imported_names(path: Path) -> set[str]:
    """Every module `path` imports by absolute name, anywhere in it; `from a import b` counts as a and a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def forbidden_imports(test_dir: Path, helpers: Path, forbidden: tuple[str, ...]) -> list[str]:
    """Each import of a `forbidden` package by a test file under test_dir, or by a helper module of `helpers`
    (tests/tiny_models.py, ...) that it imports, however indirectly."""
    wrong = []
    for start in sorted(test_dir.rglob("*.py")):
        seen, queue = {start}, [start]
        while queue:
            path = queue.pop()
            for name in sorted(imported_names(path)):
                if any(name == package or name.startswith(package + ".") for package in forbidden):
                    via = "" if path == start else f" (through {path.name})"
                    wrong.append(f"{start.relative_to(test_dir.parent)} imports {name}{via}")
                helper = helpers / f"{name}.py"
                if helper.is_file() and helper not in seen:
                    seen.add(helper)
                    queue.append(helper)
    return sorted(set(wrong))


def test_op_tests_import_neither_bench_nor_train():
    assert sorted((TESTS / "ops").glob("test_*.py")), "no op tests found"
    wrong = forbidden_imports(TESTS / "ops", TESTS, NOT_IN_OP_TESTS)
    assert not wrong, "tests/ops/ tests each op beside its reference; move these to tests/bench/ or tests/train/:\n" \
        + "\n".join(wrong)


def test_the_op_test_check_finds_imports_in_functions_and_helpers(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "test_a.py").write_text("import torch\n\ndef test():\n    from cflib.train import prepare\n")
    (tmp_path / "ops" / "test_b.py").write_text("from helper import x\nfrom cflib import ops\n")
    (tmp_path / "ops" / "test_c.py").write_text("from cflib.ops.loss import IGNORE_INDEX\nimport cflib.trainer_notes\n")
    (tmp_path / "helper.py").write_text("from cflib import bench\n")
    assert forbidden_imports(tmp_path / "ops", tmp_path, NOT_IN_OP_TESTS) == [
        "ops/test_a.py imports cflib.train", "ops/test_a.py imports cflib.train.prepare",
        "ops/test_b.py imports cflib.bench (through helper.py)"]


def pyflakes_warnings(paths: list[Path]) -> list[str]:
    """pyflakes' warnings on every .py file under `paths`, but for lines marked `# noqa` (an import kept for its
    side effect, or to check that a package imports)."""
    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter

    class Collect(Reporter):
        def __init__(self) -> None:
            self.found: list[str] = []

        def unexpectedError(self, filename, msg) -> None:
            self.found.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text) -> None:
            self.found.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message) -> None:
            line = Path(message.filename).read_text().splitlines()[message.lineno - 1]
            if "# noqa" not in line:
                self.found.append(str(message))

    collect = Collect()
    checkRecursive([str(path) for path in paths], collect)
    return collect.found


def test_pyflakes_finds_nothing_in_the_package_its_tests_or_the_benchmarks():
    assert pyflakes_warnings([PACKAGE, TESTS, BENCHMARKS]) == []


def test_the_pyflakes_check_finds_a_redefinition_and_honours_noqa(tmp_path):
    (tmp_path / "m.py").write_text("import os  # noqa: F401\nimport sys\n\n\ndef f():\n    g = 1\n\n    def g():\n"
                                   "        return 2\n    return 3\n")
    found = pyflakes_warnings([tmp_path])
    assert len(found) == 2 and "'sys' imported but unused" in found[0] and "redefinition of unused 'g'" in found[1]
