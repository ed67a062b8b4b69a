"""The exact split of a sequence of costs into consecutive groups with the least maximum.

Given layer costs ``c[0..n)`` and ``k`` partitions, find ``k`` non-empty consecutive
groups whose largest total is as small as possible (the pipeline's slowest stage, or
its fullest device).

The optimum is the total of some run ``c[s:e]``, and whether a cap ``C`` can be met is
decided greedily (fill each group while it fits): the greedy needs at most ``k`` groups
exactly when some split meets ``C``. So the search keeps an interval ``(lo, hi]``
holding the optimum (``hi`` met, ``lo`` not), and probes a run total drawn at random
from those inside the interval: every probe halves the candidates in expectation.
For each start ``s`` the run totals inside the interval are those of ends in one range
that moves right with ``s``, so counting and drawing take one pass over the starts.
In all, about ``O(n log n)`` steps.

Costs are floats; they are turned into integers exactly (every float is an integer
times a power of two), so the comparisons above are exact and the split is truly
optimal for the costs given.
"""

from __future__ import annotations

import heapq
import math
import operator
import random
import reprlib
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate, pairwise

__all__ = ["check_partitions", "solve", "whole_number"]


def whole_number(value: object, name: str) -> int:
    """``value`` as a Python int: an int or a NumPy integer, not a bool or a float.

    Raises:
        TypeError: ``value`` is not an integer; the message calls it ``name``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]  # anything with __index__
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def check_partitions(num_layers: int, partitions: int) -> int:
    """Refuse a number of partitions that ``num_layers`` layers cannot fill.

    Returns ``partitions`` as a Python int (it may be any integer, a NumPy one say).

    Raises:
        TypeError: ``partitions`` is not an integer (a bool or a float, say).
        ValueError: ``partitions`` is not positive, or exceeds ``num_layers``.
    """
    partitions = whole_number(partitions, "partitions")
    if partitions <= 0:
        raise ValueError(
            f"partitions must be a positive int, got {partitions}; pass 1 to keep all "
            f"layers in one partition"
        )
    if num_layers == 0:
        raise ValueError(
            "there are no layers to split: the model is an empty nn.Sequential (or the "
            "costs are empty); give it layers, or leave it unbalanced"
        )
    if num_layers < partitions:
        raise ValueError(
            f"cannot split {num_layers} layers into {partitions} partitions: every "
            f"partition needs at least one layer; use at most {num_layers} partitions"
        )
    return partitions


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Split ``costs`` into ``partitions`` consecutive groups minimizing the largest total.

    Returns the number of items in each group: positive ints summing to ``len(costs)``.

    Raises:
        TypeError: ``partitions`` is not an integer.
        ValueError: ``partitions`` is not positive, there are fewer costs than
            partitions, or a cost is negative or not finite.
    """
    partitions = check_partitions(len(costs), partitions)
    values = []
    for i, c in enumerate(costs):
        try:
            values.append(float(c))  # numpy scalars and 0-dim tensors included
        except OverflowError:
            raise ValueError(
                f"cost {i} is too large for a float (an int of {len(str(c))} digits); "
                f"scale the costs down"
            ) from None
        except (TypeError, ValueError) as error:
            shown = reprlib.repr(c)
            raise ValueError(f"costs must be numbers, got {shown} at index {i}: {error}") from None
    bad = [(i, c) for i, c in enumerate(values) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise ValueError(f"costs must be finite and non-negative, got {bad[:5]} (index, cost)")

    prefix = list(accumulate(_exact_integers(values), initial=0))
    best = _least_cap(prefix, partitions)
    return _split(prefix, partitions, best)


def _exact_integers(costs: Sequence[float]) -> list[int]:
    """The costs times one power of two that makes every one of them an integer."""
    ratios = [Fraction(c) for c in costs]
    scale = max(r.denominator for r in ratios)  # every denominator is a power of two
    return [int(r * scale) for r in ratios]


def _groups(prefix: list[int], cap: int, limit: int) -> int:
    """How many groups the greedy fill needs under ``cap`` (``limit + 1`` means more)."""
    n = len(prefix) - 1
    start, count = 0, 0
    while start < n:
        end = bisect_right(prefix, prefix[start] + cap) - 1
        if end == start:  # one item alone is over the cap
            return limit + 1
        start, count = end, count + 1
        if count > limit:
            return count
    return count


def _least_cap(prefix: list[int], k: int) -> int:
    n = len(prefix) - 1
    total = prefix[n]
    largest = max(b - a for a, b in pairwise(prefix))
    lo = max(largest, -(-total // k)) - 1  # below every possible answer: not met
    hi = total  # one group per item... at most k groups, met
    rng = random.Random(0)  # deterministic: the same costs give the same search
    while True:
        ranges = _ranges(prefix, lo, hi)
        count = sum(last - first for _, first, last in ranges)
        if count == 0:
            return hi
        pick = rng.randrange(count)
        for start, first, last in ranges:
            if pick < last - first:
                cap = prefix[first + pick] - prefix[start]
                break
            pick -= last - first
        if _groups(prefix, cap, k) <= k:
            hi = cap
        else:
            lo = cap


def _ranges(prefix: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """For each start ``s``, the ends ``e`` in ``[first, last)`` with lo < total < hi."""
    n = len(prefix) - 1
    ranges = []
    first = last = 0
    for start in range(n):
        first = max(first, start + 1)
        while first <= n and prefix[first] - prefix[start] <= lo:
            first += 1
        last = max(last, first)
        while last <= n and prefix[last] - prefix[start] < hi:
            last += 1
        if first < last:
            ranges.append((start, first, last))
    return ranges


def _split(prefix: list[int], k: int, cap: int) -> list[int]:
    """Exactly ``k`` non-empty groups, none over ``cap`` (which the greedy fill meets).

    The greedy fill gives at most ``k`` groups; while there are fewer, the costliest
    group of more than one item (the first of equals) is split where its larger half
    is least (the first such point). A heap of the groups and a bisection for each
    point keep this ``O(k log n)``, also on long runs of zero costs.
    """
    n = len(prefix) - 1
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(bisect_right(prefix, prefix[bounds[-1]] + cap) - 1)
    # (-total, start, end): the costliest first, then the leftmost, as groups are disjoint.
    heap = [(prefix[a] - prefix[b], a, b) for a, b in pairwise(bounds) if b - a > 1]
    heapq.heapify(heap)
    for _ in range(k - (len(bounds) - 1)):
        _, a, b = heapq.heappop(heap)
        m = _middle(prefix, a, b)
        bounds.append(m)
        for first, last in ((a, m), (m, b)):
            if last - first > 1:
                heapq.heappush(heap, (prefix[first] - prefix[last], first, last))
    return [b - a for a, b in pairwise(sorted(bounds))]


def _middle(prefix: list[int], a: int, b: int) -> int:
    """The first ``m`` in ``(a, b)`` that makes the larger of ``c[a:m]``, ``c[m:b]`` least.

    The left total grows with ``m`` and the right one shrinks: the least is at the
    first ``m`` where the left one is at least the right one, or just before it, and
    then at the first ``m`` of the run of equal right totals (zero costs) there.
    """
    total = prefix[a] + prefix[b]
    m = bisect_left(prefix, -(-total // 2), a + 1, b)  # first m: left >= right
    if m > a + 1 and (m == b or prefix[b] - prefix[m - 1] <= prefix[m] - prefix[a]):
        return bisect_left(prefix, prefix[m - 1], a + 1, m)
    return m
