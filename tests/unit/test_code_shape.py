"""The shape the code keeps: short functions, no import cycles, a router process without torch.

These are checks a contributor meets when a change breaks the layering the design relies on
(docs/design.md, "Runtime map"): they read the source, they do not run it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"gaudi_runtime": ROOT / "runtime" / "gaudi_runtime", "gaudi_operator": ROOT / "operator" / "gaudi_operator"}
MAX_FUNCTION_LINES = 60


def _sources():
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            if "_pb2" in path.name:  # generated protobuf code
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path, path.name == "__init__.py"


def _known_modules() -> set[str]:
    return {name for name, _, _ in _sources()} | {
        f"gaudi_runtime.proto.{p.stem}" for p in (PACKAGES["gaudi_runtime"] / "proto").glob("*_pb2*.py")}


def _imports(module: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """Every module of ours that `module` imports, at top level or inside a function."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_function_is_longer_than_a_screen():
    long = []
    for module, path, _ in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_the_shards_runner_stays_a_coordinator():
    """The runner loads the model and runs each step; building a step's inputs (shard/inputs.py), warmup
    (shard/warmup.py) and sampling around the step (shard/step_sampling.py) live beside it, where the next
    input kind or per-row feature goes (docs/design.md, "The shard's runner")."""
    runner = PACKAGES["gaudi_runtime"] / "shard" / "runner.py"
    lines = len(runner.read_text().splitlines())
    assert lines < 300, f"shard/runner.py has {lines} lines: move a job out of it rather than into it"


def test_no_import_cycles_between_modules():
    known = _known_modules()
    graph = {module: _imports(module, is_pkg, ast.parse(path.read_text()), known)
             for module, path, is_pkg in _sources()}
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_models_do_not_import_the_router():
    known = _known_modules()
    offenders = {}
    for module, path, is_pkg in _sources():
        if module.startswith("gaudi_runtime.models"):
            bad = {m for m in _imports(module, is_pkg, ast.parse(path.read_text()), known)
                   if m.startswith("gaudi_runtime.router")}
            if bad:
                offenders[module] = sorted(bad)
    assert not offenders


DEVICE_NAMES = {"hpu", "cuda", "cpu"}
# Where the device's name may be compared: the backends themselves, and the configuration that names them.
DEVICE_NAME_READERS = ("gaudi_runtime.device", "gaudi_runtime.config")


def _names_a_device(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in DEVICE_NAMES


def _device_name_compares(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(_names_a_device(e) for e in (node.left, *node.comparators))]


def test_device_names_are_compared_only_by_the_backends_and_the_config():
    """Outside ``device/`` and ``config.py`` code asks the backend for a fact (``Backend.computes_on_host``,
    ``flat_decode``, ``native_fp8_checkpoints``, ...; docs/design.md, "Device facts") rather than comparing
    the device's name: a new device then states its facts in one place instead of being added to every
    comparison."""
    found = [f"{module}:{line}" for module, path, _ in _sources()
             if not any(module == r or module.startswith(r + ".") for r in DEVICE_NAME_READERS)
             for line in _device_name_compares(ast.parse(path.read_text()))]
    assert not found, f"device names compared outside device/ and config.py (ask the backend): {found}"


KERNEL_HOOKS = {"kernel", "cache_writer"}
KERNEL_INSTALLER = "gaudi_runtime.layers.kernels"


def _store_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        else:
            flat.append(t)
    return flat


def _hook_writes(tree: ast.AST, dynamic_names: bool) -> list[int]:
    """Lines that set a layer's kernel hook: ``x.kernel = ...``, ``setattr(x, "kernel", ...)``, and with
    `dynamic_names` any ``setattr`` whose attribute is chosen at run time (it may be a hook)."""
    lines = []
    for node in ast.walk(tree):
        lines += [t.lineno for t in _store_targets(node) if isinstance(t, ast.Attribute) and t.attr in KERNEL_HOOKS]
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "setattr") or (
                isinstance(func, ast.Attribute) and func.attr == "__setattr__"):
            name = node.args[1]
            if (isinstance(name, ast.Constant) and name.value in KERNEL_HOOKS) or (
                    dynamic_names and not isinstance(name, ast.Constant)):
                lines.append(node.lineno)
    return lines


