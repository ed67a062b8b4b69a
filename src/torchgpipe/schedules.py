"""Pipeline schedules as data: which action each worker runs, in order.

An action is a forward ``F``, a backward ``B`` or, when a schedule splits the backward
as zero-bubble schedules do, an input-gradient ``B`` and a weight-gradient ``W``, of
one micro-batch on one stage. Its text form is ``"1F3"``: stage 1, forward, micro-batch
3. A schedule gives each worker (rank) its list of actions; a stage runs on one rank,
and with interleaving a rank runs several (virtual) stages::

    >>> print(one_f_one_b(3, 4).grid())
    rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3

Dependencies: ``F(s, i)`` after ``F(s - 1, i)``; ``B(s, i)`` after ``F(s, i)`` and
``B(s + 1, i)``; ``W(s, i)`` after ``B(s, i)``. :meth:`Schedule.validate` checks that
every action is there once, on its stage's rank, and that a dry run finishes (else
where it stalls). :func:`simulate` gives the makespan, the bubble fraction and the most
micro-batches each stage holds at once, for costs per kind of action. No torch here.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal, TypeVar, cast

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "gpipe",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "simulate",
    "timeline",
    "zero_bubble_h1",
]

Kind = Literal["F", "B", "W"]
_T = TypeVar("_T")
_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")


class ScheduleError(ValueError):
    """A schedule that misses, repeats or misplaces actions, or that cannot finish."""


@dataclass(frozen=True)
class Action:
    """Micro-batch ``i``'s forward, backward or weight gradient on stage ``stage``."""

    stage: int
    kind: Kind
    i: int

    def __post_init__(self) -> None:  # NumPy integers become ints; floats, bools refused
        for name, value in (("stage", self.stage), ("i", self.i)):
            if type(value) is int:  # the common case, fast
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise TypeError(f"Action: {name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.i}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written ``text``, such as ``"1F3"``.

        Raises:
            ValueError: ``text`` is not a stage, a kind (F, B or W) and a micro-batch.
        """
        match = _ACTION.match(text.strip())
        if match is None:
            what = "write the stage, F, B or W, and the micro-batch, as in '1F3'"
            raise ValueError(f"{text!r} is not an action; {what}")
        kind: Kind = match.group(2)  # type: ignore[assignment]  # the pattern allows only F, B, W
        return cls(int(match.group(1)), kind, int(match.group(3)))

    def needs(self, stages: int) -> list[Action]:
        """The actions that must finish before this one can start."""
        s, i = self.stage, self.i
        if self.kind == "F":
            return [Action(s - 1, "F", i)] if s > 0 else []
        if self.kind == "B":
            return [Action(s, "F", i)] + ([Action(s + 1, "B", i)] if s + 1 < stages else [])
        return [Action(s, "B", i)]


@dataclass(frozen=True)
class Schedule:
    """Each rank's actions in order.

    Args:
        stages: the number of stages (partitions; with interleaving, virtual stages).
        micro_batches: the number of micro-batches.
        ranks: for each rank, its actions in the order it runs them.
        placement: the rank of each stage. Default: stage ``s`` on rank ``s % len(ranks)``.

    Raises:
        TypeError: a count that is not an int, or something other than an Action in ``ranks``.
        ValueError: a count below 1 (no ranks), or not one rank of ``ranks`` per stage.
    """

    stages: int
    micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ranks = tuple(tuple(rank) for rank in self.ranks)
        stages, m, n = _counts(
            "Schedule", stages=self.stages, micro_batches=self.micro_batches, ranks=len(ranks)
        )
        odd = [a for rank in ranks for a in rank if not isinstance(a, Action)]
        if odd:
            raise TypeError(f"Schedule: ranks hold {odd[0]!r}, not an Action; see Schedule.parse")
        placement = tuple(self.placement) or tuple(s % n for s in range(stages))
        ints = all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in placement)
        if not ints or len(placement) != stages or any(r not in range(n) for r in placement):
            raise ValueError(
                f"Schedule: placement {placement} must give each of the {stages} stages one "
                f"of the {n} ranks (0 to {n - 1}); or leave it out for stage s on rank s % {n}"
            )
        # Frozen: set through __dict__ (NumPy counts become ints, lists of actions tuples).
        placement = tuple(map(int, placement))
        self.__dict__.update(stages=stages, micro_batches=m, ranks=ranks, placement=placement)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward is split into ``B`` (input grad) and ``W`` (weight grad)."""
        return self._kept("_splits", lambda: any(a.kind == "W" for r in self.ranks for a in r))

    def __getstate__(self) -> dict[str, object]:
        # The fields alone: what _kept holds may differ by process (a string's hash does).
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __hash__(self) -> int:  # kept: a step looks its table up in caches
        return self._kept(
            "_hash", lambda: hash((self.stages, self.micro_batches, self.ranks, self.placement))
        )

    def text(self) -> str:
        """A line of actions per rank (``-`` for a rank with none); :meth:`parse` reads it back."""
        return self._kept(
            "_text", lambda: "\n".join(" ".join(map(str, r)) or "-" for r in self.ranks)
        )

    def _kept(self, name: str, make: Callable[[], _T]) -> _T:
        """``make()``, computed once per table (it is frozen) and kept in its ``__dict__``."""
        if name not in self.__dict__:
            object.__setattr__(self, name, make())
        return cast(_T, self.__dict__[name])

    @classmethod
    def parse(
        cls, text: str, *, stages: int | None = None, micro_batches: int | None = None
    ) -> Schedule:
        """The schedule written ``text`` (one line of actions per rank; ``-``: a rank with none).

        ``stages`` and ``micro_batches`` default to what the actions mention; each stage
        is placed on the rank whose line first holds one of its actions (one no line
        holds: stage ``s`` on rank ``s % ranks``).

        Raises:
            ValueError: a word is not an action, or ``text`` holds none.
        """
        ranks = tuple(
            tuple(Action.parse(word) for word in line.split() if word != "-")
            for line in text.strip().splitlines()
            if line.strip()
        )
        actions = [a for rank in ranks for a in rank]
        if not actions:
            raise ValueError(
                f"Schedule.parse: {text!r} holds no actions; write one line of actions per "
                f"rank, as in '0F0 0B0\\n1F0 1B0'"
            )
        stages = 1 + max(a.stage for a in actions) if stages is None else stages
        m = 1 + max(a.i for a in actions) if micro_batches is None else micro_batches
        where: dict[int, int] = {}
        for r, rank in enumerate(ranks):
            for action in rank:
                where.setdefault(action.stage, r)
        return cls(stages, m, ranks, tuple(where.get(s, s % len(ranks)) for s in range(stages)))

    def grid(self, *, steps: Sequence[Sequence[Action | None]] | None = None) -> str:
        """The table as text, a rank per row; with ``steps``, aligned by step (``.`` idle)."""
        if steps is None:
            return "\n".join(
                f"rank {r}: " + " ".join(map(str, rank)) for r, rank in enumerate(self.ranks)
            )
        width = max((len(str(a)) for row in steps for a in row if a is not None), default=3)
        lines = [
            f"rank {r}: "
            + " ".join((str(row[r]) if row[r] is not None else ".").rjust(width) for row in steps)
            for r in range(len(self.ranks))
        ]
        header = "step:   " + " ".join(str(k).rjust(width) for k in range(len(steps)))
        return "\n".join([header, *lines])

    def validate(self) -> list[list[Action | None]]:
        """Check the table; return its :meth:`dry_run`.

        Raises:
            ScheduleError: an action is missing, repeated or on the wrong rank, or the
                dry run stalls (the message says where, as :meth:`dry_run`'s does).
        """
        problems = self._membership_problems()
        if problems:
            raise ScheduleError(
                "the schedule is not valid:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        return self.dry_run()

    def dry_run(self, kinds: str = "FBW") -> list[list[Action | None]]:
        """Each step's action per rank (None: idle), of the actions of ``kinds`` only.

        Every rank whose next action has all it needs runs it, one action per rank per
        step. ``kinds="F"`` is the forward alone (a forward-only step); the processes of
        a pipeline order their transfers by these steps (``distributed/plan.py``).

        Raises:
            ScheduleError: the dry run stalls (the message names the step, the waiting
                actions and what they wait for, and shows the steps so far).
        """
        ranks = [tuple(a for a in rank if a.kind in kinds) for rank in self.ranks]
        done: set[Action] = set()
        position = [0] * len(ranks)
        steps: list[list[Action | None]] = []
        total = sum(len(rank) for rank in ranks)
        while len(done) < total:
            row: list[Action | None] = []
            for r, rank in enumerate(ranks):
                nxt = rank[position[r]] if position[r] < len(rank) else None
                ready = nxt is not None and all(d in done for d in nxt.needs(self.stages))
                row.append(nxt if ready else None)
            if all(a is None for a in row):
                waiting = [
                    f"rank {r} waits to run {rank[position[r]]} for "
                    + ", ".join(
                        str(d) for d in rank[position[r]].needs(self.stages) if d not in done
                    )
                    for r, rank in enumerate(ranks)
                    if position[r] < len(rank)
                ]
                stalled, grid = "; ".join(waiting), self.grid(steps=steps)
                raise ScheduleError(
                    f"the schedule deadlocks at step {len(steps)}: {stalled}\n{grid}"
                )
            position = [p + (a is not None) for p, a in zip(position, row, strict=True)]
            done.update(a for a in row if a is not None)
            steps.append(row)
        return steps

    def _membership_problems(self) -> list[str]:
        kinds: tuple[Kind, ...] = ("F", "B", "W") if self.splits_backward else ("F", "B")
        every = [(s, i) for s in range(self.stages) for i in range(self.micro_batches)]
        expected = {Action(s, kind, i) for s, i in every for kind in kinds}
        seen: dict[Action, int] = {}
        problems = []
        for r, rank in enumerate(self.ranks):
            for action in rank:
                if action in seen:
                    problems.append(f"{action} appears twice (ranks {seen[action]} and {r})")
                seen[action] = r
                if action not in expected:
                    problems.append(f"{action} is not an action of this schedule")
                elif self.placement[action.stage] != r:
                    problems.append(
                        f"{action} is on rank {r}, but stage {action.stage} runs on rank "
                        f"{self.placement[action.stage]}"
                    )
        missing = sorted(expected - set(seen), key=lambda a: (a.stage, a.i, a.kind))
        if missing:
            problems.append(f"missing: {' '.join(map(str, missing))}")
        return problems


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs, for given costs per action.

    ``holding[s]`` is the most micro-batches whose activations stage ``s`` holds at
    once (from the end of a forward to the end of its backward, or of its weight
    gradient when the backward is split).
    """

    makespan: float
    bubble: float
    busy: tuple[float, ...]
    holding: tuple[int, ...]
    start: Mapping[Action, float]


def simulate(
    schedule: Schedule, costs: Mapping[str, float] | Callable[[Action], float]
) -> Simulation:
    """Run ``schedule`` on paper, with ``costs`` per kind of action (or per action).

    Each action starts when its rank is free and its dependencies are done, and takes
    its cost (``{"F": 1, "B": 2}``, with ``"W"`` too when the table splits the backward,
    or a function of the action). Communication is free.

    Raises:
        ScheduleError: the schedule is not valid (see :meth:`Schedule.validate`).
        ValueError: ``costs`` lacks a kind of action that the table has, or gives one
            a cost that is negative or not finite.
    """
    schedule.validate()
    if not callable(costs):
        kinds = {a.kind for rank in schedule.ranks for a in rank}
        missing = [] if hasattr(costs, "__missing__") else sorted(kinds & set("FBW") - set(costs))
        if missing:
            raise ValueError(
                f"simulate: costs {dict(costs)} has no cost for {', '.join(missing)}, which the "
                f"table has; give each kind of action its cost, as in {{'F': 1, 'B': 1, 'W': 1}}"
            )
    cost: Callable[[Action], float] = costs if callable(costs) else (lambda a: float(costs[a.kind]))
    start, end = timeline(schedule, cost)
    makespan = max(end.values())
    busy = tuple(sum(end[a] - start[a] for a in rank) for rank in schedule.ranks)
    bubble = 1 - sum(busy) / (len(schedule.ranks) * makespan) if makespan > 0 else 0.0
    release: Kind = "W" if schedule.splits_backward else "B"
    holding = []
    for s in range(schedule.stages):
        # Ends at one time (free actions) in the order the stage's rank runs them.
        order = {a: k for k, a in enumerate(schedule.ranks[schedule.placement[s]])}
        events = []
        for i in range(schedule.micro_batches):
            for action, delta in ((Action(s, "F", i), 1), (Action(s, release, i), -1)):
                events.append((end[action], order[action], delta))
        holding.append(max(itertools.accumulate((d for _, _, d in sorted(events)), initial=0)))
    return Simulation(makespan, bubble, busy, tuple(holding), start)


def timeline(
    schedule: Schedule, cost: Callable[[Action], float], kinds: str = "FBW"
) -> tuple[dict[Action, float], dict[Action, float]]:
    """When each action of ``kinds`` starts and ends, each taking ``cost(action)``.

    Each action starts when its rank is free and its dependencies are done;
    communication is free. For a valid schedule (:meth:`Schedule.validate`); with
    ``kinds="F"``, the forward alone.
    """
    ranks = [tuple(a for a in rank if a.kind in kinds) for rank in schedule.ranks]
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    free = [0.0] * len(ranks)
    position = [0] * len(ranks)
    remaining = sum(len(rank) for rank in ranks)
    while remaining:
        progressed = False
        for r, rank in enumerate(ranks):
            while position[r] < len(rank):
                action = rank[position[r]]
                needs = action.needs(schedule.stages)
                if any(d not in end for d in needs):
                    break
                begin, took = max([free[r], *(end[d] for d in needs)]), cost(action)
                if not 0 <= took < math.inf:  # NaN too
                    raise ValueError(f"{action} costs {took}: give finite costs, not negative")
                start[action], end[action] = begin, begin + took
                free[r] = end[action]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"the schedule cannot finish:\n{schedule.grid()}")
    return start, end


def gpipe(n: int, m: int) -> Schedule:
    """Fill and drain: every forward, then every backward, on each of ``n`` stages.

    The backwards go from the last micro-batch to the first, as GPipe's do: the last
    forward's activations (not checkpointed with ``'except_last'``) are used at once.

    Raises:
        TypeError, ValueError: ``n`` or ``m`` is not an int of at least 1.
    """
    n, m = _counts("gpipe", n=n, m=m)
    return Schedule(n, m, tuple(
        tuple(Action(s, "F", i) for i in range(m))
        + tuple(Action(s, "B", i) for i in reversed(range(m)))
        for s in range(n)
    ))  # fmt: skip


def one_f_one_b(n: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush) on ``n`` stages and ``m`` micro-batches.

    After ``n - s - 1`` warm-up forwards, stage ``s`` alternates one forward and one
    backward, then drains its backwards.

    Raises:
        TypeError, ValueError: ``n`` or ``m`` is not an int of at least 1.
    """
    n, m = _counts("one_f_one_b", n=n, m=m)
    ranks = []
    for s in range(n):
        warmup = min(n - s - 1, m)
        actions = [Action(s, "F", i) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(s, "F", warmup + k), Action(s, "B", k)]
        actions += [Action(s, "B", i) for i in range(m - warmup, m)]
        ranks.append(tuple(actions))
    return Schedule(n, m, tuple(ranks))


def interleaved_one_f_one_b(n: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B: ``n`` ranks each run ``v`` virtual stages.

    Stage ``c * n + r`` runs on rank ``r``; micro-batches go in groups of ``n``, so
    ``m`` must be a multiple of ``n``.

    Raises:
        TypeError, ValueError: ``n``, ``m`` or ``v`` is not an int of at least 1.
        ValueError: ``m`` is not a multiple of ``n``.
    """
    n, m, v = _counts("interleaved_one_f_one_b", n=n, m=m, v=v)
    if m % n:
        raise ValueError(f"interleaving needs micro-batches in groups of n = {n}; got m = {m}")
    total = m * v

    def forward(r: int, k: int) -> Action:
        chunk = (k // n) % v
        return Action(chunk * n + r, "F", (k // (n * v)) * n + k % n)

    def backward(r: int, k: int) -> Action:
        chunk = v - 1 - (k // n) % v
        return Action(chunk * n + r, "B", (k // (n * v)) * n + k % n)

    ranks = []
    for r in range(n):
        warmup = min((n - r - 1) * 2 + (v - 1) * n, total)
        actions = [forward(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(r, warmup + k), backward(r, k)]
        actions += [backward(r, k) for k in range(total - warmup, total)]
        ranks.append(tuple(actions))
    return Schedule(n * v, m, tuple(ranks))


def zero_bubble_h1(n: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into ``B`` and ``W`` (Qi et al., 2024).

    ``B`` (the input gradient) is on the critical path, ``W`` (the weight gradient) is
    not, so each stage may run its ``W`` later, where it would otherwise wait. Stage
    ``s`` runs 1F1B's order of ``F`` and ``B``, with ``W`` of micro-batch ``i`` right
    after the ``B`` of micro-batch ``i + s``, and its last ``s`` weight gradients at the
    end. So the first stage runs each ``W`` at once, while the last one fills its wait
    for the final backwards with ``n - 1`` of them.

    Every stage then holds at most ``n`` micro-batches (``n - s`` in flight plus ``s``
    waiting for their ``W``), which is 1F1B's peak (that of its first stage). With F,
    B and W of equal cost and ``m >= n``, a stage idles ``n - 1`` units where 1F1B idles
    ``3 (n - 1)``: a third, and the makespan is ``3 m + n - 1``.

    Raises:
        TypeError, ValueError: ``n`` or ``m`` is not an int of at least 1.
    """
    n, m = _counts("zero_bubble_h1", n=n, m=m)
    base = one_f_one_b(n, m)
    ranks = []
    for s, order in enumerate(base.ranks):
        actions: list[Action] = []
        weights = 0
        for action in order:
            actions.append(action)
            if action.kind == "B" and action.i >= s:
                actions.append(Action(s, "W", weights))
                weights += 1
        actions += [Action(s, "W", i) for i in range(weights, m)]
        ranks.append(tuple(actions))
    return Schedule(n, m, tuple(ranks))


def _counts(where: str, **counts: object) -> list[int]:
    """Each count as an int of at least 1, or an error that says which one is wrong."""
    meaning = {"n": "stages", "m": "micro-batches", "v": "virtual stages per rank"}
    checked = []
    for name, value in counts.items():
        what = f"{where}: {name} (the number of {meaning.get(name, name.replace('_', '-'))})"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"{what} must be a whole number, an int (or a NumPy integer), got "
                f"{type(value).__name__} {value!r}"
            )
        if value < 1:
            raise ValueError(f"{what} must be at least 1, got {value}")
        checked.append(int(value))
    return checked
