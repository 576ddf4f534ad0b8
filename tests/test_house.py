"""House rules that hold by test: one concept per file, so no Python file of the repository runs
past CEILING lines. The files above it when the rule came in are listed with their length then:
each may shrink (lower its entry when it does) but not grow, and a new file never joins the list.
(The other habit, functions of complexity at most 10, is ruff's C901 in pyproject.toml.)"""

import re
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
