"""Structured output: grammar libraries' mask costs, validity, accuracy and the GPU step cost.

    python -m bench structured --part masks [--tokenizers DIR]     # CPU: library choice (126k, 157k vocab)
    python -m bench structured --part validity [--requests 504]    # CPU: random byte-level checkpoints
    python -m bench structured --part accuracy [--per-shape 50]    # CPU: bundled models, with / without
    python -m bench structured --part gpu --out DIR                # H200: llada-8b preset, dual cache, 1k prompt

masks: bench/lib/grammar_costs.py. validity: JSON schemas (nested objects, arrays, enums,
numbers), regexes and choices on random checkpoints of every family (byte-level tokenizer:
bench/lib/byte_models.py) through every sampler; each answer parsed and validated (pydantic /
re.fullmatch / membership). accuracy: held-out prompts of the bundled models, free and under a
constraint that admits the right answer (a digit regex; a choice of the answer and two wrong
ones), with forwards per token. gpu: end-to-end time, forwards and time per forward of a
1k-prompt + 256-token request (block 32, dual cache, threshold 0.9) with and without a
JSON-schema constraint (the preset has random weights and no tokenizer: a byte-level tokenizer is
mapped onto its first 256 ids, so the masks span its full 126,464-token head)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from pydantic import BaseModel

from bench.lib.byte_models import FAMILIES, byte_checkpoint
from bench.lib.grammar_costs import masks
from bench.lib.record import SuiteError
from mosaic import MosaicEngine
from mosaic.assets import tasks


class Item(BaseModel):
    sku: str
    qty: int
    price: float


class Order(BaseModel):
    id: int
    status: str
    items: list[Item]
    express: bool


SCHEMAS = {"order": (Order, Order.model_json_schema() | {"properties": Order.model_json_schema()["properties"] | {
               "status": {"enum": ["new", "paid", "shipped"]}}}),
           "point": (None, {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                                             "label": {"type": "string", "maxLength": 8}},
                            "required": ["x", "y"]})}
REGEXES = [r"[A-Z]{2}-[0-9]{3,5}", r"(yes|no), [a-z]{1,6}", r"[0-9]{1,3}(\.[0-9]{1,2})?"]
CHOICES = [["red", "green", "blue"], ["A", "B", "C", "D"]]
SAMPLERS = {"llada": [dict(steps=64, block_length=32), dict(cache="dual", threshold=0.9, block_length=32),
                      dict(threshold=0.7, steps=64)],
            "llada_moe": [dict(steps=64, block_length=32), dict(cache="prefix", threshold=0.9, block_length=32)],
            "dream": [dict(steps=64), dict(cache="dual", threshold=0.9, block_length=32), dict(threshold=0.9, steps=64),
                      dict(alg="entropy", steps=64)],
            "llada2": [dict(block_length=32), dict(block_length=32, threshold=0.5)]}


def add_arguments(ap):
    ap.add_argument("--part", nargs="*", default=None, help="masks validity accuracy gpu (default: the CPU parts)")
    ap.add_argument("--tokenizers", type=Path, default=None, help="where the 126k / 157k BPE files are (or go)")
    ap.add_argument("--vocabs", type=int, nargs="+", default=[126464, 157184])
    ap.add_argument("--requests", type=int, default=504)
    ap.add_argument("--per-shape", type=int, default=50, help="accuracy: prompts per task shape (8 shapes)")
    ap.add_argument("--models", nargs="+", default=list(ACC_MODELS), help="accuracy: bundled models")
    ap.add_argument("--tokens", type=int, default=64, help="answer canvas of the validity requests")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the masks part (1: a mask's own cost; "
                    "two threads on the 2 shared cores measured contention: a 126k scatter took 170 ms, not 0.15)")


def output(args) -> str:
    parts = args.part or ["masks", "validity", "accuracy"]
    return "structured_" + "_".join(parts) + ".json"


def check(kind, value, text) -> bool:
    if kind == "json_schema":
        model, schema = SCHEMAS[value]
        obj = json.loads(text)
        if model is not None:
            model.model_validate(obj)
        else:
            assert isinstance(obj, dict) and {"x", "y"} <= obj.keys() and len(obj.get("label", "")) <= 8
        return True
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    return text in value


def validity(n: int, tokens: int, root: Path) -> dict:
    """n requests round-robin over families x samplers x constraints; each answer checked."""
    rng = random.Random(0)
    jobs = [(f, o, k, v) for f in FAMILIES for o in SAMPLERS[f]
            for k, v in [("json_schema", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES] +
            [("choice", tuple(c)) for c in CHOICES]]
    engines, rows, bad = {}, {}, []
    for i in range(n):
        fam, opts, kind, value = jobs[i % len(jobs)]
        if fam not in engines:
            engines[fam] = MosaicEngine(str(byte_checkpoint(fam, root / fam, 0)), {"device": "cpu", "progress": False})
        arg = {"json_schema": SCHEMAS[value][1]} if kind == "json_schema" else {kind: list(value) if kind == "choice"
                                                                                else value}
        prompt = rng.choice("abcdefgh") + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 11)))
        out = engines[fam].generate(prompt, max_new_tokens=tokens, seed=i, temperature=rng.choice([0.0, 0.0, 1.0]),
                                    **arg, **opts)
        try:
            ok = check(kind, value, out.text)
        except Exception:   # noqa: BLE001  (any parse or validation failure is a miss)
            ok = False
        key = f"{fam} {json.dumps(opts)} {kind}"
        r = rows.setdefault(key, {"requests": 0, "valid": 0, "forwards": 0})
        r["requests"] += 1
        r["valid"] += int(ok)
        r["forwards"] += out.steps
        if not ok:
            bad.append({"key": key, "value": str(value), "text": out.text})
    total = sum(r["valid"] for r in rows.values())
    return {"requests": n, "valid": total, "valid_share": total / n, "tokens": tokens, "by_setting": rows,
            "invalid": bad[:20]}


ACC_MODELS = ("tiny-llada", "tiny-dream")
# sampler settings of the accuracy part: the published schedule (one token a step: the constrained rule
# then commits the frontier only; and the whole answer in one step), Fast-dLLM's threshold loop
ACC_SAMPLERS = {"steps": {"steps": tasks.ANSWER_LEN}, "1 step": {"steps": 1}, "threshold 0.9": {"threshold": 0.9}}


def task_regex(prompt: str) -> str:
    """A regex of the task's answer shape (it admits the right answer): a sum has no leading zero,
    a sort's digits never fall."""
    return "".join(f"{d}*" for d in "0123456789") if prompt.startswith("sort") else "[1-9][0-9]{0,3}"


