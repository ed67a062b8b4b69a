"""Schedules as data: text form, validation with a dry run, simulation, grid."""

import math
import pickle
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from torchgpipe.schedules import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
    timeline,
    zero_bubble_h1,
)

SIZES = [(1, 1), (2, 4), (4, 8), (4, 32), (8, 8), (8, 32)]


def test_action_text_round_trip() -> None:
    assert str(Action(1, "F", 3)) == "1F3"
    assert Action.parse(" 12W30 ") == Action(12, "W", 30)
    with pytest.raises(ValueError, match=r"'1X3' is not an action"):
        Action.parse("1X3")


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zero_bubble_h1])
@pytest.mark.parametrize(("n", "m"), SIZES)
def test_schedules_validate_and_read_back(make, n: int, m: int) -> None:  # type: ignore[no-untyped-def]
    schedule = make(n, m)
    steps = schedule.validate()
    assert sum(a is not None for row in steps for a in row) == sum(map(len, schedule.ranks))
    again = Schedule.parse(schedule.text(), stages=n, micro_batches=m)
    assert again == schedule


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_gpipe_and_1f1b_bubble_is_the_textbook_one(n: int, m: int) -> None:
    ideal = (n - 1) / (m + n - 1)
    for make in (gpipe, one_f_one_b):
        assert simulate(make(n, m), {"F": 1, "B": 2}).bubble == pytest.approx(ideal)


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_1f1b_holds_at_most_n_micro_batches_and_gpipe_holds_m(n: int, m: int) -> None:
    assert simulate(gpipe(n, m), {"F": 1, "B": 2}).holding == (m,) * n
    holding = simulate(one_f_one_b(n, m), {"F": 1, "B": 2}).holding
    assert holding == tuple(min(n - s, m) for s in range(n))


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (4, 32), (8, 32)])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_v(n: int, m: int, v: int) -> None:
    # v virtual stages per rank, each costing 1/v of a whole stage's work.
    schedule = interleaved_one_f_one_b(n, m, v)
    assert schedule.stages == n * v
    assert schedule.placement == tuple(s % n for s in range(n * v))
    bubble = simulate(schedule, {"F": 1 / v, "B": 2 / v}).bubble
    assert bubble == pytest.approx((n - 1) / (v * m + n - 1))


def test_interleaving_needs_groups_of_n() -> None:
    with pytest.raises(ValueError, match="groups of n = 4; got m = 6"):
        interleaved_one_f_one_b(4, 6, 2)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 4), (4, 8), (8, 8), (8, 32)])
def test_zero_bubble_idles_a_third_of_1f1b_within_its_peak_memory(n: int, m: int) -> None:
    schedule = zero_bubble_h1(n, m)
    assert schedule.splits_backward
    zb = simulate(schedule, {"F": 1, "B": 1, "W": 1})
    reference = simulate(one_f_one_b(n, m), {"F": 1, "B": 2})  # the same work per micro-batch
    assert zb.makespan == 3 * m + n - 1
    assert reference.makespan == 3 * (m + n - 1)
    # Idle time per rank: a third of 1F1B's.
    assert zb.makespan - zb.busy[0] == pytest.approx((reference.makespan - reference.busy[0]) / 3)
    assert max(zb.holding) == max(reference.holding) == n  # 1F1B's peak memory
    assert all(held <= n for held in zb.holding)


def test_zero_bubble_with_fewer_micro_batches_than_stages_still_beats_1f1b() -> None:
    zb = simulate(zero_bubble_h1(8, 4), {"F": 1, "B": 1, "W": 1})
    reference = simulate(one_f_one_b(8, 4), {"F": 1, "B": 2})
    assert zb.bubble < reference.bubble


def test_validation_lists_missing_repeated_and_misplaced_actions() -> None:
    schedule = Schedule.parse("0F0 0F0 0B0\n1F0 0F1")
    with pytest.raises(ScheduleError) as info:
        schedule.validate()
    message = str(info.value)
    assert "0F0 appears twice" in message
    assert "0F1 is on rank 1, but stage 0 runs on rank 0" in message
    assert "missing: 0B1 1B0 1B1 1F1" in message


