"""`python -m bench <suite> [options]`: run one benchmark suite; `python -m bench --list`: the suites.

Run from the repository root (the device machine's copy has nothing installed; `-m` puts the root
on the path). Each suite writes one JSON record under --out (default bench/out/, git-ignored;
results that back a figure are copied under bench/results/ with a row in its MANIFEST.md) and
prints a short table last. Multi-GPU suites launch through torch.distributed.run:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench multi_gpu --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench.lib.record import DEFAULT_OUT, Record, SuiteError
from bench.suites import GPU_ONLY, SUITES, load
from mosaic.errors import MosaicError


def listing() -> str:
    width = max(map(len, SUITES))
    return "\n".join(f"{name:<{width}}  {line}" for name, line in SUITES.items())


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one `error:` line and exit code 2, as the mosaic CLI answers
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def parser(name: str, mod) -> argparse.ArgumentParser:
    ap = _Parser(prog=f"python -m bench {name}", description=mod.__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    mod.add_arguments(ap)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("error: name a suite: python -m bench <suite> [options] (python -m bench --list)", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsuites:\n" + listing())
        return 0
    if argv[0] == "--list":
        print(listing())
        return 0
    name = argv[0]
    if name not in SUITES:
        print(f"error: unknown suite {name!r}; the suites are: {', '.join(SUITES)} (python -m bench --list)",
              file=sys.stderr)
        return 2
    mod = load(name)
    try:
        args = parser(name, mod).parse_args(argv[1:])
    except SystemExit as e:     # argparse printed its usage and one error line (or --help)
        return e.code if isinstance(e.code, int) else 2
    if name in GPU_ONLY and not torch.cuda.is_available():
        print(f"error: the {name} suite measures on a GPU and this machine has no CUDA device; run it on a GPU "
              "machine (the suites a CPU runs: python -m bench --list, those not marked GPU)", file=sys.stderr)
        return 2
    out_name = mod.output(args) if hasattr(mod, "output") else f"{name}.json"
    rec = Record(args.out / out_name, name, vars(args), command="python -m bench " + " ".join(argv))
    try:
        mod.run(args, rec)
    except (SuiteError, MosaicError) as e:     # bad input to the suite, or to the engine it drives
        print(f"error: {e}", file=sys.stderr)
        return 2
    rec["seconds_total"] = rec.elapsed()
    rec.save()
    text = mod.table(rec)
    if text:
        print(text, flush=True)
    if rec.hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rec.exit_code)
    return rec.exit_code


def run_quietly(argv=None) -> int:
    """main(), and a reader that leaves early (`python -m bench --list | head`) ends it quietly
    with 0 instead of a BrokenPipeError traceback (Python's advice: point stdout at devnull so
    the flush at exit cannot fail again)."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(run_quietly())
