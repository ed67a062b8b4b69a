"""What every benchmark records with its figures: the machine, the versions, the code.

Each benchmark's ``main.py`` imports this file from the folder above it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import torchgpipe


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), as ``platform`` leaves it empty."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return ""


def git(directory: Path, *args: str) -> str:
    """The output of a git command run in ``directory``, or "" without git."""
    try:
        done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.rstrip()


def source_state() -> dict[str, Any]:
    """Which torchgpipe source is measured: a hash of its files, and git's view of them."""
    package = Path(torchgpipe.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return {
        "source_sha256": digest.hexdigest(),
        "git_commit": git(package, "rev-parse", "HEAD"),
        "git_modified": git(package, "status", "--porcelain", "--", ".").splitlines(),
    }


def environment() -> dict[str, Any]:
    """The machine, the versions and the date of this run."""
    return {
        "processor": platform.processor() or cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchgpipe": torchgpipe.__version__,
        **source_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Make this process ``rank`` of a gloo group of ``world`` on 127.0.0.1, one thread."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's arguments, as JSON can hold them (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` as indented JSON to ``path``, making its folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


class Progress:
    """A one-line progress bar on stderr: ``tick(label)`` before each of ``total`` items."""

    def __init__(self, total: int) -> None:
        self.total = max(total, 1)
        self.done = 0

    def tick(self, label: str) -> None:
        """Show the bar with ``label`` as the item now starting."""
        self._show(label)
        self.done += 1

    def finish(self) -> None:
        """Show the full bar and end its line."""
        self.done = self.total
        self._show("done")
        print(file=sys.stderr)

    def _show(self, label: str) -> None:
        filled = round(20 * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (20 - filled)
        print(
            f"\r[{bar}] {self.done}/{self.total} {label:<30}", end="", file=sys.stderr, flush=True
        )
