"""The GPipe module: check the arguments, split the model, place it, and run it."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import replace
from functools import partial
from typing import Any, overload

import torch
from torch import Tensor, nn

from torchgpipe import pipeline
from torchgpipe.arguments import (
    BalanceError,
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
from torchgpipe.clip import clip_grad_norm, counted_once
from torchgpipe.devices import Device, PlacedModule, check_devices
from torchgpipe.grad_hooks import hooks_once
from torchgpipe.guards import RecomputeGuard
from torchgpipe.legacy import renamed_keys, watch_loads
from torchgpipe.materialize import Init, check_materializable, check_meta_arguments, partition
from torchgpipe.microbatch import gather, scatter
from torchgpipe.rng import draw_seed
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
from torchgpipe.versions import put_versions_back
from torchgpipe.worker import Workers

__all__ = ["BalanceError", "Checkpoint", "Device", "GPipe"]

# The attributes GPipe.__init__ assigns after it checks the layers' names, which must
# not be any of them (a layer of that name would be hidden, or refused by nn.Module).
_ASSIGNED_LATER = frozenset(("skip_layout", "workers", "_ties", "_partitions"))
_ASSIGNED_LATER |= {"_inbound", "_outbound", "_guards", "_streams", "_tracer", "_made", "_layers"}


class GPipe(PlacedModule, StageHolder):
    """Wraps an ``nn.Sequential`` to train it with GPipe's pipeline parallelism.

    The layers are split into consecutive partitions of ``balance[j]`` layers, partition
    ``j`` is moved to ``devices[j]``, and each mini-batch is cut into ``chunks``
    micro-batches that flow through the partitions as a pipeline, one worker thread per
    partition. Checkpointed micro-batches keep only their inputs at partition
    boundaries and are recomputed in backward.

    Example::

        model = nn.Sequential(a, b, c, d)
        model = GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=8)
        loss_fn(model(x), y).backward()

    The wrapped layers stay the ``GPipe``'s own children under their original names, so
    ``state_dict()`` keys are those of the ``nn.Sequential`` and a checkpoint loads into
    either. The input and output (and whatever layers pass between them) may be a
    tensor or any nesting of tuples, lists and dicts of tensors sharing dim 0 (the
    batch), with other leaves passed to every micro-batch unchanged.

    Layers made with :func:`torchgpipe.skip.skippable` may pass tensors to later layers
    across partitions; ``skip_layout`` says which partition stashes and which pops each
    one, and each skip is copied once, from the one to the other.

    Args:
        module: the model; its layers run in order, each called with the previous
            layer's output.
        balance: the number of layers in each partition; it sums to ``len(module)``.
        devices: a device per partition (they may repeat). Default: every CUDA device
            in order, or ``'cpu'`` for every partition on a machine without CUDA.
        chunks: the number of micro-batches a mini-batch is cut into (fewer when the
            batch is smaller).
        checkpoint: ``'always'``, ``'except_last'`` (every micro-batch but the last)
            or ``'never'``. Nothing is checkpointed in eval mode or without grad.
        deferred_batch_norm: make every batch-norm layer a
            :class:`~torchgpipe.batchnorm.DeferredBatchNorm`, whose running statistics
            are updated once per mini-batch from the statistics of the whole
            mini-batch. In place: each layer stays the object it was (its class becomes
            a deferred subclass of its own), so whatever else holds it sees it
            deferred. Without it, each micro-batch updates them, once (recomputation
            does not).
        init: for a model built on the meta device (``with torch.device("meta")``),
            a function that fills each layer once it is allocated on its partition's
            device. Default: each module's own ``reset_parameters()``
            (:mod:`torchgpipe.materialize`).
        state_dict: for a model built on the meta device, the plain model's state dict
            to fill the layers from instead.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, an argument has the wrong
            type, or the skip connections do not match up (see
            :func:`torchgpipe.skip.verify_skippables`).
        ValueError: ``module`` holds a layer twice, or a module inside layers of two
            partitions (a parameter shared by layers is fine: each partition gets a
            copy, kept equal; ``tied.py``), ``chunks`` is not positive,
            ``checkpoint`` is unknown, a device is not available or is ``'meta'`` (a
            model built on meta is materialized on the real devices given), or a meta
            layer cannot be filled (see ``init``).
        BalanceError: ``balance`` is missing, does not sum to ``len(module)``, or has a
            non-positive entry.
        IndexError: there are fewer devices than partitions.
    """

    balance: list[int]
    devices: list[torch.device]
    chunks = Checked(check_chunks)  # read at every call: checked whenever set
    checkpoint = Checked(check_checkpoint)
    deferred_batch_norm: bool
    skip_layout: SkipLayout
    move_refused = (
        "a GPipe model cannot be moved as a whole: each partition stays on the device "
        "given in `devices`; to place it elsewhere, build a new GPipe with other devices "
        "(dtype changes such as .to(torch.float64) or .half() are allowed)"
    )

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint = "except_last",
        deferred_batch_norm: bool = False,
        init: Init | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                f"GPipe wraps an nn.Sequential, got {type(module).__name__}; put the "
                f"layers of your model in order into nn.Sequential(...)"
            )
        check_meta_arguments(module, init, state_dict)
        if state_dict is not None and renamed_keys(list(state_dict), module):
            raise ValueError(
                "state_dict= is a checkpoint of torchgpipe 0.0.7 (its keys start with "
                "'partitions.<j>.'), which a build reads as the plain model's keys: build the "
                "GPipe with the layers' resets or init=, then call load_state_dict(checkpoint), "
                "which reads 0.0.7's keys"
            )
        self.balance = check_balance(balance, len(module))
        check_layers(module)
        verify_skippables(module)
        self.devices = check_devices(devices, len(self.balance))
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = check_flag(deferred_batch_norm, "deferred_batch_norm")

        clashes = [
            name
            for name, _ in module.named_children()
            if hasattr(type(self), name) or name in vars(self) or name in _ASSIGNED_LATER
        ]
        if clashes:
            raise ValueError(
                f"layer names {clashes} are also attributes of GPipe, which would hide "
                f"them; rename those layers (the keys of the OrderedDict given to "
                f"nn.Sequential)"
            )
        layers = list(module.named_children())
        state_dict = tied_state_dict(module, state_dict)  # each name of a tie, as loaded
        fill = check_materializable(layers, init=init, state_dict=state_dict)
        # Every check has passed: from here on the module is changed (batch norm layers
        # given a deferred class; torchgpipe also changed the model in place) and placed;
        # a refusal that comes only now (a reset that left a tensor unfilled) puts it back.
        undo = Undo(module, loaded=fill.loaded(layers))
        try:
            if deferred_batch_norm:
                convert_deferred_batch_norm(module)
            for name, layer in module.named_children():
                self.add_module(name, layer)
            partitions = []
            layers = list(module.named_children())
            ends = [sum(self.balance[: j + 1]) for j in range(len(self.balance))]
            parts = [
                [layer for _, layer in layers[end - size : end]]
                for size, end in zip(self.balance, ends, strict=True)
            ]
            # A tied weight: a copy per partition.
            self._ties = Ties.untie(parts, self.devices, names=state_names(module))
            for size, device in zip(self.balance, self.devices, strict=True):
                part, layers = layers[:size], layers[size:]
                partitions.append(partition(part, device, fill))  # meta layers filled
            self._ties.align()
        except BaseException:
            undo()
            raise
        # A split model's keys: the model's own; others read torchgpipe 0.0.7's too.
        (keep_plain_keys if any(isinstance(x, Stage) for x in module) else watch_loads)(self)
        if self._ties:
            self._ties.watch_loads(self)
        # A plain attribute, not a child module: the layers are registered once, above.
        self.skip_layout = skip_layout(module, self.balance)
        self._partitions = partitions
        # Partitions with skippable layers run under a tracker of their own (skip/),
        # which takes the inbound skips and hands back the outbound ones; None: no skips.
        n = len(partitions)
        self._inbound = [self.skip_layout.inbound(j) for j in range(n)]
        self._outbound = [
            self.skip_layout.outbound(j) if has_skippables(p) else None
            for j, p in enumerate(partitions)
        ]
        # Recomputation must change no buffer otherwise than the forward did (guards.py).
        self._guards = {j: RecomputeGuard(p) for j, p in enumerate(partitions)}
        self._layers = Layers(  # what follows a layer swapped after wrapping (swaps.py)
            dict(enumerate(partitions)),
            dict(enumerate(self.devices)),
            self._ties,
            self._guards,
            self.deferred_batch_norm,
        )
        self._streams = PartitionStreams(self.devices)  # kept from run to run: stream.py
        self._tracer: Trace | None = None  # set by trace()
        self._made: dict[int, Stages] = {}  # per checkpoint_stop, the stages of untraced runs
        self.workers = Workers(n)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module``'s; the state dict's ``_metadata`` left as it came, if it raised."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            put_versions_back(self)  # what a load hook added for it (versions.py)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> Tensor:
        """Clip the gradients by their total norm, a tied weight counted once (``clip.py``).

        Use it rather than ``clip_grad_norm_(model.parameters(), ...)``, which would count
        a tied weight once per partition that holds a copy. Every copy is scaled alike.
        Arguments as torch's clip takes them (``foreach`` changes nothing here).

        Returns:
            The total norm before clipping: 0-dim, on the CPU, in the dtype torch's clip
            returns (``clip.total_norm``).
        """
        every, ties = list(self.parameters()), self._ties
        counted = counted_once(every, ties.groups, ties.ranks)
        return clip_grad_norm(counted, every, max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def partitions(self) -> nn.ModuleList:
        """The partitions, in order, each an ``nn.Sequential`` on its device.

        A new ``nn.ModuleList`` over the partitions at each access, not registered as a
        child: the layers are the model's children once, under their own names. The
        containers' own ``training`` flags follow the model's; the layers keep theirs.
        """
        with suppress(RuntimeError):  # a swap refused: the next call says so, and how
            self._follow_swaps()  # to undo it, which needs the partitions as they are
        partitions = nn.ModuleList(self._partitions)
        for container in (partitions, *self._partitions):
            container.training = self.training
        return partitions

    def _follow_swaps(self) -> None:
        """Put a layer swapped after wrapping on the other side too (``swaps.py``)."""
        if self._layers.follow(self._modules):
            self._made.clear()

    def __len__(self) -> int:
        return len(self._layers.present(self._modules))  # one attached later is no layer

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...

    @overload
    def __getitem__(self, index: slice) -> nn.Sequential: ...

    def __getitem__(self, index: int | slice) -> nn.Module:
        named = self._layers.present(self._modules)
        if isinstance(index, slice):  # under the layers' names, as a Sequential's slice
            return nn.Sequential(OrderedDict(named[index]))
        if not -len(named) <= operator.index(index) < len(named):
            raise IndexError(f"index {index} is out of range: the model has {len(named)} layers")
        return named[index][1]

    def __iter__(self) -> Iterator[nn.Module]:
        return (layer for _, layer in self._layers.present(self._modules))

    def forward(self, input: Any) -> Any:
        """Run ``input`` through the pipeline; the output is on the last device.

        Raises:
            TypeError, ValueError: the input cannot be split into micro-batches, or the
                outputs cannot be gathered back.
            BaseException: whatever a layer raised, with a note naming the partition
                and the micro-batch.
            RuntimeError: a layer of this GPipe called it (it would wait for itself);
                nothing has changed.
        """
        if not self._partitions:  # an empty model, as the empty nn.Sequential does
            draw_seed()  # as every forward does: the default generator moves on alike
            return input
        self.workers.check_caller()  # before the deferred batch norms and ties change
        batches = scatter(input, self.chunks)
        m = len(batches)
        training = self.training and pipeline.records()
        stages = self._stages(m, checkpoint_stop(self.checkpoint, m) if training else 0)
        # Deferred batch norm learns m once the workers are this call's, not before: a
        # call of another thread may be running.
        expect = partial(self.expect_micro_batches, m)
        with self._ties.using() if self._ties else nullcontext():
            outputs = pipeline.run(stages, self.workers, batches, expect)
        return gather(self._ties.after_backward(outputs) if self._ties else outputs)

    # What the schedules of torchgpipe.training ask of the stages they step (StageHolder).

    def schedule_ranks(self, virtual_stages: int, schedule: str) -> int:
        """Ranks of a table with ``virtual_stages`` partitions each: a divisor of them."""
        n = len(self.balance)
        if n == 0:
            raise ValueError(f"{schedule}: this GPipe is empty (no layers): nothing to step")
        v = virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or n % v:
            raise ValueError(
                f"{schedule}: virtual_stages must be a positive divisor of the {n} "
                f"partitions, got {v!r}"
            )
        return n // v

    def default_virtual_stages(self) -> int:
        """Two partitions per rank, when an interleaved schedule does not say."""
        return 2

    def check_table(self, table: Schedule) -> None:
        """Refuse a table that puts partitions of different devices on one rank."""
        pipeline.check_table(self.devices, table)

    def run_step(self, steps: TableSteps, input: Any, target: Any) -> StepResult:
        """One step of ``steps``, each rank on a thread of this process.

        One step or backward of this GPipe at a time sets the hooks aside: another
        thread's waits (``Workers.exclusive``).

        Raises:
            RuntimeError: a layer of this GPipe called it (it would wait for itself);
                nothing has changed.
        """
        # The parameters' own hooks run once, after the ties are summed (grad_hooks.py):
        # the tied weights' copies get the sum of their gradients as the step ends.
        with (
            self.workers.exclusive(),
            self._ties.using(step=True),
            hooks_once(self.parameters(), self._ties.own),
            self._ties.summing(),
        ):
            result = pipeline.step(self, steps, input, target)
        # Joined once every .grad holds the step's gradients: an output that cannot be
        # joined fails the step then, the gradients left in place (hooked, tied or not).
        return replace(result, output=gather(result.output, stack_scalars=True))

    def run_forward(self, steps: TableSteps, input: Any) -> Any:
        """``self(input)`` under ``no_grad``: GPipe's own forward is the forward-only one."""
        return pipeline.forward_only(self, input)

    def expect_micro_batches(self, m: int) -> Callable[[], None] | None:
        """Start deferred batch norm's mini-batch of ``m``; return what ends it, forwards done."""
        return start_mini_batch(self._layers.deferred_now(self._modules), m)

    def stages_for(self, m: int) -> Stages:
        """The partitions as the stages of a training step of ``m`` micro-batches.

        What a schedule's executor runs (``stages.py``); a trace in progress learns the
        step's ``m``. In training mode the checkpoint mode decides which micro-batches
        recompute, whatever the grad mode: a step records gradients anyway.
        """
        return self._stages(m, checkpoint_stop(self.checkpoint, m) if self.training else 0)

    def _stages(self, m: int, stop: int) -> Stages:
        self._follow_swaps()
        tracer = self._tracer
        if tracer is not None:
            tracer.m = max(tracer.m, m)
        elif stop in self._made:  # what runs before the first cell runs cold: keep what can be
            return self._made[stop]
        n = len(self._partitions)
        made = Stages(
            partitions=dict(enumerate(self._partitions)),
            devices=dict(enumerate(self.devices)),
            inbound=list(self._inbound),
            outbound=list(self._outbound),
            routes=self.skip_layout.routes,
            guards=dict(self._guards),
            streams={j: (self._streams.compute(j), self._streams.copy(j)) for j in range(n)},
            checkpoint_stop=stop,
            tracer=tracer,
        )
        return made if tracer is not None else self._made.setdefault(stop, made)

    @contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record every cell's spans while the block runs (see :mod:`torchgpipe.trace`).

        Example::

            with model.trace() as trace:
                model(x).sum().backward()
            print(trace.summary())
            trace.draw("timeline.png")

        Backward spans are recorded as long as the backward runs on graphs built inside
        the block, even if it runs after the block. Outside a trace nothing is recorded.

        Raises:
            RuntimeError: a trace of this model is already on.
        """
        with self.traced() as trace:
            yield trace

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]  # torch's, untyped
        layers = state.get("_layers")
        if layers is None or isinstance(layers.tied, set):  # pickled before: its state then
            self._guards = dict(
                enumerate(state["_guards"].values() if layers else state["_guards"])
            )
            self.__dict__.pop("_deferred", None)
            parts, devices = dict(enumerate(self._partitions)), dict(enumerate(self.devices))
            flag = self.deferred_batch_norm
            self._layers = Layers(parts, devices, self._ties, self._guards, flag)

    def __getstate__(self) -> dict[str, Any]:
        # A copy does not share a trace in progress: it belongs to the original.
        state = self.__dict__.copy()
        state["_tracer"] = None
        state["_made"] = {}  # the original's partitions and streams
        return state
