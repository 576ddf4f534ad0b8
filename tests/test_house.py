"""House rules that hold by test: one concept per file, so no Python file of the repository runs
past CEILING lines. The files above it when the rule came in are listed with their length then:
each may shrink (lower its entry when it does) but not grow, and a new file never joins the list.
And options are declared once, as config fields: the package reads no environment switch
(ENV_READS lists the variables other programs define). (The other habit, functions of
complexity at most 10, is ruff's C901 in pyproject.toml.)"""

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("mosaic", "bench", "tests", "tools")
CEILING = 350
OVER = {          # path: its lines when the ceiling came in (split it to leave the list)
    "tools/train_long.py": 662,
    "tools/train_tiny.py": 537,
    "bench/suites/soak.py": 451,
    "tests/test_inputs.py": 450,
    "tests/test_long_tasks.py": 382,
    "bench/suites/offload.py": 374,
    "tests/serve/test_server.py": 371,
    "bench/suites/multi_gpu.py": 367,
    "bench/suites/design_probe.py": 366,
    "mosaic/engine/engine.py": 363,
    "mosaic/engine/device_memory.py": 362,
    "tests/plain_families.py": 354,
}


def lengths() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def test_no_file_runs_past_the_ceiling():
    over = {path: n for path, n in lengths().items() if n > OVER.get(path, CEILING)}
    assert not over, (f"files past {CEILING} lines (or past their listed length): {over}; split by concept "
                      "(docs/DESIGN.md) rather than raising a limit")


def test_the_list_names_only_files_over_the_ceiling():
    have = lengths()
    stale = {path: have.get(path) for path in OVER if have.get(path, 0) <= CEILING}
    assert not stale, f"now at or under {CEILING} lines (or gone): drop them from OVER: {stale}"


def test_no_issue_numbers_in_code():
    """Issue numbers go in commit messages and docs, never in code (they mean nothing to a reader
    of the file: say what happened instead)."""
    pattern = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
    found = [f"{path}:{i}" for path in lengths() for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, found


# Options are declared once, as EngineConfig / GenerationConfig fields (the CLI derives its flags
# from them), so nothing in the package reads the environment except these variables, which other
# programs define or which must stay off the command line. (path, variable): why. "*" is the whole
# environment (a copy, or a name not written in the code).
ENV_READS = {
    ("mosaic/kernels/__init__.py", "TRITON_INTERPRET"): "Triton's own switch: with it set Triton runs on a CPU, "
                                                        "so the kernel choice must know (tests run kernels so)",
    ("mosaic/memory/device_meter.py", "CUDA_VISIBLE_DEVICES"): "CUDA's device mask: maps a CUDA ordinal to the NVML "
                                                               "index the meter reads",
    ("mosaic/launch.py", "RANK"): "torch.distributed's env:// rendezvous (set by the launcher or torchrun)",
    ("mosaic/launch.py", "WORLD_SIZE"): "the same rendezvous: one process or several",
    ("mosaic/launch.py", "LOCAL_RANK"): "the same rendezvous: which GPU of the host this process drives",
    ("mosaic/launch.py", "*"): "the launcher copies the environment to the processes it starts (child_env)",
    ("mosaic/cli.py", "WORLD_SIZE"): "the rendezvous's size: a command already under torchrun (or the launcher) "
                                     "does not launch again",
    ("mosaic/serve/commands.py", "MOSAIC_API_KEY"): "a secret: on the command line it would show in the process "
                                                    "list (vLLM reads VLLM_API_KEY the same way; --api-key wins)",
}


def env_reads(source: str):
    """(variable or '*', line) for each read of os.environ / os.getenv in Python source; writes
    (os.environ[k] = v, .update, a .setdefault whose value is unused) are not reads."""
    tree = ast.parse(source)
    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                {a.name for a in node.names} & {"environ", "getenv", "environb", "getenvb"}:
            yield "*", node.lineno        # an alias the attribute checks below would miss
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "getenvb")):
            continue
        name = _read_name(node, parents)
        if name is not None:
            yield name, node.lineno


def _literal(node) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "*"


def _read_name(node, parents) -> str | None:
    """The variable an os.environ / os.getenv node reads; None for a write."""
    up = parents.get(id(node))
    if node.attr.startswith("getenv"):
        return _literal(up.args[0]) if isinstance(up, ast.Call) and up.args else "*"
    if isinstance(up, ast.Subscript):
        return None if isinstance(up.ctx, (ast.Store, ast.Del)) else _literal(up.slice)
    if isinstance(up, ast.Compare) and len(up.ops) == 1 and isinstance(up.ops[0], (ast.In, ast.NotIn)):
        return _literal(up.left)
    if isinstance(up, ast.Attribute):
        call = parents.get(id(up))
        args = call.args if isinstance(call, ast.Call) else []
        if up.attr == "update" or (up.attr == "setdefault" and isinstance(parents.get(id(call)), ast.Expr)):
            return None
        return _literal(args[0]) if up.attr in ("get", "pop", "setdefault") and args else "*"
    return "*"


def test_the_package_reads_no_environment_switches():
    """No option hides in an environment variable: add an EngineConfig field (config/engine.py;
    cli_options.py derives its flag) instead. A variable another program defines goes in
    ENV_READS with why."""
    pkg = ROOT / "mosaic"
    found = {(str(p.relative_to(ROOT)), name, line) for p in pkg.rglob("*.py")
             for name, line in env_reads(p.read_text())}
    extra = sorted(f"{path}:{line} reads {name}" for path, name, line in found if (path, name) not in ENV_READS)
    assert not extra, f"environment reads outside ENV_READS: {extra}; make it an EngineConfig field"
    stale = set(ENV_READS) - {(path, name) for path, name, _ in found}
    assert not stale, f"ENV_READS entries no longer read: drop them: {sorted(stale)}"


def test_the_environment_check_sees_each_form():
    src = textwrap.dedent('''
        import os
        a = os.environ.get("A")
        b = os.environ["B"]
        c = os.getenv("C", "0")
        d = "D" in os.environ
        e = dict(os.environ)
        f = os.environ.get(name)
        os.environ["W"] = "1"
        os.environ.update(X="1")
        os.environ.setdefault("Y", "1")
        g = os.environ.setdefault("G", "1")
    ''')
    assert sorted(name for name, _ in env_reads(src)) == ["*", "*", "A", "B", "C", "D", "G"]
