"""torchgpipe: GPipe pipeline parallelism for PyTorch models too large for one device."""

from torchgpipe.checkpoint import is_checkpointing, is_recomputing
from torchgpipe.gpipe import BalanceError, GPipe

__all__ = ["BalanceError", "GPipe", "__version__", "is_checkpointing", "is_recomputing"]

__version__ = "0.1.0.dev0"
