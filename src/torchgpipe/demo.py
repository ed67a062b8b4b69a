"""The demo: train a small model with GPipe and compare it with the plain model.

Run it with ``python -m torchgpipe.demo`` (``--help`` lists the options). It builds an
MLP of ``--layers`` blocks (``Linear`` and ``ReLU``) and a classifier head, and trains it
on a synthetic task it generates itself: each of ten classes is a random point, and each
input is its class's point plus noise, so the loss visibly falls within a few steps. The
model is trained twice from the same initial weights, on the same batches: wrapped in
:class:`~torchgpipe.GPipe`, then as the plain ``nn.Sequential``. Both see the same
numbers, so their losses differ only by rounding (gradients are summed over
micro-batches in another order), which Adam amplifies over the steps. Then one more
GPipe step is traced (:meth:`~torchgpipe.GPipe.trace`): the demo prints its bubble
fraction and draws its timeline (``--timeline``; matplotlib needed).

Without CUDA every partition sits on the CPU, run by a worker thread of its own with one
intra-op thread (more threads than cores would fight). The partitions' forward passes
overlap, and so do their backward passes (each partition's backward runs on its own
worker), but two cores bound what overlapping can win. Smaller matrix products per
micro-batch cost time as well, so on a CPU the pipeline roughly breaks even with the
plain model at best. That is why the default run does not checkpoint: recomputing each
forward in backward buys memory, which this model does not need, with time that the CPU
cannot win back (``--checkpoint except_last`` is GPipe's own default).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from torchgpipe.gpipe import Checkpoint, GPipe
from torchgpipe.trace import TraceSummary

__all__ = ["main"]

_CHECKPOINT_CHOICES: tuple[Checkpoint, ...] = ("always", "except_last", "never")


@dataclass(frozen=True)
class Config:
    """The sizes and settings of one demo run."""

    steps: int
    partitions: int
    chunks: int
    batch_size: int
    width: int
    layers: int
    classes: int
    checkpoint: Checkpoint
    lr: float
    seed: int
    timeline: str  # where the timeline picture goes; "" for none


@dataclass(frozen=True)
class Result:
    """The losses of one training run, and its throughput after the warm-up step."""

    losses: list[float]
    samples_per_s: float


# A default run, and a --quick one; the default partitions depend on the machine.
_DEFAULT = Config(
    steps=20, partitions=0, chunks=4, batch_size=1024, width=1024, layers=8, classes=10,
    checkpoint="never", lr=3e-4, seed=0, timeline="gpipe-timeline.png",
)  # fmt: skip
_QUICK = Config(
    steps=8, partitions=2, chunks=2, batch_size=64, width=128, layers=4, classes=10,
    checkpoint="except_last", lr=1e-2, seed=0, timeline="gpipe-timeline.png",
)  # fmt: skip
_POSITIVE = ("steps", "partitions", "chunks", "batch_size", "width", "layers")
_PICTURES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # what --timeline can draw


def parse_args(argv: Sequence[str] | None) -> Config:
    """Read the command line into a :class:`Config`; ``--quick`` starts from tiny sizes."""
    parser = argparse.ArgumentParser(
        prog="python -m torchgpipe.demo",
        description="Train a small MLP with GPipe, then compare its speed with the plain model.",
    )
    d, q = _DEFAULT, _QUICK
    parser.add_argument("--steps", type=int, help=f"training steps ({d.steps}; quick {q.steps})")
    parser.add_argument(
        "--partitions", type=int, help="pipeline partitions (the GPUs from 2 up to 4, or 2)"
    )
    parser.add_argument(
        "--chunks", type=int, help=f"micro-batches per step ({d.chunks}; quick {q.chunks})"
    )
    parser.add_argument(
        "--batch-size", type=int, help=f"samples per step ({d.batch_size}; quick {q.batch_size})"
    )
    parser.add_argument(
        "--width", type=int, help=f"features of each Linear ({d.width}; quick {q.width})"
    )
    parser.add_argument(
        "--layers", type=int, help=f"Linear+ReLU blocks ({d.layers}; quick {q.layers})"
    )
    parser.add_argument(
        "--checkpoint",
        choices=_CHECKPOINT_CHOICES,
        help=f"GPipe's mode ({d.checkpoint}; quick {q.checkpoint})",
    )
    parser.add_argument("--lr", type=float, help=f"Adam's learning rate ({d.lr}; quick {q.lr})")
    parser.add_argument("--seed", type=int, help=f"seed of the weights and data ({d.seed})")
    parser.add_argument(
        "--timeline",
        help=f"the file to draw the traced step's timeline to ({', '.join(_PICTURES)}; a "
        f"name without a suffix gets .png), '' for none ({d.timeline})",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds")
    args = vars(parser.parse_args(argv))

    preset = _QUICK if args.pop("quick") else replace(d, partitions=_default_partitions())
    config = replace(preset, **{name: v for name, v in args.items() if v is not None})
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            parser.error(
                f"--{name.replace('_', '-')} must be positive, got {getattr(config, name)}"
            )
    if not 0 < config.lr < math.inf:
        parser.error(f"--lr must be a positive finite number, got {config.lr}")
    if not -(2**63) <= config.seed <= 2**64 - 2:  # torch's range; the data's takes seed + 1
        parser.error(f"--seed must be from -2**63 to 2**64 - 2 (torch's), got {config.seed}")
    if config.partitions > config.layers + 1:
        parser.error(
            f"--partitions {config.partitions} is more than the model's {config.layers + 1} "
            f"layers; pass at most {config.layers + 1}, or more --layers"
        )
    if config.timeline:
        try:
            config = replace(config, timeline=timeline_file(config.timeline))
        except ValueError as error:
            if args["timeline"] is None:  # the default, where the demo runs
                parser.error(
                    f"the timeline's default file {config.timeline!r}: {error}; pass "
                    f"--timeline with a file elsewhere, or --timeline '' to draw none"
                )
            parser.error(f"--timeline {config.timeline!r}: {error}")
    return config


def timeline_file(name: str) -> str:
    """The file the timeline named ``name`` is written to, checked before any training.

    Named as matplotlib names it: without a suffix (or with a bare dot), it draws a PNG
    and adds ``.png``. A folder is refused (matplotlib would write a hidden ``.png``
    in it, or a file beside it), and so is a file that cannot be written (a missing
    folder, ``/proc``): found out at the end, it would cost the whole run.

    Raises:
        ValueError: what is wrong with ``name``, in words.
    """
    if name.endswith(("/", os.sep)) or os.path.isdir(name):
        raise ValueError(
            f"names a folder; name a file in it, as {os.path.join(name, _DEFAULT.timeline)!r}"
        )
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise ValueError(f"no folder {folder!r} to draw it in")
    suffix = os.path.splitext(name)[1].lower()
    if suffix in ("", "."):  # what matplotlib does with a name without a suffix
        name = name.rstrip(".") + ".png"
    elif suffix not in _PICTURES:
        raise ValueError(
            f"draws {', '.join(_PICTURES)} files, not {suffix}; name the file with one of those"
        )
    if os.path.isdir(name):
        raise ValueError(f"would be drawn to {name!r}, which is a folder; name a file")
    # What a link names is what gets written: tried there, and the link left as it is.
    real = os.path.realpath(name)
    if os.path.exists(real) and not os.path.isfile(real):  # a pipe would block the try
        raise ValueError(f"{name!r} is not a regular file; name another file")
    existed = os.path.exists(real)
    try:
        with open(real, "ab"):  # appends nothing: a file that exists is left as it is
            pass
    except OSError as error:
        raise ValueError(f"cannot write {name!r} ({error.strerror}); name another file") from None
    if not existed:
        os.remove(real)
    return name


def _default_partitions() -> int:
    """As many partitions as GPUs, from 2 up to 4; 2 on a machine without CUDA."""
    if torch.cuda.is_available():
        return min(max(torch.cuda.device_count(), 2), 4)
    return 2


def pick_devices(n: int) -> list[torch.device]:
    """A device per partition: the GPUs in turn (all on one when there is only one)."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    count = torch.cuda.device_count()
    return [torch.device("cuda", j % count) for j in range(n)]


