"""StallTimer, the clock of every wait on another rank (csrc/waiting.h), on its own: a
wait times out only after its timeout *without progress*, so a long call whose chunks
keep coming never does. (Timing a real ring call for this would be flaky: on shared
cores, a rank can be descheduled for longer than any timeout short enough to test.)

And DepartureNote, what a rank that left tells the others: which of several notes a
waiting rank reports, and the note's trip through a shared-memory word. (Which notice
reaches a rank first is a matter of timing in a real job.)"""
import time

import pytest

from ringreduce import _core

TURNS_PER_CHECK = 256  # idle turns between clock reads


def idle_until_expired(timer, limit_s=5.0):
    """Idle turns until the timer expires; the seconds that took."""
    start = time.monotonic()
    while not timer.expired():
        assert time.monotonic() - start < limit_s, "never expired"
    return time.monotonic() - start


def test_expires_after_its_timeout_without_progress():
    waited = idle_until_expired(_core.StallTimer(0.05))
    assert 0.05 <= waited < 1.0


def test_progress_starts_the_clock_again():
    timer = _core.StallTimer(0.05)
    end = time.monotonic() + 0.4  # eight timeouts in all, with progress every 10 ms
    while time.monotonic() < end:
        for _ in range(2 * TURNS_PER_CHECK):
            assert not timer.expired()
        time.sleep(0.01)
        timer.progressed()
    assert idle_until_expired(timer) >= 0.05  # and it still expires once progress stops


def test_no_timeout_never_expires_but_still_checks_for_departures():
    timer = _core.StallTimer(0)
    checks = []
    for _ in range(10 * TURNS_PER_CHECK):
        assert not timer.expired(lambda: checks.append(1))
    assert len(checks) == 10  # waits look for ranks that left on these turns, timeout or not


GAVE_UP, LEFT, FOLLOWED, UNCLOSED, ENDED, VANISHED = (
    _core.Departure.GAVE_UP, _core.Departure.LEFT, _core.Departure.FOLLOWED,
    _core.Departure.UNCLOSED, _core.Departure.ENDED, _core.Departure.VANISHED)
NONE = _core.DepartureNote(-1, GAVE_UP, 0)


def reported(notes, exchange):
    best = _core.DepartureNote(-1, GAVE_UP, 0)
    for note in notes:
        best.prefer(note, exchange)
    return best


def test_a_note_holds_up_only_the_exchanges_its_rank_did_not_see_through():
    note = _core.DepartureNote(1, LEFT, completed=7)
    assert note.holds_up(8) and not note.holds_up(7)
    assert not NONE.holds_up(1)
    assert reported([note], 7).rank == -1


def test_the_report_names_the_rank_that_left_first():
    first = _core.DepartureNote(1, LEFT, 7)
    told = _core.DepartureNote(2, FOLLOWED, 7, cause=1, cause_why=LEFT)
    untold = _core.DepartureNote(3, FOLLOWED, 7)
    # Whatever order the notices came in: the first rank's own note, else a follower's
    # that knows it, else any.
    for notes, rank in [([untold, told, first], 1), ([told, untold], 2), ([untold, told], 2),
                        ([untold], 3)]:
        assert reported(notes, 8).rank == rank
    message = told.text()
    assert message.startswith("rank 1 has left this communicator (an error there")
    assert message.endswith("; rank 2 left after it and said so")
    assert told.origin().rank == 1 and told.origin().why == LEFT
    assert first.text() == first.origin().text()
    assert untold.text() == "rank 3 has left this communicator, after another rank did"
    assert _core.DepartureNote(0, GAVE_UP, 3).text() == (
        "rank 0 has given up on this communicator (a timeout there)")


def test_a_rank_that_gave_up_is_reported_with_the_rank_it_waited_for():
    gave_up = _core.DepartureNote(0, GAVE_UP, 3, cause=2)
    assert gave_up.text() == (
        "rank 0 has given up on this communicator (a timeout there, waiting for rank 2)")
    assert gave_up.origin().text() == gave_up.text()
    # A rank that followed it passes on who gave up; whom that one waited for has no
    # room in its note.
    followed = _core.DepartureNote(1, FOLLOWED, 3, cause=0, cause_why=GAVE_UP)
    assert followed.text() == ("rank 0 has given up on this communicator (a timeout there); "
                               "rank 1 left after it and said so")
    # Still the first that did not merely follow, whatever it carries.
    best = _core.DepartureNote(-1, GAVE_UP, 0)
    for note in (followed, gave_up):
        best.prefer(note, 4)  # both saw 3 exchanges through: they hold up a 4th
    assert best.rank == 0 and best.cause == 2


