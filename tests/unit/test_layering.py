"""Which way imports go between the shard side's packages, and no state in layers/ that code swaps at run time.

Layers (``gaudi_runtime/layers``) are device-agnostic building blocks: they call the kernels an attention
backend object gives them (``layers/attention_backend.py``), which the device backend chooses per model
(docs/design.md, "Runtime map"). So device code may import layers, never the reverse, and nothing in
layers is a module-level setting that code elsewhere overwrites. These checks read the source with
``ast`` (function-level imports and assignments included); they do not run it.
"""

from __future__ import annotations

import ast

from tests.unit.test_code_shape import PACKAGES, _cycles, _imports, _known_modules, _sources

LAYERS = "gaudi_runtime.layers"
DEVICE = "gaudi_runtime.device"
# The shard side's packages: together they must form no cycle (each one's modules as one node).
SHARD_SIDE = ("gaudi_runtime.layers", "gaudi_runtime.device", "gaudi_runtime.models", "gaudi_runtime.shard")


def _graph() -> dict[str, set[str]]:
    known = _known_modules()
    return {module: _imports(module, is_pkg, ast.parse(path.read_text()), known)
            for module, path, is_pkg in _sources()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _package_of(module: str) -> str | None:
    return next((p for p in SHARD_SIDE if _in(module, p)), None)


def test_layers_never_import_device_code():
    offenders = {m: sorted(i for i in deps if _in(i, DEVICE)) for m, deps in _graph().items() if _in(m, LAYERS)}
    assert not {m: d for m, d in offenders.items() if d}, "layers/ importing device/ (device depends on layers)"


def test_device_code_may_import_layers():
    """The allowed direction is used (the CPU's kernels and backends build on layers' interfaces): the check
    above is not vacuous because of a renamed package."""
    graph = _graph()
    assert any(_in(i, LAYERS) for m, deps in graph.items() if _in(m, DEVICE) for i in deps)
    assert any(_in(m, LAYERS) for m in graph) and any(_in(m, DEVICE) for m in graph)


def test_no_cycle_between_the_shard_side_packages():
    packages: dict[str, set[str]] = {p: set() for p in SHARD_SIDE}
    for module, deps in _graph().items():
        source = _package_of(module)
        if source is None:
            continue
        packages[source] |= {p for p in map(_package_of, deps) if p is not None and p != source}
    assert not _cycles(packages), f"package import cycles: {_cycles(packages)} (edges: {packages})"


def _layers_sources():
    return [(m, path) for m, path, _ in _sources() if _in(m, LAYERS)]


def test_layers_declare_no_global_statements():
    found = [f"{m}:{node.lineno}" for m, path in _layers_sources() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Global, ast.Nonlocal))]
    assert not found, f"`global` in layers/: {found}"


def _root_name(target: ast.expr) -> str | None:
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def _stores(tree: ast.AST):
    """(root name, line) of every assignment into an attribute or item (`a.b = ...`, `a[k] += ...`,
    `setattr(a, ...)`) anywhere in `tree`."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, (ast.Attribute, ast.Subscript)) and _root_name(leaf):
                    yield _root_name(leaf), node.lineno


def _function_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            names.add(node.name)
    return names


def test_layers_functions_never_write_into_module_level_objects():
    """Inside layers/, no function assigns into a module-level object (`IMPL.decode = ...`, a class's
    attribute, a module-level dict): layer state lives on module instances."""
    found = []
    for module, path in _layers_sources():
        tree = ast.parse(path.read_text())
        top = {n.id for stmt in tree.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        top |= {stmt.name for stmt in tree.body if isinstance(stmt, (ast.ClassDef, ast.FunctionDef))}
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            local = _function_locals(fn)
            found += [f"{module}:{line} ({name})" for name, line in _stores(fn) if name in top and name not in local]
    assert not found, f"layers/ functions writing module-level state: {found}"


def _layers_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to a layers module or to something imported from one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if _in(a.name, LAYERS)}
        elif isinstance(node, ast.ImportFrom) and node.module and (_in(node.module, LAYERS) or (
                node.module == "gaudi_runtime" and any(a.name == "layers" for a in node.names))):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_no_code_writes_into_layers_modules():
    """No module of ours sets an attribute of a layers module or of an object imported from one
    (`attention.IMPL.x = ...`, `attention.CAUSAL_CHUNK = ...`, `Attention.cache_writer = ...`): choices are
    made per model and passed in, not written into shared modules."""
    found = []
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            aliases = _layers_aliases(tree)
            found += [f"{path.relative_to(root.parent)}:{line} ({name})" for name, line in _stores(tree)
                      if name in aliases]
    assert not found, f"writes into layers/ modules' state: {found}"


def test_the_write_checks_catch_what_they_look_for():
    """The scans flag the patterns they exist for (the old global attention kernels' shape)."""
    layer_src = ast.parse("IMPL = Impl()\n\ndef select(x):\n    IMPL.decode = x\n")
    fn = next(n for n in ast.walk(layer_src) if isinstance(n, ast.FunctionDef))
    assert [name for name, _ in _stores(fn) if name not in _function_locals(fn)] == ["IMPL"]
    user = ast.parse("from gaudi_runtime.layers import attention\n\ndef f():\n    attention.IMPL.decode = 1\n"
                     "    setattr(attention.IMPL, 'x', 2)\n")
    assert [name for name, _ in _stores(user) if name in _layers_aliases(user)] == ["attention", "attention"]
