"""The published samplers' per-position math, written from their documented behaviour
(MODELS.md). Used as-is by the native path on full logits and by the planned path on chunks of
masked rows, so both compute the same values with the same rounding points.

Random draws take an explicit torch.Generator; with the same seed they follow the same stream
as the published code's global generator."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..errors import NumericsError
from ..kernels.host_ints import repeated_on
from .ties import topk


def add_gumbel_noise(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None = None,
                     generator=None) -> torch.Tensor:
    """LLaDA's Gumbel-max in float64: exp(logits) / (-log U)^temperature. temperature 0 returns
    logits itself (the same tensor, as the reference does)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64, copy=True)  # never exp_ the caller's tensor
    if noise is None:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device,
                           generator=generator)
    gumbel = noise.log_().neg_().pow_(temperature)                # in place: same values
    return logits.exp_().div_(gumbel)


def num_transfer_tokens(block_mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps]: the block's masked count split over its steps, the first n % s one more."""
    mask_num = block_mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    step = torch.arange(steps, device=block_mask_index.device)
    return base + (step[None, :] < remainder).to(torch.int64)    # on the device: no read per row


def llada_confidence(logits, x0, dtype: str, check: bool = True) -> torch.Tensor:
    """softmax probability of x0: in the logits dtype (current reference) or float64 (older).
    check: NaN tested here (check_probabilities: one host read); False where the caller's step
    tests its "conf" output after it (a planned step's reducer: engine/steps.py)."""
    src = logits.to(torch.float64) if dtype == "float64" else logits
    p = F.softmax(src, dim=-1)
    conf = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
    return check_probabilities(conf, logits.dtype) if check else conf


