"""The Python face of the ring: a Communicator over an mpi4py communicator.

Every call validates its arguments here, then hands (pointer, count, dtype) to the
C++ core, which releases the GIL while it runs. The common call (a contiguous numpy
array of a dtype and op validated here before) goes straight to the binding's
FastPath, which does the same checks without Python and hands anything else back.
Asynchronous calls go to one worker thread per communicator (the core's CallQueue; an
allreduce of numpy arrays runs there without the GIL, or in the thread that waits for
it if the worker has not started it) and run in the order they were made, so every
rank runs its collectives in the same order, as MPI requires; a
blocking call made while asynchronous ones are in flight queues behind them.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import math
import numbers
import os
import sys
import threading
import time
import traceback
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from . import _core
from . import _device
from . import _types as t
from ._arrays import keeping_on_departure
from ._mpi_check import warn_if_alone_by_mistake

_COLLECTIVES = dict(_core.COLLECTIVES)
# Each collective's _async form: its name (the core's FastPath's method that queues it,
# see csrc/bindings.cc), and the name the core's errors begin with, which a Handle's
# replace with it.
_ASYNC = {name: (name + "_async", f"ringreduce.{name}")
          for name in ("allreduce", "reduce_scatter", "allgather", "broadcast")}
# allgather outputs at least this big are confirmed (see below); each Communicator's
# FastPath reads it when the Communicator is made (tests lower it before that).
_CONFIRM_BYTES = 1 << 20


def gather_output(core, allocate, nbytes: int):
    """allgather's result, between its two halves, once every rank's row count is known.

    If one rank cannot allocate its result, the others must not go on into the ring
    and wait there for it forever. So for results big enough that allocating them might
    fail, every rank (those given ``out=`` too: the decision must be the same on every
    rank, and nbytes is) confirms that it has its result, one tiny collective, and all
    raise MemoryError if any has not; unless every rank held a result of the right
    size before the call (``out=``, or the core's fast path's guess, as the header
    exchange told them all), when none allocates. A rank that fails to make a smaller
    one (or meets Ctrl-C there) leaves the communicator where the others need it in
    the ring, so that they raise at once (the core's allgather_abandon()).
    """
    if nbytes < _CONFIRM_BYTES or core.allgather_results_held:
        try:
            return allocate()
        except BaseException as error:
            core.allgather_abandon(type(error).__name__)
            raise
    try:
        result = allocate()
    except BaseException as error:
        try:
            core.allgather_confirm(False, nbytes)  # raises, naming this rank, everywhere
        except Exception:
            if isinstance(error, Exception):
                raise  # (the confirmation's error; Ctrl-C's is raised as itself)
        raise
    core.allgather_confirm(True, nbytes)
    return result


_NO_ROW_SHAPE_TAG = t.shape_tag(())


def row_layout(row_shape: tuple) -> tuple[int, int]:
    """(elements per row, the row shape's tag for the header) of allgather's rows."""
    if not row_shape:  # 1-D x, the common case, in a fraction of the time
        return 1, _NO_ROW_SHAPE_TAG
    return math.prod(row_shape), t.shape_tag(row_shape)  # math.prod: np.prod costs us


def input_copy(core, x, name: str, chunk: int) -> np.ndarray:
    """A copy of x that the core can read (C-contiguous, native byte order), made as a
    call runs: after the calls queued before it, which may still write x's memory. A
    rank without the memory for it takes part in the call's header exchange before
    raising, as one that rejects its arguments does, so that the others raise too
    instead of waiting for it."""
    try:
        return t.readable_copy(x)
    except MemoryError as error:
        raise _told(core, name, chunk, t.named(error, t.where(core.rank, core.size, name))
                    ) from None


def copy_into(core, out, x, name: str, chunk: int) -> np.ndarray:
    """x copied into out as a call runs (as input_copy, after the calls queued before
    it). A rank without the memory for it (numpy takes a temporary of x's size where out
    is x's own bytes in another layout: out=a, x=a.T) takes part in the call's header
    exchange before raising, as input_copy's does: else its next call would pair with
    the others' pending one."""
    try:
        out[...] = x
    except MemoryError as error:
        raise _told(core, name, chunk, t.named(error, t.where(core.rank, core.size, name))
                    ) from None
    return out


def _told(core, name: str, chunk: int, error: MemoryError) -> MemoryError:
    """error, once the other ranks have been told in the call's header exchange that
    this rank failed to prepare collective `name` (see t.told_in_vain)."""
    try:
        core.announce_invalid(_COLLECTIVES[name], chunk, failed=True)
    except _core.CollectiveTimeoutError as timeout:
        return t.told_in_vain(error, timeout)
    return error


def gather_rows(core, source, rows, row_shape, dtype, chunk, out, results):
    """allgather of a host array: every rank's row count first (with the rows
    themselves when they are small enough to ride along), then the result (out, or a
    new array from results, a _Results), then the ring. (The core's FastPath, which
    guesses the result's size before the exchange, saves a step more: GuessedGather.)

    source is contiguous and native, or a strided (or byte-swapped) array that shares
    no memory with out: that one is copied straight into its rows of the result, which
    the ring then gathers in place, rather than into an array of its own first."""
    row_elems, tag = row_layout(row_shape)
    out_rows = -1 if out is None else out.shape[0]
    readable = t.readable(source)
    # The result's size is known only once every rank has said its row count (and the
    # core has checked out= against them, on every rank). Positional arguments only:
    # keywords cost pybind11 almost a microsecond, as much as the exchange itself. A
    # strided source does not ride along (the core takes only contiguous rows).
    counts = core.allgather_counts(rows, row_elems, tag, dtype, chunk, out_rows, False,
                                   source if readable else None)
    total = sum(counts)
    native = t.native(source.dtype)
    start = sum(counts[:core.rank])  # (this rank's first row in the result)

    def allocate():
        if out is not None:
            result = out
        else:
            try:
                result = results.empty((total,) + row_shape, native)
            except ValueError as error:  # (numpy's: only rows of no bytes can add up so far)
                raise ValueError(f"{t.where(core.rank, core.size, 'allgather')}: the ranks' "
                                 f"rows add up to {total}, more than an array can have "
                                 f"({error})") from None
        if not readable:  # here, so that a failure is confirmed as the result's own
            result[start:start + rows] = source
        return result

    result = gather_output(core, allocate, total * row_elems * native.itemsize)
    if not readable:
        source = result[start:start + rows]
    core.allgather(source, result, counts, row_elems, dtype)
    return result


class _Scratch:
    """A host buffer that grows on demand and is kept: reduce_scatter's workspace. Taken
    when a call is prepared (maybe in two threads at once) and used while it runs, which
    the executor serialises; a buffer replaced by a bigger one lives on in its views."""

    def __init__(self):
        self.buffer = np.empty(0, np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        buffer = self.buffer  # (once: another thread may replace it meanwhile)
        if buffer.nbytes < nbytes:
            buffer = self.buffer = np.empty(nbytes, np.uint8)
        return buffer[:nbytes]


def _references(objects: list, i: int) -> int:
    return sys.getrefcount(objects[i])


# What _references() counts for an object held by its list alone. Measured by the same
# code rather than assumed, as what getrefcount() counts of its own argument varies
# between Python versions.
_ALONE = _references([object()], 0) if hasattr(sys, "getrefcount") else -1


class _Results:
    """Where new results (calls without out=) come from.

    Results from MIN_BYTES to MAX_BYTES come from buffers kept across calls, the last
    KEEP of them: a fresh array that big is a fresh mmap from the C library, and the
    kernel zeroes every page of it at first touch, which cost a 64 MiB allgather on 2
    ranks about 40% more time than the same call with out=. A buffer is handed out
    again, for a result of the same size, only once nothing but this list holds it:
    every result is a view of its buffer (so it holds a reference), and so does every
    view or buffer export of a result. An idle buffer of another size is let go (sizes
    that change would otherwise keep memory that is never reused), and bigger results
    are not kept, so at most KEEP * MAX_BYTES stay allocated while the Communicator is
    open. Smaller results come from np.empty, whose memory the C library reuses without
    faults. Used from the caller's thread and the worker's, hence the lock.
    """

    MIN_BYTES = 32 << 20
    MAX_BYTES = 256 << 20
    KEEP = 2

    def __init__(self):
        self.buffers: list[np.ndarray] = []  # least recently handed out first
        self.lock = threading.Lock()

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = (math.prod(shape) if isinstance(shape, tuple) else shape) * dtype.itemsize
        if not self.MIN_BYTES <= nbytes <= self.MAX_BYTES or _ALONE < 0:
            return np.empty(shape, dtype)
        with self.lock:
            buffers = self.buffers
            idle = [_references(buffers, i) == _ALONE for i in range(len(buffers))]
            chosen = next((i for i in range(len(buffers))
                           if idle[i] and buffers[i].nbytes == nbytes), None)
            buffer = np.empty(nbytes, np.uint8) if chosen is None else buffers[chosen]
            self.buffers = [b for i, b in enumerate(buffers)
                            if i != chosen and not (idle[i] and b.nbytes != nbytes)]
            self.buffers.append(buffer)
            del self.buffers[:-self.KEEP]  # (each freed once its last result is)
            return buffer.view(dtype).reshape(shape)


_HANDLE_ERROR = threading.Lock()  # (Handle.wait's first error: rare, so one for all)


class Handle:
    """A collective in flight. ``wait()`` returns its result (or raises its error)."""

    __slots__ = ("_work", "_error", "_frames", "_context", "_ran")

    def __init__(self, work: "_Work", context: str, ran: str | None = None):
        self._work = work
        self._error = None  # what the call raised, raised again by every wait()
        self._frames = None  # its traceback below wait(), which each raise starts anew
        self._context = context  # "ringreduce.allreduce_async (rank 1 of 4)", for errors
        # The name the core's errors begin with ("ringreduce.allreduce": the collective
        # it runs), which wait() replaces with the call's, where the caller made it as
        # allreduce_async (None: a call of the library's own, inside a step or
        # allreduce_gradients, whose errors say what ran).
        self._ran = ran

    def __repr__(self) -> str:
        return (f"<ringreduce.Handle: {self._context}, "
                f"{'done' if self._work.done() else 'in flight'}>")

    def __reduce_ex__(self, protocol):
        # (copy.copy, copy.deepcopy and pickle: a deep copy would copy the Communicator.)
        raise TypeError(f"{self._context}: a Handle cannot be copied or pickled: share it, "
                        "or copy the result of its wait()")

    def done(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._work.done()

    def wait(self, timeout: float | None = None):
        """Block until the collective finishes; return its result array.

        Without a timeout, a call on host (numpy) arrays that the worker thread has not
        started runs in this thread (after the calls queued before it), which saves
        handing it over; it is then a blocking call for signal handlers too. With a
        timeout (seconds), raise TimeoutError if it has not finished by then; the
        collective keeps running and can be waited on again. (A call that failed raises
        its error at every wait; a CollectiveTimeoutError is a TimeoutError too, so a
        polling loop that catches TimeoutError must let it through first.)
        """
        if (type(timeout) is float or type(timeout) is int) and \
                0 <= timeout < threading.TIMEOUT_MAX:
            # The usual timeout, without the checks below, whose isinstance() of an
            # abstract class costs some 0.5 us, a tenth of a small call waited for so.
            # (A bool's type is not int; NaN, infinity and the rest go below.)
            timeout = float(timeout)
        elif timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                raise TypeError(f"{self._context}: Handle.wait: timeout must be a number of "
                                f"seconds or None, got {type(timeout).__name__}")
            if not timeout >= 0:  # (NaN too)
                raise ValueError(f"{self._context}: Handle.wait: timeout must be >= 0 seconds, "
                                 f"got {timeout}")
            try:
                seconds = float(timeout)  # (threading takes no numpy.float32 or Fraction)
            except OverflowError:  # (2 ** 2000)
                seconds = math.inf
            # threading cannot wait that long, but can wait forever
            timeout = None if seconds >= threading.TIMEOUT_MAX else seconds
        work = self._work  # a _Work, or the core's AsyncCall
        if not work.done():
            if _this_process != work.pid:
                # The worker thread that would finish it exists only in the parent.
                raise ValueError(f"{self._context}: Handle.wait: this collective runs in process "
                                 f"{work.pid}, of which this one is a child made by "
                                 "fork(); it cannot finish here")
            if not work.wait(timeout):
                raise TimeoutError(f"{self._context}: still running after Handle.wait's "
                                   f"timeout of {timeout} s (wait again for its result)")
        if self._error is not None:
            raise self._error.with_traceback(self._frames)
        try:
            return work.outcome()
        except KeyboardInterrupt:
            # Ctrl-C stopped a call this thread ran (a wait's run_here()): raised here
            # once, as by a blocking call; later waits raise what the call's would,
            # stopped on the worker (as the FastPath's calls do).
            with _HANDLE_ERROR:
                if self._error is None:
                    self._error = RuntimeError(f"{self._context}: interrupted (SIGINT) on this "
                                               "rank, which is leaving the communicator")
            if not getattr(work, "interrupt_raised", False):
                raise
            # (Raised by the wait of a later call, which ran this one: not twice.)
            raised = frames = None
        except _NeverRan as error:
            # One error for every call that the cancel found queued: each wait raises
            # one of its own, which names its call, as every call's error does.
            raised, frames = ValueError(f"{self._context}: {error}"), None
        except Exception as error:  # (the core's error is made anew each time)
            raised = t.renamed(error, self._ran, t.call_of(self._context))
            # Its traceback begins with this wait() and outcome(), and each raise puts
            # the raising wait() first: without them the caller reads each frame once.
            frames = raised.__traceback__
            while frames is not None and frames.tb_frame.f_code in _WAIT_FRAMES:
                frames = frames.tb_next
        with _HANDLE_ERROR:  # (threads waiting at once: every wait raises the first's)
            if self._error is None:
                self._error, self._frames = raised, frames
        # Raised outside the except block, so that the core's error (its message
        # replaced) is not chained, and without `from None`, which would hide the
        # exception the caller may be handling around wait().
        raise self._error.with_traceback(self._frames)


class _NeverRan(ValueError):
    """Why the calls still queued never start (see _Executor.cancel): each Handle's
    wait() raises it as a ValueError of its own that begins with its call and rank."""


class _Work:
    __slots__ = ("core", "run", "result", "error", "finished", "cancelled", "pid", "queued",
                 "interrupt_raised", "watched", "observed")

    def __init__(self, core, run, pid, watched=False):
        self.pid = pid  # the process whose worker thread runs it
        # A call the user made (an *_async): its error, if its Handle is dropped
        # unwaited, is noted for a warning (see _LostIfDropped). The library's own calls
        # wait for theirs.
        self.watched = watched
        self.observed = False  # outcome() was asked for
        self.core = core
        self.run = run  # returns the collective's result
        self.result = None
        self.error = None
        self.finished = threading.Event()
        self.cancelled = None  # the error to raise instead, if set before it starts
        self.queued = None  # its place in the worker's queue, once there (the core sets it)
        # Its error, what a signal handler raised in it (KeyboardInterrupt, SystemExit),
        # was raised by the wait() of a call queued after it, which ran it (the core sets
        # it): its own wait() raises what the worker's would for a KeyboardInterrupt.
        self.interrupt_raised = False

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float | None) -> bool:
        queued = self.queued
        if queued is not None and not self.finished.is_set():
            # As the FastPath's calls: without a timeout, this thread runs the call if
            # the worker has not started it (and the calls queued before it), where it
            # may (host arrays: see Executor.push); with one, it leaves it to the worker.
            if timeout is None:
                queued.run_here()
            else:
                queued.wake_worker()
        return self.finished.wait(timeout)

    def outcome(self):
        """Once done: the result, or the error raised."""
        self.observed = True
        if self.error is not None:
            raise self.error
        return self.result

    def execute(self, catching=BaseException):
        """Runs it; what it raises of `catching` is handed to whoever waits (anything
        else propagates here: Ctrl-C in the caller's own thread)."""
        run, self.run = self.run, None  # (a Handle kept for its result keeps no inputs)
        if self.cancelled is not None:
            self.error = self.cancelled
        else:
            try:
                self.result = keeping_on_departure(self.core, run)
            except catching as error:
                self.error = error
                if self.watched and isinstance(error, _LOST_UNLESS_WAITED):
                    # Its traceback (this frame among them, which holds this _Work)
                    # would keep it alive until a garbage collection: without it, it
                    # goes, with its note, as its Handle does. (The message says all:
                    # the frames were the library's.) So would those of the errors it
                    # was raised during (a MemoryError behind the core's).
                    _without_frames(error)
                    self.__class__ = _LostIfDropped
        self.finished.set()

    def keep_escaped(self, error: BaseException) -> bool:
        """What escaped execute() where the core ran it (a signal handler's error, raised
        between two of its lines, outside its try), if it was not finished: the call's
        error (also where it had its result), so that no wait() waits for good. Whether
        it was kept (else the core raises it from the wait that ran the call, if any)."""
        if self.finished.is_set():
            return False
        self.error = error
        self.finished.set()
        return True


class _LostIfDropped(_Work):
    """A _Work whose call failed with an error that nothing after it would raise (a
    MismatchError leaves the Communicator usable): dropped before a wait() raised it,
    it notes it for a warning (see _core.take_dropped_errors, and the core's
    DroppedErrors for the FastPath's calls). Only such a failed call becomes one: no
    other Handle pays for a finalizer."""

    __slots__ = ()

    def __del__(self):
        if not self.observed and self.pid == _this_process:
            kind = "MemoryError" if isinstance(self.error, MemoryError) else \
                type(self.error).__name__  # (as the core's notes name it)
            _core.note_dropped_error(f"{kind}: {self.error}")


def _without_frames(error: BaseException) -> None:
    """Drops the tracebacks of error and of every error it was raised from or during."""
    chain, seen = [error], set()
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        chain += [link.__cause__, link.__context__]


# (What a dropped Handle's call may fail with unseen: after a timeout or a departure the
# Communicator is unusable, and its next call says so.)
_LOST_UNLESS_WAITED = (_core.MismatchError, MemoryError, _core.MPIError, _core.NoThreadError)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_of_dropped_errors() -> None:
    """Warns of the errors lost with Handles dropped unwaited, if any (DroppedErrors in
    the core), pointing at the caller's line (the first frame outside this package)."""
    if not _core.dropped_errors_pending():  # (the common case: no lock taken)
        return
    count, texts = _core.take_dropped_errors()
    if not count:
        return
    level, frame = 1, sys._getframe(0)  # (stacklevel 1: this frame)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    if count == 1:
        what = ("an asynchronous call failed, and its Handle was dropped without wait(), "
                "which raises the error: its result (out= too) holds whatever it held "
                "before. Wait for every Handle. The error")
    else:
        what = (f"{count} asynchronous calls failed, and their Handles were dropped without "
                "wait(), which raises the error: their results (out= too) hold whatever "
                "they held before. Wait for every Handle. The first")
    warnings.warn(f"ringreduce: {what}: {texts[0]}", t.DroppedErrorWarning, stacklevel=level)


_WAIT_FRAMES = (Handle.wait.__code__, _Work.outcome.__code__)


# MPI without THREAD_MULTIPLE lets one thread at a time call it (SERIALIZED), or only
# the main thread (FUNNELED, SINGLE). Every Communicator then holds this one lock while
# it calls MPI (making, calls, closing), so that ringreduce keeps the rule itself: its
# MPI calls are all inside its own. The program keeps its own MPI calls apart from them.
_SERIAL = _core.RunningLock()
_THREAD_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                  MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}


def _check_thread(context: str, level: int) -> None:
    """Raises unless MPI, initialised at `level` (below THREAD_MULTIPLE), lets this
    thread call it."""
    if level < MPI.THREAD_SERIALIZED and not MPI.Is_thread_main():
        raise ValueError(f"{context}: MPI was initialised with {_THREAD_LEVELS[level]}, which "
                         "lets only the main thread call MPI; make ringreduce calls from the "
                         "main thread, or initialise MPI with MPI_THREAD_MULTIPLE (mpi4py's "
                         "default: mpi4py.rc.thread_level = 'multiple')")


class _Executor:
    """Runs queued work items one at a time, in order, on a thread of its own (the
    core's CallQueue, csrc/call_queue.h): an allreduce of host arrays queued by the
    FastPath runs there without the GIL, a _Work with it.

    Kept apart from Communicator so that the worker thread does not keep the
    communicator alive.
    """

    def __init__(self, threaded: bool):
        self.threaded = threaded  # False: MPI lacks THREAD_MULTIPLE, run everything inline
        self.calls = _core.Executor() if threaded else _core.Executor(running=_SERIAL)
        # Held while the core runs a collective. Reentrant: a signal handler that calls
        # close() while its thread holds it (a call just returned from the core) must
        # not wait for itself.
        self.running = self.calls.running

    @property
    def busy(self) -> bool:
        """Whether a call is queued or running on the worker thread (or the thread
        stop_later() left to end on its own has not ended yet)."""
        return self.calls.pending() > 0 or self.calls.detached_alive

    @property
    def in_flight(self) -> bool:
        """Whether a queued call has yet to finish running. Unlike busy, not one that
        has finished and that the worker has yet to take off its queue, which may take
        it a time slice where it shares a core with the caller that waited for the call."""
        return self.calls.unfinished() > 0

    @property
    def started(self) -> bool:
        """Whether the worker thread is running."""
        return self.calls.started

    def submit(self, work: _Work, anywhere: bool = False) -> bool:
        """Whether work was queued (or, below THREAD_MULTIPLE, run): not once calls are
        refused. anywhere: a wait() may run it in the waiting thread (a collective of
        host arrays; not one on a GPU, which the worker's thread serves)."""
        if not self.threaded:
            with self.running:
                if self.calls.refusing():
                    return False
                # Run here and now, as a blocking call: its error is raised by wait(),
                # but Ctrl-C (KeyboardInterrupt) from the call, which it stopped (kept
                # in the Handle, the program went on as if nothing had been pressed).
                work.execute(catching=Exception)
            return True
        return self.calls.push(work, anywhere)

    def refuse_calls(self, refused: bool = True) -> None:
        """While refused, no call starts: submit() queues nothing, the FastPath hands
        every call to the Python layer, and _run() raises (the calls queued before
        still run). For a close, against a thread that got past its check of _closing
        just before the close began."""
        self.calls.refuse_calls(refused)

    def drain(self) -> None:
        self.calls.drain()

    def cancel(self, error: "_NeverRan") -> None:
        """Queued work that has not started yet will not: its wait() raises error (as a
        ValueError naming its call)."""
        self.calls.cancel(error)

    def finish(self) -> None:
        """Let queued work complete, then stop the worker thread."""
        self.drain()
        self.stop()

    def stop(self) -> None:
        self.calls.stop()

    def stop_later(self) -> None:
        """The worker thread ends once the queued calls have run; returns at once."""
        self.calls.stop_later()


class _BeginDroppedClose:
    """Queued behind the calls in flight of a Communicator dropped unclosed: as soon as
    they are over, it marks itself gone on shared memory, or begins its close over MPI
    messages, as it would have when dropped idle, so that a rank that makes one call
    more on it than this one raises then, not at this rank's exit (while this rank,
    say, waits for that rank in a call on another Communicator, or keeps a Handle, which
    keeps the core)."""

    def __init__(self, core, serial: int):
        self.core, self.serial, self.cancelled = core, serial, None

    def execute(self) -> None:  # (on the worker thread, holding its running lock)
        core, self.core = self.core, None
        if self.cancelled is not None or core.departed or MPI.Is_finalized():
            return
        core.release_scratch()
        if core.begin_close_at_exit():
            with _dropped_looking:  # (the exit may be taking them this moment)
                _dropped_closing[self.serial] = core


_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
_made = itertools.count()  # Communicator._serial: the order this rank made them in
_launch_checked = False  # (see warn_if_alone_by_mistake)
# The cores of Communicators dropped unclosed whose wire is MPI messages, by _serial,
# kept for their close at exit, the only way a rank waiting in a call this rank never
# made can learn that it never will: under THREAD_MULTIPLE begun when dropped, and
# finished (freeing the MPI communicator) once every rank has closed or dropped it,
# looked at whenever a Communicator is made, and at exit; else begun at exit.
_dropped_closing: "dict[int, _core.RingCommunicator]" = {}
# (Below THREAD_MULTIPLE, with the executor whose lock their close at exit takes: such
# an executor has no thread of its own, so nothing is in flight on them.)
_dropped_over_mpi: "dict[int, tuple[_core.RingCommunicator, _Executor]]" = {}
_dropped_looking = threading.Lock()  # one thread at a time finishes _dropped_closing's
# The Communicators dropped with calls in flight, by _serial: (a weak reference to the
# core, which the calls keep alive until they are over, and the executor, whose worker
# finishes them on its own, then begins the close over MPI messages: _BeginDroppedClose),
# waited for at exit, before MPI goes away.
_dropped_busy: "dict[int, tuple[weakref.ref, _Executor]]" = {}
# Cores that left on a thread MPI's level kept from telling the others (below
# SERIALIZED): told at exit, on the main thread, before any close at exit waits for them.
_untold_over_mpi: "list[_core.RingCommunicator]" = []
_PROCESS = os.getpid()  # MPI's process: a child made by fork() must leave MPI alone
# This process, without os.getpid()'s system call (0.1 us, in every wait for a call not
# done): renewed in a child made by fork().
_this_process = _PROCESS
# Whether MPI was initialised when this process last forked (a child may run an MPI of
# its own only if not): read at each fork, as MPI may be initialised after the import
# (mpi4py.rc.initialize = False, then MPI.Init_thread()).
_MPI_BEFORE_FORK = MPI.Is_initialized()
_FORK_CHILD = False  # this is a child made by fork() of MPI's process (os.getpid() costs
                     # a system call, which the module-level functions make no room for)


def _after_fork_in_child():
    # Every Communicator here is the parent's: closed in the child, so calls raise (a
    # call would otherwise take the parent's place in the ring, with the child's data),
    # and close() or an exception leaving its `with` block does nothing (it would tell
    # the other ranks that this rank left, or free the parent's MPI communicator).
    # (The ones not in _live are closed already.)
    global _FORK_CHILD, _this_process, _PROCESS
    _FORK_CHILD = _MPI_BEFORE_FORK
    _this_process = os.getpid()
    if not _MPI_BEFORE_FORK:  # (no MPI of its parent's to leave alone: it may run its own)
        _PROCESS = _this_process
    for comm in list(_live):
        comm._closed = True
        comm._fast = None
    _core.release_dropped_errors()
    _core.take_dropped_errors()  # (the parent's to warn of)


def _before_fork():
    global _MPI_BEFORE_FORK
    _MPI_BEFORE_FORK = MPI.Is_initialized()
    # Taken by this thread, the one the child goes on in, so that no other holds it in
    # the child (where it would never be released: see _core's hold_dropped_errors).
    _core.hold_dropped_errors()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child,
                    after_in_parent=_core.release_dropped_errors)


@atexit.register
def _finish_all(why: str = "the process is ending", let_calls_finish: bool = False):
    # Before mpi4py finalises MPI: let queued collectives finish, so that no thread is
    # inside MPI when MPI goes away. Freeing is collective, and ranks could reach here
    # with different communicators still open, so MPI_Finalize frees what is left.
    # why: what the errors of calls and creations stopped here give as the reason.
    # let_calls_finish: a blocking call another thread is running finishes first (the
    # program's own MPI.Finalize(), with its threads alive); else it stops.
    if os.getpid() != _PROCESS:
        return
    global _finalizing
    if let_calls_finish:
        _finalizing = why
    # A daemon thread making a Communicator (for ranks that may never come), now or
    # later, stops at its next wait: it would be inside MPI when MPI goes away, and
    # under THREAD_SERIALIZED it holds the lock the closes below take.
    _core.stop_creations_on_other_threads(why)
    failing = _uncaught_exception()
    if failing is not None:
        # Every Communicator this rank leaves from now on (a call stopped below
        # included) tells the others that its process is ending: none can be made with
        # it again, and they need not wait for it there.
        _core.note_process_ending()
    comms = [comm for comm in list(_live) if not comm._closed]
    dropped = sorted(_dropped_over_mpi.items())
    _dropped_over_mpi.clear()
    dropped_busy = []
    while _dropped_busy:  # (one at a time: a garbage collection may add one meanwhile)
        try:
            dropped_busy.append(_dropped_busy.popitem())
        except KeyError:  # (another thread took the last: _finish_dropped_closes)
            break
    with _dropped_looking:
        closing = [(core, _dropped_looking) for core in _dropped_closing.values()]
        _dropped_closing.clear()
        if failing is not None:  # (leave, as every Communicator below: not wait)
            for core, _ in closing:
                core.leave()
            closing = []
    for comm in comms:
        comm._ended = why  # (what a daemon thread's call meets from now on)
        comm._refuse_calls()
        if comm._executor.running.held_by_a_caller() and not let_calls_finish:
            # A daemon thread (the only kind left at exit) is inside a blocking call.
            # Python stops daemon threads where they are; one stopped inside the core,
            # without the GIL, ends the process (std::terminate). So its call stops at
            # its next wait, and this rank leaves, as after an error. (First for every
            # Communicator: below THREAD_MULTIPLE they share one lock, and a call on one
            # would hold up finishing the others.)
            comm._core.stop_soon(why)
    if not MPI.Is_finalized():
        with _SERIAL:  # (after the stops: a daemon thread's call may hold it)
            for core in _untold_over_mpi:
                core.tell_departure()
    _untold_over_mpi.clear()
    # Over MPI messages each Communicator's close at exit waits for the others: begun on
    # all before waiting on any, as another rank may wait for this one in a call on
    # the second while this one would wait for it in the first; and on one with calls in
    # flight only once they are over (they may wait for another rank's call on another,
    # whose close must not wait for them). closing: (core, lock) of the closes at exit
    # begun; busy: (whether its calls are still in flight, begin its close, leave on
    # Ctrl-C) of those with calls in flight.
    busy = []

    def begin_dropped_busy(serial):  # its _BeginDroppedClose ran during the wait
        with _dropped_looking:
            core = _dropped_closing.pop(serial, None)
        if core is not None:
            closing.append((core, _dropped_looking))

    def leave_dropped_busy(core, executor):
        executor.cancel(_NeverRan(f"never ran: {why}"))
        core.stop_soon(why)  # (a call its worker thread runs: then it leaves)
        with executor.running:
            core.leave()

    for serial, (core_ref, executor) in dropped_busy:
        core = core_ref()  # (None: its calls are over, and its thread about to end)
        if core is not None and failing is None:
            busy.append((lambda executor=executor: executor.busy,
                         functools.partial(begin_dropped_busy, serial),
                         functools.partial(leave_dropped_busy, core, executor)))
            continue
        if core is not None:
            leave_dropped_busy(core, executor)
        # Its thread ends soon (what it runs has stopped): waited for, so that it does
        # not take the GIL for its end while the interpreter is finalising.
        busy.append((lambda executor=executor: executor.busy, lambda: None, lambda: None))

    def begin(comm):
        if comm._leave(None, stopping=why):
            closing.append((comm._core, comm._executor.running))

    def in_use(executor):
        # (Another thread's blocking call, where let_calls_finish, as a call in flight.)
        return executor.busy or let_calls_finish and executor.running.held_by_a_caller()

    def begin_dropped(core, executor):
        with executor.running:
            if core.begin_close_at_exit():
                closing.append((core, executor.running))

    try:
        for _, comm in sorted([(comm._serial, comm) for comm in comms] + dropped,
                              key=lambda made: made[0]):
            if not isinstance(comm, Communicator):
                core, executor = comm
                if failing is not None:
                    core.stop_soon(why)
                    with executor.running:
                        core.leave()
                else:
                    begin_dropped(core, executor)
            elif failing is None and in_use(comm._executor):
                busy.append((functools.partial(in_use, comm._executor),
                             functools.partial(begin, comm),
                             functools.partial(comm._leave, "Ctrl-C (KeyboardInterrupt) at "
                                               "exit" if not let_calls_finish else
                                               "Ctrl-C (KeyboardInterrupt) in MPI.Finalize()")))
            elif failing is None:
                begin(comm)
            else:
                # The process may end on an exception raised on this rank only, while
                # the others wait for it in a collective: as when an exception leaves a
                # `with` block, leave then, so that they raise at once instead of waiting
                # out their timeout (and MPI_Finalize here, waiting for them, with them).
                comm._leave(f"an uncaught {type(failing).__name__} ended the process first",
                            stopping=why)
        _finish_closes_at_exit(closing, busy)
    except KeyboardInterrupt:  # Ctrl-C at exit: leave without waiting for the others
        for core, lock in closing:
            with lock:
                core.leave()
        for _, _, leave in busy:
            leave()
        # The dropped Communicators' threads end once their cancelled calls are through,
        # each taking the GIL: one that took it while the interpreter finalises would
        # end the process (std::terminate). So they are waited for (up to 10 s).
        _wait_until_idle([executor for _, (_, executor) in dropped_busy], 10.0)
    # Daemon threads that were waiting to run a call (for the lock, say) come out now
    # that every Communicator is closed here: let them, before Python stops them.
    _core.wait_until_no_thread_without_gil(10.0)
    with _SERIAL:
        _core.finish_abandoned_duplicates()
    # A script's last calls, failed and dropped unwaited (its last step's, say), have
    # no later call to warn of them.
    try:
        _warn_of_dropped_errors()
    except Exception:  # (-W error: at exit, printed rather than raised)
        traceback.print_exc()


def _wait_until_idle(executors: list, seconds: float) -> None:
    """Waits (up to `seconds`, through further Ctrl-Cs) until none of the executors is
    busy."""
    deadline = time.monotonic() + seconds
    while any(executor.busy for executor in executors) and time.monotonic() < deadline:
        try:
            time.sleep(0.001)
        except KeyboardInterrupt:
            pass


def _finish_dropped_closes() -> None:
    """Frees the Communicators dropped unclosed that every rank has closed or dropped,
    and forgets those dropped with calls in flight that are over."""
    for serial, (_, executor) in list(_dropped_busy.items()):
        if not executor.busy:
            _dropped_busy.pop(serial, None)
    if _dropped_closing and _dropped_looking.acquire(blocking=False):
        try:
            for serial, core in list(_dropped_closing.items()):
                if core.finish_close_at_exit():
                    del _dropped_closing[serial]
        finally:
            _dropped_looking.release()


def _finish_closes_at_exit(closing: list, busy: list) -> None:
    """Waits until the closes at exit begun (closing: (core, lock)) are over, beginning
    those in `busy` ((still in flight?, begin)) as their calls in flight end (both lists
    are left with what is still to do, for a Ctrl-C)."""
    idle = 0
    while closing or busy:
        for waiting in [waiting for waiting in busy if not waiting[0]()]:
            busy.remove(waiting)
            waiting[1]()
        for core, lock in list(closing):
            with lock:
                if core.finish_close_at_exit():
                    closing.remove((core, lock))
        idle += 1
        if (closing or busy) and idle > 100:  # (the others are not at their exit yet)
            time.sleep(min(0.01, 1e-5 * idle))


_finalizing = None  # why, once the program's own MPI.Finalize() has begun finishing them


def _finalize_after_ringreduce(finalize=MPI.Finalize):
    # A program that calls MPI.Finalize() itself, with calls in flight, has its
    # Communicators finished first, as at exit: the call running on the worker thread
    # was inside MPI as MPI went away, and the process crashed. (Before MPI_Finalize:
    # from inside it, below, the worker's MPI calls could still crash MPICH there.)
    # Another thread's blocking call finishes too, as a call queued on the worker does:
    # the program's threads live on (at exit, only daemon threads are left, which
    # Python stops where they are).
    _finish_all("MPI.Finalize() on this rank", let_calls_finish=True)
    return finalize()


MPI.Finalize = functools.wraps(MPI.Finalize)(_finalize_after_ringreduce)


def _at_mpi_finalize(comm, keyval, value):
    # MPI_Finalize deletes MPI_COMM_SELF's attributes first, while MPI still works: for
    # an MPI_Finalize that MPI.Finalize above did not see (the name bound before
    # ringreduce was imported, say). At exit they are finished already (_finish_all()
    # runs before mpi4py finalises).
    if not sys.is_finalizing():
        _finish_all("MPI_Finalize on this rank")


def _finished_at_mpi_finalize():
    """Once MPI is initialised (by the first Communicator, at the latest)."""
    global _FINALIZE_KEYVAL
    if _FINALIZE_KEYVAL is None:
        _FINALIZE_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_at_mpi_finalize)
        MPI.COMM_SELF.Set_attr(_FINALIZE_KEYVAL, True)


_FINALIZE_KEYVAL = None


_mpi_was_initialised = False  # (once MPI says so, it does for good: asked until then)


def _mpi_initialised() -> bool:
    """MPI.Is_initialized(), asked only until it says yes (every module-level call asks,
    through mpi_unusable_here: 25 ns of a 1 us call, where the flag costs 10)."""
    global _mpi_was_initialised
    if not _mpi_was_initialised:
        _mpi_was_initialised = MPI.Is_initialized()
    return _mpi_was_initialised


def mpi_unusable_here() -> bool:
    """MPI is not initialised yet (mpi4py.rc.initialize = False) or has been finalised,
    or this is a child made by fork() of MPI's process: a Communicator cannot be made
    (Communicator() says why, touching no MPI)."""
    return (_FORK_CHILD or not (_mpi_was_initialised or _mpi_initialised())
            or MPI.Is_finalized())


def checked_mpi_comm(comm, caller: str, pid: int | None = None):
    """The MPI communicator a Communicator would be made over (comm=None: COMM_WORLD),
    or the error, naming ringreduce.<caller>, that says why none can be: checked before
    anything else touches MPI, which after MPI_Finalize, or in a child made by fork(),
    ends the process without a word. pid: this process's, where the caller has it (it
    costs a system call, which the module-level functions make no room for: they go by
    what os.fork() told _after_fork_in_child)."""
    if _FORK_CHILD or (pid is not None and pid != _PROCESS and _MPI_BEFORE_FORK):
        raise ValueError(f"ringreduce.{caller}: process {os.getpid()} is a child made "
                         f"by fork() of MPI's process {_PROCESS}; MPI does not let a "
                         "child use it")
    if MPI.Is_finalized():
        raise _core.MPIError(f"ringreduce.{caller}: MPI has been finalised "
                             "(MPI.Finalize()): no Communicator can be made")
    if not _mpi_initialised():  # (MPI's own error would end the process, unraised)
        raise _core.MPIError(f"ringreduce.{caller}: MPI is not initialised yet: with "
                             "mpi4py.rc.initialize = False, call MPI.Init() or "
                             "MPI.Init_thread() first")
    if comm is None:
        comm = MPI.COMM_WORLD
    if isinstance(comm, Communicator):
        comm = comm.mpi_comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"ringreduce.{caller}: comm must be an mpi4py communicator (such "
                        "as MPI.COMM_WORLD) or a ringreduce Communicator, got "
                        f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"ringreduce.{caller}: comm is MPI.COMM_NULL: a communicator "
                         "already Free()d, or what Split() or Create_group() gives a rank "
                         "left out of every group")
    if isinstance(comm, MPI.Intercomm) or comm.Is_inter():
        raise TypeError(f"ringreduce.{caller}: comm must be an intracommunicator, "
                        f"got an intercommunicator ({type(comm).__name__})")
    return comm


