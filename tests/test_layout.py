"""The layout's rules, read from the source (no imports run; ~0.5 s for all): imports point down;
no import cycle, at module level or through functions (eagle3/ imports inside functions only
where LAZY_IMPORTS says why); no private name crosses a module boundary;
loading a checkpoint pulls in no decoding loop; the draft method is compared by name (or asked
which it is) only in its registry; the README's layout map names every module and nothing that
is gone; no file is over 600 lines nor function over 80; datagen/ and train/ import the project
inside a function only under a comment saying why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eagle3.methods import METHODS

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("eagle3", "datagen", "train")
# eagle3/ read top-down: a module imports (at module level) only its own layer and those below;
# the draft's layer belongs with the model, a method's own draft with the methods, and a method's
# own drafter (eagle3/methods/<name>/decoding.py) with the decoders
LAYERS = (
    ("eagle3.evaluation",),
    ("eagle3.engine",),
    ("eagle3.decoding",),
    ("eagle3.checkpoint",),
    ("eagle3.methods",),
    ("eagle3.model", "eagle3.layers"),
)


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def parse(packages: tuple[str, ...]) -> dict[str, ast.Module]:
    return {
        module_name(p): ast.parse(p.read_text(), str(p))
        for package in packages
        for p in sorted((REPO / package).rglob("*.py"))
    }


@pytest.fixture(scope="module")
def modules() -> dict[str, ast.Module]:
    return parse(PRODUCT)


# Function-level imports of project modules in eagle3/ (importer, imported) and why each waits;
# every other project import in eagle3/ is at the top of its module (or under TYPE_CHECKING)
LAZY_IMPORTS = {
    ("eagle3.methods.eagle3", "eagle3.decoding.eagle"): "the method names its in-house drafter; "
    "loading a checkpoint or training imports no decoding loop",
    ("eagle3.methods.p_eagle", "eagle3.methods.p_eagle.decoding"): "as EAGLE-3's drafter",
}


def imported(name: str, tree: ast.Module, known: dict, top_only: bool) -> set[str]:
    """The product modules `name` imports (module level only, or anywhere)."""
    nodes = tree.body if top_only else list(ast.walk(tree))
    return imports_in(name, nodes, known)


def imported_in_functions(name: str, tree: ast.Module, known: dict) -> set[str]:
    """The product modules `name` imports inside a function or method."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return imports_in(name, [n for f in functions for n in ast.walk(f)], known)


def imports_in(name: str, nodes: list[ast.AST], known: dict) -> set[str]:
    """The product modules the import statements among `nodes` (of module `name`) name."""
    is_package = (REPO / name.replace(".", "/") / "__init__.py").is_file()
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts) + (f".{base}" if base else "")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def is_decoder(name: str) -> bool:
    """A decoding module: eagle3.decoding's, or a method's own drafter."""
    return name.startswith("eagle3.decoding") or re.fullmatch(
        r"eagle3\.methods\.\w+\.decoding", name
    )


def layer_of(name: str) -> int | None:
    if is_decoder(name):
        return LAYERS.index(("eagle3.decoding",))
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_eagle3_layers_import_downward(modules):
    up = [
        f"{name} -> {dep}"
        for name, tree in modules.items()
        if layer_of(name) is not None
        for dep in imported(name, tree, modules, top_only=True)
        if layer_of(dep) is not None and layer_of(dep) < layer_of(name)
    ]
    assert not up, "imports pointing up the layers of eagle3/: " + "; ".join(up)


def test_no_module_level_import_cycle(modules):
    graph = {name: imported(name, tree, modules, top_only=True) for name, tree in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_eagle3_imports_inside_functions_only_where_listed(modules):
    """A project import inside a function of eagle3/ hides an edge of the import graph: each
    one is in LAZY_IMPORTS with its reason (an optional third-party dependency may wait freely)."""
    lazy = {
        (name, dep)
        for name, tree in modules.items()
        if name.startswith("eagle3.")
        for dep in imported_in_functions(name, tree, modules)
    }
    assert lazy == set(LAZY_IMPORTS), (
        f"unlisted: {sorted(lazy - set(LAZY_IMPORTS))}; gone: {sorted(set(LAZY_IMPORTS) - lazy)}"
    )


def project_imports_in_functions(tree: ast.Module) -> set[ast.stmt]:
    """The import statements inside functions that name a project package."""
    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name.split(".")[0] in PRODUCT for name in names):
                found.add(node)
    return found