def check_probabilities(conf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """conf itself; NumericsError when it holds a NaN (a softmax over NaN or +inf logits: the
    network overflowed in `dtype`), so that no sampler commits tokens chosen from NaN
    probabilities (every such token was id 0). One reduction over the [M] confidences."""
    if not conf.is_floating_point() or capturing():   # a captured step is checked after it (engine/steps.py)
        return conf
    if bool(torch.isnan(conf).any()):
        raise nan_error(dtype)
    return conf


def segment_nan(conf: torch.Tensor, counts) -> torch.Tensor | None:
    """[S] bool on conf's device, no host read: whether rows [o_s, o_s + counts[s]) of the stacked
    confidences conf [sum(counts)] hold a NaN (o_s the counts before s), so each request of a
    stacked step raises for its own rows only (engine/batching.py). None where conf is not
    floating point (nothing to test). One isnan and one reduction: a [S, c] view's any() when
    every count is c, else a sum over the rows' segment ids (cached per counts)."""
    if not conf.is_floating_point():
        return None
    counts = tuple(counts)
    nan = torch.isnan(conf)
    if counts and counts[0] > 0 and counts.count(counts[0]) == len(counts):
        return nan.view(len(counts), counts[0]).any(1)
    seg = repeated_on(tuple(range(len(counts))), counts, conf.device)   # each row's request
    return torch.zeros(len(counts), dtype=torch.int32, device=conf.device).index_add_(0, seg, nan.int()) > 0


def nan_error(dtype: torch.dtype) -> NumericsError:
    hint = " (float16's range ends at 65,504: use bfloat16 or float32)" if dtype == torch.float16 else ""
    return NumericsError(f"the model's probabilities are NaN in {str(dtype).removeprefix('torch.')}: its logits "
                         f"overflowed{hint}; no token was committed from them")


class _Deferred(threading.local):
    """This thread's NaN tests not read yet: [(0-d bool tensor, dtype)]."""

    def __init__(self):
        self.checks: list = []


_DEFERRED = _Deferred()


def defer_check(conf: torch.Tensor, dtype: torch.dtype) -> None:
    """check_probabilities without a host read: the NaN test of a planned step's confidences
    stays on the device until the step's one readback (read_with_checks, runtime/commit.apply)
    or settle_checks() (the driver, at every StepDone) reads it, so no step waits on the device
    twice. Either raises the NumericsError before the step's StepDone, so no token chosen from
    NaN probabilities is ever returned or streamed."""
    if conf.is_floating_point() and conf.numel() and not capturing():
        _pending().append((torch.isnan(conf).any(), dtype))


def _pending() -> list:
    return _DEFERRED.checks


def read_with_checks(t: torch.Tensor) -> list:
    """t.tolist() (t [k, B] integers) read together with the pending NaN tests (one transfer);
    NumericsError if one is set."""
    checks = _pending()
    if not checks:
        return t.tolist()
    flags = torch.stack([f for f, _ in checks]).to(device=t.device, dtype=t.dtype)
    vals = torch.cat([t.reshape(-1), flags]).tolist()
    _raise_first([(v, dt) for v, (_, dt) in zip(vals[t.numel():], checks)])
    B = t.shape[1]
    return [vals[i:i + B] for i in range(0, t.numel(), B)]


def settle_checks() -> None:
    """Read the pending NaN tests (one transfer, none when nothing is pending); NumericsError if
    one is set."""
    checks = _pending()
    if checks:
        vals = torch.stack([f for f, _ in checks]).tolist()
        _raise_first([(v, dt) for v, (_, dt) in zip(vals, checks)])


def take_checks() -> list:
    """The pending NaN tests, taken off this thread's list: a Scheduler round runs several
    requests' steps before any of them reads back (engine/batching.py), so each run holds its own
    tests (RequestRun.hold_checks) and puts them back when its sampler resumes (restore_checks);
    otherwise the first run's readback would read, and raise for, its round-mates' tests."""
    checks = list(_pending())
    _pending().clear()
    return checks


def restore_checks(checks: list) -> None:
    """Put tests taken by take_checks back on this thread's list (read at the next readback)."""
    _pending().extend(checks)


def clear_checks() -> None:
    """Forget the pending NaN tests (a request that starts, or one that failed)."""
    _pending().clear()


def _raise_first(read: list) -> None:
    _pending().clear()
    for bad, dtype in read:
        if bad:
            raise nan_error(dtype)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream (no host reads then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature as the reference divides them (in the logits' dtype), or in float32
    where that overflows: float16 tops out at 65,504, so a logit of 10 at temperature 1e-4 is inf
    and the softmax NaN (the reference then samples id 0 everywhere). Identical to the reference
    whenever its quotient is finite; float32 keeps the ordering and the distribution it meant."""
    scaled = logits / temperature
    if scaled.dtype != torch.float32 and scaled.dtype != torch.float64 and not bool(torch.isfinite(scaled).all()) \
            and bool(torch.isfinite(logits).all()):
        scaled = logits.float() / temperature
    return scaled


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """un + (scale + 1) * (cond - un), in place on cond (same rounding as the reference)."""
    return cond.sub_(uncond).mul_(scale + 1).add_(uncond)


def top_p_logits(logits, top_p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()   # keep the first token above the threshold
    remove[..., 0] = 0
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits, top_k):
    top_k = min(top_k, logits.size(-1))
    remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False,
                  neg_entropy=False, generator=None, check: bool = True):
    """Dream's sample_tokens: (confidence, x0) per row of logits [M, V]. Deviation (MODELS.md):
    where logits / temperature overflows the logits' dtype it is taken in float32 (scale_logits),
    and NaN probabilities raise NumericsError instead of yielding id 0 (check False: the caller
    tests the confidences it returns, as a planned step tests its "conf" output: no host read here)."""
    if temperature > 0:
        logits = scale_logits(logits, temperature)
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        try:
            dist = torch.distributions.Categorical(probs=probs)   # validates and normalises
            x0 = torch.multinomial(dist.probs.reshape(-1, dist.probs.shape[-1]), 1, True,
                                   generator=generator).T.reshape(probs.shape[:-1])
            confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        except ValueError:   # the reference falls back to the most likely token
            confidence, x0 = probs.max(dim=-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        # the reference sorts each row and subtracts its first two values; the two largest
        # values of topk are those same two numbers, without the sort's [M, V] values, int64
        # ids and radix-sort double buffers (~20 B per logit on a GPU, the transient that put
        # Dream topk_margin requests at temperature > 0 over their charge in the GPU soak)
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        log_probs = torch.log(probs + 1e-10)
        confidence = torch.sum(probs * log_probs, dim=-1)
    return (check_probabilities(confidence, logits.dtype) if check else confidence), x0


def multinomial_one(probs: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.multinomial(probs [M, V], 1, True, generator) without its host-side checks: ATen's
    path for one sample (aten/src/ATen/native/Distributions.cpp, multinomial_out: q ~ Exp(1)
    drawn by exponential_ over a tensor like probs, then argmax(probs / q)), so the same draws
    and the same ids, bit for bit. Returns (ids [M, 1] int64, ok [] bool: the checks it skipped
    pass: every probability finite and >= 0, no row summing to 0; where they fail the reference
    raises). For a captured step, which cannot read a value on the host."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    ids = torch.argmax(q, dim=-1, keepdim=True)
    ok = (probs.max() < torch.inf) & (probs.min() >= 0) & ~(probs.sum(-1) == 0).any()
    return ids, ok


def sample_tokens_captured(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False,
                           neg_entropy=False, generator=None):
    """sample_tokens (confidence, x0) with no host read, inside a captured step, and ok [] bool:
    True where the reference takes no host-side branch, and then the values are the reference's
    bit for bit (the same ops, Categorical's normalisation and multinomial_one). ok is False where
    the reference would divide in float32 (scale_logits) or multinomial would raise: the caller
    reruns the step eagerly. drew [] bool: False where Categorical's validation fails (bfloat16
    probabilities often miss its 1e-6 simplex test): the reference then takes the argmax without
    drawing, which the outputs already are, so the step stands and the request's stream does
    not advance (runtime/graphs.py)."""
    ok = torch.ones((), dtype=torch.bool, device=logits.device)
    drew = ok
    if temperature > 0:
        scaled = logits / temperature
        if scaled.dtype not in (torch.float32, torch.float64):
            ok = ok & ~(~torch.isfinite(scaled).all() & torch.isfinite(logits).all())
        logits = scaled
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        p = probs / probs.sum(-1, keepdim=True)                     # Categorical(probs=...)
        if torch.distributions.Distribution._validate_args:
            drew = torch.distributions.constraints.simplex.check(p).all()
        drawn, fine = multinomial_one(p.reshape(-1, p.shape[-1]), generator)
        drawn = drawn.T.reshape(probs.shape[:-1])
        best, top = probs.max(dim=-1)
        ok = ok & (fine | ~drew)          # multinomial's checks run only where it would draw
        x0 = torch.where(drew, drawn, top)
        confidence = torch.where(drew, torch.gather(probs, -1, drawn.unsqueeze(-1)).squeeze(-1), best)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        log_probs = torch.log(probs + 1e-10)
        confidence = torch.sum(probs * log_probs, dim=-1)
    return confidence, x0, ok, drew


def dream_transfer_count(num_mask_token: torch.Tensor, t, s, last: bool) -> int:
    """int(mean masked count * (1 - s/t)) in float32; everything left on the last step."""
    return int(dream_transfer_tensor(num_mask_token, t, s, last))


def dream_transfer_tensor(num_mask_token: torch.Tensor, t, s, last: bool) -> torch.Tensor:
    """dream_transfer_count as a 0-d int64 tensor on the device, read by no one: the float32
    product truncated toward zero, as int() truncates it."""
    return (num_mask_token if last else num_mask_token * (1 - s / t)).to(torch.int64)


def topk_transfer(confidence: torch.Tensor, k: torch.Tensor | list, starts: list[int] | None = None) -> torch.Tensor:
    """[B, L] bool: per row the k[j] highest confidences, ranked as the reference's torch.topk
    does on the row from its first real token (starts[j]; ties.py): the full row when it is not
    padded, so that a batch of one breaks ties exactly as the reference."""
    transfer = torch.zeros_like(confidence, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        _, idx = topk(confidence[j], int(k[j]), starts[j] if starts else 0)
        transfer[j, idx] = True
    return transfer
