"""bench/results/ and bench/suites/ stay honest: every result file has a row in
bench/results/MANIFEST.md and every row names a file; a suite imports bench.lib and mosaic, never
another suite; no bench code runs code from a string; the registry names every suite module with
its docstring's first line. CPU, no imports of the suites' heavy dependencies."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results"
SUITES = ROOT / "bench" / "suites"


def manifest_rows(text: str) -> list[str]:
    """The paths in the first column of every table whose header is `| file | ... |`."""
    rows, in_files = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_files = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "file":
            in_files = True
        elif in_files and not set(cells[0]) <= {"-"}:
            names = re.findall(r"`([^`]+)`", cells[0])
            assert len(names) == 1, f"a manifest row names one file in backticks: {line}"
            rows.append(names[0])
    return rows


def test_every_result_file_has_exactly_one_manifest_row_and_every_row_a_file():
    rows = manifest_rows((RESULTS / "MANIFEST.md").read_text())
    files = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()} - {"MANIFEST.md"}
    dupes = {r for r in rows if rows.count(r) > 1}
    assert not dupes, f"files with more than one manifest row: {sorted(dupes)}"
    missing = sorted(files - set(rows))
    assert not missing, f"files under bench/results/ without a row in MANIFEST.md: {missing}"
    ghosts = sorted(set(rows) - files)
    assert not ghosts, f"MANIFEST.md rows naming files that do not exist: {ghosts}"


def test_manifest_parser_sees_missing_and_extra_rows():
    text = "| file | commit | command | backs |\n|---|---|---|---|\n| `a.json` | c | `x` | y |\n\n" \
           "| old | new |\n|---|---|\n| `bench/x.py` | `python -m bench x` |\n"
    assert manifest_rows(text) == ["a.json"]


def imports_of(path: Path, package: str = "bench.suites") -> list[str]:
    """Absolute module names a file imports (relative imports resolved inside `package`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                out.append(base + "." + (node.module or ""))
            else:
                out.append(node.module or "")
                out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def suite_modules() -> list[Path]:
    return sorted(p for p in SUITES.glob("*.py") if p.name != "__init__.py")


def test_no_suite_imports_another_suite_and_lib_imports_no_suite():
    bad = []
    for path in suite_modules():
        bad += [f"{path.name}: {m}" for m in imports_of(path)
                if m.startswith("bench.suites") or m in ("bench_steps", "common") or m.startswith("bench_")]
    for path in (ROOT / "bench" / "lib").glob("*.py"):
        bad += [f"lib/{path.name}: {m}" for m in imports_of(path, "bench.lib") if m.startswith("bench.suites")]
    assert not bad, f"suites import bench.lib and mosaic only: {bad}"


def test_the_import_check_catches_a_suite_importing_a_suite(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("from bench.suites import speed\nfrom . import soak\nimport bench.lib.measure\n")
    assert [m for m in imports_of(p) if m.startswith("bench.suites")] == ["bench.suites", "bench.suites.speed",
                                                                            "bench.suites."]


def test_no_bench_code_runs_code_from_a_string():
    bad = []
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval"):
                bad.append(f"{path.name}:{node.lineno} {node.func.id}()")
            if isinstance(node, ast.Constant) and node.value == "-c":
                bad.append(f"{path.name}:{node.lineno} a '-c' argument")
    assert not bad, bad


def test_the_registry_lists_every_suite_with_its_docstring_line():
    from bench.suites import SUITES as REGISTRY
    names = {p.stem for p in suite_modules()}
    assert names == set(REGISTRY), f"unregistered: {names - set(REGISTRY)}, missing: {set(REGISTRY) - names}"
    for path in suite_modules():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0] == REGISTRY[path.stem], path.name
        tree = ast.parse(path.read_text())
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"add_arguments", "run", "table"} <= defs, f"{path.name} lacks the suite contract"
