from __future__ import annotations


class MosaicError(Exception):
    """Base of every error the engine raises on purpose."""


class CheckpointError(MosaicError, ValueError):
    """A checkpoint folder or preset that cannot be loaded as asked."""


class InputError(MosaicError, ValueError):
    """A request whose arguments are wrong (lengths, options, token ids). param: the name of the
    option at fault where the check knows it (GenerationConfig's field name: steps, seed, ...),
    None otherwise; the server reports it as the error's `param`."""

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigFileError(InputError):
    """A YAML engine config that does not validate; its message names the file's own keys (the
    command line leaves them as they are instead of turning them into flags)."""


class NumericsError(MosaicError, ArithmeticError):
    """A step whose probabilities are not numbers (NaN): the network overflowed in its dtype.
    Raised before the sampler commits a token from them."""


class StepInterrupted(MosaicError):
    """A planned step stopped between two of its ops because its caller asked (the request was
    cancelled: Ctx.interrupt); the request's tensors are discarded, nothing shared is left
    half-written."""


class MemoryBudgetError(MosaicError, MemoryError):
    """A request that cannot fit the memory budget; raised before anything is allocated.
    needed_bytes / budget_bytes: what it needs and what there is (bytes); max_tokens: the longest
    request of its shape that fits, where admission searched it; phase: what does not fit where
    the chunk search knows it ("attn", "ffn", "logits" alone, "plan" when the phases fit one by
    one but the whole step does not), None otherwise (weights, context, the card)."""

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int,
                 max_tokens: int | None = None, phase: str | None = None):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.max_tokens = max_tokens
        self.phase = phase


def gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals; below 0.01 GiB as MiB, below 0.1 MiB as KiB and below
    1 KiB as bytes, so a small size never reads as 0.00 GiB or 0.0 MiB."""
    size = abs(num_bytes)
    if size < 2**10:
        return f"{num_bytes:.0f} bytes"
    if size < 0.1 * 2**20:
        return f"{num_bytes / 2**10:.1f} KiB"
    if size < 0.01 * 2**30:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**30:.2f} GiB"
