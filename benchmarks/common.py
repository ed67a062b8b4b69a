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


# The command line, checked before anything is measured: a bad value found at the end
# (a folder given as --out) would cost the whole run.


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (sizes, rounds, processes)."""
    return _integer(text, 1)


def whole(text: str) -> int:
    """An argparse type: a whole number of at least 0 (warm-up steps)."""
    return _integer(text, 0)


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is not at least {least}")
    return value


def positive(text: str) -> float:
    """An argparse type: a finite number above 0 (a sleep, a timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def out_file(text: str) -> Path:
    """An argparse type: a file the results can be written to (its folders may be missing).

    Tried as the run's end will write it (its folders made, the file opened), and left
    as it was: what the try made is removed again.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file in it")
    made = [folder for folder in path.parents if not folder.exists()]
    existed = path.exists() or path.is_symlink()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {error}") from None
    finally:
        if not existed and path.exists():
            path.unlink()
        for folder in made:  # innermost first
            if folder.exists():
                folder.rmdir()
    return path


PICTURES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def picture(text: str) -> Path:
    """An argparse type: a picture file (a name without a suffix gets .png)."""
    suffix = Path(text).suffix.lower()
    if suffix and suffix not in PICTURES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: draw to one of {', '.join(PICTURES)}, not {suffix}"
        )
    return out_file(text if suffix else f"{text}.png")


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, **quick: Any
) -> argparse.Namespace:
    """The command line; with ``--quick``, ``quick``'s values for the options not given."""
    args = parser.parse_args(argv)
    if args.quick:
        unset = object()  # not a string: argparse would convert it by the option's type
        parser.set_defaults(**dict.fromkeys(vars(args), unset))
        again = vars(parser.parse_args(argv))
        for name, value in quick.items():
            if again[name] is unset:  # not on the command line
                setattr(args, name, value)
    out, plot = getattr(args, "out", None), getattr(args, "plot", None)
    if out is not None and plot is not None and out.resolve() == plot.resolve():
        parser.error(f"--out and --plot name one file, {str(out)!r}: the picture would replace it")
    return args


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