ACC_CONSTRAINTS = {"free": lambda p: {}, "digits [0-9]{1,8}": lambda p: {"regex": "[0-9]{1,8}"},
                   "task regex": lambda p: {"regex": task_regex(p)}, "choice of 3": lambda p: {"choice": choices(p)}}


def accuracy(per_shape: int, models=ACC_MODELS, samplers=None) -> dict:
    """Answer accuracy of the bundled models on `per_shape` held-out prompts of each task shape
    (8 shapes: 400 prompts at 50), free and under constraints that admit the right answer, per
    sampler setting: accuracy, the paired comparison with the free answers (right -> wrong,
    wrong -> right), forwards per answer token and rows re-reduced under a mask. Prompts run
    batched: one generate() per group of equal length and equal constraint (no padding: LLaDA's
    positions count left padding), a choice (different per prompt) one prompt at a time."""
    import torch
    torch.set_num_threads(1)
    prompts = tasks.held_out(per_shape)
    out = {"prompts": len(prompts), "answer_tokens": tasks.ANSWER_LEN, "threads": 1}
    for name in models:
        e = MosaicEngine(name, {"device": "cpu", "progress": False})
        for sname, sopts in (samplers or ACC_SAMPLERS).items():
            res = out[f"{name} {sname}"] = {}
            free = None
            for label, make in ACC_CONSTRAINTS.items():
                texts, forwards, masked, t0 = {}, 0, 0, time.perf_counter()
                for group in batches(prompts, make):
                    g = e.generate(group, max_new_tokens=tasks.ANSWER_LEN, **sopts, **make(group[0]))
                    texts.update(zip(group, g.texts))
                    rows = (g.stats.get("nfe_per_row") if g.stats else None) or [g.steps] * len(group)
                    forwards += sum(rows)
                    masked += (g.stats.get("structured") or {}).get("rows_masked", 0)
                right = {p: texts[p] == tasks.solve(p) for p in prompts}
                r = res[label] = {"accuracy": sum(right.values()) / len(prompts), "count": len(prompts),
                                  "forwards_per_token": forwards / (len(prompts) * tasks.ANSWER_LEN),
                                  "rows_masked": masked, "seconds": time.perf_counter() - t0}
                if free is None:
                    free = right, texts
                    continue
                lost = [p for p in prompts if free[0][p] and not right[p]]
                r |= {"points_vs_free": 100 * (r["accuracy"] - res["free"]["accuracy"]),
                      "same_answer": sum(texts[p] == free[1][p] for p in prompts) / len(prompts),
                      "right_to_wrong": len(lost), "wrong_to_right": sum(right[p] and not free[0][p] for p in prompts),
                      "lost": [{"prompt": p, "free": free[1][p], "constrained": texts[p]} for p in lost[:12]]}
    return out


