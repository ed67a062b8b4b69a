"""A process's share of a pipeline: its stages of an ``nn.Sequential``, on its device.

Every process builds the same ``nn.Sequential`` and gives the same balance; the one of
rank ``r`` among ``R`` keeps the partitions ``r, r + R, r + 2R, ...`` (one, unless the
balance has several partitions per process for an interleaved schedule) and moves
their layers to its device. The others' layers stay where the caller built them.

At construction the processes compare what each was given (balance, options, each
layer's type and parameter shapes, which tensors are tied: ``distributed/checks.py``)
and all refuse to start, with the same message, when they differ. The same exchange
carries a failure of one process's own start (a state dict that lacks a key of its
layers): it raises its error, the others a ``RemoteError`` that names it, at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from torchgpipe.arguments import (
    Checked,
    Checkpoint,
    check_balance,
    check_checkpoint,
    check_chunks,
    check_flag,
    check_layers,
    checkpoint_stop,
)
from torchgpipe.batchnorm import convert_deferred_batch_norm, start_mini_batch
from torchgpipe.devices import Device, PlacedModule, as_device
from torchgpipe.distributed.channel import Transport
from torchgpipe.distributed.checks import (
    check_placement,
    check_rank,
    connect,
    fingerprint,
    start_together,
)
from torchgpipe.distributed.collect import clip_across, collect, refuse
from torchgpipe.distributed.exchange import Exchange, Key
from torchgpipe.distributed.ties import AcrossRanks, frozen_everywhere, tied_ranks, unlike_dtypes
from torchgpipe.guards import RecomputeGuard
from torchgpipe.materialize import Init, check_materializable, check_meta_arguments, partition
from torchgpipe.schedules import Schedule
from torchgpipe.skip.layout import SkipLayout, skip_layout, verify_skippables
from torchgpipe.split_stage import Stage, keep_plain_keys
from torchgpipe.stages import StageHolder, Stages, has_skippables
from torchgpipe.steps import StepResult, TableSteps
from torchgpipe.stream import PartitionStreams
from torchgpipe.swaps import Layers
from torchgpipe.tied import Ties, state_names, tied_state_dict
from torchgpipe.trace import Trace
from torchgpipe.undo import Undo
from torchgpipe.worker import WorkerPool

__all__ = ["PipelineStage"]


class PipelineStage(PlacedModule, StageHolder):
    """This process's stages of a pipeline that runs over several processes.

    Build one in every process of the pipeline, from the same ``nn.Sequential`` and the
    same arguments, then drive it with a schedule of :mod:`torchgpipe.distributed`::

        dist.init_process_group("gloo")          # under torchrun
        stage = PipelineStage(model, balance=[2, 2, 2, 2], chunks=8)
        schedule = Schedule1F1B(stage, nn.CrossEntropyLoss())
        result = schedule.step(input, target)    # input on rank 0, target on the last
        optimizer.step()                         # over stage.parameters()

    The stage is a module that holds this process's layers under their names in the
    ``nn.Sequential``, so ``stage.parameters()`` are the ones to optimize here and
    ``stage.state_dict()`` has the keys of the plain model's (a split model's too:
    :func:`torchgpipe.split`). A parameter that stages on several processes use (a
    tied embedding and output head) has a copy in each; after every step each copy's
    gradient is the sum over all its uses, so equal updates keep them equal
    (``distributed/ties.py``).

    Args:
        module: the whole model, the same in every process; its layers are split by
            ``balance`` into partitions, each a stage.
        balance: how many layers each partition has. With ``R`` processes there are
            ``R`` partitions, or ``v * R`` for ``v`` stages per process (interleaved).
        rank: this process's rank in the pipeline, to be checked against the process
            group; None: take it from the group.
        device: where this process's layers run; default: CPU with gloo, the current
            CUDA device with NCCL.
        chunks: micro-batches per mini-batch.
        checkpoint: which micro-batches recompute their forward in backward:
            ``'always'``, ``'except_last'`` (the default) or ``'never'``.
        deferred_batch_norm: batch norm statistics over the mini-batch, not each
            micro-batch (see :class:`torchgpipe.GPipe`).
        group: the processes of this pipeline (``torch.distributed`` process group);
            None: every process. Several pipelines (data parallelism) each take a group.
        transport: how messages travel; default: a
            :class:`~torchgpipe.distributed.ProcessGroupTransport` over ``group``.
        init: for a model built on the meta device (``with torch.device("meta")``),
            a function that fills each of this process's layers once allocated on
            ``device``; the other layers are never allocated here. Default: each
            module's own ``reset_parameters()`` (:mod:`torchgpipe.materialize`).
        state_dict: for a model built on the meta device, the plain model's state dict
            (or the part of it with this process's layers) to fill them from instead.
        static_shapes: whether the values between stages are laid out the same (shapes,
            dtypes, structure, non-tensor values, which tensors want a gradient) at
            every step whose input is laid out as one of the last 8 steps', as
            ``torch.distributed.pipelining`` assumes. Then no metadata travels and
            receives are posted without waiting, and a value that changes anyway fails
            its step with an error that says so (the transfers stay matched). Default
            False: anything may change. On gloo a step on a remembered input layout
            still expects the last layouts, and a value laid out otherwise moves whole to
            the side channel (as fast while none do); on NCCL its metadata goes first.

    Raises:
        TypeError, ValueError, BalanceError: bad arguments, as for ``GPipe``; a
            ``group`` that this process is not in.
        RuntimeError: ``torch.distributed`` is not initialized (and no transport given);
            ``transport`` was closed, or given up once a rank was lost.
        ValueError: the processes were given different models or arguments; or, raised
            once the other processes have been told (see ``RemoteError``): a balance
            that does not give every process the same number of stages, a ``rank``
            that is not this process's, a ``state_dict`` or ``init`` that cannot fill
            this process's layers.
        RemoteError: another process failed to start (named, with its error) or died.
    """

    chunks = Checked(check_chunks)  # read at every step: checked whenever set
    checkpoint = Checked(check_checkpoint)
    move_refused = (
        "a PipelineStage cannot be moved: its layers stay on `device`, where its "
        "transfers expect them; to run elsewhere, build the stage with device=... "
        "(dtype changes such as .to(torch.float64) are allowed, alike in every process)"
    )

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int],
        *,
        rank: int | None = None,
        device: Device | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint = "except_last",
        deferred_batch_norm: bool = False,
        group: Any = None,
        transport: Transport | None = None,
        init: Init | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        static_shapes: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                f"PipelineStage takes an nn.Sequential, got {type(module).__name__}; put "
                f"the layers of your model in order into nn.Sequential(...)"
            )
        check_meta_arguments(module, init, state_dict)
        self.balance = check_balance(balance, len(module))
        check_layers(module)
        verify_skippables(module)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = check_flag(deferred_batch_norm, "deferred_batch_norm")
        self.static_shapes = check_flag(static_shapes, "static_shapes")
        # For distributed/schedule.py: per input layout (a digest), the frames of every
        # message of its last step that ended well.
        self.shapes: dict[bytes, dict[Any, Any]] = {}
        self.table_text: str | None = None  # the last table started (its text)
        wanted = None if device is None else as_device(device)
        if transport is None:
            transport = connect(group, wanted, len(self.balance))
        elif wanted is not None and wanted != transport.device:
            raise ValueError(
                f"device is {wanted} but the transport receives on {transport.device}; "
                f"give them the same device"
            )
        transport.check_open()  # one given up after a lost rank cannot start anew
        self.transport = transport
        self.device = transport.device
        self.rank = transport.rank
        self.world_size = transport.world_size
        n = len(self.balance)
        self.virtual_stages = n // self.world_size
        self.stages = tuple(range(self.rank, n, self.world_size))  # this process's
        self._pool: WorkerPool | None = None
        self._tracer: Trace | None = None  # set by trace()
        # What follows may fail here alone (a rank= or balance only this process was given,
        # a state dict lacking these layers' keys): the others, waiting, must hear of it.
        outcome: dict[str, Any] | Exception
        undo = Undo(module, loaded=module if state_dict is not None else ())  # see below
        try:
            check_placement(rank, self.rank, self.world_size, n)
            outcome = self._build(module, init=init, state_dict=state_dict)
        except Exception as error:
            outcome = error
        try:
            # The pipeline's name, its processes' alike; each step's start carries it.
            self.pipeline_name = start_together(self._start_exchange(), outcome, self)
            self._across = AcrossRanks(transport)
            self._across.align(self._ties)
        except BaseException:
            self._stop_listening()  # a stage that failed to start leaves no thread behind,
            undo()  # and the model as it was (values loaded from state_dict= included)
            raise

    def _build(
        self, module: nn.Sequential, *, init: Init | None, state_dict: Mapping[str, Tensor] | None
    ) -> dict[str, Any]:
        """Take this process's stages of ``module``; its fingerprint, for the others."""
        n = len(self.balance)
        given = ("balance", "chunks", "checkpoint", "deferred_batch_norm", "static_shapes")
        mine = fingerprint(module, {k: getattr(self, k) for k in ("world_size", *given)})
        layers = list(module.named_children())
        starts = [sum(self.balance[:s]) for s in range(n + 1)]
        self.skip_layout: SkipLayout = skip_layout(module, self.balance)
        self._has_skips = [
            any(has_skippables(layer) for _, layer in layers[starts[s] : starts[s + 1]])
            for s in range(n)
        ]
        self.partitions: dict[int, nn.Sequential] = {}
        own = [layer for s in self.stages for layer in layers[starts[s] : starts[s + 1]]]
        state_dict = tied_state_dict(module, state_dict)  # each name of a tie, as loaded
        # The whole model: a parameter tied to another rank's layer is filled there.
        fill = check_materializable(own, init=init, state_dict=state_dict, model=module)
        if self.deferred_batch_norm:
            convert_deferred_batch_norm(module)
        layers = list(module.named_children())  # with the deferred batch norms
        every = [[layer for _, layer in layers[starts[s] : starts[s + 1]]] for s in range(n)]
        shared = tied_ranks(every, [s % self.world_size for s in range(n)])
        self._ties = Ties.untie(  # a tied weight: a copy per stage here, kept equal to theirs
            [every[s] for s in self.stages],
            [self.device] * len(self.stages),
            shared={key: ranks for key, ranks in shared.items() if self.rank in ranks},
            names=state_names(module),
        )
        for s in self.stages:
            part = layers[starts[s] : starts[s + 1]]
            # Only this process's layers are allocated, when built on the meta device.
            self.partitions[s] = partition(part, self.device, fill)
            for name, layer in part:
                self.add_module(name, layer)
        if any(isinstance(layer, Stage) for layer in module):
            keep_plain_keys(self)  # a split model's keys: the model's own
        if self._ties:  # load the whole model's state dict on every rank (strict=False)
            self._ties.watch_loads(self)
        # Recomputation changes buffers as the forward did (guards.py); a swap: swaps.py.
        self._guards = {s: RecomputeGuard(self.partitions[s]) for s in self.stages}
        devices, flag = dict.fromkeys(self.stages, self.device), self.deferred_batch_norm
        self._layers = Layers(self.partitions, devices, self._ties, self._guards, flag)
        self._streams = PartitionStreams([self.device])  # one device: one pair for its stages
        return mine

    @property
    def is_first(self) -> bool:
        """Whether this process runs stage 0, which takes the input."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """Whether this process runs the last stage, which computes the loss."""
        return len(self.balance) - 1 in self.stages

    def forward(self, *args: Any) -> Any:
        """Not a callable model: raises TypeError, saying to step it with a schedule."""
        raise TypeError(
            "a PipelineStage runs in steps that span every process: use torchgpipe."
            "Schedule1F1B(stage, loss_fn).step(input, target) (or another schedule), not a call"
        )

    # What the schedules of torchgpipe.training ask of the stages they step (StageHolder).

    def schedule_ranks(self, virtual_stages: int, schedule: str) -> int:
        """The processes, which must each hold ``virtual_stages`` stages."""
        if virtual_stages != self.virtual_stages:
            if virtual_stages == 1 and schedule != "ScheduleInterleaved1F1B":
                raise ValueError(
                    f"{schedule} runs one stage per process, but the balance gives each "
                    f"of the {self.world_size} processes {self.virtual_stages}; use "
                    f"ScheduleInterleaved1F1B, or a balance of {self.world_size} partitions"
                )
            raise ValueError(
                f"{schedule}: the balance gives each of the {self.world_size} processes "
                f"{self.virtual_stages} stages, not {virtual_stages!r}; leave "
                f"virtual_stages out"
            )
        return self.world_size

    def default_virtual_stages(self) -> int:
        """The stages each process holds (its balance over the processes)."""
        return self.virtual_stages

    def check_table(self, table: Schedule) -> None:
        """Refuse a table of another number of ranks, or another placement of stages."""
        n, world = len(self.balance), self.world_size
        if len(table.ranks) != world:
            raise ValueError(
                f"the schedule runs on {len(table.ranks)} ranks but the pipeline has "
                f"{world} processes; with {n // world} stages per process use "
                f"{'ScheduleInterleaved1F1B' if n > world else 'a one-stage-per-rank schedule'}"
            )
        misplaced = [s for s in range(n) if table.placement[s] != s % world]
        if misplaced:
            raise ValueError(
                f"the schedule puts stages {misplaced} on ranks "
                f"{[table.placement[s] for s in misplaced]}, but stage s runs on rank "
                f"s % {world}; use a table with the default placement"
            )

    def run_step(self, steps: TableSteps, input: Any, target: Any) -> StepResult:
        """This process's part of one step of ``steps``, in every process at once."""
        from torchgpipe.distributed.schedule import run_step  # it builds on this module

        with self._ties.using(step=True), self._ties.summing(reduce=False):  # run_step sums
            return run_step(self, steps, input, target)  # them; a failed one's dropped

    @property
    def tie_groups(self) -> list[list[Tensor]]:
        """This process's copies of each weight tied across stages, owner first."""
        return self._ties.own

    def prepare_tied(self) -> list[Any]:
        """What the tied weights' sum needs, made before this rank ends a step (``Ties``)."""
        return self._ties.prepare(self._across)

    def reduce_tied(self, sums: list[Any], ends: Mapping[int, Any]) -> None:
        """Sum the tied weights' gradients over their copies, here and in other processes.

        Called in every process once a step ended well on every rank (``schedule.py``).
        """
        unlike_dtypes(sums, self.rank, ends)
        self._ties.finish(sums, frozen_everywhere(sums, self._ties.ranks, self.rank, ends))

    def run_forward(self, steps: TableSteps, input: Any) -> Any:
        """This process's part of a forward-only step; the output on the last rank."""
        from torchgpipe.distributed.schedule import run_forward  # it builds on this module

        return run_forward(self, steps, input)

    @contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record this process's cells while the block runs; gather_trace() merges them.

        ::

            with stage.trace() as trace:
                schedule.step(x, y)
            merged = stage.gather_trace(trace)           # in every process
            if merged is not None:                       # on rank 0
                merged.save_chrome("pipeline.json")      # a row per stage

        Raises:
            RuntimeError: a trace of this stage is already on.
        """
        with self.traced() as trace:
            yield trace

    def gather_trace(self, trace: Trace, dst: int = 0) -> Trace | None:
        """Every process's trace merged on rank ``dst``, which gets it; None elsewhere.

        Call it in every process at once, outside a step. Spans go on ``dst``'s clock
        through the wall clock: exact on one machine, as good as NTP between machines.

        Raises:
            TypeError, ValueError: ``trace`` is not this stage's own, or ``dst`` not a
                rank of the pipeline (the other processes are told).
            RemoteError: another process failed or was lost.
        """
        try:
            dst = check_rank(dst, self.world_size, "dst")
            if not isinstance(trace, Trace):
                raise TypeError(
                    f"gather_trace takes the Trace that stage.trace() gave, got "
                    f"{type(trace).__name__}; pass `trace` of `with stage.trace() as trace:`"
                )
            strays = sorted({e.j for e in trace.events} - set(self.stages))
            if trace.n != len(self.balance) or strays:  # another pipeline's, or rank's
                raise ValueError(
                    f"gather_trace takes this stage's own trace (of stages {self.stages} of "
                    f"{len(self.balance)}), got one of {trace.n} partitions"
                    f"{f' with events of stages {strays}' if strays else ''}"
                )
        except (TypeError, ValueError) as refused:
            refuse(self, "trace", refused)
            raise
        got = collect(self, "trace", (trace.m, trace.on_wall_clock()), [dst])
        if self.rank != dst:
            return None
        merged = Trace(len(self.balance), m=trace.m, origin=trace.origin)
        for peer, (m, events) in sorted(got.items()):
            merged.m = max(merged.m, m)
            merged.merge(events, f"rank {peer}")
        return merged

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> Tensor:
        """Clip every process's gradients by one total norm, each weight counted once.

        Call it in every process at once, after a step (torch's clip would clip each by
        its own norm: ``clip.py``); returns the total norm, the same everywhere (as GPipe's).

        Raises:
            TypeError, ValueError, RuntimeError: this process failed (the others are told).
            RemoteError: another process failed or was lost.
        """
        return clip_across(self, self._ties, max_norm, norm_type, error_if_nonfinite, foreach)

    def stages_for(self, m: int) -> Stages:
        """This process's stages (and every stage's skips) for a step of ``m`` micro-batches."""
        n = len(self.balance)
        self._layers.follow(self._modules)  # a layer swapped after wrapping (swaps.py)
        if self._tracer is not None:
            self._tracer.m = max(self._tracer.m, m)
        return Stages(
            partitions=dict(self.partitions),
            devices=dict.fromkeys(self.stages, self.device),
            inbound=[self.skip_layout.inbound(s) for s in range(n)],
            outbound=[
                self.skip_layout.outbound(s) if self._has_skips[s] else None for s in range(n)
            ],
            routes=self.skip_layout.routes,
            guards=dict(self._guards),
            streams=dict.fromkeys(self.stages, (self._streams.compute(0), self._streams.copy(0))),
            checkpoint_stop=checkpoint_stop(self.checkpoint, m) if self.training else 0,
            tracer=self._tracer,
        )

    def expect_micro_batches(self, m: int) -> Callable[[], None] | None:
        """Start deferred batch norm's mini-batch of ``m``; return what ends it, forwards done."""
        return start_mini_batch(self._layers.deferred_now(self._modules), m)

    def exchange(self) -> Exchange:
        """A new exchange for one step (or the start), listening to every peer.

        Its functions hold no reference to the stage: an exchange (in a cycle with its
        transfers) would keep a dropped stage, parameters and listeners, until collected.
        """
        self.transport.check_open()
        routes, world = self.skip_layout.routes, self.world_size
        index = {route.key: k for k, route in enumerate(routes)}

        def owner(key: Key) -> int:  # the rank of the stage that takes it
            kind = key[0]
            if kind in ("F", "G"):
                return int(key[1]) % world
            route = routes[index[key[1]]]
            return (route.pop_partition if kind == "S" else route.stash_partition) % world

        def wire(key: Key) -> Key:
            return (key[0], index[key[1]], *key[2:]) if key[0] in ("S", "SG") else key

        def unwire(key: Key) -> Key:
            return (key[0], routes[key[1]].key, *key[2:]) if key[0] in ("S", "SG") else key

        return Exchange(
            self.transport,
            self._listeners(),
            owner=owner,
            stages=self._rank_stages(),
            wire=wire,
            unwire=unwire,
        )

    def _listeners(self) -> WorkerPool:
        pool = self._pool
        if pool is None or pool.pid != os.getpid():
            peers = max(self.world_size - 1, 0)
            pool = self._pool = WorkerPool(peers, name="torchgpipe-listener")
        return pool

    def _rank_stages(self) -> list[tuple[int, ...]]:
        """The stages of each rank, by rank."""
        n, world = len(self.balance), self.world_size
        return [tuple(range(r, n, world)) for r in range(world)]

    def _start_exchange(self) -> Exchange:
        """The exchange of the start (``checks.start_together``), for no step's messages.

        It needs none of what :meth:`_build` makes, which may have failed.
        """
        rank = self.rank  # not self: see exchange()
        owner: Callable[[Key], int] = lambda key: rank  # noqa: E731
        return Exchange(self.transport, self._listeners(), owner=owner, stages=self._rank_stages())

    def _stop_listening(self) -> None:
        """Let the listener threads end (those of a stage that failed to start)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a PipelineStage belongs to its process and cannot be copied")
