"""The NCCL test double itself: it passes what NCCL runs and fails what would hang."""

from __future__ import annotations

import threading

import pytest
from nccl_rules import Mismatch, NCCLRules, Violation, WouldHang


def test_a_send_meets_its_receive_in_issue_order() -> None:
    rules = NCCLRules(2)
    rules.issue(0, 1, "send", 64)
    rules.issue(0, 1, "recv", 32)
    rules.issue(1, 0, "recv", 64)
    rules.issue(1, 0, "send", 32)
    rules.check()


def test_two_ranks_that_both_send_first_would_hang() -> None:
    rules = NCCLRules(2)
    rules.issue(0, 1, "send", 64)
    rules.issue(0, 1, "recv", 64)
    rules.issue(1, 0, "send", 64)
    rules.issue(1, 0, "recv", 64)
    with pytest.raises(WouldHang, match=r"rank 0 send -> rank 1 .* waits for rank 1 recv"):
        rules.check()


def test_the_same_exchange_as_one_group_runs() -> None:
    rules = NCCLRules(2)
    rules.group(0, [(1, "send", 64), (1, "recv", 64)])
    rules.group(1, [(0, "send", 64), (0, "recv", 64)])
    rules.check()


def test_a_chain_of_three_runs_when_each_waits_in_order() -> None:
    rules = NCCLRules(3)
    rules.issue(0, 1, "send", 8)
    rules.issue(1, 0, "recv", 8)
    rules.issue(1, 2, "send", 8)
    rules.issue(2, 1, "recv", 8)
    rules.issue(2, 1, "send", 4)  # and the gradients back
    rules.issue(1, 2, "recv", 4)
    rules.issue(1, 0, "send", 4)
    rules.issue(0, 1, "recv", 4)
    rules.check()


def test_a_receive_posted_behind_an_unrelated_send_would_hang_in_a_ring() -> None:
    rules = NCCLRules(3)
    for r in range(3):  # each sends to the next before receiving from the previous
        rules.issue(r, (r + 1) % 3, "send", 8)
        rules.issue(r, (r - 1) % 3, "recv", 8)
    with pytest.raises(WouldHang):
        rules.check()


def test_different_byte_counts_and_unmatched_operations_are_mismatches() -> None:
    rules = NCCLRules(2)
    rules.issue(0, 1, "send", 64)
    rules.issue(1, 0, "recv", 32)
    with pytest.raises(Mismatch, match="different byte counts"):
        rules.check()
    rules = NCCLRules(2)
    rules.issue(0, 1, "send", 64)
    with pytest.raises(Mismatch, match="sends 1 times to rank 1, which receives 0 times"):
        rules.check()


def test_a_second_issuing_thread_is_refused_at_once() -> None:
    rules = NCCLRules(2)
    rules.issue(0, 1, "send", 8)
    raised: list[BaseException] = []

    def other() -> None:
        try:
            rules.issue(0, 1, "recv", 8)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(raised) == 1
    assert isinstance(raised[0], Violation)
    assert "from two threads" in str(raised[0])


def test_a_group_with_two_peers_finishes_after_one_of_them_moved_on() -> None:
    # Rank 1 receives from rank 0 and sends to rank 2 in one group. Rank 0's send
    # finishes as soon as that group starts, and rank 0 goes on to its next operation
    # while rank 1's group still waits for rank 2: the group must still finish.
    rules = NCCLRules(3)
    rules.issue(0, 1, "send", 8)
    rules.issue(0, 2, "recv", 4)
    rules.group(1, [(0, "recv", 8), (2, "send", 4)])
    rules.issue(2, 0, "send", 4)
    rules.issue(2, 1, "recv", 4)
    rules.check()