def says_why(lines: list[str], node: ast.stmt) -> bool:
    """A comment right above the import block `node` stands in (its other imports skipped)."""
    above = node.lineno - 2
    while above >= 0 and (
        not lines[above].strip()
        or lines[above].lstrip().startswith(("import ", "from ", ")"))
        or lines[above].rstrip().endswith(",")  # a name of a parenthesised import
    ):
        above -= 1
    return above >= 0 and lines[above].lstrip().startswith("#")


def test_datagen_and_train_import_the_project_inside_functions_under_a_comment():
    """Outside eagle3/ (whose lazy edges LAZY_IMPORTS lists), a project import inside a function
    waits for a reason (torch not loaded on a path that never needs it): the comment right
    above its import block says which."""
    bare = []
    for package in ("datagen", "train"):
        for path in sorted((REPO / package).rglob("*.py")):
            text = path.read_text()
            lines = text.splitlines()
            for node in project_imports_in_functions(ast.parse(text)):
                if not says_why(lines, node):
                    bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, "project imports inside functions, no comment says why: " + ", ".join(bare)


def test_no_import_cycle_even_through_functions(modules):
    """Counting the imports inside functions too, there is no cycle: the decoders are reached
    from the methods, never the reverse, and the model never calls up into the registry."""
    graph = {
        name: imported(name, tree, modules, top_only=True)  # TYPE_CHECKING's run no code
        | imported_in_functions(name, tree, modules)
        for name, tree in modules.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:  # on the path: a cycle back to it
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_no_private_name_is_imported_across_modules(modules):
    crossing = [
        f"{name}: from {node.module} import {alias.name}"
        for name, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not crossing, "private names imported across modules: " + "; ".join(crossing)


def test_loading_a_checkpoint_imports_no_decoding_loop(modules):
    graph = {name: imported(name, tree, modules, top_only=True) for name, tree in modules.items()}
    seen, todo = set(), ["eagle3.checkpoint", "eagle3.methods", "eagle3.published"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert not {m for m in seen if is_decoder(m)}


def test_the_method_is_compared_by_name_only_in_its_registry(modules):
    """A comparison of something named *method* with a method's name outside eagle3/methods/
    is a dispatch the registry should own (method_of(cfg).<what differs>)."""
    found = []
    for name, tree in {**modules, **parse(("scripts",))}.items():
        if name.startswith("eagle3.methods"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = {c.value for c in sides if isinstance(c, ast.Constant)} & set(METHODS)
            if names and any("method" in ast.unparse(s) for s in sides):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "method names compared outside the registry: " + "; ".join(found)


# the facts a method object answers (eagle3/methods/); reading one outside the registry is a
# question about which method this is, which the method should answer itself
KIND_FLAGS = {"parallel"}
# (module, the source of the node): asking which method it is, where no method object can answer
WHICH_METHOD_ALLOWED = {
    # the default method's run folder keeps its historical name train/ (README, docs, tests name
    # it): a folder name, not behaviour
    ("scripts.quickstart", "args.method == DEFAULT_METHOD"),
    # speculators' model type of a published drafter, which is also EAGLE-3's name: not ours
    ("eagle3.published", "kind != 'eagle3'"),
}


def asks_which_method(node: ast.AST) -> bool:
    """A node that tests a method's kind: a kind flag read off an object, a comparison with a
    method's name (a literal, in a literal tuple/list/set, or DEFAULT_METHOD), or an
    isinstance check against a method class."""
    if isinstance(node, ast.Attribute):
        return node.attr in KIND_FLAGS
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            if any(isinstance(c, ast.Constant) and c.value in METHODS for c in items):
                return True
            if isinstance(side, ast.Name) and side.id == "DEFAULT_METHOD":
                return True
        return False
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and node.args[1:]:
        return ast.unparse(node.args[1]).endswith("Method")
    return False


def test_no_product_file_outside_the_methods_asks_which_method_it_has(modules):
    """Code outside eagle3/methods/ asks the method object (method_of(cfg).<fact>, e.g.
    drafts_trees, ttt_unroll, served_extra(), own_tensors): it never reads a kind flag such as
    `.parallel`, compares with a method's name, or tests a method's class."""
    trees = {**modules, **parse(("scripts", "benchmarks"))}
    found = [
        f"{name}:{node.lineno}: {ast.unparse(node)}"
        for name, tree in trees.items()
        if not name.startswith("eagle3.methods")
        for node in ast.walk(tree)
        if asks_which_method(node) and (name, ast.unparse(node)) not in WHICH_METHOD_ALLOWED
    ]
    assert not found, "asking which method it is outside eagle3/methods/: " + "; ".join(found)


def test_the_which_method_allow_list_names_only_what_is_there(modules):
    """Each WHICH_METHOD_ALLOWED entry is still in its module (a stale one is removed)."""
    trees = {**modules, **parse(("scripts",))}
    present = {(name, ast.unparse(n)) for name, tree in trees.items() for n in ast.walk(tree)}
    assert WHICH_METHOD_ALLOWED <= present, WHICH_METHOD_ALLOWED - present


def readme_map() -> tuple[set[str], set[str]]:
    """The README layout table's last column: (files named, folders named without a file list).
    A path starts at a top-level folder; a bare name is in the folder named last before it."""
    table = (REPO / "README.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    files, whole = set(), set()
    for row in (line for line in table.splitlines() if line.startswith("| ")):
        folder, listed = "", False
        for token in re.findall(r"`([^`]+)`", row.split("|")[-2]):
            if token.split("/")[0] in {*PRODUCT, "configs", "scripts", "benchmarks",
                                       "experiments", "docs", "results", "tests"}:  # fmt: skip
                if folder and not listed:
                    whole.add(folder)
                folder, listed = token.rpartition("/")[0] + "/", not token.endswith("/")
                files.add(token)
            else:
                (whole if token.endswith("/") else files).add(folder + token)
                listed = True
        if folder and not listed:
            whole.add(folder)
    return files, whole


def test_the_readme_layout_map_names_every_module():
    files, whole = readme_map()
    unnamed = [
        str(p.relative_to(REPO))
        for package in PRODUCT
        for p in sorted((REPO / package).rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py")
        and str(p.relative_to(REPO)) not in files
        and not any(str(p.relative_to(REPO)).startswith(w) for w in whole)
    ]
    absent = [f for f in sorted(files) if "*" not in f and "$" not in f and not (REPO / f).exists()]
    assert not unnamed, "modules the README's layout map does not name: " + ", ".join(unnamed)
    assert not absent, "the README's layout map names what is not there: " + ", ".join(absent)


# Sizes a newcomer can read: every product file (benchmarks, experiments and scripts included)
SIZED = (*PRODUCT, "benchmarks", "experiments", "scripts")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # def line to last line, docstring included


def sized_sources() -> dict[str, str]:
    return {
        p.relative_to(REPO).as_posix(): p.read_text()
        for package in SIZED
        for p in sorted((REPO / package).rglob("*.py"))
    }


def test_no_product_file_is_over_600_lines():
    lengths = {rel: len(text.splitlines()) for rel, text in sized_sources().items()}
    long = sorted(f"{rel} ({n})" for rel, n in lengths.items() if n > MAX_FILE_LINES)
    assert not long, f"over {MAX_FILE_LINES} lines: split by concept: " + "; ".join(long)


def test_no_function_is_over_80_lines():
    lengths = {
        f"{rel}:{node.name}": node.end_lineno - node.lineno + 1
        for rel, text in sized_sources().items()
        for node in ast.walk(ast.parse(text, rel))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    long = sorted(f"{name} ({n})" for name, n in lengths.items() if n > MAX_FUNCTION_LINES)
    assert not long, f"over {MAX_FUNCTION_LINES} lines: extract named helpers: " + "; ".join(long)
