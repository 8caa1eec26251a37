"""WireTuner, the bookkeeping that picks shared memory or MPI messages for a ring call
(csrc/wire_tuner.h), on its own: no MPI, made-up times."""
from ringreduce import _core

EVERY = _core.WireTuner.EXPLORE_EVERY
LEARN = _core.WireTuner.LEARN_CALLS
MIB = 1 << 20


def choices(tuner, nbytes, calls):
    return [tuner.prefer_shm(nbytes) for _ in range(calls)]


def test_shared_memory_first_the_wires_in_turn_and_the_other_wire_now_and_then():
    # Nothing recorded: the first LEARN calls alternate, then shared memory it is, but
    # for a look at MPI every EVERY-th call.
    tuner = _core.WireTuner()
    picks = choices(tuner, MIB, 3 * EVERY)
    assert [i for i, shm in enumerate(picks) if not shm] == (
        list(range(1, LEARN, 2)) + [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1])


def test_a_few_calls_already_find_the_faster_wire():
    # The first LEARN calls take the wires in turn: a collective called a few times
    # only still finds the faster wire, by three times each.
    assert LEARN == 8
    tuner = _core.WireTuner()
    assert run(tuner, LEARN + 3, shm_us=263, mpi_us=88) == [True, False] * 4 + [False] * 3
    tuner = _core.WireTuner()
    assert run(tuner, LEARN + 3, shm_us=49, mpi_us=83) == [True, False] * 4 + [True] * 3
    # MPI's first two calls slow (the library's own set-up, as MPICH's 1 MiB broadcasts
    # were): four looks, of which the last three count, still see it faster.
    tuner = _core.WireTuner()
    mpi_calls = 0
    picks = []
    for _ in range(LEARN + 3):
        shm = tuner.prefer_shm(MIB)
        mpi_calls += not shm
        tuner.record(MIB, shm, (230 if shm else 580 if mpi_calls <= 2 else 140) * 1e-6)
        picks.append(shm)
    assert picks == [True, False] * 4 + [False] * 3
    # Times that are there already (three of each) need no turns.
    tuner = _core.WireTuner()
    for _ in range(3):
        tuner.record(MIB, False, 83e-6)
        tuner.record(MIB, True, 49e-6)
    assert choices(tuner, MIB, 3) == [True, True, True]


def run(tuner, calls, shm_us, mpi_us):
    """calls ring calls of 1 MiB, each on the wire the tuner picks, taking that long."""
    picks = []
    for _ in range(calls):
        shm = tuner.prefer_shm(MIB)
        tuner.record(MIB, shm, (shm_us if shm else mpi_us) * 1e-6)
        picks.append(shm)
    return picks


def test_the_faster_wire_wins_and_the_estimate_follows_a_change():
    tuner = _core.WireTuner()
    # The usual phase (times measured on the development machine): shared memory.
    picks = run(tuner, 4 * EVERY, shm_us=49, mpi_us=83)
    assert picks.count(False) == LEARN // 2 + 4  # only the looks at MPI
    # One odd slow call changes nothing...
    assert run(tuner, 1, shm_us=500, mpi_us=83) == [True]
    assert run(tuner, 3, shm_us=49, mpi_us=83) == [True] * 3
    # ...but a slow phase for shared memory does, after two calls...
    picks = run(tuner, 4 * EVERY, shm_us=263, mpi_us=88)
    assert picks[:3] == [True, True, False]
    assert picks[2:].count(True) == 4  # ...looking back at shared memory now and then
    # The phase ends: shared memory wins back after two looks.
    picks = run(tuner, 4 * EVERY, shm_us=49, mpi_us=83)
    assert picks[-2 * EVERY:].count(False) == 2  # only the looks at MPI


def test_size_classes_are_separate_and_times_count_per_byte():
    # (Three times of each wire, so that no class is still taking the wires in turn.)
    tuner = _core.WireTuner()
    for _ in range(3):
        tuner.record(MIB, True, 1.0)
        tuner.record(MIB, False, 0.5)       # MPI faster at 1 MiB...
        tuner.record(64 << 10, True, 0.5)
        tuner.record(64 << 10, False, 1.0)  # ...shared memory at 64 KiB
    assert tuner.prefer_shm(MIB) is False and tuner.prefer_shm(64 << 10) is True

    tuner = _core.WireTuner()
    for _ in range(3):
        tuner.record(MIB, False, 0.5)           # MPI: 0.5 s per MiB
        tuner.record(3 * MIB // 2, True, 0.6)   # shared memory: 0.4 s per MiB, same class
    assert tuner.prefer_shm(MIB) is True
