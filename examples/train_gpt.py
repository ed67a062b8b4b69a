"""Train a small GPT-style language model, split automatically, with GPipe and with 1F1B.

The model is an ordinary ``nn.Module`` (embeddings, causal transformer blocks, an output
head tied to the token embedding), not an ``nn.Sequential``: ``torchgpipe.split``
cuts it into balanced stages. The text is made here, by a random but fixed chain of
words. Three copies of one initial model train on the same batches: the plain model,
``GPipe`` over the split stages (``model(x)`` then ``loss.backward()``), and the
``Schedule1F1B`` step over another split copy; their loss curves match.

Run it with ``python examples/train_gpt.py`` (``--steps``, ``--stages``, ``--chunks``).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, SplitError, split

WORDS = [
    *("the", "a", "pipe", "stage", "cell", "runs", "sends", "waits"),
    *("then", "and", "on", "each", "device", "batch"),
]


def make_text(length: int, seed: int = 0) -> str:
    """Words in a fixed random chain: each word has three likely successors."""
    generator = torch.Generator().manual_seed(seed)
    follow = torch.randint(0, len(WORDS), (len(WORDS), 3), generator=generator)
    word, text = 0, []
    while sum(len(w) + 1 for w in text) < length:
        text.append(WORDS[word])
        word = int(follow[word, torch.randint(0, 3, (1,), generator=generator)])
    return " ".join(text)[:length]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """``x`` (batch, length, width) attends to itself where ``mask`` is 0."""
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, a head tied to the embedding."""

    def __init__(self, vocab: int, width: int = 64, depth: int = 6, context: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, 4) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: the first and the last stage use it
        nn.init.normal_(self.tokens.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        """The next token's logits at every position of ``ids`` (batch, length)."""
        n = ids.size(1)
        mask = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), diagonal=1)
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


NAMES = ("plain", "GPipe", "1F1B")


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of every position's logits against the next token."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def positive(text: str) -> int:
    """An argument of at least 1, or an argparse error that says so."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def tied_pair(pipe: GPipe) -> tuple[Tensor, Tensor]:
    """The token embedding's weight and the head's, in whichever stages split put them.

    The stages keep the plain model's parameter names, so search them by name: with many
    stages the first may hold no layer of the model at all.
    """
    found = {
        name: p for stage in pipe for name, p in stage.named_parameters(remove_duplicate=False)
    }
    return found["tokens.weight"], found["head.weight"]


def main() -> None:
    """Train the three copies side by side and print their losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=30, help="training steps (30)")
    parser.add_argument("--stages", type=positive, default=3, help="stages to split into (3)")
    parser.add_argument("--chunks", type=positive, default=4, help="micro-batches per batch (4)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # each CPU stage runs on a worker thread of its own

    text = make_text(20_000)
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    context, batch = 32, 16
    model = GPT(len(alphabet), context=context)
    example = data[:context].expand(batch, context)

    plain = copy.deepcopy(model)
    try:
        pipe = GPipe(
            split(copy.deepcopy(model), example, stages=args.stages),
            [1] * args.stages,
            devices=["cpu"] * args.stages,  # CPU partitions, on a machine with GPUs too
            chunks=args.chunks,
        )
    except SplitError as error:  # too many stages for the model, say
        parser.error(f"--stages {args.stages}: {error}")
    stepped = GPipe(
        split(copy.deepcopy(model), example, stages=args.stages),
        [1] * args.stages,
        devices=["cpu"] * args.stages,
        chunks=args.chunks,
    )
    schedule = Schedule1F1B(stepped, lm_loss)
    print(
        "stages:", [sum(p.numel() for p in stage.parameters()) for stage in pipe], "parameters each"
    )

    optimizers = [torch.optim.Adam(m.parameters(), lr=3e-3) for m in (plain, pipe, stepped)]
    sampler = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=sampler)
        x = torch.stack([data[s : s + context] for s in starts])
        y = torch.stack([data[s + 1 : s + context + 1] for s in starts])
        for optimizer in optimizers:
            optimizer.zero_grad()
        losses = []
        for m in (plain, pipe):
            loss = lm_loss(m(x), y)
            loss.backward()
            losses.append(loss.item())
        losses.append(schedule.step(x, y).loss.item())
        for optimizer in optimizers:
            optimizer.step()
        worst = max(worst, max(abs(v - losses[0]) for v in losses))
        if step % 5 == 0 or step in (1, args.steps):
            row = "  ".join(f"{name} {v:.4f}" for name, v in zip(NAMES, losses, strict=True))
            print(f"step {step:3d}  loss {row}")
    print(f"largest loss difference from the plain model: {worst:.2e}")
    tied = [torch.equal(*tied_pair(m)) for m in (pipe, stepped)]
    print(f"tied copies equal after training: {all(tied)}")
    back = copy.deepcopy(model)
    back.load_state_dict(pipe.state_dict())  # the plain model's keys, both tied names included
    print(f"state dict loads into the plain model: {torch.allclose(back(x), pipe(x), atol=1e-5)}")


if __name__ == "__main__":
    main()
