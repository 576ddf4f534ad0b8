"""The constrained step in two halves (runtime/samplers/constrained_reducer.py: the family reducer
and the saved logits on the device, the DFA walk on the host after the step) gives the tokens the
earlier design gave (the walk inside the step after each logits chunk, reproduced here as the
oracle), on random byte-level checkpoints, where the walk masks many rows: every family, the
count, threshold and cache loops, greedy and sampled, batched."""

from __future__ import annotations

import pytest
import torch
from fake_graphs import FakeGraphs

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.runtime.samplers import constraint as constraint_mod

pytest.importorskip("outlines_core")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
    "enum": ["ab", "c"]}, "maxItems": 3}, "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"]}

CASES = [("llada", dict(steps=48, block_length=16)), ("llada", dict(steps=48, block_length=16, temperature=1.0)),
         ("llada", dict(cache="dual", threshold=0.9, block_length=16)),
         ("dream", dict(steps=48, temperature=1.0, top_p=0.9)), ("dream", dict(threshold=0.9, steps=48)),
         ("dream", dict(cache="prefix", threshold=0.9, block_length=16)), ("llada2", dict(block_length=16))]


class InStepWalk:
    """The earlier ConstrainedReducer: the family reducer on a logits chunk, then the walk over the
    chunk's rows at once inside the step (a host read per chunk), re-reducing a disallowed row
    from a saved copy of the chunk's logits. Nothing is saved as an output; `walk` is a no-op."""
    fused = None
    after_bytes = None

    def __init__(self, inner, constraint, rows, width, *_):
        self.inner, self.c = inner, constraint
        self.seq = (rows // width).tolist()
        self.cur: dict[int, list] = {}

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def subset(self, idx):
        return self

    def outputs(self, dtype):
        return self.inner.outputs(dtype)

    def signature(self):
        return ("in-step walk", id(self))

    def transient_bytes(self, m, V, dtype):
        return self.inner.transient_bytes(m, V, dtype) + (m + 1) * V * 5

    def finish(self):
        self.inner.finish()

    def walk(self, outs):
        return outs

    def __call__(self, lg, lu, a, b, outs):
        saved, saved_u = lg.clone(), None if lu is None else lu.clone()
        self.inner(lg, lu, a, b, outs)
        x0 = outs["x0"].tolist()
        g, c = self.c.g, self.c
        for j in range(b - a):
            seq = self.seq[a + j]
            cur = self.cur.setdefault(seq, [c.state[seq], c.front[seq], False])
            left = c.end[seq] - cur[1] - 1
            if cur[2]:
                outs["x0"][j] = g.eos
            elif not g.allows(cur[0], x0[j], left):
                row = saved[j:j + 1]
                row.masked_fill_(~g.mask(cur[0], left), -torch.inf)
                one = {k: v[j:j + 1] for k, v in outs.items()}
                self.inner(row, None if saved_u is None else saved_u[j:j + 1], a + j, a + j + 1, one)
                x0[j] = int(one["x0"][0])
                c.count_masked()
            tok = int(outs["x0"][j]) if cur[2] else x0[j]
            if tok in c.eos_ids:
                cur[2] = True
            else:
                cur[0] = g.advance(cur[0], tok)
            cur[1] += 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("walk")
    return {f: str(byte_checkpoint(f, root / f, 0)) for f in {c[0] for c in CASES}}


def run_all(folders):
    out = {}
    for family in folders:
        e = MosaicEngine(folders[family], {"device": "cpu", "progress": False})
        for i, (fam, opts) in enumerate(CASES):
            if fam == family:
                g = e.generate(["x", "yz"], max_new_tokens=48, json_schema=SCHEMA, seed=7, **opts)
                out[i] = (g.tokens, g.stats["structured"]["rows_masked"])
    return out


def test_walk_after_the_step_gives_the_in_step_walks_tokens(folders, monkeypatch):
    new = run_all(folders)
    monkeypatch.setattr(constraint_mod, "ConstrainedReducer", InStepWalk)
    old = run_all(folders)
    for i, (_, opts) in enumerate(CASES):
        assert torch.equal(new[i][0], old[i][0]), CASES[i]
        # Fast-dLLM's threshold rule: the walk stops at the first row below the threshold (the rows
        # after it are never committed), so it re-reduces fewer rows; elsewhere exactly the same rows
        stops = "threshold" in opts and "cache" in opts
        assert (new[i][1] <= old[i][1]) if stops else (new[i][1] == old[i][1]), (CASES[i], new[i][1], old[i][1])
    assert sum(masked for _, masked in new.values()) > 20      # the walk masked rows: the re-reduction is tested
    assert new[2][1] < old[2][1]                              # and stopped early under the threshold rule


@pytest.mark.parametrize("opts", [dict(steps=48, block_length=16), dict(cache="dual", threshold=0.9, block_length=16)])
def test_constrained_steps_are_captured_and_replayed(folders, opts):
    from mosaic.runtime.graphs import StepGraphs
    kw = dict(max_new_tokens=48, json_schema=SCHEMA, **opts)
    ref = MosaicEngine(folders["llada"], {"device": "cpu", "progress": False}).generate(["x", "yz"], **kw)
    e = MosaicEngine(folders["llada"], {"device": "cpu", "progress": False})
    e.runner.graphs = StepGraphs(FakeGraphs())
    out = e.generate(["x", "yz"], **kw)
    st = e.runner.graphs.stats
    assert torch.equal(out.tokens, ref.tokens) and out.stats["structured"] == ref.stats["structured"]
    assert st.captures >= 1 and st.replays > st.captures and not st.failures