def batches(prompts: list[str], make, size: int = 50) -> list[list[str]]:
    """Prompts grouped by length and by constraint (a choice differs per prompt), at most `size`."""
    groups: dict = {}
    for p in prompts:
        groups.setdefault((len(p), json.dumps(make(p))), []).append(p)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


def choices(prompt: str) -> list[str]:
    """The right answer and two wrong ones of the same length (deterministic per prompt)."""
    right = tasks.solve(prompt)
    rng = random.Random(prompt)
    wrong = set()
    while len(wrong) < 2:
        w = "".join(rng.choice("0123456789") for _ in right)
        if w != right:
            wrong.add(w)
    return sorted({right, *wrong})


def gpu(prompt_len: int = 1024, tokens: int = 256) -> dict:
    """The llada-8b preset on CUDA (random weights, a byte-level tokenizer over its first 256
    ids), a 1k prompt and 256 new tokens in blocks of 32, dual cache, threshold 0.9: step_cost."""
    import torch
    if not torch.cuda.is_available():
        raise SuiteError("--part gpu needs CUDA")
    e = MosaicEngine("llada-8b", {"device": "cuda", "progress": False})
    byte_compiler(e)
    prompt = [int(i) for i in torch.randint(0, 30000, (prompt_len,), generator=torch.Generator().manual_seed(0))]
    return step_cost(e, prompt, dict(max_new_tokens=tokens, block_length=32, steps=tokens, cache="dual",
                                     threshold=0.9))


def byte_compiler(e) -> None:
    """Give an engine whose checkpoint has no tokenizer (a preset) a byte-level one for its
    constraints: bytes are its first 256 ids, masks span its whole head."""
    from tokenizers import Tokenizer

    from bench.lib.byte_models import byte_tokenizer_json
    from mosaic.runtime.grammar import Compiler
    from mosaic.tokenizer import TextTokenizer
    cfg = e.model.cfg
    e.requests.compiler = Compiler(TextTokenizer(Tokenizer.from_str(byte_tokenizer_json()), {}), cfg.vocab,
                                   cfg.eos_id)


class Cycles:
    """Wraps an engine's executor: the time from each call to the next one (the forward, its
    readbacks and the sampler's host work until it asks again: one step's cycle), per kind of
    call (a block cache's 'fill' or 'block' step, 'plain' without one). The last call's cycle
    ends at done()."""

    def __init__(self, executor):
        self.executor, self.marks = executor, []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def __call__(self, call, state):
        cache = getattr(call, "cache", None)
        self.marks.append((time.perf_counter(), "plain" if cache is None else cache.mode))
        return self.executor(call, state)

    def done(self) -> dict:
        """{kind: {"count", "mean_ms"}} of the cycles since the wrap."""
        ends = [t for t, _ in self.marks[1:]] + [time.perf_counter()]
        out: dict = {}
        for (t, kind), end in zip(self.marks, ends):
            r = out.setdefault(kind, {"count": 0, "total_ms": 0.0})
            r["count"] += 1
            r["total_ms"] += 1e3 * (end - t)
        return {k: {"count": r["count"], "mean_ms": r["total_ms"] / r["count"]} for k, r in out.items()}


