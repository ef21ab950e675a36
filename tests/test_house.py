"""The house rules, kept by tests: the architecture map names only files that exist, and
every module of the package has its place in it."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def test_architecture_map_names_only_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:comlrl|workers|tests|deploy|examples|benchmarks)/[\w/.-]+)`",
                           text))
    assert len(named) >= 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def _ownership_map() -> list[tuple[str, str]]:
    """(concern, file) rows of docs/architecture.md's "Who owns what" table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    return [tuple(cell.strip() for cell in row.strip("|").rsplit("|", 1)) for row in rows]


def _package_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for folder in ("comlrl", "workers")
                  for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py")


def test_the_architecture_map_maps_every_concern_to_one_file_and_every_file_to_one_concern():
    """Issue 36 replaced a 450-line cap (files were trimmed to pass it instead of split by
    concern) with what it stood for, checked both ways: each row of the map names one
    concern and exactly one file, each module of the package is named in exactly one row,
    and no row names a file that is not a module. (Package `__init__` files hold no concern
    of their own.)"""
    rows = _ownership_map()
    assert len(rows) >= 30, "the table was not found"
    named = []
    for concern, cell in rows:
        files = re.findall(r"`([\w/.-]+\.py)`", cell)
        assert len(files) == 1 and cell == f"`{files[0]}`", f"one file per concern: {cell}"
        assert len(concern) > 10, f"say what {cell} owns"
        named.append(files[0])
    twice = sorted({f for f in named if named.count(f) > 1})
    assert not twice, f"these files hold more than one concern in the map: {twice}"
    modules = _package_modules()
    assert not sorted(set(modules) - set(named)), \
        f"name these in docs/architecture.md with their concern: {sorted(set(modules) - set(named))}"
    assert not sorted(set(named) - set(modules)), \
        f"the map names files that are not modules: {sorted(set(named) - set(modules))}"


def _package_imports() -> dict[str, set[str]]:
    """Every package module and the package modules it imports, at any depth of the file
    (imports inside functions too). `from a.b import c` is an import of module `a.b.c` when
    that is a module, else of `a.b`; the parent packages Python initialises on the way are
    not counted (they are imported by every submodule and hold only re-exports)."""
    import ast

    modules = {}
    for folder in ("comlrl", "workers"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else known(base))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_no_import_cycle_among_package_modules():
    """Issue 36: one dependency order. A cycle (seven `workers/` modules once imported each
    other, hidden by imports inside functions) means no module can be read, tested or moved
    without the others; this finds every strongly connected group of two or more."""
    graph = _package_imports()
    assert len(graph) >= 30 and graph["workers.driver.session"], "the import parser found nothing"
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:              # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append({m: sorted(graph[m] & set(group)) for m in sorted(group)})

    for module in sorted(graph):
        if module not in order:
            visit(module)
    assert not cycles, f"import cycles (module -> the members it imports): {cycles}"


LAYERS = [
    ("comlrl",),
    ("workers.engines", "workers.checkpoint_write", "workers.model_source", "workers.console",
     "workers.ray_calls"),
    ("workers.transports",),
    ("workers.roles",),
    ("workers.driver",),
    ("workers.runtime", "workers.cli"),
]
"""docs/architecture.md's dependency order, lowest first: a module imports only its own
layer and those below."""

HEAVY = {"ray", "torch", "vllm", "transformers", "wandb", "datasets", "safetensors", "numpy",
         "tokenizers", "xxhash", "peft", "psutil", "yaml", "matplotlib", "tqdm", "huggingface_hub"}
"""Third-party modules slow enough to import that a module imports them where it uses them."""
PLATFORM_ONLY = {"fcntl"}
"""Standard modules some platforms lack (Windows has no fcntl): imported where used."""


def _layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} has no layer: add it to LAYERS and docs/architecture.md")


def _imports_in_functions(path) -> list[tuple[int, str]]:
    import ast

    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and id(node) not in top:
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and id(node) not in top and not node.level:
            found.append((node.lineno, node.module))
    return found


def test_each_layer_imports_only_the_layers_below_it():
    """Issue 36: `comlrl/` below `workers/`, shared helpers below transports, transports
    below the actor roles, roles below the driver. The one way up is the trainer's call of
    the runtime's facade (`workers.runtime`), made inside the methods that start Ray work."""
    upward = []
    for module, targets in sorted(_package_imports().items()):
        for target in sorted(targets):
            if _layer(target) <= _layer(module):
                continue
            if module.startswith("comlrl.") and target == "workers.runtime":
                continue
            upward.append(f"{module} -> {target}")
    assert not upward, f"imports against the layer order: {upward}"


def test_imports_inside_functions_are_of_heavy_modules_or_the_runtime_facade():
    """Issue 36: "lazy imports only where an import is heavy (say which)". Inside a function
    a module may import only a heavy third-party module (`HEAVY`), one a platform may lack
    (`PLATFORM_ONLY`), or, from `comlrl/`, the runtime's facade; everything else goes at the
    top, where the dependency order is visible."""
    found = []
    for folder in ("comlrl", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, name in _imports_in_functions(path):
                if name.split(".")[0] in HEAVY | PLATFORM_ONLY:
                    continue
                if folder == "comlrl" and name == "workers.runtime":
                    continue
                found.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not found, f"move these to the top of their module: {found}"


def test_no_function_runs_over_eighty_lines():
    """Issue 36: a function over ~80 lines holds more than one step; it is split where its
    steps are (the check counts the def line through the last, decorators excluded)."""
    import ast

    long = []
    for folder in ("comlrl", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > 80:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                    f"({length} lines)")
    assert not long, f"split these: {long}"


TIMING = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:CPU-s|ms|s|GB/s|MB/s)\b"
                    r"|\b\d+(?:\.\d+)?x (?:faster|slower)")


def test_package_comments_quote_no_timings():
    """Issue 36 and the guide: "Timings belong in BENCHMARKS.md, not in code comments" (one
    day's numbers go stale in code). Comments and docstrings of the package say why and
    point to BENCHMARKS.md; string literals that are not docstrings (messages) are not
    checked, nor are numbers that are settings (a timeout of 60 s is `timeout=60`)."""
    import ast
    import io
    import tokenize

    found = []
    for folder in ("comlrl", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            texts = [(tok.start[0], tok.string) for tok in
                     tokenize.generate_tokens(io.StringIO(source).readline)
                     if tok.type == tokenize.COMMENT]
            for node in ast.walk(ast.parse(source)):
                body = getattr(node, "body", None)
                if isinstance(body, list):
                    for stmt in body:
                        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                                and isinstance(stmt.value.value, str):
                            texts.append((stmt.lineno, stmt.value.value))
            for line, text in texts:
                for match in TIMING.finditer(text):
                    found.append(f"{path.relative_to(ROOT)}:{line} {match.group(0)!r}")
    assert not found, f"timings in comments (move them to BENCHMARKS.md): {found}"
