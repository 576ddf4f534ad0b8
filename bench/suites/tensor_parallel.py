"""Tensor parallelism on several GPUs: dual-cache block step, 1k+256 end to end, NVML per GPU (torchrun).

Tensor parallelism's targets on two GPUs (TP=2 vs one GPU, llada-8b, seeded random weights, bf16): the
dual-cache block step <= 0.6x one GPU's (each GPU reads half of the layer weights), end-to-end
tok/s >= 1.6x at a 1,024-token prompt + 256 generated tokens; the NVML peak of every GPU within
its budget; token agreement with one GPU. One launch (prepared; not run yet: no GPU was lent):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench tensor_parallel --out DIR

Phase A, before the process group exists: every rank is a one-GPU process on its own GPU and
runs the one-GPU baseline (rank 0 by default, with CUDA graphs; rank 1 with cuda_graphs='off',
as tensor parallelism runs: it does not capture steps). Phase B, NCCL (NCCL_BOUNDS
unless set): the same model loaded on every GPU with the same seed, handed to an engine with
parallel='tensor' (each rank copies its slices, the full copy is dropped before measuring), the
same requests. A request: `--prompt` random tokens, `--gen` tokens in blocks of `--block`, one
token per step, cache='dual'; the block step is the median time between two on_step calls inside
a block (the fill steps excluded), end to end is the whole generate(). --smoke: the same flow on a
CPU with gloo, tiny-llada and a short request (a check of the suite's code, not a measurement):

    python -m torch.distributed.run --nproc_per_node 2 -m bench tensor_parallel --smoke --out /tmp/tp"""

from __future__ import annotations

import contextlib
import time
import traceback

import torch
import torch.distributed as dist

from bench.lib.measure import free, median, sync
from bench.lib.ranks import everyone, start_rank
from mosaic import MosaicEngine, load

GiB = 2**30
FULL = {"model": "llada-8b", "prompt": 1024, "gen": 256, "block": 32, "repeat": 2}
SMOKE = {"model": "tiny-llada", "prompt": 48, "gen": 16, "block": 8, "repeat": 1}
CFG = dict(FULL)


def add_arguments(ap):
    ap.add_argument("--smoke", action="store_true", help="the same flow on a CPU: gloo, tiny-llada")


def prompt_ids(model, n: int) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, model.cfg.mask_id - 1, (n,), generator=g).tolist()


def request(engine, dev, m) -> dict:
    """One dual-cache request of CFG's shape, CFG['repeat'] times (the first a warm-up when > 1):
    end-to-end seconds and tok/s, the median block step, NVML peak of this GPU (meter m)."""
    gen = dict(max_new_tokens=CFG["gen"], steps=CFG["gen"], block_length=CFG["block"], cache="dual",
               progress=False)
    ids = prompt_ids(engine.model, CFG["prompt"])
    runs = []
    for _ in range(CFG["repeat"]):
        stamps = []

        def on_step(i, canvas):
            sync(dev)
            stamps.append(time.perf_counter())
        sync(dev)
        with (m if m is not None else contextlib.nullcontext()), \
                (m.window() if m is not None else contextlib.nullcontext()) as w:
            t = time.perf_counter()
            out = engine.generate(ids, on_step=on_step, **gen)
            sync(dev)
            sec = time.perf_counter() - t
        per_block = CFG["block"]
        # steps 1..per_block-1 of every block follow a block step (step 0 of a block follows the fill)
        block_ms = [(stamps[i] - stamps[i - 1]) * 1e3 for i in range(1, len(stamps)) if i % per_block]
        runs.append({"seconds": sec, "tok_s": CFG["gen"] / sec, "block_step_ms": median(block_ms),
                     "steps": len(stamps), "nvml_peak_bytes": w.peak_bytes if w is not None else None,
                     "tokens": out.tokens.cpu()})
    last = runs[-1]
    return {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "seconds": last["seconds"],
            "tok_s": last["tok_s"], "block_step_ms": last["block_step_ms"], "nvml_peak_bytes": last["nvml_peak_bytes"],
            "weight_bytes": engine.model.weight_bytes(), "tokens": last["tokens"], "lossy": out.lossy}