def step_cost(e, prompt, opts: dict, schema=None) -> dict:
    """One request free, under a JSON schema, free again, each timed after a warm-up request
    (kernels, graph captures, the schema's compile): end-to-end seconds, forwards, ms per forward,
    tokens per forward, each kind of step's mean cycle (Cycles: a block step's forward plus the
    host work until the next, the constraint's walk included), the captured-graph counters of the
    timed request and the constraint's statistics. step_ratio: the constrained block step's cycle
    over the free one's (the mean of both free runs), the steady state of a cached request; a
    constrained answer that ends early (end-of-text fills the rest) runs fewer block steps, so its
    end-to-end ms per forward weighs the full-canvas fills more (end_to_end_ratio)."""
    import torch
    schema = SCHEMAS["order"][1] if schema is None else schema
    sync = torch.cuda.synchronize if e.model.device.type == "cuda" else (lambda: None)
    graphs, plain = e.runner.graphs, e.executor
    res = {}
    for label, extra in (("free", {}), ("json_schema", {"json_schema": schema}), ("free again", {})):
        e.generate(prompt, **opts, **extra)                     # warm-up (captures, compiles)
        before = graphs.stats.as_dict() if graphs is not None else {}
        sync()
        e.executor = cycles = Cycles(plain)
        try:
            t = time.perf_counter()
            g = e.generate(prompt, **opts, **extra)
            sync()
            s = time.perf_counter() - t
            kinds = cycles.done()
        finally:
            e.executor = plain
        after = graphs.stats.as_dict() if graphs is not None else {}
        res[label] = {"seconds": s, "forwards": g.steps, "ms_per_forward": 1e3 * s / g.steps,
                      "tokens_per_forward": opts["max_new_tokens"] / g.steps, "cycles": kinds,
                      "stats": g.stats.get("structured"), "lossy": g.lossy,
                      "graphs": {k: after[k] - before[k] for k in ("captures", "replays", "eager") if k in after}}
    step = "block" if "block" in res["free"]["cycles"] else "plain"

    def mean(label, key):
        return (res[label][key] if key == "ms_per_forward" else res[label]["cycles"][step]["mean_ms"])
    for key, name in (("cycle", "step_ratio"), ("ms_per_forward", "end_to_end_ratio")):
        free = (mean("free", key) + mean("free again", key)) / 2
        res[name] = mean("json_schema", key) / free
    res["step_kind"] = step
    return res


def run(args, rec) -> dict:
    parts = args.part or ["masks", "validity", "accuracy"]
    cache = args.tokenizers or args.out / "tokenizers"
    if "masks" in parts:
        import torch
        torch.set_num_threads(args.threads)
        rec.case("masks", lambda: masks(args.vocabs, cache))
    if "validity" in parts:
        rec.case("validity", lambda: validity(args.requests, args.tokens, args.out / "byte_models"))
    if "accuracy" in parts:
        rec.case("accuracy", lambda: accuracy(args.per_shape, args.models))
    if "gpu" in parts:
        rec.case("gpu", gpu)
    return rec


def table(rec) -> str:
    lines = []
    for key, r in ((rec.get("masks") or {}).get("libraries") or {}).items():
        if "constraints" in r:
            c = r["constraints"]
            lines.append(f"{key:<22} prepare {r['prepare_s']:6.2f} s  " + "  ".join(
                f"{k}: compile {v['compile_s'] * 1e3:7.1f} ms mask p50 {v['mask']['median_us']:7.1f} us"
                for k, v in c.items()))
        else:
            lines.append(f"{key:<22} {r}")
    v = rec.get("validity")
    if isinstance(v, dict) and "requests" in v:
        lines.append(f"validity: {v['valid']}/{v['requests']} constrained answers parse and validate")
    for name, res in (rec.get("accuracy") or {}).items():
        if isinstance(res, dict):
            lines.append(f"{name}: " + ", ".join(f"{k} {r['accuracy']:.1%}" for k, r in res.items()
                                                 if isinstance(r, dict) and "accuracy" in r))
    g = rec.get("gpu")
    if isinstance(g, dict) and "step_ratio" in g:
        kind = g.get("step_kind", "block")
        lines.append(f"gpu: step_ratio {g['step_ratio']:.3f} (constrained {kind} step / free, target <= 1.15; "
                     f"end to end per forward {g['end_to_end_ratio']:.3f}): " + ", ".join(
                         f"{k} {g[k]['cycles'][kind]['mean_ms']:.2f} ms x {g[k]['cycles'][kind]['count']} {kind} "
                         f"steps, {g[k]['forwards']} forwards" for k in ("free", "json_schema", "free again")))
    return "\n".join(lines)
