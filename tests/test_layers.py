"""The layer rule (docs/DESIGN.md): imports run one way, with no cycles and no hidden imports.

Layers, bottom to top; a module may import from its own layer or the ones below it only."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mosaic"

LAYERS = [
    ("foundation", ["mosaic.errors", "mosaic.config", "mosaic.config_file", "mosaic.checkpoint_fields"]),
    ("kernels", ["mosaic.kernels"]),
    ("graph", ["mosaic.graph"]),
    ("models", ["mosaic.models", "mosaic.tokenizer", "mosaic.loader", "mosaic.assets", "mosaic.prompts"]),
    ("memory", ["mosaic.memory"]),
    ("execution", ["mosaic.runtime"]),
    ("policy", ["mosaic.policy"]),
    ("facade", ["mosaic.engine", "mosaic.block_generate", "mosaic.engine_requests", "mosaic.engine_memory",
                "mosaic.warmup", "mosaic.launch", "mosaic.compat", "mosaic.cli", "mosaic.cli_args", "mosaic.arg_types",
                "mosaic.serve", "mosaic", "mosaic.__main__"]),
]
# package modules that need an optional heavy dependency at import time: the one place that
# uses them imports them lazily (inside a function), so the CPU install never needs it
OPTIONAL = {"mosaic.kernels.masked_logits_triton", "mosaic.kernels.attention_triton",
            "mosaic.kernels.elementwise_triton", "mosaic.kernels.merge_triton",
            "mosaic.kernels.fp8_triton",
            "mosaic.serve.server"}   # fastapi, uvicorn, prometheus-client: the serve extra


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> int:
    best, idx = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, idx = len(p), i
    assert idx is not None, f"{mod} belongs to no layer: add it to LAYERS and docs/DESIGN.md"
    return idx


def imports(path: Path):
    """(imported package module, line, inside a function?) for every import of mosaic.*"""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(n) for f in funcs for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = {resolve(f"{target}.{a.name}") for a in node.names}
        elif isinstance(node, ast.Import):
            names = {resolve(a.name) for a in node.names}
        else:
            continue
        for name in sorted(names):
            if name == "mosaic" or name.startswith("mosaic."):
                yield name, node.lineno, id(node) in inner


def resolve(name: str) -> str:
    """The module a dotted import name refers to (an attribute import names its module)."""
    orig = name
    while True:
        p = PACKAGE.parent / Path(*name.split("."))
        if p.with_suffix(".py").exists() or (p / "__init__.py").exists():
            return name
        if "." not in name:
            return orig
        name = name.rsplit(".", 1)[0]


def graph():
    edges = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path)
        edges[mod] = list(imports(path))
    return edges


def test_every_module_is_in_a_layer():
    for mod in graph():
        layer_of(mod)


def test_no_import_from_a_layer_above():
    bad = []
    for mod, targets in graph().items():
        for target, line, _ in targets:
            if layer_of(target) > layer_of(mod):
                bad.append(f"{mod}:{line} imports {target} ({LAYERS[layer_of(target)][0]} is above "
                           f"{LAYERS[layer_of(mod)][0]})")
    assert not bad, "\n".join(bad)


def test_no_function_local_imports_of_the_package():
    bad = [f"{mod}:{line} imports {t} inside a function" for mod, targets in graph().items()
           for t, line, local in targets if local and t not in OPTIONAL]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {m: {t for t, _, _ in ts if t != m and not m.startswith(t + ".")} for m, ts in graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m)


def test_the_checker_sees_a_violation(tmp_path):
    """The rule can fail: an upward, function-local import is reported by both checks."""
    src = "def f():\n    from ..engine import MosaicEngine\n"
    path = PACKAGE / "kernels" / "_probe_violation.py"
    path.write_text(src)
    try:
        found = list(imports(path))
    finally:
        path.unlink()
    assert found == [("mosaic.engine", 2, True)]
    assert layer_of("mosaic.engine") > layer_of("mosaic.kernels._probe_violation")
