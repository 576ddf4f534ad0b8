"""`mosaic calibrate MODEL --out engine.yaml`: block-sparse attention chosen per layer for a
quality target (mosaic/engine/calibrate.py does the work; this prints its summary)."""

from __future__ import annotations

import sys

from .engine.calibrate import calibrate
from .errors import InputError


def cmd_calibrate(args) -> int:
    if args.prompts and args.tasks:
        raise InputError("give calibration prompts (--prompts FILE) or --tasks, not both")
    if args.block is not None and (args.block < 16 or args.block & (args.block - 1)):
        raise InputError(f"--block {args.block}: a power of two >= 16")
    doc = calibrate(args.model, args.out, prompts=args.prompts, tasks=args.tasks, lengths=args.lengths, n=args.n,
                    min_recall=args.min_recall, max_loss=args.max_loss, max_kl=args.max_kl, block=args.block,
                    dense_steps=args.dense_steps, estimates=tuple(args.estimates),
                    verify=False if args.no_verify else None, eval_n=args.eval_n, answer_len=args.answer_len,
                    threads=args.threads, device=args.device, progress=not args.no_progress, json_out=args.json)
    print(summary(doc))
    print(f"wrote {args.out}" + (f" and {args.json}" if args.json else ""), file=sys.stderr)
    return 0


def summary(doc: dict) -> str:
    """A few lines: per layer the choice and its recall; accuracy and modelled speed-ups."""
    rec = doc["calibration"]
    lines = [f"{rec['model']}: block {rec['block']}, estimate {rec['estimate']}, target recall >= "
             f"{rec['target']['min_recall']} or one-layer KL <= {rec['target']['max_kl']}"
             + (f", loss <= {rec['target']['max_loss']} points" if rec["target"]["max_loss"] is not None else "")]
    for c in rec["layers"]:
        err = f", one-layer KL {c['one_layer_kl']:.4f}" if "one_layer_kl" in c else ""
        lines.append(f"  layer {c['layer']}: {c['label']:<18} density {c['density']:.3f} recall {c['recall']:.3f} "
                     f"entropy {c['entropy']:.3f}{err}")
    acc = rec.get("accuracy")
    if acc:
        for name, cells in acc["exact_percent"].items():
            lines.append(f"  accuracy {name}: " + ", ".join(f"{k} {v:.1f}%" for k, v in cells.items()))
        lines.append(f"  worst loss against dense: {acc['worst_loss_points']:.1f} points (n={acc['n']} per cell)")
    sp = rec["modelled_speedup"]
    lines.append(f"  modelled speed-up: {sp['calibration_geometry']['speedup']:.2f}x on {rec['model']} at "
                 f"{sp['calibration_geometry']['tokens']} tokens; {sp['llada_8b_128k']['speedup']:.2f}x on llada-8b "
                 f"at 128k ({sp['llada_8b_128k']['rule']}; every layer topk 0.1: "
                 f"{sp['llada_8b_128k_every_layer_topk_0.1']['speedup']:.2f}x)")
    return "\n".join(lines)
