"""A session's target rows on their way to a feature draft (specdec.serving.features.SessionFeatures), exact cases:
what each proposal request carries, a full resend, a verdict that restarts the rows, and a gap."""

from __future__ import annotations

from specdec.serving.features import SessionFeatures

ROW = 4  # bytes: two bfloat16 numbers


def rows(*values: int) -> bytes:
    return b"".join(bytes([v]) * ROW for v in values)


def test_requests_carry_the_rows_the_draft_lacks():
    f = SessionFeatures([1, 2], width=2)
    assert not f.ready(5)
    f.absorb(0, rows(0, 1, 2, 3, 4), on_gap=None)  # the prompt's 5 positions, from the first (K = 0) verdict
    assert f.rows == 5 and f.ready(6) and not f.ready(7)
    assert f.for_draft(0) == (0, rows(0, 1, 2, 3, 4))
    f.sent()
    f.absorb(5, rows(5, 6), on_gap=None)  # the next verdict: its fed token and an accepted draft
    assert f.for_draft(6) == (5, rows(5, 6))  # only what the draft tier lacks
    f.sent()
    assert f.for_draft(8) == (7, b"")  # nothing new
    assert f.for_draft(0) == (0, rows(0, 1, 2, 3, 4, 5, 6))  # a full resend: all of them


def test_a_failed_request_sends_its_rows_again():
    f = SessionFeatures([1], width=2)
    f.absorb(0, rows(0, 1, 2), on_gap=None)
    assert f.for_draft(0) == (0, rows(0, 1, 2))  # no sent(): the request failed
    f.absorb(3, rows(3), on_gap=None)
    assert f.for_draft(4) == (0, rows(0, 1, 2, 3))


def test_a_verdict_from_an_earlier_position_replaces_the_rows_after_it():
    """The target re-prefilled (a full send): its rows start at 0 again; the draft is sent them from there."""
    f = SessionFeatures([1], width=2)
    f.absorb(0, rows(0, 1, 2, 3), on_gap=None)
    f.for_draft(0)
    f.sent()
    f.absorb(0, rows(9, 9, 9, 9, 9), on_gap=None)
    assert f.rows == 5
    assert f.for_draft(5) == (0, rows(9, 9, 9, 9, 9))


def test_a_gap_resets_the_target_instead_of_keeping_a_hole():
    f = SessionFeatures([1], width=2)
    f.absorb(0, rows(0, 1), on_gap=None)
    gaps = []
    f.absorb(4, rows(4), on_gap=lambda: gaps.append(1))  # rows 2, 3 were in a reply that was lost
    assert gaps == [1] and f.rows == 2
    f.absorb(0, rows(0, 1, 2, 3, 4), on_gap=None)  # the full send the reset caused
    assert f.rows == 5