def test_a_rank_whose_process_is_ending_is_reported_as_ended_through_its_followers():
    ended = _core.DepartureNote(2, ENDED, 4)
    assert ended.text() == "rank 2 has ended (an uncaught exception there ends its process)"
    followed = _core.DepartureNote(0, FOLLOWED, 4, cause=2, cause_why=ENDED)
    assert followed.origin().why == ENDED and followed.origin().rank == 2
    assert followed.text().startswith("rank 2 has ended (an uncaught exception")


@pytest.mark.parametrize("why, completed, cause, cause_why", [
    (GAVE_UP, 0, -1, GAVE_UP),
    (GAVE_UP, 7, 3, GAVE_UP),
    (LEFT, 12345, -1, GAVE_UP),
    (FOLLOWED, 1, 0, GAVE_UP),
    (FOLLOWED, (1 << 46) - 1, 4094, LEFT),  # the largest of each field
    (UNCLOSED, 3, 4094, UNCLOSED),
    (ENDED, 9, -1, GAVE_UP),
    (FOLLOWED, 9, 2, ENDED),
    (VANISHED, 9, -1, GAVE_UP),
    (FOLLOWED, 9, 1, VANISHED),
])
def test_a_note_comes_back_whole_from_its_shared_memory_word(why, completed, cause, cause_why):
    note = _core.DepartureNote(5, why, completed, cause, cause_why)
    word = note.shm_word()
    assert word != 0  # (0 means: still in)
    back = _core.DepartureNote.from_shm_word(5, word)
    assert (back.rank, back.why, back.completed, back.cause, back.cause_why) == (
        5, why, completed, cause, cause_why)
    assert _core.DepartureNote.from_shm_word(5, 0).rank == -1


def test_a_cause_beyond_the_words_field_comes_back_as_not_known():
    note = _core.DepartureNote(2, FOLLOWED, 9, cause=5000, cause_why=LEFT)
    back = _core.DepartureNote.from_shm_word(2, note.shm_word())
    assert (back.rank, back.why, back.completed, back.cause) == (2, FOLLOWED, 9, -1)


def test_a_notice_sent_while_the_ranks_were_making_the_communicator_says_so():
    # A rank stopped (Ctrl-C) while making a Communicator tells the others with
    # completed -1: it holds up every step of the making and every call after it.
    making = _core.DepartureNote(1, LEFT, -1)
    assert making.holds_up(0) and making.holds_up(1)
    assert making.text() == ("rank 1 has left this communicator while the ranks were making "
                             "it (Ctrl-C there)")
    # At exit (or MPI.Finalize()), a creation stopped on another thread says Ended.
    assert _core.DepartureNote(1, ENDED, -1).text() == (
        "rank 1 has ended (an uncaught exception there ends its process) while the ranks "
        "were making it")
    # One that left in (or after) the first call did not leave while it was being made.
    for completed in (0, 3):
        assert "making" not in _core.DepartureNote(1, LEFT, completed).text()


def test_the_kind_of_timeout_a_notice_raises_is_whether_another_rank_timed_out():
    # DistributedOptimizer.step() explains "another gave up" (and "not joined"), not a
    # rank that left for other reasons.
    assert _core.DepartureNote(0, GAVE_UP, 3, cause=2).timeout_kind() == "another gave up"
    # A follower's notice is judged by the rank it followed.
    assert _core.DepartureNote(1, FOLLOWED, 3, cause=0,
                               cause_why=GAVE_UP).timeout_kind() == "another gave up"
    for why in (LEFT, UNCLOSED, ENDED, VANISHED):
        assert _core.DepartureNote(0, why, 3).timeout_kind() == "in call"
        assert _core.DepartureNote(1, FOLLOWED, 3, cause=0,
                                   cause_why=why).timeout_kind() == "in call"
    assert _core.DepartureNote(1, FOLLOWED, 3).timeout_kind() == "in call"  # (not known)
    assert _core.DepartureNote(1, LEFT, -1).timeout_kind() == "in call"
