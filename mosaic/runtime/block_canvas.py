"""The canvas of a block-diffusion batch: every sequence's blocks on the same columns.

The published generate() (LLaDA2.x, one prompt) lays a prompt of P tokens and G masks on
n = ceil((P + G) / block) blocks counted from the prompt's first token: the blocks left of
P // block are prompt only, the block holding the prompt's tail is denoised first (its prompt
positions stay), and the last block may run past P + G (those masks are denoised too, and cut
off). A batch keeps each sequence exactly that: sequence b is right-aligned on W = max n blocks
with (W - n_b) blocks of left padding, which are never attended and shift no position (its
positions count from its first real token), so each sequence's tokens are those of its run
alone while all of them step through the same global blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockCanvas:
    """ids [B, W] (padding, prompts, masks); pads[b]: sequence b's first column (a multiple of
    block); prompt_lens[b]; gen_length G; block: columns per block."""
    ids: torch.Tensor
    pads: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    gen_length: int
    block: int

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_blocks(self) -> int:
        return self.width // self.block

    def first_block(self, b: int) -> int:
        """The global index of sequence b's first denoised block (holding its prompt's tail)."""
        return (self.pads[b] + self.prompt_lens[b]) // self.block

    def answer(self, b: int) -> tuple[int, int]:
        """Columns [lo, hi) of sequence b's G generated tokens."""
        lo = self.pads[b] + self.prompt_lens[b]
        return lo, lo + self.gen_length

    def answers(self) -> torch.Tensor:
        """[B, G] every sequence's generated tokens."""
        return torch.stack([self.ids[b, slice(*self.answer(b))] for b in range(self.batch)])

    def standard(self, pad_id: int) -> torch.Tensor:
        """The engine's layout [B, P + G]: prompts left-padded to the longest, then the answers."""
        P = max(self.prompt_lens)
        out = torch.full((self.batch, P + self.gen_length), pad_id, dtype=self.ids.dtype, device=self.ids.device)
        for b in range(self.batch):
            lo, hi = self.answer(b)
            out[b, P - self.prompt_lens[b]:] = self.ids[b, self.pads[b]:hi]
        return out


def block_canvas(prompts: list[list[int]], gen_length: int, block: int, mask_id: int, pad_id: int,
                 device=None) -> BlockCanvas:
    """The aligned canvas of token-id prompts (see the module docstring)."""
    n = [-(-(len(p) + gen_length) // block) for p in prompts]
    W = max(n) * block
    ids = torch.full((len(prompts), W), mask_id, dtype=torch.long)
    pads = []
    for b, p in enumerate(prompts):
        pad = (max(n) - n[b]) * block
        ids[b, :pad] = pad_id
        ids[b, pad:pad + len(p)] = torch.tensor(p, dtype=torch.long)
        pads.append(pad)
    return BlockCanvas(ids.to(device) if device is not None else ids, tuple(pads), tuple(len(p) for p in prompts),
                       gen_length, block)
