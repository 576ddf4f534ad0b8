"""FP8 quality on the bundled models: logit KL, token agreement and held-out accuracy.

Logit KL and token agreement against the 16-bit model, and held-out accuracy, per precision
setting. Runs on the CPU (float32 model, FP8 emulated exactly: kernels/fp8.py) or on
a GPU (bf16, torch._scaled_mm).

    python -m bench eval_fp8 [--device cpu] [--per-shape 25] [--out DIR]

Settings: the 16-bit model; every layer FP8; every layer and the embedding FP8; the sensitivity
chooser (KL measure) at weight targets of 0.75, 0.6 and 0.45 of the 16-bit bytes (fp32 here: FP8
layers take a quarter of their bytes; on bf16 a half). Writes fp8_quality_<device>.json and
prints one table per model."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from bench.lib import engine as E
from mosaic import MosaicEngine
from mosaic.assets import tasks
from mosaic.policy.sensitivity import calibration_canvases

SETTINGS = {
    "16-bit": None,
    "fp8 all layers": {"ranges": [{"layers": [0, 99], "dtype": "fp8"}]},
    "fp8 all + embedding": {"ranges": [{"layers": [0, 99], "dtype": "fp8"}], "embed": "fp8"},
    "auto 0.75": {"auto": True, "target_weight_bytes": 0.75},
    "auto 0.6": {"auto": True, "target_weight_bytes": 0.6},
    "auto 0.45": {"auto": True, "target_weight_bytes": 0.45},
}


def fix_ranges(pc, layers):
    if pc and "ranges" in pc:
        pc = {**pc, "ranges": [{**r, "layers": [r["layers"][0], min(r["layers"][1], layers - 1)]}
                               for r in pc["ranges"]]}
    return pc


def logits_at_masks(engine, canvases):
    logits = E.forward_logits(engine, canvases)
    return logits[canvases == engine.model.cfg.mask_id].float()


def accuracy(engine, prompts, batch=50):
    by_len = defaultdict(list)
    for p in prompts:
        by_len[len(p)].append(p)
    right = 0
    for group in by_len.values():
        for i in range(0, len(group), batch):
            part = group[i:i + batch]
            out = engine.generate(part, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN, progress=False)
            right += sum(t == tasks.solve(p) for p, t in zip(part, out.texts))
    return right / len(prompts)


def evaluate(name, device, per_shape, settings, on_row=None):
    prompts = tasks.held_out(per_shape)
    base = MosaicEngine(name, {"device": device, "progress": False})
    layers = base.model.cfg.num_layers
    # canvases from the held-out distribution's shapes, not the chooser's calibration seed
    canv = calibration_canvases(base.model, 64, seed=4242)
    ref = logits_at_masks(base, canv)
    ref_lp = torch.log_softmax(ref, -1)
    rows = []
    for label, pc in settings.items():
        t0 = time.perf_counter()
        eng = base if pc is None else MosaicEngine(name, {"device": device, "progress": False,
                                                         "precision": fix_ranges(pc, layers)})
        lg = logits_at_masks(eng, canv)
        lp = torch.log_softmax(lg, -1)
        kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
        agree = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
        acc = accuracy(eng, prompts)
        rep = E.precision_report(eng)
        rows.append({"setting": label, "precision": list(eng.model.precision) or ["16-bit"] * layers,
                     "embed_fp8": "embed_scale" in eng.model.extra, "weight_bytes": eng.model.weight_bytes(),
                     "weight_bytes_16bit": base.model.weight_bytes(), "kl": kl, "token_agreement": agree,
                     "accuracy": acc, "sensitivity": rep.get("sensitivity"), "seconds": time.perf_counter() - t0})
        print(f"  {name} {label}: KL {kl:.2e}, agreement {agree:.3f}, accuracy {acc:.3f}", flush=True)
        res = {"model": name, "device": device, "dtype": str(base.model.dtype), "prompts": len(prompts),
               "canvases": int(canv.shape[0]), "rows": rows}
        if on_row:
            on_row(res)
    return res


def add_arguments(ap):
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="tiny-llada,tiny-dream")
    ap.add_argument("--per-shape", type=int, default=25)
    ap.add_argument("--settings", default=",".join(SETTINGS))


def output(args) -> str:
    return f"fp8_quality_{args.device.split(':')[0]}.json"


def run(args, rec) -> dict:
    settings = {k: SETTINGS[k] for k in args.settings.split(",")}
    rec["results"] = []
    for i, m in enumerate(args.models.split(",")):
        def save(res, i=i):                       # after every row: a cut-short run keeps what it has
            rec["results"][i:] = [res]
            rec.save()
        save(evaluate(m, args.device, args.per_shape, settings, save))
    return rec


def table(rec) -> str:
    lines = []
    for r in rec["results"]:
        lines.append(f"\n{r['model']} ({r['dtype']}, {r['device']}; KL and agreement on {r['canvases']} canvases, "
                     f"accuracy on {r['prompts']} held-out prompts)")
        lines.append(f"{'setting':<22} {'fp8 layers':>10} {'weights':>9} {'vs 16-bit':>9} {'KL':>9} {'agree':>7} "
                     f"{'accuracy':>9}")
        for row in r["rows"]:
            n8 = sum(p == "fp8" for p in row["precision"])
            lines.append(f"{row['setting']:<22} {n8:>6}/{len(row['precision']):<3} "
                         f"{row['weight_bytes'] / 2**20:>7.2f}MB "
                         f"{row['weight_bytes'] / row['weight_bytes_16bit'] - 1:>+8.1%} {row['kl']:>9.2e} "
                         f"{row['token_agreement']:>7.3f} {row['accuracy']:>9.1%}")
    return "\n".join(lines).strip()
