"""The sampling defaults a checkpoint's own published code sets: the keyword defaults of the
generate() method that its config.json's auto_map names (read with `ast`, never executed).

LLaDA2.1 checkpoints ship the same model class as LLaDA2.0 with a generate() that edits tokens
(editing_threshold=0.9, max_post_steps=16, num_to_transfer=1 in the copies read): calling the
checkpoint's generate() with its defaults runs LLaDA2.1's sampler, so the record reads those
defaults here and the engine takes them as the request defaults below generation_config.json."""

from __future__ import annotations

import ast
from pathlib import Path


def _class_source(raw: dict, folder: Path) -> tuple[Path, str] | None:
    """(modeling file, class name) of auto_map's AutoModelForCausalLM, or None."""
    ref = (raw.get("auto_map") or {}).get("AutoModelForCausalLM")
    if not isinstance(ref, str) or "." not in ref:
        return None
    module, cls = ref.split("--")[-1].rsplit(".", 1)
    path = folder / (module.replace(".", "/") + ".py")
    return (path, cls) if path.is_file() else None


def generate_defaults(raw: dict, folder: Path | None, names: tuple[str, ...]) -> dict:
    """{name: default} of the keyword arguments `names` of the checkpoint's generate() whose
    defaults are literals; {} without a folder, an auto_map, the file, the class or the method.
    A file that does not parse is treated as absent (the checkpoint's other files decide)."""
    found = _class_source(raw, folder) if folder is not None else None
    if found is None:
        return {}
    path, cls = found
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "generate":
                    return _literal_defaults(fn.args, names)
    return {}


def _literal_defaults(args: ast.arguments, names: tuple[str, ...]) -> dict:
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    out = {}
    for arg, default in pairs:
        if arg.arg in names:
            try:
                out[arg.arg] = ast.literal_eval(default)
            except ValueError:
                continue
    return out
