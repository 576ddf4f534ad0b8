"""Every capacity figure the docs quote is what the command they name prints now, and every
CPU example command in the docs runs and prints what the doc says it prints.

FIGURES: (doc, a regex whose group is the doc's figure, the `mosaic plan` arguments that give
it). A doc whose number differs from the command's fails here: regenerate the doc, never the
test. The llada-8b / dream-7b plans take seconds each on a CPU, so most are marked slow."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from mosaic.cli import main

ROOT = Path(__file__).resolve().parents[1]
H200 = ["--device", "cuda"]


def _plan(model, budget, *extra):
    return ["--model", model, "--budget", budget, *extra, *H200]


def _row(budget: str, col: int) -> str:
    """The col-th figure (0-based) of the PARALLEL.md row of that budget."""
    return r"\| " + budget + r" \|" + r"[^|]*\|" * col + r" ([\d,]+)"


FIGURES = [
    *[("docs/PARALLEL.md", _row(b, k - 1), _plan("llada-8b", b.replace(" ", ""), "--gpus", str(k)))
      for b in ("20 GiB", "40 GiB", "80 GiB") for k in (1, 2, 3, 4)],
    *[("docs/PARALLEL.md", r"\| TP " + m + " " + b + r" \|" + r"[^|]*\|" * i + r" ([\d,]+)",
       _plan(m, b.replace(" ", ""), *(("--gpus", str(k), "--parallel", "tensor") if k > 1 else ())))
      for m, budgets in (("llada-8b", ("20 GiB", "40 GiB", "80 GiB")), ("dream-7b", ("20 GiB", "40 GiB")))
      for b in budgets for i, k in enumerate((1, 2, 4))],
    ("docs/FAST_DECODING.md", r"LLaDA-8B at 40 GiB,\s+([\d,]+) tokens without a cache", _plan("llada-8b", "40GiB")),
    ("docs/FAST_DECODING.md", r"([\d,]+) with every layer's K/V on the device",
     _plan("llada-8b", "40GiB", "--kv-tier", "device")),
    ("docs/FAST_DECODING.md", r"([\d,]+) with the host tier", _plan("llada-8b", "40GiB", "--kv-tier", "host")),
    ("docs/OFFLOAD.md", r"resident L_max \(([\d,]+) tokens\)", _plan("llada-8b", "40GiB")),
    *[("README.md", r"\| " + m + r" \|" + r"[^|]*\|" * i + r" ([\d,]+)", _plan(m, b))
      for m in ("llada-8b", "dream-7b", "llada-moe-7b") for i, b in enumerate(("24GiB", "40GiB", "80GiB"))],
]


def _cases():
    for i, (doc, pattern, args) in enumerate(FIGURES):
        slow = not (doc == "docs/FAST_DECODING.md" and "--kv-tier" in args and "device" in args)
        yield pytest.param(doc, pattern, args, id=f"{Path(doc).stem}-{i}",
                           marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("doc, pattern, args", list(_cases()))
def test_doc_figure_is_what_the_command_prints(doc, pattern, args, capsys):
    text = (ROOT / doc).read_text()
    found = re.search(pattern, text)
    assert found, f"{doc}: no figure matching {pattern!r}"
    quoted = int(found.group(1).replace(",", ""))
    assert main(["plan", *args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["l_max"]
    assert quoted == printed, f"{doc} says {quoted:,}; `mosaic plan {' '.join(args)}` prints {printed:,}"


# -- example commands: `mosaic generate ...   # -> ANSWER` lines of the bash blocks
EXAMPLE_DOCS = ("README.md", "docs/FAST_DECODING.md", "docs/TROUBLESHOOTING.md", "docs/CONFIG.md")


def _examples():
    for doc in EXAMPLE_DOCS:
        text = (ROOT / doc).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.splitlines():
                cmd, _, comment = line.partition("#")
                cmd = cmd.strip()
                if not cmd.startswith("mosaic generate") or "/path/to" in cmd or "--prompt-file" in cmd:
                    continue
                want = comment.split("->", 1)[1].strip() if "->" in comment else None
                yield pytest.param(cmd, want, id=f"{Path(doc).stem}:{cmd[16:60]}")


EXAMPLES = list(_examples())


def test_the_docs_have_runnable_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("cmd, want", EXAMPLES)
def test_doc_example_runs_and_prints_what_the_doc_says(cmd, want, capsys):
    argv = shlex.split(cmd)[1:]
    if "--no-progress" not in argv and "--json" not in argv:
        argv.append("--no-progress")
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if want is not None:
        assert want in out, f"`{cmd}` printed {out!r}, the doc says {want!r}"


def test_readme_python_example():
    import mosaic
    engine = mosaic.MosaicEngine("tiny-llada", {"device": "cpu"})
    assert engine.generate("sort 907=", max_new_tokens=8, steps=8).text == "079"
