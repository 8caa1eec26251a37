"""StallTimer, the clock of every wait on another rank (csrc/waiting.h), on its own: a
wait times out only after its timeout *without progress*, so a long call whose chunks
keep coming never does. (Timing a real ring call for this would be flaky: on shared
cores, a rank can be descheduled for longer than any timeout short enough to test.)"""
import time

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