def test_a_deadlock_names_the_step_and_shows_the_grid() -> None:
    # Stage 1 wants micro-batch 1 first, stage 0 wants its backward of 0 before 1F... .
    schedule = Schedule.parse("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError) as info:
        schedule.validate()
    message = str(info.value)
    assert "deadlocks at step 1" in message
    assert "rank 0 waits to run 0B0 for 1B0" in message
    assert "rank 1 waits to run 1F1 for 0F1" in message
    assert "step:" in message
    assert "0F0" in message


def test_grid_aligns_the_dry_run_by_step() -> None:
    schedule = gpipe(2, 2)
    grid = schedule.grid(steps=schedule.validate())
    lines = grid.splitlines()
    assert lines[0].split() == ["step:", "0", "1", "2", "3", "4", "5"]
    assert lines[1].split() == ["rank", "0:", "0F0", "0F1", ".", ".", "0B1", "0B0"]
    assert lines[2].split() == ["rank", "1:", ".", "1F0", "1F1", "1B1", "1B0", "."]


def test_module_example_is_right() -> None:
    import doctest

    import torchgpipe.schedules

    assert doctest.testmod(torchgpipe.schedules).failed == 0


def test_public_names() -> None:
    import torchgpipe.schedules

    assert sorted(torchgpipe.schedules.__all__) == sorted(
        [
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
    )


def test_timeline_plays_a_part_of_the_table_with_given_costs() -> None:
    table = one_f_one_b(2, 3)
    start, end = timeline(table, lambda a: {"F": 1.0, "B": 2.0}[a.kind])
    assert (start[Action(1, "F", 0)], end[Action(1, "B", 0)]) == (1.0, 4.0)
    assert start[Action(0, "B", 0)] == 4.0  # after the gradient of 1B0
    forward_start, forward_end = timeline(table, lambda a: 1.0, kinds="F")
    assert set(forward_start) == {a for rank in table.ranks for a in rank if a.kind == "F"}
    assert max(forward_end.values()) == 4.0  # m + n - 1 ticks


def test_parse_refuses_text_without_actions() -> None:
    # It used to fail with "max() arg is an empty sequence".
    for text in ("", "  \n \n"):
        with pytest.raises(ValueError, match=r"holds no actions; write one line of actions"):
            Schedule.parse(text)


def test_parse_reads_back_a_placement_of_its_own() -> None:
    # Stages 0 and 1 on rank 0, 2 and 3 on rank 1: parse placed stage s on rank s % 2,
    # and validate() then refused the table that text() had written.
    text = "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\n2F0 3F0 2F1 3F1 3B0 2B0 3B1 2B1"
    table = Schedule.parse(text)
    assert table.placement == (0, 0, 1, 1)
    table.validate()
    assert Schedule.parse(table.text()) == table
    # A stage no line holds (stages= beyond the actions) keeps the default s % ranks.
    assert Schedule.parse("0F0 0B0\n1F0 1B0", stages=3).placement == (0, 1, 0)


def test_text_reads_back_a_rank_without_actions() -> None:
    # An idle rank was an empty line, which parse dropped: the table read back had a rank
    # fewer, and every rank after the idle one took the actions of the one before.
    work = (Action(0, "F", 0), Action(1, "F", 0), Action(1, "B", 0), Action(0, "B", 0))
    for ranks in ((work, ()), ((), work), ((), work, ())):
        table = Schedule(2, 1, ranks, (ranks.index(work),) * 2)
        assert Schedule.parse(table.text(), stages=2) == table
    assert table.text() == "-\n0F0 1F0 1B0 0B0\n-"


def test_schedule_refuses_a_placement_that_is_not_one_rank_per_stage() -> None:
    ranks = ((Action(0, "F", 0), Action(0, "B", 0)), (Action(1, "F", 0), Action(1, "B", 0)))
    # Too short: validate() used to raise a bare IndexError.
    with pytest.raises(ValueError, match=r"placement \(0,\) must give each of the 2 stages"):
        Schedule(2, 1, ranks, placement=(0,))
    with pytest.raises(ValueError, match=r"one of the 2 ranks \(0 to 1\)"):
        Schedule(2, 1, ranks, placement=(0, 5))
    for odd in [(True, False), (0.0, 1.0)]:  # ranks are ints, not what equals one
        with pytest.raises(ValueError, match=r"must give each of the 2 stages one of"):
            Schedule(2, 1, ranks, placement=odd)  # type: ignore[arg-type]
    numpy_ranks: Any = [np.int64(0), np.int64(1)]
    assert Schedule(2, 1, ranks, placement=numpy_ranks).placement == (0, 1)
    with pytest.raises(ValueError, match=r"ranks \(the number of ranks\) must be at least 1"):
        Schedule(1, 1, ())
    with pytest.raises(TypeError, match=r"ranks hold '0F0', not an Action"):
        Schedule(1, 1, (("0F0",),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Schedule: stages \(the number of stages\)"):
        Schedule.parse("0F0 0B0", stages=0)


def test_schedule_takes_lists_and_numpy_counts() -> None:
    import numpy as np

    table = Schedule(np.int64(1), np.int32(1), [[Action(0, "F", 0), Action(0, "B", 0)]])  # type: ignore[arg-type]
    assert table == one_f_one_b(1, 1)
    assert type(table.stages) is int
    assert hash(table) == hash(one_f_one_b(1, 1))


def test_actions_take_numpy_ints_and_refuse_other_numbers() -> None:
    import numpy as np

    # A table built over np.arange: its actions passed every check, then every step
    # failed deep in the cells' seeds (OverflowError).
    action = Action(np.int64(1), "F", np.int64(0))  # type: ignore[arg-type]
    assert type(action.stage) is int
    assert type(action.i) is int
    assert action == Action(1, "F", 0)
    assert hash(action) == hash(Action(1, "F", 0))
    for stage, i in [(0.0, 0), (True, 0), (0, 1.0)]:
        with pytest.raises(TypeError, match="must be an int"):
            Action(stage, "F", i)  # type: ignore[arg-type]


BUILDERS = {
    "gpipe": gpipe,
    "one_f_one_b": one_f_one_b,
    "zero_bubble_h1": zero_bubble_h1,
    "interleaved_one_f_one_b": lambda n, m: interleaved_one_f_one_b(n, m, 1),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("bad", [2.5, 2.0, "2", True, None])
def test_table_builders_refuse_counts_that_are_not_ints(name: str, bad: object) -> None:
    # one_f_one_b(2.5, 4) used to raise "'float' object cannot be interpreted as an
    # integer", one_f_one_b('2', 4) "'<' not supported between 'str' and 'int'".
    make = BUILDERS[name]
    with pytest.raises(TypeError, match=rf"^{name}: n \(the number of stages\) must be a whole"):
        make(bad, 2)
    with pytest.raises(TypeError, match=rf"^{name}: m \(the number of micro-batches\) must"):
        make(2, bad)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_table_builders_refuse_counts_below_one_and_take_numpy_ints(name: str) -> None:
    import numpy as np

    make = BUILDERS[name]
    with pytest.raises(ValueError, match=rf"^{name}: n \(the number of stages\) .* got 0"):
        make(0, 2)
    with pytest.raises(ValueError, match=rf"^{name}: m \(the number of micro-batches\) .* got -1"):
        make(2, -1)
    assert make(np.int64(2), np.int32(4)) == make(2, 4)


def test_interleaving_refuses_a_bad_number_of_virtual_stages() -> None:
    with pytest.raises(TypeError, match=r"v \(the number of virtual stages per rank\) must be"):
        interleaved_one_f_one_b(2, 4, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"v \(the number of virtual stages .* got 0"):
        interleaved_one_f_one_b(2, 4, 0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_simulate_refuses_a_cost_not_finite_or_negative(bad: float) -> None:
    # -1 gave a makespan, NaN a bubble of 0.
    with pytest.raises(ValueError, match=r"0F0 costs .*: give finite costs, not negative"):
        simulate(one_f_one_b(2, 2), {"F": bad, "B": 2})
    with pytest.raises(ValueError, match=r"costs .*: give finite costs, not negative"):
        simulate(one_f_one_b(2, 2), lambda a: bad if a.kind == "B" else 1.0)
    assert simulate(one_f_one_b(2, 2), {"F": 0, "B": 1}).makespan == 2 + 2 - 1


@pytest.mark.parametrize("table", [one_f_one_b(3, 4), gpipe(2, 3), zero_bubble_h1(3, 4)])
def test_simulate_counts_what_is_held_alike_when_actions_are_free(table: Schedule) -> None:
    # Ends at one time were taken releases first: free actions held nothing at all.
    costs = {"F": 1.0, "B": 2.0, "W": 1.0}
    free = {kind: 0.0 for kind in costs}
    assert simulate(table, free).holding == simulate(table, costs).holding
    assert max(simulate(table, free).holding) > 0


def test_simulate_names_the_kinds_of_action_without_a_cost() -> None:
    # The README's {"F": 1, "B": 2} on a table with W used to raise a bare KeyError: 'W'.
    with pytest.raises(ValueError, match=r"has no cost for W, which the table has"):
        simulate(zero_bubble_h1(2, 2), {"F": 1, "B": 2})
    with pytest.raises(ValueError, match=r"has no cost for B, W"):
        simulate(zero_bubble_h1(2, 2), {"F": 1})
    # A mapping that has a cost for any kind needs none named.
    assert simulate(zero_bubble_h1(2, 2), defaultdict(lambda: 1.0)).makespan > 0
    # A cost for a kind the table lacks is no harm.
    assert simulate(one_f_one_b(2, 2), {"F": 1, "B": 2, "W": 1}).makespan == 3 * (2 + 2 - 1)


def test_a_table_pickles_its_fields_alone_and_answers_alike_after() -> None:
    used, fresh = zero_bubble_h1(2, 4), zero_bubble_h1(2, 4)
    assert used.splits_backward  # each kept in the table now
    assert hash(used) == hash(fresh)
    assert used.text() == fresh.text()
    assert pickle.dumps(used) == pickle.dumps(fresh)  # what it kept does not travel
    back = pickle.loads(pickle.dumps(used))
    assert back == used
    assert hash(back) == hash(used)
    assert back.text() == used.text()
    assert back.splits_backward
    assert not pickle.loads(pickle.dumps(gpipe(2, 4))).splits_backward
