"""Row reducers: what the planned path computes from a chunk of masked rows' logits.

A reducer is handed logits [M_c, V] of consecutive masked slots and writes per-slot results
(token id, confidence) into small [M] buffers; it applies exactly the published per-position
math (published.py) to those rows. `fused` describes the work to the Triton kernel where one
exists, so the logits never exist as a tensor at all.

Random draws and captured steps (runtime/graphs.py): a reducer names the generator it draws
from (`generator`, None: torch's default one of the device) and gives a copy drawing from
another (`with_generator`: a captured step draws from the graph's own generator, loaded with
the request's stream before each replay); `draw_calls(m, V, dtype, fused)` lists the random
calls it makes for a chunk of m rows (kind, elements, dtype), so the request's generator can be
advanced by what the eager step would have drawn for its real rows; where the published code
takes a host-side branch, a captured reducer computes a device flag instead (output "ok",
False: the step is rerun eagerly)."""

from __future__ import annotations

import copy

import torch

from ..kernels.masked_logits import FusedSpec
from . import published as P


class NoiseStream:
    """Uniform float64 noise for rows of a [R, V] tensor, drawn in row order so that on the CPU
    it equals one torch.rand([R, V]) call of the same generator (the CPU generator fills in
    order; rows nobody asked for are drawn and dropped). CUDA's generator is counter-based per
    call, so there the rows are a valid stream but not the reference's."""

    def __init__(self, total_rows: int, vocab: int, generator, device, piece: int = 256):
        self.total, self.vocab, self.g, self.device = total_rows, vocab, generator, device
        self.cursor, self.piece = 0, piece
        # the CPU generator fills in order: the reference's rows are reproduced there; CUDA's is
        # counter-based per call, and one call per chunk is what a captured step can replay
        self.in_order = torch.device(device).type != "cuda"

    def _skip_to(self, row: int, scratch: torch.Tensor):
        while self.cursor < row:
            n = min(row - self.cursor, scratch.shape[0])
            scratch[:n].uniform_(generator=self.g)
            self.cursor += n

    def rows(self, positions) -> torch.Tensor:
        """[len(positions), V] float64 uniforms: on the CPU in the reference's row order (a list
        of flat positions, ascending), on CUDA one draw for the rows (positions: any sequence of
        their count; the counter-based stream keeps no row order, and one call per chunk is what
        a captured step can replay)."""
        if not self.in_order:
            return torch.rand((len(positions), self.vocab), dtype=torch.float64, device=self.device,
                              generator=self.g)
        out = torch.empty(len(positions), self.vocab, dtype=torch.float64, device=self.device)
        i = 0
        while i < len(positions):
            self._skip_to(positions[i], out[i:])
            run = 1
            while i + run < len(positions) and positions[i + run] == positions[i] + run:
                run += 1
            out[i:i + run].uniform_(generator=self.g)
            self.cursor += run
            i += run
        return out

    def finish(self):
        # only the CPU generator fills in order: on CUDA the rows nobody asked for keep no stream
        # in step, and drawing them would take a [256, V] float64 scratch outside the plan and
        # the budget (258 MB at V = 126,464) plus N x V draws per step
        if not self.in_order:
            return
        if self.cursor < self.total:
            scratch = torch.empty(min(self.piece, self.total - self.cursor), self.vocab,
                                  dtype=torch.float64, device=self.device)
            self._skip_to(self.total, scratch)


