"""The longest request the server's engine admits (MosaicEngine.capacity: the one L_max search,
policy/admitter.py), under the names the server and `mosaic chat` use."""

from __future__ import annotations

from ..config import GenerationConfig
from ..engine import MosaicEngine


def capacity_tokens(engine: MosaicEngine, gen: GenerationConfig | None = None) -> int | None:
    """Longest prompt + max_new_tokens that admission accepts, to the token, or None when nothing
    limits it: gen None: the model's default options with the worst split of the length (a
    1-token prompt); gen given (mosaic chat): its canvas fixed, the prompt growing."""
    return engine.capacity(gen)
