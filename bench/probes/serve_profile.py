"""Where a served round's wall goes: `mosaic serve`'s app in this process (ServerThread), C
streaming clients of 1k-token prompts + 128 tokens (dual cache 0.9, block 32), the server's
engine thread profiled while they run: its host functions (cProfile, enabled inside the thread
by a wrapped Scheduler.step), the Scheduler's rounds (wall inside step() and between steps: the
worker's queue, reports and streaming), and the GPU's kernel time over the unprofiled wall.

    python -m bench.probes.serve_profile --concurrency 16 --out DIR     # llada-8b on the GPU
    python -m bench.probes.serve_profile --cpu --concurrency 4 --out DIR  # tiny-llada, a smoke run

Writes DIR/serve_profile.json."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import pstats
import time
from pathlib import Path

import torch

from bench.lib.measure import canvas
from mosaic import MosaicEngine
from mosaic.engine.scheduler import Scheduler
from mosaic.serve.commands import SERVE_ROUND_TOKENS

DUAL = dict(cache="dual", threshold=0.9)


class StepProbe:
    """Scheduler.step wrapped: rounds, their wall inside step() and between steps, and a cProfile
    of the thread that steps while `on` (created and enabled inside that thread)."""

    def __init__(self):
        self.on, self.prof, self.rounds, self.inside, self.last, self.between = False, None, 0, 0.0, None, 0.0
        self.sizes: dict[int, int] = {}        # running sequences at a profiled round -> rounds
        self.walls: list[float] = []           # each profiled round's wall inside step(), s
        self.sched = None
        real = Scheduler.step

        def step(sched):
            self.sched = sched
            if self.on and self.prof is None:        # the first profiled round: no gap before it
                self.prof, self.last = cProfile.Profile(), None
                self.prof.enable()
            if not self.on and self.prof is not None:
                self.prof.disable()
            t0 = time.perf_counter()
            if self.on and self.last is not None:
                self.between += t0 - self.last
            out = real(sched)
            t1 = time.perf_counter()
            if self.on:
                self.rounds += 1
                self.inside += t1 - t0
                self.walls.append(t1 - t0)
                k = len(sched.running) + len(out)
                self.sizes[k] = self.sizes.get(k, 0) + 1
            self.last = t1
            return out
        Scheduler.step = step


def top(prof, key: int, n: int = 30) -> list[dict]:
    stats = pstats.Stats(prof).stats
    rows = sorted(((v[key], f"{k[0].split('mosaic/')[-1]}:{k[1]}:{k[2]}", v[1]) for k, v in stats.items()),
                  reverse=True)[:n]
    return [{"s": round(t, 4), "fn": f, "calls": c} for t, f, c in rows]


async def clients(url: str, body: dict, c: int) -> list[float]:
    import httpx

    async def one():
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, (await r.aread())[:300]
            async for _ in r.aiter_lines():
                pass
        return time.perf_counter() - t0
    return await asyncio.gather(*(one() for _ in range(c)))


def _quantiles(xs: list[float]) -> list[float]:
    xs = sorted(xs) or [0.0]
    return [xs[len(xs) // 2], xs[int(0.9 * (len(xs) - 1))], xs[-1]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--round-tokens", type=int, default=SERVE_ROUND_TOKENS,
                    help="the server's chunked-joining budget (default: mosaic serve's); 0: fills run whole")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    from mosaic.config import EngineConfig
    from mosaic.serve.commands import default_budget
    from mosaic.serve.server import ServerThread
    device = "cpu" if a.cpu else "cuda"
    econf, _ = default_budget(EngineConfig.coerce({"progress": False, "device": device}))
    econf = dataclasses.replace(econf, round_tokens=a.round_tokens or None)     # as mosaic serve sets it
    eng = MosaicEngine("tiny-llada" if a.cpu else "llada-8b", econf)
    n, new = (40, 16) if a.cpu else (1024, 128)    # tiny-llada: 64 positions
    ids = [t for t in canvas(eng.model, n, 0)[0].tolist() if t != eng.model.cfg.mask_id]
    body = {"prompt": ids, "max_tokens": new, "stream": True, "block_length": min(32, new), "steps": new, **DUAL}
    probe = StepProbe()
    with ServerThread(eng, max_batch=a.concurrency, request_timeout=None) as srv:
        asyncio.run(clients(srv.url, body, 1))
        asyncio.run(clients(srv.url, body, a.concurrency))          # warm: the buckets' captures
        t0 = time.perf_counter()
        lat = asyncio.run(clients(srv.url, body, a.concurrency))
        wall = time.perf_counter() - t0
        before = probe.sched.stats.as_dict() if probe.sched is not None else {}
        probe.on = True
        asyncio.run(clients(srv.url, body, a.concurrency))
        probe.on = False
        after = probe.sched.stats.as_dict() if probe.sched is not None else {}
        asyncio.run(clients(srv.url, body, 1))                     # its first step disables the profile
        gpu = None
        if not a.cpu:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                asyncio.run(clients(srv.url, body, a.concurrency))
                torch.cuda.synchronize()
            kernel_s = sum(e.device_time for e in p.events() if e.device_type.name == "CUDA") / 1e6
            gpu = {"kernel_s": kernel_s, "busy_of_unprofiled_wall": kernel_s / wall}
    res = {"concurrency": a.concurrency, "wall_s": wall, "tok_per_s": a.concurrency * new / wall,
           "latency_max_s": max(lat), "profiled_rounds": probe.rounds,
           "ms_in_step_per_round": 1e3 * probe.inside / max(1, probe.rounds),
           "ms_between_steps_per_round": 1e3 * probe.between / max(1, probe.rounds), "gpu": gpu,
           "round_tokens": econf.round_tokens, "running_per_round": dict(sorted(probe.sizes.items())),
           "round_ms_p50_p90_max": [round(1e3 * w, 2) for w in _quantiles(probe.walls)],
           "executor": {k: (after[k] - before.get(k, 0)) if k in ("steps", "stacked_steps", "fill_slices")
                        else after[k] for k in after},
           "tottime": top(probe.prof, 2) if probe.prof else [], "cumtime": top(probe.prof, 3) if probe.prof else []}
    print(json.dumps({k: v for k, v in res.items() if k not in ("tottime", "cumtime")}), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "serve_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