def measured(dev, m, **opts) -> dict:
    """request() on a fresh engine of CFG's model with engine options opts, closed after."""
    model = load(CFG["model"], device=dev)      # the same seeded weights on every process
    engine = MosaicEngine(model, {"progress": False, **opts})
    del model                                    # tensor: the engine keeps its own slices only
    free(dev)
    try:
        return request(engine, dev, m) | {"options": opts}
    finally:
        engine.close()
        free(dev)


def guarded(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (recorded; the other parts still run)
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}


def run(args, rec) -> dict:
    CFG.clear()
    CFG.update(SMOKE if args.smoke else FULL)
    rank, world, dev, m = start_rank(args.smoke)
    rec.write, rec.hard_exit = rank == 0, True
    rec.update(model=CFG["model"], world=world, shape=dict(CFG), cases={})

    # -- phase A: one GPU per process; rank 0 as it runs by default (CUDA graphs on a GPU),
    # rank 1 without CUDA graphs (tensor parallelism does not capture steps: the like-for-like base)
    one = guarded(lambda: measured(dev, m, **({"cuda_graphs": "off"} if rank % 2 else {})))

    # -- phase B: tensor parallel over every rank
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    ones = everyone({k: v for k, v in one.items() if k != "tokens"}, dev)
    ref = one.get("tokens")
    tp = guarded(lambda: measured(dev, m, parallel="tensor"))
    if "tokens" in tp and ref is not None:
        tp["tokens_agree_one_gpu"] = float((tp.pop("tokens") == ref).float().mean())
    tp.pop("tokens", None)
    tps = everyone(tp, dev)
    rec["cases"] = {"one_gpu": ones, "tensor_parallel": tps}
    b = tps[0]
    for r, a in enumerate(ones):   # against each one-GPU baseline (rank 0: default, rank 1: no graphs)
        if "error" not in a and "error" not in b:
            rec.setdefault("summary", {})[f"vs_one_gpu_rank{r}"] = {
                "one_gpu_options": a["options"], "block_step_ratio": b["block_step_ms"] / a["block_step_ms"],
                "e2e_speedup": b["tok_s"] / a["tok_s"], "weights_per_gpu_ratio": b["weight_bytes"] / a["weight_bytes"]}
    rec["targets"] = {"block_step_ratio_max": 0.6, "e2e_speedup_min": 1.6}
    rec.save()
    dist.destroy_process_group()
    return rec


def table(rec) -> str:
    if not rec.write:
        return ""
    c = rec["cases"]
    lines = [f"{CFG['model']}: prompt {CFG['prompt']} + {CFG['gen']} tokens, blocks of {CFG['block']}, dual cache"]
    for name in ("one_gpu", "tensor_parallel"):
        for r, v in enumerate(c.get(name, [])):
            if "error" in v:
                lines.append(f"{name:>16} rank {r}: {v['error']}")
                continue
            peak = v.get("nvml_peak_bytes")
            lines.append(f"{name:>16} rank {r}: block step {v['block_step_ms']:8.2f} ms, {v['tok_s']:8.1f} tok/s, "
                         f"weights {v['weight_bytes'] / GiB:6.2f} GiB, NVML peak "
                         f"{'-' if peak is None else f'{peak / GiB:.2f} GiB'}"
                         + (f", tokens agree {v['tokens_agree_one_gpu']:.3f}" if "tokens_agree_one_gpu" in v else ""))
    for key, s in (rec.get("summary") or {}).items():
        lines.append(f"TP={rec['world']} {key} {s['one_gpu_options'] or 'default'}: block step "
                     f"{s['block_step_ratio']:.2f}x (target <= 0.6x), end to end {s['e2e_speedup']:.2f}x "
                     f"(target >= 1.6x), weights per GPU {s['weights_per_gpu_ratio']:.2f}x")
    return "\n".join(lines)
