"""Rotary position embeddings from a precomputed table indexed by position ids.

Knows: how to fill a (positions, head_dim) cos/sin table by calling the transformers
model's own rotary module once (so every static rope type it implements, with its
attention scaling, gives bit-identical tables), growing it on demand, and how to apply it
to q and k laid out as (batch, n, heads, head_dim).
Does not know: rope types whose angles depend on the sequence length (``dynamic``,
``longrope``); ``arch`` refuses those.
"""

from __future__ import annotations

import torch

from cadence.errors import CadenceError

INITIAL_TABLE = 4096


class RopeTable:
    def __init__(self, rotary: torch.nn.Module, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        self.rotary, self.max_positions = rotary, max_positions
        self.dtype, self.device = dtype, device
        self.cos = self.sin = None
        self._fill(min(INITIAL_TABLE, max_positions))

    @torch.inference_mode()
    def _fill(self, size: int) -> None:
        pos = torch.arange(size, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        half = self.cos.shape[-1] // 2
        # rotate_half(x) * sin == swap_halves(x) * sin_signed, with the first half negated
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def lookup(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for ``positions`` (batch, n) -> each (batch, n, 1, head_dim).
        ``top`` is an upper bound on the positions (checked without a device sync)."""
        if top >= self.cos.shape[0]:
            if top >= self.max_positions:
                raise CadenceError(f"position {top} beyond the model's {self.max_positions} positions")
            size = self.cos.shape[0]
            while size <= top:
                size *= 2
            self._fill(min(size, self.max_positions))
        return self.cos[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2)


def apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x (batch, n, heads, head_dim)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * sin_signed
