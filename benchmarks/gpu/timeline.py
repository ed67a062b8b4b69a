"""GPU timeline: one training step as the GPU ran it, copies beside compute.

ResNet-101 (224x224) in four partitions on one GPU, the batch in pinned CPU memory:
each micro-batch is copied in on the first partition's copy stream while the partitions'
compute streams work on earlier ones. PyTorch's profiler records every kernel and copy
with its stream; the picture has a row per stream, and the overlap figure says which
share of the copies' time ran while a kernel of another stream was running. The
library's own trace of the same step (host-side spans per partition) is drawn beside.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu/timeline.py --out-dir benchmarks/gpu/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchgpipe import GPipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import environment, write_json  # benchmarks/common.py
from models import build

CUDA = torch.device("cuda", 0)
GPU_KINDS = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "memset"}


def gpu_events(chrome_trace: Path) -> list[dict[str, Any]]:
    """The kernels, copies and memsets of a Chrome trace: kind, stream, start, end (us)."""
    events = json.loads(chrome_trace.read_text())["traceEvents"]
    found = []
    for event in events:
        kind = GPU_KINDS.get(event.get("cat", ""))
        if kind is None or "dur" not in event:
            continue
        start = float(event["ts"])
        found.append({
            "kind": kind,
            "name": event.get("name", ""),
            "stream": int(event.get("args", {}).get("stream", -1)),
            "start": start,
            "end": start + float(event["dur"]),
        })  # fmt: skip
    return found


def copy_overlap(events: list[dict[str, Any]]) -> float:
    """The share of host-to-device copy time during which another stream ran a kernel."""
    kernels = sorted((e["start"], e["end"], e["stream"]) for e in events if e["kind"] == "kernel")
    copies = [e for e in events if e["kind"] == "copy" and "HtoD" in e["name"]]
    total = covered = 0.0
    for c in copies:
        total += c["end"] - c["start"]
        spans = sorted(
            (max(s, c["start"]), min(e, c["end"]))
            for s, e, stream in kernels
            if stream != c["stream"] and s < c["end"] and e > c["start"]
        )
        reach = c["start"]
        for s, e in spans:  # the union of the kernels' spans within the copy
            if e > reach:
                covered += e - max(s, reach)
                reach = e
    return covered / total if total else 0.0


def draw(events: list[dict[str, Any]], path: Path, title: str) -> None:
    """A row per stream: kernels in blue, copies in orange, memsets in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({e["stream"] for e in events})
    origin = min(e["start"] for e in events)
    colours = {"kernel": "tab:blue", "copy": "tab:orange", "memset": "tab:grey"}
    figure, axes = plt.subplots(figsize=(12, 0.6 * len(streams) + 1.5))
    for row, stream in enumerate(streams):
        mine = [e for e in events if e["stream"] == stream]
        for kind, colour in colours.items():
            spans = [((e["start"] - origin) / 1e3, (e["end"] - e["start"]) / 1e3)
                     for e in mine if e["kind"] == kind]  # fmt: skip
            if spans:
                axes.broken_barh(spans, (row - 0.4, 0.8), color=colour, label=kind)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes.legend(unique.values(), unique.keys(), loc="upper right")
    axes.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    axes.set_xlabel("ms")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    """Profile one step after warm-up; write the trace, the pictures and the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--balance", type=int, nargs="+", default=[10, 10, 10, 10])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--checkpoint", choices=("always", "except_last", "never"),
                        default="except_last")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spec = build("resnet101", args.size)
    n = len(args.balance)
    model = GPipe(spec.model, args.balance, devices=[CUDA] * n, chunks=args.chunks,
                  checkpoint=args.checkpoint)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, *spec.sample_shape).pin_memory()
    target = torch.zeros(args.batch, dtype=torch.long, device=CUDA)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()

    for _ in range(3):
        step()
    unprofiled = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        unprofiled.append(time.perf_counter() - started)
    # The GPU's activity only: recording every CPU operator as well slows the host down
    # several times over, starving the GPU and hiding the very overlap this shows.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    chrome = args.out_dir / "timeline-trace.json"
    prof.export_chrome_trace(str(chrome))
    events = gpu_events(chrome)
    overlap = copy_overlap(events)
    title = (f"ResNet-101, {n} partitions on {torch.cuda.get_device_name(CUDA)}, batch "
             f"{args.batch} in {args.chunks} micro-batches from pinned memory, checkpoint "
             f"{args.checkpoint!r}")  # fmt: skip
    draw(events, args.out_dir / "timeline-gpu.png", title)
    with model.trace() as trace:
        step()
        torch.cuda.synchronize()
    trace.draw(str(args.out_dir / "timeline-host.png"))
    copies = [e for e in events if e["kind"] == "copy"]
    kernels = [e for e in events if e["kind"] == "kernel"]
    span_ms = (max(e["end"] for e in events) - min(e["start"] for e in events)) / 1e3
    figures = {
        "streams": len({e["stream"] for e in events}),
        "kernels": len(kernels),
        "copies": len(copies),
        "copy_ms": sum(e["end"] - e["start"] for e in copies) / 1e3,
        "kernel_ms": sum(e["end"] - e["start"] for e in kernels) / 1e3,
        "gpu_span_ms": span_ms,
        "unprofiled_step_ms": statistics.median(unprofiled) * 1e3,
        "htod_copy_time_overlapping_kernels": overlap,
    }
    print(title)
    for key, value in figures.items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    print(trace.summary())
    parameters = {k: str(v) for k, v in vars(args).items()}
    results = {"environment": environment(), "parameters": parameters, "figures": figures}
    write_json(args.out_dir / "timeline.json", results)
    print(f"wrote {args.out_dir}/timeline-gpu.png, timeline-host.png, timeline-trace.json")


if __name__ == "__main__":
    main()
