"""How small a difference the sleep-layer rows of ``main.py`` can see on this machine.

The bare pipeline of ``main.py`` (threads, queues, sleep layers) is timed against
itself, round by round, exactly as ``main.py`` times GPipe against it: once unchanged
(an A/A comparison, whose true ratio is 1), and once with a known amount of pure-Python
work added to every cell after its layer (``--extra``, in microseconds, as timed on a
busy thread). If the unchanged ratio strays from 1 by as much as the target's margin,
or a known cost per cell does not show in the ratio, the target cannot be told from
the machine's swings by this method.

Run from the repository root::

    python benchmarks/pipeline_speed/noise.py              # a few minutes
    python benchmarks/pipeline_speed/noise.py --quick      # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # benchmarks/common.py
    count,
    environment,
    out_file,
    parse,
    positive,
    settings,
    write_json,
)
from main import bare_pipeline  # benchmarks/pipeline_speed/main.py

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "noise.json"


def loop_iterations(microseconds: float) -> int:
    """How many turns of :func:`busy` take ``microseconds`` on a busy thread."""
    turns = 200_000
    started = time.perf_counter()
    busy(turns)
    per_us = turns / ((time.perf_counter() - started) * 1e6)
    return int(microseconds * per_us)


def busy(turns: int) -> int:
    """Pure-Python work that holds the GIL, as a library's bookkeeping would."""
    total = 0
    for k in range(turns):
        total += k
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=count, default=9)
    parser.add_argument("--extra", type=positive, nargs="+", default=[100.0, 200.0])
    parser.add_argument("--sizes", default="2x32,4x32,8x8,8x32", help="n x m, comma separated")
    parser.add_argument("--ms", type=positive, default=10.0, help="the sleep of a layer")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--out", type=out_file, default=DEFAULT_OUT)
    args = parse(parser, argv, rounds=1, extra=[50.0], sizes="2x2", ms=1.0)
    torch.set_num_threads(1)
    f = args.ms / 1000
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    extras = {0.0: 0, **{us: loop_iterations(us) for us in args.extra}}
    print(
        f"The bare pipeline against itself, f = {args.ms} ms, {args.rounds} rounds, medians "
        f"of per-round ratios;\n'+X us' adds X microseconds of pure-Python work per cell"
    )
    header = f"{'n':>3} {'m':>4} " + " ".join(
        f"{'same' if us == 0 else f'+{us:g} us':>9}" for us in extras
    )
    print(header)
    rows = []
    for n, m in sizes:
        ratios: dict[float, list[float]] = {us: [] for us in extras}
        for _ in range(args.rounds):
            for us, turns in extras.items():
                reference = bare_pipeline(n, m, f)
                extra = partial(busy, turns) if turns else None
                ratios[us].append(bare_pipeline(n, m, f, extra) / reference)
        medians = {us: statistics.median(values) for us, values in ratios.items()}
        print(f"{n:>3} {m:>4} " + " ".join(f"{medians[us]:>9.3f}" for us in extras))
        rows.append({"n": n, "m": m, "ratios": {str(us): medians[us] for us in extras}})
    results = {"environment": environment(), "settings": settings(args), "rows": rows}
    write_json(args.out, results)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
