"""torchgpipe: GPipe pipeline parallelism for PyTorch models too large for one device."""

from torchgpipe.checkpoint import is_checkpointing, is_recomputing
from torchgpipe.gpipe import BalanceError, GPipe
from torchgpipe.split import SplitError, split
from torchgpipe.training import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    StepResult,
)

__all__ = [
    "BalanceError",
    "GPipe",
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble",
    "SplitError",
    "StepResult",
    "__version__",
    "is_checkpointing",
    "is_recomputing",
    "split",
]

__version__ = "0.1.0.dev0"
