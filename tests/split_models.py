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


class ReadsTiedHead(nn.Module):
    """A head tied to the embedding, whose weight the forward reads, not the head."""

    def __init__(self, how: str = "matmul") -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.mid(self.emb(ids)))
        if self.how == "matmul":
            return h @ self.head.weight.t()
        return F.linear(h, self.head.weight)


class ReadsProjection(nn.Module):
    """A Linear that the forward never calls, whose weight and bias it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.b(self.a(x))), self.proj.weight, self.proj.bias)


class WithUnused(nn.Module):
    """A submodule the forward never calls, defined first or last; and unused tensors."""

    def __init__(self, unused_first: bool = False, tensors: bool = True) -> None:
        super().__init__()
        if unused_first:
            self.aux = nn.Linear(4, 2)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if tensors:  # the model's own, with no reset to fill them on the meta device
            self.offset = nn.Parameter(torch.zeros(4))
            self.register_buffer("unused_steps", torch.tensor(3))
        if not unused_first:
            self.aux = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))
