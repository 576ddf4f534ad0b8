"""The layer rule (docs/DESIGN.md): imports run one way, with no cycles and no hidden imports.

Layers, bottom to top; a module may import from its own layer or the ones below it only."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mosaic"

LAYERS = [
    ("foundation", ["mosaic.errors", "mosaic.config", "mosaic.config_file", "mosaic.checkpoint_fields",
                    "mosaic.host_memory"]),
    ("kernels", ["mosaic.kernels"]),
    ("graph", ["mosaic.graph"]),
    ("models", ["mosaic.models", "mosaic.tokenizer", "mosaic.loader", "mosaic.checkpoint_io", "mosaic.assets",
                "mosaic.prompts", "mosaic.chat_template"]),
    ("memory", ["mosaic.memory"]),
    ("execution", ["mosaic.runtime"]),
    ("policy", ["mosaic.policy"]),
    ("facade", ["mosaic.engine", "mosaic.cli_options",
                "mosaic.launch", "mosaic.compat", "mosaic.compat_fast", "mosaic.cli", "mosaic.cli_args",
                "mosaic.cli_plan", "mosaic.cli_calibrate", "mosaic.arg_types",
                "mosaic.serve", "mosaic", "mosaic.__main__"]),
]
# package modules that need an optional heavy dependency at import time: the one place that
# uses them imports them lazily (inside a function), so the CPU install never needs it
OPTIONAL = {"mosaic.kernels.masked_logits_triton", "mosaic.kernels.attention_triton",
            "mosaic.kernels.elementwise_triton", "mosaic.kernels.merge_triton",
            "mosaic.kernels.fp8_triton", "mosaic.kernels.invariant_triton", "mosaic.kernels.moe_triton",
            "mosaic.kernels.moe_combine_triton", "mosaic.kernels.varlen_triton", "mosaic.kernels.rmsnorm_triton",
            "mosaic.serve.server"}   # fastapi, uvicorn, prometheus-client: the serve extra


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> int:
    """The layer whose longest prefix names `mod`; the bare package name "mosaic" (its __init__)
    names only itself, so a new module under mosaic/ must be placed in LAYERS."""
    best, idx = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or (p != "mosaic" and mod.startswith(p + "."))) and len(p) > best:
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


def test_a_new_module_must_be_placed():
    """The package's own name places only its __init__: a new top-level module belongs to no
    layer until LAYERS names it (the bare prefix "mosaic" used to match every module)."""
    assert layer_of("mosaic") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("mosaic.brand_new_module")


# writes to another object's attributes that are allowed, with the reason
FOREIGN_WRITES = {
    ("mosaic.cli", "warnings.showwarning"),   # the CLI's own process prints warnings as one line
    ("mosaic.kernels.attention_triton", "nargs[name].block_shape"),   # Triton's pre_hook sets TMA blocks
    ("mosaic.cli", "sys.stdout"),             # `mosaic plan | head`: the reader left, exit quietly
}


def _created_names(fn) -> set[str]:
    """Names a function binds to objects it creates: a call's result (a constructor or factory),
    or an element of one of its own object's containers (self.blocks[i])."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and (isinstance(n.value, ast.Call) or (
                isinstance(n.value, ast.Subscript) and ast.unparse(n.value).startswith("self."))):
            for t in n.targets:
                out |= {e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)}
        elif isinstance(n, ast.withitem) and isinstance(n.optional_vars, ast.Name):
            out.add(n.optional_vars.id)
        elif isinstance(n, ast.For) and isinstance(n.target, ast.Name) and ast.unparse(n.iter).startswith("self."):
            out.add(n.target.id)          # an element of the object's own container
    return out


def _owned_fields(cls: ast.ClassDef) -> set[str]:
    """self.X that the class itself builds (self.X = a call) anywhere in its methods."""
    out = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
    return out


def foreign_writes():  # noqa: C901
    """'module:line target' for every attribute written on an object the writing code did not
    create: a function's parameter, a global, another object's field."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path)
        tree = ast.parse(path.read_text())
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        owner = {id(f): c for c in classes for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            created = _created_names(fn)
            owned = _owned_fields(owner[id(fn)]) if id(fn) in owner else set()
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else \
                    [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if not isinstance(tt, ast.Attribute):
                            continue
                        base = tt.value
                        while isinstance(base, ast.Attribute) and isinstance(base.value, ast.Attribute):
                            base = base.value        # a.b.c = ...: judged by who created a.b
                        root = base.value if isinstance(base, ast.Attribute) else None
                        if isinstance(root, ast.Name) and root.id in created:
                            ok = True                # a field of an object made here (ctypes structs)
                        elif isinstance(base, ast.Name):
                            ok = base.id in ("self", "cls") or base.id in created
                        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                            ok = base.value.id == "self" and base.attr in owned
                        else:
                            ok = False
                        if not ok and (mod, ast.unparse(tt)) not in FOREIGN_WRITES:
                            bad.append(f"{mod}:{n.lineno} {ast.unparse(tt)}")
    return bad


def test_no_module_writes_an_attribute_of_an_object_it_did_not_create():
    bad = foreign_writes()
    assert not bad, "\n".join(bad)
