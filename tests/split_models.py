"""Models that are not nn.Sequential, for the tests of torchgpipe.split."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, attn_mask=mask, need_weights=False)
        x = x + attended
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, causal blocks, and a head tied to the embedding."""

    def __init__(
        self,
        vocab: int = 32,
        width: int = 16,
        depth: int = 4,
        context: int = 8,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, 2, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.size(1)
        mask = torch.triu(torch.full((length, length), float("-inf"), device=ids.device), 1)
        x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class Level(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.layer(x))


class UShaped(nn.Module):
    """A U-Net's shape on vectors: each level's output joins its mirror level's input."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.down = nn.ModuleList([Level(width) for _ in range(depth)])
        self.middle = Level(width)
        self.up = nn.ModuleList([Level(width) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        kept = []
        for level in self.down:
            x = level(x)
            kept.append(x)
        x = self.middle(x)
        for level in self.up:
            x = level(x + kept.pop())
        return x


class Keywords(nn.Module):
    """Takes keyword arguments with a default, returns a dict with a tuple in it."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.third = nn.Linear(width, 3)

    def forward(
        self, x: Tensor, scale: Tensor, shift: float = 0.5, bias: Tensor | None = None
    ) -> dict[str, object]:
        h = F.relu(self.first(x)) * scale
        if bias is not None:
            h = h + bias
        g = self.second(h) + shift
        return {"out": self.third(g), "both": (h, g)}