def even_balance(num_layers: int, n: int) -> list[int]:
    """Split ``num_layers`` into ``n`` partitions whose sizes differ by one at most."""
    base, extra = divmod(num_layers, n)
    return [base + (1 if j < extra else 0) for j in range(n)]


def build_model(config: Config) -> nn.Sequential:
    """The MLP: ``layers`` blocks of ``Linear`` and ``ReLU``, then a classifier head."""
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU())
        for _ in range(config.layers)
    ]
    return nn.Sequential(*blocks, nn.Linear(config.width, config.classes))


def make_data(config: Config, num_batches: int = 4) -> list[tuple[Tensor, Tensor]]:
    """A few batches of the synthetic task; step ``s`` trains on batch ``s % num_batches``.

    Each class is a random centre in ``width`` dimensions, and each input its class's
    centre plus Gaussian noise twice as large as the centres' entries.
    """
    generator = torch.Generator().manual_seed(config.seed + 1)
    centres = torch.randn(config.classes, config.width, generator=generator)
    batches = []
    for _ in range(num_batches):
        y = torch.randint(config.classes, (config.batch_size,), generator=generator)
        noise = torch.randn(config.batch_size, config.width, generator=generator)
        batches.append((centres[y] + 2 * noise, y))
    return batches


def train(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    config: Config,
    *,
    label: str,
    devices: tuple[torch.device, torch.device],
) -> Result:
    """Train ``model`` for ``config.steps`` steps, printing the loss of each step.

    ``devices`` are where the inputs go in and where the outputs come out.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    elapsed = 0.0
    print(f"{label}:")
    for step in range(config.steps):
        x, y = data[step % len(data)]
        x, y = x.to(devices[0]), y.to(devices[1])
        _synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        _synchronize()
        seconds = time.perf_counter() - start
        if step > 0 or config.steps == 1:
            elapsed += seconds
        rate = len(x) / seconds
        bar = _bar(step + 1, config.steps)
        progress = f"{bar} step {step + 1:3d}/{config.steps}"
        print(f"  {progress}  loss {losses[-1]:.4f}  {rate:8.1f} samples/s")
    timed_steps = max(config.steps - 1, 1)
    return Result(losses, timed_steps * config.batch_size / elapsed)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def run(config: Config) -> tuple[Result, Result, TraceSummary]:
    """Train the model with GPipe, then plain from the same weights; return both results.

    One more GPipe step (forward and backward, no update) is traced: its summary is
    returned and, if ``config.timeline``, its timeline drawn there.
    """
    devices = pick_devices(config.partitions)
    if devices[0].type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    model = build_model(config)
    plain = copy.deepcopy(model)
    data = make_data(config)
    balance = even_balance(len(model), config.partitions)

    print(
        f"model: {config.layers} x (Linear({config.width}, {config.width}) + ReLU) + "
        f"Linear({config.width}, {config.classes}), "
        f"{sum(p.numel() for p in model.parameters()):,} parameters"
    )
    print(
        f"GPipe: balance {balance}, devices {[str(d) for d in devices]}, chunks "
        f"{config.chunks}, checkpoint {config.checkpoint!r}; batch {config.batch_size}, "
        f"{config.steps} steps, torch {torch.__version__}, {torch.get_num_threads()} "
        f"intra-op thread(s)"
    )
    pipe = GPipe(
        model, balance, devices=devices, chunks=config.chunks, checkpoint=config.checkpoint
    )
    piped = train(pipe, data, config, label="GPipe", devices=(devices[0], devices[-1]))
    plain.to(devices[0])
    alone = train(plain, data, config, label="plain", devices=(devices[0], devices[0]))
    summary = trace_step(pipe, data[0], config, devices=(devices[0], devices[-1]))
    return piped, alone, summary


def trace_step(
    pipe: GPipe,
    batch: tuple[Tensor, Tensor],
    config: Config,
    *,
    devices: tuple[torch.device, torch.device],
) -> TraceSummary:
    """Trace one forward and backward of ``pipe``; print its summary, draw its timeline."""
    x, y = batch[0].to(devices[0]), batch[1].to(devices[1])
    with pipe.trace() as trace:
        nn.functional.cross_entropy(pipe(x), y).backward()
        _synchronize()
    pipe.zero_grad()
    summary = trace.summary()
    print("one traced step (forward and backward):")
    print("  " + str(summary).replace("\n", "\n  "))
    if config.timeline:
        try:
            trace.draw(config.timeline)
        except ImportError as error:
            print(f"  no timeline drawn: {error}")
        else:
            print(f"  timeline drawn to {config.timeline}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the demo with the command line ``argv`` (default: ``sys.argv[1:]``).

    Returns 0, or 1 when the final loss of GPipe is not below half its first (of
    several steps: one alone is not checked).
    """
    config = parse_args(argv)
    start = time.perf_counter()
    piped, alone, traced = run(config)
    gap = max(abs(a - b) for a, b in zip(piped.losses, alone.losses, strict=True))
    ratio = piped.samples_per_s / alone.samples_per_s
    print("throughput, after the first (warm-up) step:")
    print(f"  GPipe  {piped.samples_per_s:10.1f} samples/s")
    print(f"  plain  {alone.samples_per_s:10.1f} samples/s")
    print(f"  ratio  {ratio:10.2f} (GPipe / plain)")
    print(f"largest loss difference between GPipe and plain (rounding): {gap:.2e}")
    print(
        f"summary: final loss {piped.losses[-1]:.4f} (first {piped.losses[0]:.4f}), "
        f"GPipe/plain throughput {ratio:.2f}x, bubble {traced.bubble:.1%} (ideal "
        f"{traced.ideal_bubble:.1%}), {time.perf_counter() - start:.1f} s in all"
    )
    first, last = piped.losses[0], piped.losses[-1]
    if len(piped.losses) > 1 and not last < first / 2:  # one step cannot train
        print(
            f"error: the loss went from {first:.4f} to {last:.4f}, not below half of it; "
            f"train for more --steps, or change --lr",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