def _uncaught_exception() -> BaseException | None:
    """The exception ending the process, if one does: Python prints it and keeps it in
    sys.last_value before it runs the atexit functions. sys.exit() sets nothing. In an
    interactive session, or an IPython kernel (Jupyter, an ipyparallel engine), it is
    any earlier error, which ended nothing."""
    if hasattr(sys, "ps1"):
        return None
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        return None
    return getattr(sys, "last_value", None)


def _checked_chunk_bytes(value, context: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{context}: chunk_bytes must be an int, got {type(value).__name__}")
    if not 1 <= value <= _core.MAX_CHUNK_BYTES:
        raise ValueError(f"{context}: chunk_bytes must be in [1, {_core.MAX_CHUNK_BYTES}], "
                         f"got {value}")
    return int(value)


# Half an hour, as torch.distributed's default: long enough for any real wait (a rank
# saving a checkpoint while the others reach the next allreduce), short enough that a
# job with a rank that will never come fails with a message instead of hanging.
DEFAULT_TIMEOUT = 1800.0


class _FromEnvironment:
    """Communicator's default timeout (see _default_timeout()); its repr is what
    help(Communicator) shows as the default."""

    __slots__ = ()

    def __repr__(self):
        return f"$RINGREDUCE_TIMEOUT or {DEFAULT_TIMEOUT:g}"


_FROM_ENVIRONMENT = _FromEnvironment()


def _default_timeout(context: str = "ringreduce.Communicator") -> float | None:
    """RINGREDUCE_TIMEOUT, read when a Communicator is made (0: none), or DEFAULT_TIMEOUT
    (also when it is set but empty, as `RINGREDUCE_TIMEOUT= cmd` does)."""
    text = os.environ.get("RINGREDUCE_TIMEOUT")
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ValueError(f"{context}: RINGREDUCE_TIMEOUT must be a number of seconds >= 0 (0: no "
                         f"timeout), got {text!r}")
    return value or None


def _checked_timeout(value, context: str) -> float:
    """The core's form of a timeout: seconds, or 0 for none."""
    if value is None:
        return 0.0
    # (Any real number, as Handle.wait takes: a Fraction too.)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{context}: timeout must be a number of seconds or None, "
                        f"got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range: as good as forever, or negative
        value = math.inf if value > 0 else -math.inf
    if not value > 0:  # NaN too
        raise ValueError(f"{context}: timeout must be positive seconds (or None for no "
                         f"timeout), got {value}")
    return 0.0 if math.isinf(value) else value


# The core's switches, the values each takes (empty: as unset, as the core reads it),
# and what they mean.
_SWITCHES = {
    "RINGREDUCE_SHM": (("0", "1", "stream"),
                       "0 (no shared memory), 1 (shared memory for every call it can take, "
                       "untimed), stream (the same, its slots written with streaming "
                       "stores) or unset (each call size timed on every wire)"),
    "RINGREDUCE_RING": (("machines", "ranks"),
                        "machines (on several machines, each one's ranks side by side on "
                        "the ring) or ranks (rank order, as benchmarks/bench_placement.py "
                        "compares; any rank asking for it decides for all) or unset "
                        "(machines)"),
    "RINGREDUCE_CUDA_AWARE": (("0", "1"),
                              "0 (GPU buffers staged through host memory), 1 (handed to "
                              "MPI as they are) or unset (as the MPI library says it can)"),
}


def _timeout_to_refuse_with(timeout, context: str) -> float:
    """The core's timeout for a rank whose arguments are bad, to tell the others so
    (see Communicator.__init__): its own if that was good, else RINGREDUCE_TIMEOUT's,
    else DEFAULT_TIMEOUT; never none, as its own error is not to wait for good on
    ranks that may never come."""
    for value in (timeout, _FROM_ENVIRONMENT):
        try:
            if value is _FROM_ENVIRONMENT:
                value = _default_timeout(context)
            return _checked_timeout(value, context) or DEFAULT_TIMEOUT
        except (TypeError, ValueError):
            continue
    return DEFAULT_TIMEOUT


def _settings_refused() -> list[str]:
    """Why each RINGREDUCE_* switch set to a value not understood is refused: a value
    meant otherwise ("false", "no") must not pass silently as 1."""
    return [f"{name} must be {meaning}; got {value!r}"
            for name, (values, meaning) in _SWITCHES.items()
            if (value := os.environ.get(name)) not in (None, "", *values)]


def _check_environment(context: str) -> None:
    refused = _settings_refused()
    if refused:
        raise ValueError(f"{context}: {refused[0]}")


class Communicator(t.NamedSettings):
    """Ring collectives over the ranks of an mpi4py intracommunicator.

    ``Communicator()`` uses ``MPI.COMM_WORLD``. Creating one is collective: every
    rank of ``comm`` must create it, because it duplicates ``comm`` so that the
    ring's messages never mix with the caller's.

    ``timeout``: seconds a call waits on another rank (to join the call, or to move
    its next chunk) before raising ``CollectiveTimeoutError``, after which this
    Communicator is unusable on that rank; creating one waits as long for every rank
    to create it. Default: 1800, or ``RINGREDUCE_TIMEOUT``
    (0: none); ``None``: wait forever.
    """

    def __init__(self, comm=None, *, chunk_bytes: int | None = None,
                 timeout: float | None = _FROM_ENVIRONMENT):
        self._pid = os.getpid()  # the process it belongs to (see _after_fork_in_child)
        comm = checked_mpi_comm(comm, "Communicator", self._pid)
        if not isinstance(comm, MPI.Intracomm):
            comm = MPI.Intracomm(comm)  # (an MPI.Comm of an intracommunicator)
        context = t.where(comm.Get_rank(), comm.Get_size(), "Communicator")
        refusal = None  # a bad argument here: raised once the other ranks know of it
        try:
            self._chunk_bytes = (_core.DEFAULT_CHUNK_BYTES if chunk_bytes is None
                                 else _checked_chunk_bytes(chunk_bytes, context))
            if timeout is _FROM_ENVIRONMENT:
                timeout = _default_timeout(context)
            timeout = _checked_timeout(timeout, context)
            _check_environment(context)
        except (TypeError, ValueError) as error:
            if comm.Get_size() == 1:
                raise
            refusal = error
            timeout = _timeout_to_refuse_with(timeout, context)
        self._mpi_comm = comm
        self._thread_level = MPI.Query_thread()
        threaded = self._thread_level == MPI.THREAD_MULTIPLE
        _check_thread(context, self._thread_level)
        _finish_dropped_closes()  # (their MPI communicators, before this takes one more)
        with contextlib.nullcontext() if threaded else _SERIAL:
            _finished_at_mpi_finalize()
            if refusal is not None:
                # The others already wait in the making, which is collective: this rank
                # joins it to tell them (they raise ValueError at once, saying why,
                # rather than at their timeout), then every rank frees what it made.
                why = f"{type(refusal).__name__}: {str(refusal).removeprefix(context + ': ')}"
                try:
                    _core.RingCommunicator(MPI._addressof(comm), timeout, refusal=why)
                except Exception:  # (it always raises; whatever it says, this rank's
                    pass           # own error says what the caller must mend)
                raise refusal from None
            self._core = _core.RingCommunicator(MPI._addressof(comm), timeout)
        self._serial = next(_made)  # (__del__ needs it once there is a core)
        global _launch_checked
        if not _launch_checked:  # (once a process: MPI_COMM_WORLD does not change)
            _launch_checked = True
            warn_if_alone_by_mistake(MPI.COMM_WORLD.Get_size(), os.environ,
                                     lambda text: warnings.warn(text, RuntimeWarning, 4))
        self._rank: int = self._core.rank
        self._size: int = self._core.size
        self._ring = tuple(self._core.ring_order)
        self._executor = _Executor(threaded)
        self._closed = False
        self._closing = False  # close() has begun: no more calls
        self._ended = None  # why ringreduce finished it before MPI_Finalize (the exit)
        self._direct = None  # see _cuda_direct()
        self._scratch = _Scratch()
        self._results = _Results()  # results without out=: big ones reuse kept buffers
        self._fast = self._make_fast_path()  # the common case of every call (None: closing)
        self._optimizers_made = 0  # DistributedOptimizers over this one (see optim.py)
        self._contexts = {call: t.where(self.rank, self.size, call)
                          for name in _COLLECTIVES for call in (name, name + "_async")}
        self._async_context = self._contexts["allreduce_async"]  # (Handles')
        _live.add(self)

    # -- properties ---------------------------------------------------------------

    # Its settings are properties: no other public name is set (t.NamedSettings, which
    # costs nothing in calls: a Communicator sets its attributes when made and closed).
    _ATTRIBUTES = frozenset()

    def _no_such_setting(self, name: str) -> str:  # (NamedSettings's error)
        return (f"{t.where(self.rank, self.size, 'Communicator')}: Communicator has no "
                f"setting {name!r} (its settings are timeout and chunk_bytes)")

    @property
    def rank(self) -> int:
        """This rank's number in the communicator (mpi_comm.Get_rank())."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks (mpi_comm.Get_size())."""
        return self._size

    @property
    def mpi_comm(self):
        """The mpi4py communicator this one was made from (not our private duplicate)."""
        return self._mpi_comm

    @property
    def timeout(self) -> float | None:
        """Seconds a call waits on another rank (to join it, or for its next chunk)
        before raising CollectiveTimeoutError; None: forever. Ranks may differ."""
        return self._core.timeout or None

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._core.timeout = _checked_timeout(
            value, t.where(self.rank, self.size, "Communicator.timeout"))

    @property
    def chunk_bytes(self) -> int:
        """Pipeline chunk size in bytes. Ranks use rank 0's value, so they always agree."""
        return self._chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._chunk_bytes = _checked_chunk_bytes(
            value, t.where(self.rank, self.size, "Communicator.chunk_bytes"))
        fast = self._fast
        if fast is not None:
            fast.chunk_bytes = self._chunk_bytes

    @property
    def transport(self) -> str:
        """How chunks travel: "shared memory" when all ranks share one node, else "MPI"
        (also on one rank, with RINGREDUCE_SHM=0, or where the ranks cannot map each
        other's memory: transport_reason says which)."""
        return self._core.transport

    @property
    def transport_reason(self) -> str:
        """Why chunks travel as MPI messages ("" when through shared memory): the same
        on every rank, e.g. "the ranks are on more than one machine: ..."."""
        return self._core.transport_reason

    @property
    def ring(self) -> tuple:
        """The ranks in the order the ring goes round (each sends to the next, the last
        to the first): (0, 1, ..., size-1) unless the ranks are on several machines and
        were not placed machine by machine; then each machine's ranks side by side, so
        that only as many chunks cross between machines as there are machines (unless
        a rank has RINGREDUCE_RING=ranks)."""
        return self._ring

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent to others since the Communicator was made,
        through shared memory or MPI messages: 2(p-1)/p of an allreduce's N bytes (when
        p divides the count), (p-1)/p of a reduce_scatter's, every rank's rows but its
        right neighbour's for an allgather (p-1 times its own where all ranks have as
        many), and N for a broadcast from each rank of its chain but the last.
        Not the header every call exchanges, nor the data of calls small enough to ride
        in it. `python -m ringreduce explain` and `sim` predict it."""
        return self._core.ring_bytes_sent

    @property
    def ring_steps(self) -> int:
        """Ring steps this rank has run since the Communicator was made: 2(p-1) for an
        allreduce that goes round the ring, p-1 for a reduce_scatter or allgather, none
        for a broadcast (a chain) or a call done inside the header exchange."""
        return self._core.ring_steps

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self):
        state = "closed" if self._closed else f"chunk_bytes={self._chunk_bytes}"
        return f"<ringreduce.Communicator rank {self.rank} of {self.size}, {state}>"

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy and pickle all come here. A shallow copy shared this
        # one's core and worker thread, so dropping the copy closed them under the
        # original (on that rank alone: the others then met a close in their next
        # call, or waited out their timeout); a deep copy or a pickle cannot carry a
        # rank's place in a ring of live processes.
        raise TypeError(
            f"{t.where(self.rank, self.size, 'Communicator')}: a Communicator cannot be "
            "copied or pickled (it is this rank's duplicate of an MPI communicator, its "
            "shared memory and its worker thread): share the object itself (for "
            "copy.deepcopy() of an object that holds it, pass "
            "memo={id(comm): comm}), or make another on every rank with "
            "rr.Communicator(comm.mpi_comm). A process made by multiprocessing cannot "
            "use it: MPI gives a rank to one process")

    # -- collectives ----------------------------------------------------------------

    def allreduce(self, x, op="sum", out=None):
        """Reduce x element-wise over all ranks; every rank gets the result.

        Returns a new array shaped like x, or ``out`` (which may be x itself, for an
        in-place reduction). x is never modified unless it is ``out``.
        """
        fast = self._fast  # (None once closing)
        if fast is not None:
            result = fast.allreduce(x, op, out)
            if result is not None:
                return result
        return self._call("allreduce", self._prepare_allreduce, x, op, out, wait=True)

    def allreduce_async(self, x, op="sum", out=None) -> Handle:
        """Start allreduce and return a Handle; ``handle.wait()`` gives the result.

        Neither x nor out may be touched until then. Any number may be in flight;
        they complete in the order they were started.
        """
        # (The FastPath's call made here, not through _call_async: a step of a
        # data-parallel optimizer makes many small ones, and each frame and lookup
        # saved is some 0.05 us of a call that costs about 1 us to start.)
        fast = self._fast
        if fast is not None:
            call = fast.allreduce_async(x, op, out)
            if call is not None:
                return Handle(call, self._async_context, "ringreduce.allreduce")
        return self._call_async("allreduce", self._prepare_allreduce, x, op, out)

    def reduce_scatter(self, x, op="sum", out=None):
        """Reduce x.ravel() over all ranks; return this rank's block of the result.

        Blocks are laid out as ``np.array_split(result, size)``: block r goes to rank r.
        The ring needs a workspace as large as x; the Communicator keeps the largest
        one it has needed (numpy inputs) until it is closed.
        """
        fast = self._fast
        if fast is not None:
            result = fast.reduce_scatter(x, op, out)
            if result is not None:
                return result
        return self._call("reduce_scatter", self._prepare_reduce_scatter, x, op, out, wait=True)

    def reduce_scatter_async(self, x, op="sum", out=None) -> Handle:
        """Start reduce_scatter and return a Handle; ``handle.wait()`` gives this rank's
        block. As for allreduce_async, neither x nor out may be touched until then, and
        calls of every kind complete in the order they were made."""
        return self._call_async("reduce_scatter", self._prepare_reduce_scatter, x, op, out)

    def allgather(self, x, out=None):
        """Every rank's x concatenated along axis 0, in rank order.

        Ranks may differ in ``x.shape[0]`` but not in ``x.shape[1:]`` or dtype. A 0-d
        x counts as one row. ``out``, if given, receives the result (and is returned):
        its rows must add up to all ranks' rows, which every rank checks before any data
        moves. x may be out's own block of rows (gathering in place).
        """
        fast = self._fast
        if fast is not None:
            result = fast.allgather(x, out)
            if result is not None:
                return result
        return self._call("allgather", self._prepare_allgather, x, out, wait=True)

    def allgather_async(self, x, out=None) -> Handle:
        """Start allgather and return a Handle; ``handle.wait()`` gives the gathered
        array. As for allreduce_async, neither x nor out may be touched until then."""
        return self._call_async("allgather", self._prepare_allgather, x, out)

    def broadcast(self, x, root: int = 0):
        """Overwrite x on every rank with root's x, in place; return x."""
        fast = self._fast
        if fast is not None:
            result = fast.broadcast(x, root)
            if result is not None:
                return result
        return self._call("broadcast", self._prepare_broadcast, x, root, wait=True)

    def broadcast_async(self, x, root: int = 0) -> Handle:
        """Start broadcast and return a Handle; ``handle.wait()`` returns x, then
        holding root's data. x may not be touched (on root: written) until then."""
        return self._call_async("broadcast", self._prepare_broadcast, x, root)

    def close(self) -> None:
        """Finish collectives in flight and free the private MPI communicator.

        Collective, like creation: every rank closes its communicators in the same
        order. Calls after it raise ValueError. At exit, work in flight is finished
        and MPI_Finalize frees what was not closed.
        """
        if self._closed:
            return
        self._check_calling_thread(t.where(self.rank, self.size, "close"))
        # No call starts here from now on (another thread's raises ValueError), so that
        # the calls in flight finish and the close takes its turn after them, even while
        # another thread would go on making calls.
        self._closing = True
        fast, self._fast = self._fast, None
        self._executor.refuse_calls()
        try:
            self._executor.finish()
        except BaseException:  # Ctrl-C: not closed, so usable as before
            self._executor.refuse_calls(False)
            self._closing = False
            if fast is not None:
                fast.chunk_bytes = self._chunk_bytes
            self._fast = fast
            raise
        # A blocking call another thread runs now ends first: closing under it would
        # send this rank's part of the close into that call's exchange with the others.
        with self._executor.running:
            if self._closed:
                return
            self._abandon()
            if not MPI.Is_finalized():
                self._core.close()
        _warn_of_dropped_errors()  # (the calls in flight are over: all noted)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
            return
        # An exception is leaving the block, maybe on this rank only, while the others
        # wait in a collective: freeing (collective) here could hang the job where it
        # should fail. So only stop using it, and tell the others, whose waits on this
        # rank then raise at once (and whose close() frees nothing); MPI_Finalize frees it.
        # Asynchronous calls still queued never start; one running on the worker thread
        # stops at its next wait (which makes this rank leave), or ends. Only then may
        # this thread use the core, which is not thread-safe.
        self._leave("an exception left the Communicator's `with` block first")

    def _refuse_calls(self) -> None:
        """From now on no call starts (another thread's raises ValueError)."""
        self._closing = True
        self._fast = None
        self._executor.refuse_calls()

    def _leave(self, why: str | None, stopping: str = "the process is ending") -> bool:
        """Stop using this communicator on this rank only, and tell the others. Queued
        asynchronous calls never start (their wait() raises ValueError, saying why).
        why None, at a normal exit: they finish first, and the others learn that this
        rank makes no more calls (a rank that comes to a call this one never made, an
        uneven last step, then raises at once): on shared memory at once; over MPI
        messages in a close at exit, which this begins, and which the caller finishes
        (core.finish_close_at_exit()) if this returns True. A call stopped gives why
        (else `stopping`, why the process finishes its Communicators) as its reason."""
        closing = False
        if not self._closed and not MPI.Is_finalized():
            self._refuse_calls()
            executor = self._executor
            if why is not None:
                executor.cancel(_NeverRan(f"never ran: {why}, and this rank left the "
                                          "communicator"))
                self._core.stop_soon(why)
            executor.finish()
            # (A call a daemon thread began since, at exit.)
            self._core.stop_soon(why or stopping)
            with executor.running:
                if why is None:
                    closing = self._core.begin_close_at_exit()
                else:
                    # Below SERIALIZED only the main thread may call MPI (an exception
                    # may leave a `with` block on another): then the ranks on shared
                    # memory learn of it, the others at their timeout, or at this
                    # rank's exit, where the main thread tells them.
                    over_mpi = (self._thread_level >= MPI.THREAD_SERIALIZED
                                or threading.current_thread() is threading.main_thread())
                    self._core.leave(over_mpi=over_mpi)
                    if not over_mpi:
                        _untold_over_mpi.append(self._core)
        self._abandon()
        return closing

    def _abandon(self) -> None:
        """Stop using this communicator, here only (close() also frees it, collectively)."""
        self._closed = True
        self._fast = None
        self._scratch = _Scratch()
        self._results = _Results()
        _live.discard(self)

    def __del__(self):
        if os.getpid() != getattr(self, "_pid", None):
            return  # a copy in a child made by fork(): its thread and MPI are the parent's
        executor = getattr(self, "_executor", None)
        core = getattr(self, "_core", None)
        tells_others = (getattr(self, "_closed", True) is False and core is not None
                        and core.size > 1 and not core.departed and not sys.is_finalizing()
                        and not MPI.Is_finalized())
        closes_over_mpi = tells_others and core.transport == "MPI"
        if executor is not None and executor.started:  # (so THREAD_MULTIPLE)
            if executor.busy:
                # Calls in flight: the worker finishes them and ends on its own. Waiting
                # for them here could wait for good, inside the garbage collection of
                # whatever this thread was doing: they may wait for ranks that wait for
                # what this thread does next (a call on another Communicator). (Dropped
                # by the worker itself, its last call holding the last reference, the
                # same.) It tells the others right after them.
                if tells_others:
                    # (Refused only after a Ctrl-C in _leave()'s drain: its stop_soon()
                    # makes the call in flight leave, which tells the others already.)
                    executor.calls.push(_BeginDroppedClose(core, self._serial))
                    closes_over_mpi = False
                executor.stop_later()
                _dropped_busy[self._serial] = (weakref.ref(core), executor)
            else:
                executor.stop()
        if closes_over_mpi:
            if self._thread_level != MPI.THREAD_MULTIPLE:
                # (MPI may not be called on this thread, where garbage collection ran.)
                core.release_scratch()
                _dropped_over_mpi[self._serial] = (core, executor)
            else:
                core.release_scratch()
                if core.begin_close_at_exit():
                    _dropped_closing[self._serial] = core
        # Freeing is collective, and garbage collection runs at different times on
        # different ranks, so a dropped Communicator cannot free itself: say so, as
        # Python does for an unclosed file.
        if (getattr(self, "_closed", True) is False and getattr(self, "_warn_unclosed", True)
                and not sys.is_finalizing()):
            warnings.warn(f"{self!r} was never closed: its MPI communicator is freed only "
                          "when garbage collection finds it (below MPI_THREAD_MULTIPLE, at "
                          "MPI_Finalize; over MPI messages, once every rank dropped it). Call "
                          "close() on every rank, or use "
                          "`with rr.Communicator() as comm:`",
                          ResourceWarning, source=self)
        # It may come back (the warning's record keeps its source, as pytest's and
        # warnings.catch_warnings(record=True) do): as closed, not as a Communicator
        # whose worker has stopped and whose ranks were told it makes no more calls.
        self._closed = True
        self._fast = None

    # -- plumbing -------------------------------------------------------------------

    def _make_fast_path(self):
        """The core's FastPath, which serves the common case of each collective (a
        contiguous numpy array, a dtype and op validated once by the general path, an
        out= that needs no further checks, nothing in flight) without Python's checks,
        which cost a small call as much as its exchange; it returns None for anything
        else, which the general path serves. It holds none of this Communicator, only
        what the calls need (no cycle: a dropped Communicator still warns at once)."""
        executor = self._executor
        if self._thread_level < MPI.THREAD_SERIALIZED:
            return None  # (every call checks its thread, in Python)
        return _core.FastPath(self._core, executor.calls, executor.threaded, t.validated_pairs,
                              t.MPI_OP_KEYS, t.dtype_codes, t.shape_tag, self._results.empty,
                              self._scratch.get, self._chunk_bytes, _Results.MIN_BYTES,
                              _CONFIRM_BYTES)

    def _call_async(self, name, prepare, *args) -> Handle:
        """The collective `name` made as `name`_async: its Handle, whose errors say so;
        queued by the FastPath where it takes the call, else by the Python layer."""
        fast_name, ran = _ASYNC[name]
        context, fast = self._contexts[fast_name], self._fast
        if fast is not None:
            call = getattr(fast, fast_name)(*args)
            if call is not None:
                return Handle(call, context, ran)
        handle = self._call(name, prepare, *args, wait=False, context=context, watched=True)
        handle._ran = ran
        return handle

    def _call(self, name, prepare, *args, wait, context=None, watched=False):
        """context: what errors call it (else the collective's name), a Handle's too
        (else allreduce_async's, or a blocking call's own). watched: a call the user made
        as *_async (see _Work)."""
        # (While any is pending, the FastPath sends calls here.) Warned once this rank has
        # taken its part in the call: a warning raised as an error (-W error) must not
        # make it skip the call, which the others' next call would then pair with.
        dropped = _core.dropped_errors_pending()
        # (A blocking call queued behind asynchronous ones waits on a Handle too, whose
        # errors then name it: one that never ran, say.)
        handle_context = context or (self._contexts[name] if wait else self._async_context)
        context = context or self._contexts[name]
        if self._closed or self._closing:
            self._refuse_as_closed(context)
        self._check_calling_thread(context)
        try:
            run = prepare(context, *args)
        except Exception as error:  # TypeError, ValueError, a MemoryError copying x, ...
            own = t.named(error, context) if isinstance(error, MemoryError) else error
            try:
                self._join_as_rejected(name, failed=isinstance(error, MemoryError))
            except _core.CollectiveTimeoutError as timeout:
                raise t.told_in_vain(own, timeout) from None
            if own is not error:
                raise own from None
            raise
        # One rank waits for no one, so an asynchronous call on host arrays is done at
        # once, in this thread: handing it to the worker thread costs more than the call
        # itself (some 15 us; a small call on one rank takes about 1 us). (Not
        # on a GPU, where the call waits for the work queued on the caller's stream,
        # which the caller need not wait for.)
        on_host = not _device.is_device_array(args[0])
        at_once = wait or self.size == 1 and on_host
        try:
            done = self._run(context, run, wait, at_once, handle_context, anywhere=on_host,
                             watched=watched)
        except _core.NoThreadError as error:
            # Not queued: as a call this rank failed to prepare, so that the others raise
            # instead of pairing this call with the next one this rank makes. Its Handle
            # raises, as for any asynchronous call that failed: a caller that counts its
            # calls (the DistributedOptimizer's buckets) counts this one, made as the
            # others made theirs.
            self._join_as_rejected(name, failed=True)
            failure = _core.NoThreadError(
                f"{context}: {error}: this rank's asynchronous calls need it (raise the limit "
                "on threads: `ulimit -u`, or a container's limit on pids; or make blocking "
                "calls)")
            if wait:
                raise failure from None

            def fail():
                raise failure
            work = _Work(self._core, fail, self._pid, watched)
            work.execute(catching=Exception)
            done = Handle(work, handle_context)
        # A blocking call waited for the calls queued before it: one of them whose Handle
        # was dropped may have failed meanwhile, and is warned of now, not a call later.
        if dropped or wait:
            _warn_of_dropped_errors()
        return done

    def _check_calling_thread(self, context: str) -> None:
        """Raises (errors beginning with context) where MPI, initialised below
        THREAD_SERIALIZED, does not let this thread call it."""
        if not self._executor.threaded:
            _check_thread(context, self._thread_level)

    def _refuse_as_closed(self, context: str) -> None:
        """Raises (errors beginning with context) where this Communicator is closed or
        being closed: why no call can be made on it."""
        if self._closed:
            if MPI.Is_finalized():  # (which finished every Communicator: see _finish_all)
                raise _core.MPIError(f"{context}: MPI has been finalised (MPI.Finalize()): "
                                     "no call can follow")
            if os.getpid() != self._pid:
                raise ValueError(f"{context}: this Communicator belongs to process "
                                 f"{self._pid}, of which this one is a child made by fork(); "
                                 "MPI does not let a child use it")
        raise self._closed_error(context)

    def _closed_error(self, context: str) -> Exception:
        """The error of a call made once close() has begun (in another thread, or done)."""
        if _finalizing is not None:  # (as after it: see _call)
            return _core.MPIError(f"{context}: MPI is being finalised ({_finalizing}): no "
                                  "call can follow")
        if self._ended is not None:  # (no close() of the program's: a daemon's call)
            return ValueError(f"{context}: {self._ended}: ringreduce has finished this "
                              "Communicator, as it does every one before MPI is finalised; "
                              "no call can follow")
        if self._closed:
            return ValueError(f"{context}: this Communicator has been closed")
        return ValueError(f"{context}: this Communicator is being closed (by another thread)")

    def _join_as_rejected(self, name: str, failed: bool = False) -> None:
        """For a rank that rejected its arguments to collective `name` (failed: failed to
        prepare it, for want of memory or a thread): still take part in its header
        exchange, so that the other ranks raise MismatchError naming this rank instead
        of waiting for it forever; this rank raises its own error after."""
        core, collective, chunk = self._core, _COLLECTIVES[name], self._chunk_bytes
        if self._executor.calls.refusing():
            return  # (a close began meanwhile: this rank makes no more calls)
        self._run(self._contexts[name],
                  lambda: core.announce_invalid(collective, chunk, failed=failed),
                  wait=True, at_once=True, anywhere=True)

    # The kinds of check, its top byte: CheckedCallsMismatch is raised only where every
    # rank passed a check of one kind, that is, made the same caller's call. (The
    # core's MismatchError names them: describe_check in ring_communicator.cc.)
    CHECK_GRADIENTS, CHECK_OPTIMIZER = 1, 2

    @staticmethod
    def _check(kind: int, value: int) -> int:
        """A check of `kind` (never 0) from any int (a hash, say)."""
        return (kind << 56) | (value & ((1 << 56) - 1))

    def _allreduce_checked(self, x, op, check: int, wait: bool = True):
        """allreduce(x, op, out=x) (wait=False: allreduce_async), where every rank must
        also pass the same `check` (an int64) or every rank raises MismatchError
        before any data moves (CheckedCallsMismatch where every rank passed one of the
        same kind, see _check()): the
        test that callers like allreduce_gradients need that the ranks made the same
        call, carried in the call's own header instead of costing an exchange."""
        fast = self._fast
        if fast is not None:
            if wait:
                result = fast.allreduce(x, op, x, check)
                if result is not None:
                    return result
            else:
                call = fast.allreduce_async(x, op, x, check)
                if call is not None:
                    return Handle(call, self._async_context)
        return self._call("allreduce", self._prepare_allreduce, x, op, x, check, wait=wait)

    def _run(self, context: str, run, wait: bool, at_once: bool,
             handle_context: str | None = None, anywhere: bool = False,
             watched: bool = False):
        """run() now, in this thread, if at_once and nothing is in flight (else on the
        worker thread, or where anywhere, in a thread that waits for it); its result
        (wait), or a Handle (whose errors begin with handle_context, by default
        allreduce_async's). Raises ValueError once another thread's close() has begun."""
        executor = self._executor
        handle_context = handle_context or self._async_context
        # Nothing in flight: run in this thread, the cheapest way; the same inside a
        # call this thread runs for its wait() (a signal handler's call, made in the
        # middle of one of the Python layer's), which, queued, would wait for good
        # behind that call: then it runs here and now, as inside a blocking call.
        calls = executor.calls
        if at_once and (not executor.in_flight or calls.helping_here()):
            # The lock keeps the worker from starting a newly queued item meanwhile.
            with executor.running:
                if calls.refusing():
                    raise self._closed_error(context)
                if not executor.in_flight or calls.helping_here():
                    if wait:
                        return keeping_on_departure(self._core, run)
                    # An error is raised by wait(), as the worker's would be; but
                    # Ctrl-C (KeyboardInterrupt) here and now, as a blocking call's.
                    work = _Work(self._core, run, self._pid, watched)
                    work.execute(catching=Exception)
                    return Handle(work, handle_context)
        work = _Work(self._core, run, self._pid, watched)  # (calls in a fork()ed child raised)
        if not executor.submit(work, anywhere):
            raise self._closed_error(context)
        handle = Handle(work, handle_context)
        return handle.wait() if wait else handle

    def _cuda_direct(self) -> bool:
        """Whether GPU buffers go to MPI as they are (a CUDA-aware MPI) or are staged
        through pinned host memory. Asked once; ranks may differ."""
        if self._direct is None:
            self._direct = bool(_core.mpi_cuda_aware())
        return self._direct

    def _prepare_allreduce(self, context, x, op, out, check=0):
        if _device.is_device_array(x):
            return _device.prepare_allreduce(self, context, x, op, out, check)
        x = t.as_input_array(x, "x", context)
        native = t.native(x.dtype)
        dtype, op = t.reduction_codes(native, op, context)
        if out is None:
            out = self._results.empty(x.shape, native)
        else:
            t.check_out(out, x.shape, native, context)
        # A strided (or byte-swapped) x is copied into out, which the ring then reduces
        # in place: no second array of x's size (the copy is x's values as they are
        # when the call runs, as a separate copy's would be). Else a copy of x: where x
        # overlaps out other than as the same buffer, as the ring would read its own
        # writes (and numpy 2.4's assignment copies wrong between some overlapping
        # strided arrays).
        overlapping = x is not out and np.may_share_memory(x, out) \
            and not t.same_buffer(x, out)
        into_out = not t.readable(x) and not overlapping
        copy = overlapping  # (strided or not)
        chunk = self._chunk_bytes
        core = self._core

        def run():
            if into_out:
                source = copy_into(core, out, x, "allreduce", chunk)
            else:
                source = input_copy(core, x, "allreduce", chunk) if copy else x
            core.allreduce(source, out, dtype, op, chunk, check)
            return out

        return run

    def _prepare_reduce_scatter(self, context, x, op, out):
        if _device.is_device_array(x):
            return _device.prepare_reduce_scatter(self, context, x, op, out)
        x = t.as_input_array(x, "x", context)
        native = t.native(x.dtype)
        dtype, op = t.reduction_codes(native, op, context)
        offset, count = _core.segment_of(self.rank, self.size, x.size)
        if out is None:
            out = self._results.empty(count, native)
        else:
            t.check_out(out, (count,), native, context)
        copy = not t.readable(x)
        chunk = self._chunk_bytes
        core = self._core
        # The ring needs a whole buffer's worth of partial sums; reusing one spares a
        # fresh array, and its page faults, every call. Taken here, so that a rank
        # without the memory says so in the header exchange (runs are serialised, and
        # a buffer replaced by a bigger one lives on in the views taken of it).
        work = self._scratch.get(x.nbytes).view(native)

        # The block goes straight into out, unless out shares memory with x other than
        # as x's own block (then the ring could overwrite input it has yet to read).
        direct = copy or not np.may_share_memory(out, x) or t.same_buffer(
            out, x.reshape(-1)[offset:offset + count])

        # A strided (or byte-swapped) x is copied into the workspace, which the ring
        # then reduces in place (as allreduce's first phase does its out): no array of
        # x's size at every call, the kept workspace touched in full instead of
        # (p - 2)/p of it. One rank has no ring to use a workspace: a copy of x there.
        into_work = copy and self.size > 1

        def run():
            if into_work:
                source = copy_into(core, work.reshape(x.shape), x, "reduce_scatter", chunk)
            else:
                source = input_copy(core, x, "reduce_scatter", chunk) if copy else x
            if direct:
                core.reduce_scatter(source, work, dtype, op, chunk, out)
            else:
                core.reduce_scatter(source, work, dtype, op, chunk)
                out[...] = work[offset:offset + count]
            return out

        return run

    def _prepare_allgather(self, context, x, out):
        if _device.is_device_array(x):
            return _device.prepare_allgather(self, context, x, out)
        x = t.as_input_array(x, "x", context)
        native = t.native(x.dtype)
        dtype = t.dtype_code(native, "x", context)
        rows = 1 if x.ndim == 0 else x.shape[0]
        row_shape = tuple(x.shape[1:])
        if out is not None:
            t.check_out(out, (None,) + row_shape, native, context)
        copy = not t.readable(x)
        chunk = self._chunk_bytes
        core = self._core
        results = self._results

        # A strided (or byte-swapped) x goes straight into its rows of the result
        # (gather_rows), unless it is small enough to ride along with the row counts
        # (then a copy of it does) or shares memory with out: copied into out's rows
        # before the ring, it would be read in full before the ring writes, but numpy
        # 2.4's assignment copies wrong between some overlapping strided arrays (see
        # allreduce), so a separate copy of it first.
        copy = copy and (x.nbytes <= core.inline_capacity
                         or out is not None and np.may_share_memory(x, out))

        def run():
            source = input_copy(core, x, "allgather", chunk) if copy else x
            return gather_rows(core, source, rows, row_shape, dtype, chunk, out, results)

        return run

    def _prepare_broadcast(self, context, x, root):
        if _device.is_device_array(x):
            return _device.prepare_broadcast(self, context, x, root)
        if isinstance(x, np.generic):
            t.reject_not_an_array(x, "x", context, "broadcast works in place")
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{context}: x must be a numpy.ndarray or a GPU array (broadcast "
                            f"works in place), got {t.qualified_type_name(x)}"
                            + ("; np.frombuffer(x, np.uint8) is a writeable array over its "
                               "bytes" if isinstance(x, (bytearray, memoryview))
                               else t.foreign_array_hint(x)))
        t.reject_masked(x, "x", context)
        if not x.dtype.isnative:
            raise TypeError(f"{context}: x has non-native byte order ({x.dtype}); "
                            "broadcast works in place and cannot convert it")
        dtype = t.dtype_code(x.dtype, "x", context)
        t.check_root(root, self.size, context)
        if self.rank != root and not x.flags.writeable:
            raise ValueError(f"{context}: x is read-only, but broadcast writes root's data into it")
        copy = not x.flags.c_contiguous
        chunk = self._chunk_bytes
        core, rank = self._core, self.rank  # (a queued call keeps no Communicator alive)
        root = int(root)

        def run():
            buffer = input_copy(core, x, "broadcast", chunk) if copy else x
            core.broadcast(buffer, dtype, root, chunk)
            if buffer is not x and rank != root:  # root's x may be read-only
                x[...] = buffer.reshape(x.shape)
            return x

        return run
