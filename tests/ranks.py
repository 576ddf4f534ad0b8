"""Spawning ranks for the sequence-parallel tests: gloo processes on the CPU, or several gloo
processes sharing one GPU (gloo broadcasts CUDA tensors; NCCL refuses two ranks on one GPU)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import bundled, left_padded, random_model

from mosaic import MosaicEngine, load


def prompts(cfg, batch):
    g = torch.Generator().manual_seed(11)
    out = [torch.randint(0, cfg.mask_id - 4, (6 + 4 * i,), generator=g).tolist() for i in range(batch)]
    return out if batch > 1 else out[0]


def make(family, device="cpu"):
    if family.startswith("tiny-"):
        return load(bundled(family), device=device, dtype="float32" if device != "cpu" else "auto")
    assert device == "cpu"
    return random_model(family)


def batch_prompts(family, model, batch):
    if family == "tiny-llada":
        return ["sort 90817263=", "sort 4411="][:batch]
    if family == "tiny-dream":
        return ["57+384=", "sort 4411="][:batch]
    return prompts(model.cfg, batch)


def batch_inputs(family, model, batch) -> dict:
    """generate()'s prompt arguments: one prompt, or ONE left-padded request of `batch` rows (a
    [B, L] tensor and its mask: a list would be a batch of requests in one process, where several
    processes run it as one padded request)."""
    p = batch_prompts(family, model, batch)
    if batch == 1:
        return {"prompt": p}
    ids = [model.tokenizer.encode(q) if isinstance(q, str) else q for q in p]
    inputs, mask = left_padded(model.cfg, ids)
    return {"inputs": inputs, "attention_mask": mask}


def single(family, case, batch, device="cpu"):
    model = make(family, device)
    return MosaicEngine(model, {"progress": False}).generate(**batch_inputs(family, model, batch), **case)


def worker(rank, world, init, family, case, batch, chunks, path, peer_rows, device, opts=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = make(family, device)
        # peer_rows: peers' K/V arrive in several pieces per shard
        engine = MosaicEngine(model, {"progress": False, "sanitize": True, "chunks": chunks,
                                      **({"peer_rows": peer_rows} if peer_rows else {}), **(opts or {})})
        out = engine.generate(**batch_inputs(family, model, batch), **case)
        torch.save(out.tokens.cpu(), f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def run(tmp_path, world, family, case, batch, chunks=None, peer_rows=None, device="cpu", opts=None):
    """Each rank's tokens; opts: more engine options for every rank."""
    path = str(tmp_path / "tokens")
    mp.spawn(worker, args=(world, f"file://{tmp_path}/init", family, case, batch, chunks, path,
                           peer_rows, device, opts), nprocs=world, join=True)
    return [torch.load(f"{path}.{r}") for r in range(world)]
