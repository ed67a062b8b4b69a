"""Pipelines over several processes and machines, on ``torch.distributed``.

One process per stage (or per group of stages, for interleaving), launched by
``torchrun``, talking over gloo on CPU or NCCL on GPU. Every process builds the same
``nn.Sequential``, keeps its stages in a :class:`PipelineStage`, and runs the steps of
a schedule, as in one process::

    import torch.distributed as dist
    from torchgpipe.distributed import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")                 # torchrun --nproc-per-node=4 train.py
    stage = PipelineStage(model, balance=[3, 3, 3, 3], chunks=8)
    schedule = Schedule1F1B(stage, nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    result = schedule.step(input, target)           # input on rank 0, target on rank 3
    optimizer.step()

Activations, gradients and skips travel between processes with their shapes and
dtypes, which may change from step to step (on gloo, a step on an input laid out as a
recent one's expects the layouts it saw; ``static_shapes=True`` promises that they
hold, for NCCL). Each process issues its transfers from one thread, in an order both ranks
of every pair derive from the schedule's table, as NCCL requires. A failure on one rank
makes every rank's step fail: the rank that raised re-raises its exception, the others
a :class:`RemoteError` naming it.
"""

from torchgpipe.distributed.data_parallel import all_reduce_gradients
from torchgpipe.distributed.errors import RemoteError
from torchgpipe.distributed.local import LocalTransport
from torchgpipe.distributed.stage import PipelineStage
from torchgpipe.distributed.transport import (
    ProcessGroupTransport,
    Transport,
    TransportError,
)

# The schedules are torchgpipe's own, the same classes for one process and several:
# given a PipelineStage, they step it across the processes.
from torchgpipe.training import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    StepResult,
)

__all__ = [
    "LocalTransport",
    "PipelineSchedule",
    "PipelineStage",
    "ProcessGroupTransport",
    "RemoteError",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble",
    "StepResult",
    "Transport",
    "TransportError",
    "all_reduce_gradients",
]
