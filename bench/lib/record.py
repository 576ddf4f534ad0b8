"""What every benchmark record carries (date, commit, machine, GPU, versions, config) and how a
suite writes it: one JSON file under --out, rewritten after every finished part, so that a run
cut by a time limit keeps what it measured."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the repository
RESULTS = ROOT / "bench" / "results"                # committed records (bench/results/MANIFEST.md)
DEFAULT_OUT = Path("bench") / "out"                 # scratch output (git-ignored); commit by copying


class SuiteError(Exception):
    """Bad input to a suite, or a machine it cannot run on: `python -m bench` prints one
    `error:` line and exits with code 2."""


def git_commit() -> str:
    """MOSAIC_COMMIT when set (the device machine's copy has no .git), else `git rev-parse`
    (+dirty with uncommitted changes to tracked files), else 'unknown'."""
    if os.environ.get("MOSAIC_COMMIT"):
        return os.environ["MOSAIC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    """Machine, GPU and versions. Asks CUDA for the device name: call it after a suite has read
    any pre-context baseline (the soak's device meter)."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"machine": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton_version,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0,
            "cuda": torch.version.cuda if cuda else None}


def record_header(config: dict) -> dict:
    """The header of a record: date (UTC), commit, machine fields and the configuration."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), **machine(), "config": config}


def jsonable(config: dict) -> dict:
    """argparse values as JSON: paths as strings, everything else as it is."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()}


class Record(dict):
    """One suite's JSON record. The header's date, commit and config are taken at creation; the
    machine fields (which ask CUDA) at the first save. `save()` rewrites the file (indent 1);
    `case(name, fn)` runs one part: its result, or its error and traceback, under name, its
    seconds under `seconds[name]`, then saves. `write = False` keeps a process from writing (the
    non-zero ranks of a multi-GPU run); `exit_code` is what `python -m bench` returns;
    `hard_exit` ends the process with os._exit after the table (NCCL teardown can hang)."""

    def __init__(self, path: Path, suite: str, config: dict, command: str | None = None):
        super().__init__(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         commit=git_commit(), suite=suite,
                         command=command or "python -m bench " + " ".join(sys.argv[1:]), config=jsonable(config))
        self.path, self.write, self.exit_code, self.hard_exit = Path(path), True, 0, False
        self._machine = False
        self.t0 = time.perf_counter()

    def save(self) -> Path:
        if not self._machine:
            self.update({k: v for k, v in machine().items() if k not in self})
            self._machine = True
        if self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self, indent=1, default=str) + "\n")
        return self.path

    def case(self, name: str, fn, into: str | None = None):
        """fn() recorded under self[into][name] (or self[name]); an exception is recorded as
        {'error', 'trace'} and the run goes on. Returns the result (None after an error)."""
        box = self.setdefault(into, {}) if into else self
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001  (a bench: record it and go on; one part must not lose the others)
            res = None
            box[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
            print(box[name]["trace"], flush=True)
        else:
            box[name] = res
        self.setdefault("seconds", {})[name] = time.perf_counter() - t
        self.save()
        return res

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def write_json(path: Path, obj) -> Path:
    """obj as indented JSON at path (folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return path


def child_record(suite: str, args: list[str], out: Path, env: dict | None = None, timeout: float | None = None,
                 name: str | None = None) -> dict:
    """Run `python -m bench suite args --out out` in a child process (an allocator mode is fixed at
    process start) and return its record, or {'error': stderr tail} when it failed."""
    r = subprocess.run([sys.executable, "-m", "bench", suite, *args, "--out", str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-3000:] if r.returncode == 0 else r.stderr[-3000:], flush=True)
    path = Path(out) / (name or f"{suite}.json")
    if r.returncode or not path.exists():
        return {"error": (r.stderr or r.stdout)[-3000:]}
    return json.loads(path.read_text())