def test_kernels_are_installed_in_one_place():
    """A layer's kernel hooks (``kernel``, ``cache_writer``) are set only by ``layers/kernels.install_kernels``,
    from the `LayerKernels` a device backend builds: one typed seam, as the attention backend is, not
    attributes set wherever a device's code finds a module of the right type."""
    found = []
    for module, path, _ in _sources():
        if module == KERNEL_INSTALLER:
            continue
        kernel_side = module.startswith(("gaudi_runtime.device", "gaudi_runtime.layers", "gaudi_runtime.quant"))
        found += [f"{module}:{line}" for line in _hook_writes(ast.parse(path.read_text()), kernel_side)]
    assert not found, f"kernel hooks set outside layers/kernels.install_kernels: {found}"


def test_the_seam_checks_catch_what_they_look_for():
    compares = ast.parse('if backend.name == "hpu": pass\nok = x.device.type in ("cpu", "meta")\n'
                         'fine = name == "hpus"\n')
    assert _device_name_compares(compares) == [1, 2]
    writes = ast.parse('m.kernel = k\nm.lora.kernel, y = k, 1\nsetattr(m, "cache_writer", w)\n'
                       'setattr(m, attribute, k)\nm.kernels = k\nkernel = None\n')
    assert sorted(_hook_writes(writes, dynamic_names=False)) == [1, 2, 3]
    assert sorted(_hook_writes(writes, dynamic_names=True)) == [1, 2, 3, 4]


def test_the_router_process_loads_neither_torch_nor_model_code(tmp_path):
    """The router only speaks HTTP and the shards' proto: importing its entry module and loading
    a tokenizer must not pull torch (seconds at every start) or the shard side into the process."""
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"},
        "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": [], "normalizer": None,
        "post_processor": None, "decoder": None, "truncation": None, "padding": None}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    probe = (
        "import json, sys\n"
        "from gaudi_runtime.config import Config\n"
        "from gaudi_runtime.router.main import load_tokenizer\n"
        f"tok = load_tokenizer(Config.of(model_id='m').model, {str(tmp_path)!r})\n"
        "assert tok.encode('hello', add_special_tokens=False) == [1]\n"
        # The router marks torch absent with a None entry: the modules loaded are the others.
        "print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if m.split(".")[0] == "torch"]
    shard_side = [m for m in loaded if m.startswith("gaudi_runtime.")
                  and m.split(".")[1] in ("shard", "models", "layers", "device", "quant")]
    assert not shard_side


CHILD_WRITES = {"apply", "create", "delete", "patch_if_unchanged"}


def test_operator_children_are_written_only_through_components():
    """The operator's children are created, applied, joined, left and deleted in one module,
    `children.py`, which does so for every component of the registry (components/): no other module
    calls kube's writes, so a new child kind cannot grow a special case of its own in the handlers."""
    known = _known_modules()
    offenders = []
    for module, path, is_pkg in _sources():
        if not module.startswith("gaudi_operator.") or module in ("gaudi_operator.children", "gaudi_operator.kube"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in CHILD_WRITES and isinstance(node.value, ast.Name)
                    and node.value.id == "kube"):
                offenders.append(f"{module}:{node.lineno}: kube.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("kube"):
                offenders += [f"{module}:{node.lineno}: imports kube.{a.name}" for a in node.names
                              if a.name in CHILD_WRITES]
        if module.startswith("gaudi_operator.components"):
            io = {"gaudi_operator.kube", "gaudi_operator.children", "gaudi_operator.handlers"}
            offenders += [f"{module}: imports {m} (components are pure)"
                          for m in sorted(_imports(module, is_pkg, tree, known) & io)]
    assert not offenders, "child writes outside children.py:\n" + "\n".join(offenders)
