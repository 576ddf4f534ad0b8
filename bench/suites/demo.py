"""A new user's first contact on the CPU: the README's demo command and the first request's cost.

    python -m bench demo --out DIR                 # ~1 min on 2 cores
    python -m bench demo --busy 2 --out DIR        # the same with 2 spinning processes beside it

Parts (JSON to OUT/demo.json, a table printed last):
  command     the README's demo (`mosaic generate --prompt "sort 31415926="`) as a fresh process,
              --repeats times: wall seconds from exec to exit (import, load, warm-up, steps,
              output), and the tokens it printed (they must be the README's)
  first       in one process per bundled model: MosaicEngine built, then the same request twice
              (generate(), 8 tokens): the first's seconds over the second's (the target
              <= 3x; it was 7.4x before the engine warmed itself up and chose one thread for a
              small model)

--busy N starts N processes that spin on the CPU for the whole run (a busy 2-core machine: where
PyTorch's default two intra-op threads spun against the load, the demo took 9.2 s).
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time

from bench.lib.measure import median
from bench.lib.record import ROOT

DEMO = ["-m", "mosaic", "generate", "--prompt", "sort 31415926="]
EXPECTED = "11234569"


def add_arguments(ap):
    ap.add_argument("--repeats", type=int, default=3, help="runs of the demo command")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the run (a busy machine)")
    ap.add_argument("--only", nargs="*", default=None, help="parts to run (command first)")


def _spin(stop):
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2147483648


def command_part(repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, *DEMO], cwd=ROOT, capture_output=True, text=True, timeout=300)
        runs.append({"seconds": time.perf_counter() - t, "rc": r.returncode,
                     "stdout": r.stdout.strip()[-200:], "expected_in_output": EXPECTED in r.stdout})
    return {"command": "mosaic generate --prompt 'sort 31415926='", "runs": runs,
            "median_s": median([x["seconds"] for x in runs]), "max_s": max(x["seconds"] for x in runs),
            "all_expected": all(x["expected_in_output"] and x["rc"] == 0 for x in runs)}


def first_part() -> dict:
    import torch

    from mosaic import MosaicEngine, load
    rows = []
    for name, prompt in (("tiny-llada", "sort 31415926="), ("tiny-dream", "123+456=")):
        t = time.perf_counter()
        eng = MosaicEngine(load(name), {"progress": False})
        built = time.perf_counter() - t
        a, b = eng.generate(prompt), eng.generate(prompt)
        rows.append({"model": name, "engine_s": built, "first_s": a.seconds, "second_s": b.seconds,
                     "first_over_second": a.seconds / b.seconds, "same_text": a.text == b.text,
                     "threads": torch.get_num_threads()})
        eng.close()
    return {"rows": rows}


def run(args, rec):
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        parts = args.only or ["command", "first"]
        if "command" in parts:
            rec.case("command", lambda: command_part(args.repeats))
        if "first" in parts:
            rec.case("first", first_part)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    return rec


def table(rec) -> str:
    lines = [f"busy processes beside the run: {rec['config']['busy']}"]
    c = rec.get("command")
    if c and "error" not in c:
        lines.append(f"demo command: median {c['median_s']:.2f} s, max {c['max_s']:.2f} s over "
                     f"{len(c['runs'])} runs; tokens as the README: {c['all_expected']}")
    f = rec.get("first")
    if f and "error" not in f:
        for r in f["rows"]:
            lines.append(f"{r['model']}: engine {r['engine_s']:.2f} s, first request {r['first_s']:.3f} s, "
                         f"second {r['second_s']:.3f} s ({r['first_over_second']:.2f}x; target <= 3x)")
    return "\n".join(lines)