class LLaDAReducer:
    def __init__(self, mcfg, gen, positions, total_rows: int, generator, device):
        self.m, self.g, self.generator = mcfg, gen, generator
        self.cuda = torch.device(device).type == "cuda"
        # flattened [B*L] position of each slot, ascending; a host list only where noise is drawn
        # in the reference's row order (the CPU)
        self.positions = positions.tolist() if gen.temperature > 0 and not self.cuda and \
            hasattr(positions, "tolist") else positions          # (rows() takes either)
        self.noise = NoiseStream(total_rows, mcfg.vocab, generator, device) \
            if gen.temperature > 0 else None
        self.conf_f64 = gen.confidence_dtype == "float64"

    def with_generator(self, generator) -> LLaDAReducer:
        """The same reduction drawing from `generator` (a captured step's own)."""
        r = copy.copy(self)
        r.generator = generator
        if r.noise is not None:
            r.noise = copy.copy(r.noise)
            r.noise.g = generator
        return r

    def draw_seed(self, out: torch.Tensor) -> None:
        """The fused kernel's Gumbel key, drawn on the device into out [1] int64 (graph/ctx.py)."""
        out.random_(0, 2**31 - 1, generator=self.generator)

    @property
    def draws(self) -> bool:
        return self.g.temperature > 0

    def capture_problem(self, fused: bool) -> str | None:
        """Why a step of this reduction cannot be captured (None: it can)."""
        if self.noise is not None and self.noise.in_order:
            return "noise in the reference's row order (CPU)"
        return None

    def draw_calls(self, m: int, V: int, dtype, fused: bool) -> list[tuple[str, int, torch.dtype]]:
        """The random calls of a chunk of m rows: the buffer path's uniforms (the fused path's
        one-element seed is drawn alike for any m)."""
        return [("uniform", m * V, torch.float64)] if self.draws and not fused else []

    def subset(self, idx: torch.Tensor) -> LLaDAReducer:
        """The same reduction for some of the slots (a rank's share); the noise stream is shared
        and still drawn in full row order, so every rank's generator stays in step."""
        r = copy.copy(self)
        pos = self.positions
        r.positions = [pos[i] for i in idx.tolist()] if isinstance(pos, list) else pos[idx]
        return r

    def outputs(self, dtype):
        outs = [("x0", torch.int64)]
        if self.g.remasking == "low_confidence":
            outs.append(("conf", torch.float64 if self.conf_f64 else dtype))
        return outs

    @property
    def fused(self) -> FusedSpec | None:
        g = self.g
        if self.conf_f64 or g.logits_eos_inf or g.confidence_eos_eot_inf or g.cfg_scale > 0:
            return None
        if g.temperature > 0 and self.noise is not None and self.noise.device.type != "cuda":
            return None  # CPU: reproduce the reference's random stream on the buffer path
        return FusedSpec(temperature=g.temperature, want_prob=g.remasking == "low_confidence")

    def signature(self):
        return ("llada", self.g.remasking, self.conf_f64, self.g.temperature > 0)

    def row_math(self):
        """Everything a row's result depends on besides its logits (None: a random stream of the
        request's own), so that stacked requests with equal row_math reduce as one (a captured
        step does not depend on which rows are whose: engine/batching.StackedReducer)."""
        g = self.g
        if g.temperature > 0:
            return None
        return ("llada", g.remasking, self.conf_f64, g.confidence_dtype, g.logits_eos_inf, g.confidence_eos_eot_inf,
                g.cfg_scale, self.m.eos_id, self.m.eot_id)

    def transient_bytes(self, m, V, dtype) -> int:
        isz = torch.empty((), dtype=dtype).element_size()
        conf = 2 * m * V * 8 if self.conf_f64 else m * V * isz
        return conf + (2 * m * V * 8 if self.g.temperature > 0 else 0)

    def __call__(self, lg, lu, a, b, outs):
        g, cfg = self.g, self.m
        if lu is not None:
            P.cfg_combine(lg, lu, g.cfg_scale)
        if g.logits_eos_inf:
            lg[:, cfg.eos_id] = -torch.inf
        noise = None
        if self.noise is not None:   # in order: the chunk's positions; else only its row count (padded rows too)
            noise = self.noise.rows(self.positions[a:b] if self.noise.in_order else range(b - a))
        noisy = P.add_gumbel_noise(lg, g.temperature, noise)
        torch.argmax(noisy, dim=-1, out=outs["x0"])
        if g.confidence_eos_eot_inf:  # the reference's chained assignment, temperature 0 included
            noisy[:, cfg.eos_id] = -torch.inf
            lg[:, cfg.eot_id] = -torch.inf
        if "conf" in outs:
            # tested for NaN after the step, with the rest of its "conf" (engine/steps.py): a test here
            # read the device mid-step (one host wait per chunk of an eager step)
            outs["conf"].copy_(P.llada_confidence(lg, outs["x0"], g.confidence_dtype, check=False))

    def finish(self):
        if self.noise is not None:
            self.noise.finish()


class DreamReducer:
    def __init__(self, gen, generator, with_confidence: bool):
        self.g, self.generator, self.with_conf = gen, generator, with_confidence

    def subset(self, idx: torch.Tensor) -> DreamReducer:
        return self

    def with_generator(self, generator) -> DreamReducer:
        return DreamReducer(self.g, generator, self.with_conf)

    @property
    def draws(self) -> bool:
        return self.g.temperature > 0

    def capture_problem(self, fused: bool) -> str | None:
        return None

    @property
    def one_row_scan(self) -> bool:
        """top-p's cumsum: its bits over one row differ from a padded step's (runtime/graphs.py)."""
        return self.g.top_p is not None and self.g.top_p < 1

    def draw_calls(self, m: int, V: int, dtype, fused: bool) -> list[tuple[str, int, torch.dtype]]:
        """torch.multinomial's exponential draws over the chunk's probabilities (model dtype)."""
        return [("exponential", m * V, dtype)] if self.draws else []

    def outputs(self, dtype):
        # ok: False where the published code would have taken a host-side branch (published.py)
        # drew: False where the published code took the argmax without a draw (the stream stays)
        return [("x0", torch.int64)] + ([("conf", dtype)] if self.with_conf else []) + \
            ([("ok", torch.bool), ("drew", torch.bool)] if self.draws else [])

    @property
    def fused(self) -> FusedSpec | None:
        g = self.g
        if g.temperature > 0 or g.top_p is not None or g.top_k is not None:
            return None
        return FusedSpec(want_prob=g.alg == "maskgit_plus", want_margin=g.alg == "topk_margin",
                         want_entropy=g.alg == "entropy")

    def signature(self):
        return ("dream", self.g.alg, self.with_conf, self.g.temperature > 0,
                self.g.top_p, self.g.top_k)

    def row_math(self):
        """As LLaDAReducer.row_math."""
        g = self.g
        return None if g.temperature > 0 else ("dream", g.alg, self.with_conf, g.top_p, g.top_k)

    def transient_bytes(self, m, V, dtype) -> int:
        isz = torch.empty((), dtype=dtype).element_size()
        # filtered logits, top-p sort values + int64 ids, cumsum, masks, probs, margin sort
        return m * V * (6 * isz + 2 * 8 + 3)

    def __call__(self, lg, lu, a, b, outs):
        g = self.g
        kw = dict(margin_confidence=g.alg == "topk_margin", neg_entropy=g.alg == "entropy", generator=self.generator)
        if "ok" in outs and P.capturing():
            conf, x0, ok, drew = P.sample_tokens_captured(lg, g.temperature, g.top_p, g.top_k, **kw)
            outs["ok"].copy_(ok.expand(outs["ok"].shape))
            outs["drew"].copy_(drew.expand(outs["drew"].shape))
        else:
            # with a "conf" output the step tests it after (engine/steps.py): no host read mid-step
            conf, x0 = P.sample_tokens(lg, g.temperature, g.top_p, g.top_k, check="conf" not in outs, **kw)
            for flag in ("ok", "drew"):
                if flag in outs:
                    outs[flag].fill_(True)
        outs["x0"].copy_(x0)
        if "conf" in outs:
            outs["conf"].copy_(conf)

    def finish(self):
        pass
