// The one file that knows about Python: converts arrays to (pointer, count, dtype),
// releases the GIL around the core, and maps C++ exceptions to Python ones. It
// decides nothing: validation lives in ringreduce/ (FastPath below only recognises the
// calls that ringreduce/'s checks would pass, from its tables) and the algorithm in the
// core.
#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "call_queue.h"
#include "copy.h"
#include "cuda.h"
#include "errors.h"
#include "lowrank.h"
#include "reduce.h"
#include "ring_communicator.h"
#include "ring_schedule.h"
#include "shm_channel.h"
#include "waiting.h"

namespace py = pybind11;
using namespace ringreduce;

namespace {

MPI_Comm comm_from_address(uintptr_t address) {
  // MPI._addressof(comm) is the address of the handle inside the mpi4py object: an
  // int for MPICH, a pointer for Open MPI; dereferencing as MPI_Comm is right for both.
  return *reinterpret_cast<MPI_Comm*>(address);
}

// Where a device call runs: GPU `ordinal` (or the host emulation, for tests on
// machines without a GPU), after event `ready` of the caller's `stream`.
DeviceCall device_call(RingCommunicator&, int ordinal, uintptr_t ready, uintptr_t stream,
                       bool direct, bool emulate) {
  return DeviceCall{ordinal, emulate, reinterpret_cast<void*>(ready),
                    reinterpret_cast<void*>(stream), direct};
}

// Threads inside ringreduce without the GIL. Python, finalising, ends a thread that
// takes the GIL back (pthread_exit); inside C++ frames that ends the process
// (std::terminate). So the exit waits until none is left in here (see
// wait_until_no_thread_without_gil), having stopped what they were doing.
std::atomic<int> threads_without_gil{0};

struct CountedWithoutGil {
  CountedWithoutGil() { threads_without_gil.fetch_add(1); }
  ~CountedWithoutGil() { threads_without_gil.fetch_sub(1); }
};

// py::gil_scoped_release, counted until the GIL is back (members end in reverse order).
class WithoutGil {
  CountedWithoutGil counted_;
  py::gil_scoped_release release_;
};

// Ctrl-C: Python's SIGINT handler only notes the signal, and raises KeyboardInterrupt
// once this thread runs Python again, which a call waiting for a rank that will not come
// never does. So the handler Python installed is chained behind one that also counts
// SIGINTs; the core's waits stop a call during which the count moved (StopRequest).
// A later signal.signal(SIGINT, ...) replaces it, so making a Communicator chains it
// again (calls in between wait out their timeout), if Python's handler is its default.
std::atomic<uint64_t> sigints{0};
struct sigaction python_sigint;

extern "C" void count_sigint(int signal, siginfo_t* info, void* context) {
  sigints.fetch_add(1, std::memory_order_relaxed);  // lock-free: safe in a handler
  if (python_sigint.sa_flags & SA_SIGINFO)
    python_sigint.sa_sigaction(signal, info, context);
  else
    python_sigint.sa_handler(signal);
}

// Whether Python's SIGINT handler is its default, which raises KeyboardInterrupt. A
// handler of the program's own (a graceful stop that sets a flag, say) decides for
// itself what a SIGINT does: a call must not be stopped under it.
bool python_default_sigint() {
  py::module_ signal = py::module_::import("signal");
  return signal.attr("getsignal")(SIGINT).is(signal.attr("default_int_handler"));
}

void chain_sigint_handler() {
  if (!python_default_sigint()) return;
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return;
  const bool handled = (current.sa_flags & SA_SIGINFO)
                           ? current.sa_sigaction != nullptr
                           : current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN;
  if (!handled) return;  // ignored, or ends the process anyway
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == count_sigint)
    return;  // chained already (a second load of this module): not behind itself
  python_sigint = current;
  struct sigaction counting = current;
  counting.sa_flags |= SA_SIGINFO;
  counting.sa_sigaction = count_sigint;
  sigaction(SIGINT, &counting, nullptr);
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The Python layer checks every argument before these calls; if a buffer still does not
// fit, this rank takes part in the header exchange before raising, like any rank that
// rejects its arguments, so that the others raise instead of waiting for it.
void check_buffer(RingCommunicator& self, bool fits, Collective collective, int64_t chunk_bytes,
                  const char* what) {
  if (fits) return;
  {
    WithoutGil nogil;
    self.announce_invalid(collective, chunk_bytes);
  }
  throw std::invalid_argument(std::string(collective_name(collective)) + ": " + what);
}

// A call that fails and makes this rank leave the communicator (a timeout, an error
// mid-ring) leaves MPI requests behind that may still read its arrays (pending sends)
// whenever a late rank comes: so such a call keeps them alive for good. Runs call()
// without the GIL.
template <typename F>
auto keeping_on_departure(RingCommunicator& self, std::initializer_list<py::handle> arrays,
                          F&& call) {
  const bool departed_before = self.departed();
  try {
    WithoutGil nogil;
    return call();
  } catch (...) {
    if (self.departed() && !departed_before)
      for (py::handle array : arrays) array.inc_ref();  // never released
    throw;
  }
}

// References to Python objects dropped by a thread that does not hold the GIL (the
// worker, finishing a call): released by the next caller from Python that comes by.
class LaterReleases {
 public:
  void add(PyObject* object) {
    if (object == nullptr) return;
    // Every other thread that lets go of a call does so from Python, with the GIL.
    // (Not PyGILState_Check(), which says yes to every thread once a subinterpreter
    // exists.)
    if (!CallQueue::on_worker_thread()) {
      Py_DECREF(object);
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    objects_.push_back(object);
  }
  // In a child made by fork(): the parent's worker may have held the lock. What it
  // listed is forgotten (not released: that thread's objects are the parent's business).
  void after_fork_in_child() {
    new (&mutex_) std::mutex();
    new (&objects_) std::vector<PyObject*>();
  }
  void flush() {  // (with the GIL)
    std::vector<PyObject*> objects;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      objects.swap(objects_);
    }
    for (PyObject* object : objects) Py_DECREF(object);
  }

 private:
  std::mutex mutex_;
  std::vector<PyObject*> objects_;
};
LaterReleases later_releases;

// The errors of asynchronous calls whose Handles were dropped without a wait(), which
// would otherwise be lost without a word (the call's result, out= too, holding
// whatever it held): a MismatchError leaves the Communicator usable, so nothing later
// would say so. Noted as the call goes (AsyncCall's destructor, or the Python layer's
// _Work), on whatever thread, and taken by the Python layer, which warns, at the next
// call that reaches it: while any is pending, the FastPath serves no call. Nothing is
// done for a call that succeeded or was waited for, so no Handle pays for this.
class DroppedErrors {
 public:
  void note(std::string text) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (texts_.size() < kKept) texts_.push_back(std::move(text));
    ++count_;
    pending_.store(true, std::memory_order_release);
  }
  bool pending() const { return pending_.load(std::memory_order_relaxed); }
  // How many, and the first kKept of them; forgets them.
  std::pair<int64_t, std::vector<std::string>> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.store(false, std::memory_order_relaxed);
    std::pair<int64_t, std::vector<std::string>> taken(count_, std::move(texts_));
    texts_.clear();
    count_ = 0;
    return taken;
  }
  // Held by the forking thread across fork() (communicator.py's register_at_fork): held
  // by another thread then (the worker noting one), it stayed locked in the child, where
  // no thread would release it, and the child's first take() waited forever.
  void hold_for_fork() { mutex_.lock(); }
  void release_after_fork() { mutex_.unlock(); }

 private:
  static constexpr size_t kKept = 3;
  std::mutex mutex_;
  std::vector<std::string> texts_;
  int64_t count_ = 0;
  std::atomic<bool> pending_{false};
};
DroppedErrors& dropped_errors = *new DroppedErrors;  // (never destroyed: a detached worker
                                                    // may note one as the process ends)

// A core error that a dropped Handle would lose, as the Python layer names its kind;
// empty for those that speak for themselves: after a timeout or a departure (the
// Communicator is unusable, and its next call says so) or a stop (Ctrl-C, a close).
std::string lost_error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const MismatchError& e) {
    return std::string("MismatchError: ") + e.what();
  } catch (const OutOfMemoryError& e) {
    return std::string("MemoryError: ") + e.what();
  } catch (const MpiError& e) {
    return std::string("MPIError: ") + e.what();
  } catch (...) {
    return std::string();
  }
}

// Waits (without the GIL) until done() or `seconds` have passed (no value: for good), in
// slices, between which it runs Python's signal handlers: Ctrl-C raises
// KeyboardInterrupt from the wait, as from Python's own. Whether done().
template <typename Done, typename WaitFor>
bool wait_interruptibly(std::optional<double> seconds, Done done, WaitFor wait_for) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  constexpr double kSlice = 0.05;
  for (;;) {
    if (done()) return true;
    double slice = kSlice;
    if (seconds) {
      const double left = *seconds - std::chrono::duration<double>(Clock::now() - start).count();
      if (left <= 0) return false;
      slice = std::min(slice, left);
    }
    {
      WithoutGil nogil;
      if (wait_for(slice)) return true;
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Takes the executor's RunningLock as Python's RLock.acquire() would: without the GIL
// while it waits (its holder may need the GIL to finish), and raising what a signal
// handler raises meanwhile. timeout: seconds (no value: for good).
bool acquire_running(RunningLock& lock, bool blocking, std::optional<double> timeout) {
  if (timeout && *timeout < 0) {
    if (*timeout != -1) throw py::value_error("timeout value must be a non-negative number");
    timeout.reset();  // (-1: for good, as RLock.acquire's default)
  }
  if (!blocking && timeout) throw py::value_error("can't specify a timeout for a non-blocking call");
  if (lock.try_lock()) return true;
  if (!blocking) return false;
  bool held = false;
  wait_interruptibly(timeout, [&] { return held; }, [&](double slice) {
    held = lock.try_lock_for(slice);
    return held;
  });
  // A Ctrl-C that came while this thread waited (its holder's call, stopped by it, let
  // the lock go) is raised here, not lost: the call this thread goes on to run arms its
  // stop after it, and would wait out its timeout.
  if (held && PyErr_CheckSignals() != 0) {
    lock.unlock();
    throw py::error_already_set();
  }
  return held;
}

// Raises `error`, a Python exception object (owned elsewhere), as a C++ exception that
// pybind11 hands back to Python: anew each time, where an error is raised by every wait.
[[noreturn]] void raise_object(PyObject* error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error)), error);
  throw py::error_already_set();
}

// Whether `error` is what a signal handler raises (KeyboardInterrupt on Ctrl-C,
// SystemExit, ...): an exception, not an Exception. (With the GIL.)
bool from_a_signal_handler(PyObject* error) {
  return PyExceptionInstance_Check(error) && !PyErr_GivenExceptionMatches(error, PyExc_Exception);
}

// The call whose wait() this thread runs queued calls for (CallQueue::run_here()), and
// what a signal handler raised (KeyboardInterrupt on Ctrl-C, SystemExit, ...: not an
// Exception) inside one queued before it that the Python layer queued, which this
// thread ran (Python runs the main thread's handlers there): that call kept it as its
// own error, so that nothing else would raise it (see run_for_wait()). Owned.
thread_local const CallQueue::Call* waited_call = nullptr;
thread_local PyObject* raised_in_earlier_call = nullptr;

// For a wait() without a timeout: runs `target`, after the calls queued before it, in
// this thread where the worker has not started them and they may run here (see
// CallQueue::run_here()), up to a Ctrl-C; whether it ran target. Ctrl-C raises
// KeyboardInterrupt here, also where it stopped a call before target (whose handle
// raises what the worker's would), not target's error from the worker later; so does
// what another signal's handler raised in such a call, after which the calls left go
// to the worker. after: run with the GIL before anything is raised.
template <typename After>
bool run_for_wait(const std::weak_ptr<CallQueue::State>& queue, const CallQueue::Call& target,
                  After after) {
  const uint64_t interrupts = sigints.load(std::memory_order_relaxed);
  const CallQueue::Call* const outer = waited_call;
  waited_call = &target;
  bool ran;
  {
    WithoutGil nogil;
    ran = CallQueue::run_here(queue, target, [&] {  // (after a call a handler raised in)
      return sigints.load(std::memory_order_relaxed) != interrupts ||
             raised_in_earlier_call != nullptr;
    });
  }
  waited_call = outer;
  py::object raised = py::reinterpret_steal<py::object>(raised_in_earlier_call);
  raised_in_earlier_call = nullptr;
  after();
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  if (raised) raise_object(raised.ptr());
  return ran;
}

// Where this thread runs calls for a wait() and a signal handler raised `error` in one
// (from_a_signal_handler()): that wait raises it (run_for_wait()); whether it will.
// (With the GIL.)
bool kept_for_the_wait(PyObject* error) {
  if (waited_call == nullptr || !from_a_signal_handler(error)) return false;
  if (raised_in_earlier_call == nullptr) {  // (the wait runs no more calls)
    Py_INCREF(error);
    raised_in_earlier_call = error;
  }
  return true;
}

// The same for `call`, which `error` stopped, where it ran for the wait() of a call
// queued after it (its own wait() then raises what the worker's would).
bool raised_for_a_later_wait(const CallQueue::Call& call, PyObject* error) {
  return waited_call != &call && kept_for_the_wait(error);
}

// The GIL, for a queued call that runs Python: on a thread with a Python thread state
// of its own (a caller's, running calls for its wait()), with that; on the worker, with
// one made at its first Python call and kept for the next ones (making one for every
// call costs some 20 us) until the thread ends.
class GilForQueuedCall {
 public:
  GilForQueuedCall() {
    if (!had_state_ && !python_state_kept) {
      gil_.inc_ref();
      python_state_kept = true;
    }
  }
  // The worker thread ends (stop(), with the GIL released): lets go of its thread state.
  static void thread_end() {
    if (!python_state_kept) return;
    py::gil_scoped_acquire gil;
    gil.dec_ref();  // (and its destructor the last reference, which deletes the state)
    python_state_kept = false;
  }

 private:
  const bool had_state_ = PyGILState_GetThisThreadState() != nullptr;  // (before gil_)
  py::gil_scoped_acquire gil_;
  static thread_local bool python_state_kept;
};
thread_local bool GilForQueuedCall::python_state_kept = false;

// A call the Python layer queued: its _Work, whose execute() runs it (and keeps its
// result or error), with the GIL.
class PythonCall : public CallQueue::Call {
 public:
  // anywhere: a caller's wait() may run it in its own thread (CallQueue::run_here()),
  // as it may an AsyncCall: a collective of host arrays, whose Python runs as well
  // on the caller's Python thread as on the worker's. Not one on a GPU, whose stream
  // and current device are the worker's own (see _device._Launch).
  PythonCall(py::object work, bool anywhere)
      : work_(work.release().ptr()), anywhere_(anywhere) {}
  ~PythonCall() override { later_releases.add(work_); }
  void run() override {
    GilForQueuedCall gil;
    PyObject* work = work_;
    work_ = nullptr;
    PyObject* done = PyObject_CallMethod(work, "execute", nullptr);
    if (done == nullptr) keep_escaped_error(work);
    Py_XDECREF(done);
    if (waited_call != nullptr && waited_call != this) note_interrupt(work);
    Py_DECREF(work);  // not kept until the next call comes: its result may be big
    later_releases.flush();
    ran_.store(true, std::memory_order_release);
  }
  bool finished() const override { return ran_.load(std::memory_order_acquire); }
  bool runs_anywhere() const override { return anywhere_; }
  bool takes_the_gil() const override { return true; }
  PyObject* work() const { return work_; }

 private:
  // What escaped execute(), which keeps every error of its call: one that a signal
  // handler raised between two of its lines, outside its try (Ctrl-C in a call that a
  // wait() runs). The call's error all the same (work.keep_escaped()), so that its
  // waits raise it rather than wait for good for a call never marked finished; where
  // the call had finished, the wait this thread runs it for raises it (a signal
  // handler's error), or it is written as unraisable (anything else, or no such wait).
  static void keep_escaped_error(PyObject* work) {
    py::error_already_set escaped;  // (fetched: no error is set now)
    bool kept = false;
    try {
      py::object keep = py::getattr(work, "keep_escaped", py::none());
      kept = !keep.is_none() && keep(escaped.value()).cast<bool>();
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable(py::reinterpret_borrow<py::object>(work));
    }
    if (kept || kept_for_the_wait(escaped.value().ptr())) return;
    escaped.discard_as_unraisable(py::reinterpret_borrow<py::object>(work));
  }

  // Run by a wait() for a call queued after it: if a signal handler raised in it, its
  // own wait() raises what the worker's would (work.interrupt_raised).
  void note_interrupt(PyObject* work) {
    PyObject* error = PyObject_GetAttrString(work, "error");
    if (error == nullptr) {
      PyErr_Clear();
      return;
    }
    if (raised_for_a_later_wait(*this, error) &&
        PyObject_SetAttrString(work, "interrupt_raised", Py_True) != 0) {
      PyErr_Clear();
    }
    Py_DECREF(error);
  }

  PyObject* work_;  // (owned)
  const bool anywhere_;
  std::atomic<bool> ran_{false};
};

// A _Work's place in its queue (its `queued`), for its Handle's wait(): weak, so that
// it keeps neither the call nor the queue alive (the call holds the _Work).
class QueuedPythonCall {
 public:
  QueuedPythonCall(std::weak_ptr<PythonCall> call, std::weak_ptr<CallQueue::State> queue)
      : call_(std::move(call)), queue_(std::move(queue)) {}
  // For a wait() without a timeout: where the worker has not started the call, and it
  // and every call queued before it may run anywhere, runs them in this thread (as
  // AsyncCall::wait() does), up to a Ctrl-C; whether it ran the call.
  bool run_here() {
    std::shared_ptr<PythonCall> call = call_.lock();  // (none: it ran, and left)
    if (call == nullptr || !call->runs_anywhere()) return false;
    return run_for_wait(queue_, *call, [&] {
      call.reset();  // (with the GIL: the last reference may hold its _Work)
      later_releases.flush();
    });
  }
  // For a wait() with a timeout, which leaves the call to the worker: wakes a worker
  // taking its turn (push() did not, for a call that may run anywhere).
  void wake_worker() {
    WithoutGil nogil;
    CallQueue::wake_worker(queue_);
  }

 private:
  std::weak_ptr<PythonCall> call_;
  std::weak_ptr<CallQueue::State> queue_;
};

// What GuessedGather throws where its remake could not make the result: the caller
// raises the Python error its remake kept (never held by a C++ exception, which another
// thread may destroy without the GIL, and which pybind11 restores only once).
struct ResultNotMade {};

// Why a remake could not make the result: the kind of error making it raised, and
// whether a signal handler raised it (KeyboardInterrupt, SystemExit: not an Exception).
struct RemakeFailure {
  std::string kind;
  bool interrupted = false;
  // From the error just caught (with the GIL).
  explicit RemakeFailure(const py::error_already_set& error)
      : kind(Py_TYPE(error.value().ptr())->tp_name),
        interrupted(from_a_signal_handler(error.value().ptr())) {}
  RemakeFailure() = default;
};

// allgather of a contiguous host array into a result held before the exchange: out=,
// or a guess (this rank's rows times the ranks). Where every rank's rows add up to it,
// the exchange fills it in the same step (rows that ride along) or the ring does;
// where not, remake(total rows, &failure) first makes one of the true size (with the
// GIL: the Python layer's _Results.empty) and returns its data, or null, having kept
// what making it raised (and said what in failure: RemakeFailure). A big
// result is confirmed by every rank unless every rank held one of the right size (as
// gather_output() in Python), so that one that cannot make its result does not leave
// the others waiting in the ring: every rank takes the same steps.
struct GuessedGather {
  const void* input;
  int64_t rows, row_elems, row_shape_tag, itemsize;
  DType dtype;
  int64_t chunk_bytes;
  int64_t out_rows;  // out='s (-1: none)
  void* held;        // the result held before the exchange, and its rows
  int64_t held_rows;
  int64_t confirm_bytes;

  template <typename Remake>
  void run(RingCommunicator& ring, Remake remake) const {
    const std::vector<int64_t> counts = ring.allgather_counts(
        rows, row_elems, row_shape_tag, dtype, chunk_bytes, kHostMemory, out_rows, input, held_rows);
    int64_t total = 0;
    for (int64_t r : counts) total += r;
    void* into = held;
    RemakeFailure failure;
    // (Never with out=, which allgather_counts checked.)
    if (total != held_rows) into = remake(total, &failure);
    const int64_t bytes = total * row_elems * itemsize;
    if (bytes >= confirm_bytes && !ring.allgather_results_held()) {
      try {
        ring.allgather_confirm(into != nullptr, bytes);  // (throws everywhere if one failed)
      } catch (...) {
        if (!failure.interrupted) throw;  // (Ctrl-C is raised as Ctrl-C, not as no memory)
      }
    } else if (into == nullptr) {
      ring.allgather_abandon(failure.kind);
    }
    if (into == nullptr) throw ResultNotMade();
    if (!ring.allgather_from_counts(into, total, counts, row_elems, dtype))
      ring.allgather(input, into, counts, row_elems, dtype);  // the ring
  }
};

// GuessedGather's remake: `result`, the wrong guess, let go of first, becomes one of
// `rows` rows of x's shape and dtype from `empty` (the Python layer's _Results.empty);
// its data. Null where making it raised: *raised holds that, *failure says what. With
// the GIL.
void* remade_gather_result(py::object& result, py::handle empty, py::handle x, int64_t rows,
                           RemakeFailure* failure, py::object* raised) {
  result = py::object();
  const auto* proxy = py::detail::array_proxy(x.ptr());
  try {
    py::tuple shape(proxy->nd);
    shape[0] = py::int_(rows);
    for (int i = 1; i < proxy->nd; ++i) shape[i] = py::int_(static_cast<int64_t>(proxy->dimensions[i]));
    result = empty(shape, py::handle(proxy->descr));
  } catch (py::error_already_set& error) {
    *failure = RemakeFailure(error);
    *raised = error.value();
    return nullptr;
  }
  return py::detail::array_proxy(result.ptr())->data;
}

// A collective of host arrays queued by the FastPath (its *_async()): `call` runs it
// on the worker without Python (but for an allgather's remade_result()); waited for
// through its Handle (the same interface as a _Work: done(), wait(), outcome(), pid).
// x: its input; result: what wait() returns; workspace: a buffer it uses besides
// (reduce_scatter's), or None: each kept alive until the call is over.
class AsyncCall : public CallQueue::Call {
 public:
  using Collective = std::function<void(AsyncCall&)>;
  AsyncCall(py::handle core, RingCommunicator* ring, py::handle x, py::handle result,
            py::handle workspace, Collective call)
      : ring_(ring), call_(std::move(call)), pid_(this_process()) {
    core_ = core.inc_ref().ptr();
    x_ = x.inc_ref().ptr();
    result_ = result.inc_ref().ptr();
    workspace_ = workspace.inc_ref().ptr();
  }
  ~AsyncCall() override {
    // In a child made by fork(), a thread of the parent's may have been waiting on the
    // condition: destroying it would wait for that thread for good.
    if (this_process() != pid_) (void)finished_.release();
    if (watched_ && error_ && !kept_ && !observed_.load(std::memory_order_acquire) &&
        this_process() == pid_) {
      std::string lost = lost_error_text(error_);
      if (!lost.empty()) dropped_errors.note(std::move(lost));
    }
    later_releases.add(core_);
    later_releases.add(cancelled_);
    later_releases.add(raised_);
    later_releases.add(empty_);
    if (kept_) return;  // its rank left mid-call: MPI may still read or write them
    later_releases.add(x_);
    later_releases.add(result_);
    later_releases.add(workspace_);
  }

  void run() override {  // without the GIL
    if (!cancelling_.load(std::memory_order_acquire)) {
      const bool departed_before = ring_->departed();
      try {
        call_(*this);
      } catch (const ResultNotMade&) {  // (its error: raised_)
      } catch (...) {
        error_ = std::current_exception();
        kept_ = ring_->departed() && !departed_before;
      }
      if (!kept_) {  // a finished call does not keep its input alive
        later_releases.add(x_);
        x_ = nullptr;
        later_releases.add(workspace_);
        workspace_ = nullptr;
      }
      later_releases.add(empty_);
      empty_ = nullptr;
      call_ = nullptr;
    }
  }
  void announce() override {  // (the running lock let go)
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.store(true, std::memory_order_release);
    }
    finished_->notify_all();
  }

  // Marks it done without running: the caller did the call's work itself (one rank, a
  // copy), so it never goes to the worker.
  void done_here() {
    later_releases.add(x_);
    x_ = nullptr;
    call_ = nullptr;
    done_.store(true, std::memory_order_release);
  }

  // Instead of running, it will raise `error` (a Python exception), if not started yet.
  void cancel(py::handle error) {
    if (cancelled_ != nullptr) return;
    cancelled_ = error.inc_ref().ptr();
    cancelling_.store(true, std::memory_order_release);
  }

  // For an allgather queued with a guess at its result's size: where the ranks' rows
  // add up to other than it, what remade_result() makes the result with (the Python
  // layer's _Results.empty).
  void remakes_with(py::handle empty) { empty_ = empty.inc_ref().ptr(); }
  // The result, of `rows` rows, made anew in place of the guess; its data. With the
  // GIL, as the Python layer's calls take it. Null where making it raised: outcome()
  // raises that (*failure says what it was); a signal handler's error (Ctrl-C's) that
  // came while this ran for the wait of a later call, that wait raises too (see
  // PythonCall::note_interrupt()).
  void* remade_result(int64_t rows, RemakeFailure* failure) {
    GilForQueuedCall gil;
    py::object result = py::reinterpret_steal<py::object>(result_), raised;
    void* data = remade_gather_result(result, empty_, x_, rows, failure, &raised);
    result_ = result.release().ptr();  // (null where it raised)
    raised_ = raised.release().ptr();
    if (raised_ != nullptr && raised_for_a_later_wait(*this, raised_)) interrupt_raised_ = true;
    return data;
  }
  // Its error (KeyboardInterrupt) was raised by the wait() of a later call, which ran
  // it: its own wait() raises what the worker's would (see Handle.wait in Python).
  bool interrupt_raised() const { return interrupt_raised_; }

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool runs_anywhere() const override { return true; }
  bool finished() const override { return done(); }
  void queued_on(std::weak_ptr<CallQueue::State> queue) { queue_ = std::move(queue); }
  // A call the user made (an *_async): its error, if its Handle is dropped unwaited, is
  // noted for a warning (see DroppedErrors). The library's own calls wait for theirs.
  void watch() { watched_ = true; }

  bool wait(std::optional<double> seconds) {
    if (!done() && !seconds) {
      // Where the worker has not started it, this thread runs it, after the calls
      // queued before it (CallQueue::run_here()), up to a Ctrl-C, which stops a call it
      // runs as it would stop one on the worker, and is raised here as from any wait.
      run_for_wait(queue_, *this, [] {});
    } else if (!done()) {
      CallQueue::wake_worker(queue_);  // (a wait with a timeout leaves it to the worker)
    }
    const bool done = wait_interruptibly(seconds, [&] { return this->done(); }, [&](double slice) {
      std::unique_lock<std::mutex> lock(mutex_);
      return finished_->wait_for(lock, std::chrono::duration<double>(slice),
                                 [&] { return this->done(); });
    });
    return done;
  }
  // Once done: the result, or the error raised. (Releases what finished calls let go
  // of, the input of this one among them.)
  py::object outcome() {
    observed_.store(true, std::memory_order_release);
    later_releases.flush();
    const bool cancelled = cancelling_.load(std::memory_order_acquire);
    if (!cancelled && error_) std::rethrow_exception(error_);
    if (PyObject* raised = cancelled ? cancelled_ : raised_) raise_object(raised);
    return py::reinterpret_borrow<py::object>(result_);
  }
  long pid() const { return static_cast<long>(pid_); }

 private:
  RingCommunicator* ring_;
  std::weak_ptr<CallQueue::State> queue_;  // the queue it is in, for wait() (run_here())
  PyObject* core_;  // keeps ring_ alive (owned, as are the others)
  PyObject* x_;
  PyObject* result_;
  PyObject* workspace_;
  PyObject* empty_ = nullptr;  // (see remakes_with())
  PyObject* raised_ = nullptr;  // what remade_result() raised (owned, as the others)
  PyObject* cancelled_ = nullptr;
  std::atomic<bool> cancelling_{false};
  Collective call_;  // the collective (pointers and numbers only: no Python)
  bool interrupt_raised_ = false;
  bool watched_ = false;  // (see watch())
  std::atomic<bool> observed_{false};  // outcome() was asked for
  pid_t pid_;
  std::exception_ptr error_;
  bool kept_ = false;
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::unique_ptr<std::condition_variable> finished_ = std::make_unique<std::condition_variable>();
};

// The CallQueue of a Communicator, as the Python layer's _Executor uses it.
class Executor {
 public:
  explicit Executor(std::shared_ptr<RunningLock> running)
      : queue_(&GilForQueuedCall::thread_end, std::move(running)) {}
  ~Executor() {  // (from Python, with the GIL)
    WithoutGil nogil;  // (queued Python calls need it to finish)
    queue_.stop();
  }
  // Whether it was queued (see CallQueue::refuse_calls()). anywhere: see PythonCall;
  // work.queued, if work has it, is set to its QueuedPythonCall.
  bool push(py::object work, bool anywhere) {
    later_releases.flush();
    auto call = std::make_shared<PythonCall>(work, anywhere);
    if (py::hasattr(work, "queued")) work.attr("queued") = QueuedPythonCall(call, queue_.state());
    return queue_.push(std::move(call));
  }
  bool push_async(const std::shared_ptr<AsyncCall>& call) {  // (its caller flushed)
    call->queued_on(queue_.state());
    return queue_.push(call);
  }
  void refuse_calls(bool refused) { queue_.refuse_calls(refused); }
  bool refusing() const { return queue_.refusing(); }
  int64_t pending() const { return queue_.pending(); }
  int64_t unfinished() const { return queue_.unfinished(); }
  bool started() const { return queue_.started(); }
  int64_t run_by_callers() const { return queue_.run_by_callers(); }
  int64_t turns_unwoken() const { return queue_.turns_unwoken(); }
  void hold_worker(bool held) { queue_.hold_worker(held); }
  void drain() {
    // Inside a call this thread runs for its wait() (a signal handler that closes the
    // Communicator, run in the middle of a call of the Python layer's): nothing else
    // runs before that call returns, which it cannot while this waits. So this goes
    // on, as in a blocking call; the calls queued behind it run after.
    if (queue_.helping_here()) {
      later_releases.flush();
      return;
    }
    wait_interruptibly(std::nullopt, [&] { return queue_.pending() == 0; },
                       [&](double slice) { return queue_.wait_idle(slice); });
    later_releases.flush();
  }
  void cancel(py::handle error) {
    queue_.for_each_waiting([&](CallQueue::Call& call) {
      if (auto* python = dynamic_cast<PythonCall*>(&call)) {
        py::handle(python->work()).attr("cancelled") = error;
      } else if (auto* async = dynamic_cast<AsyncCall*>(&call)) {
        async->cancel(error);
      }
    });
  }
  void stop() {
    {
      WithoutGil nogil;
      queue_.stop();
    }
    later_releases.flush();
  }
  void stop_later() {  // (no wait: the GIL stays)
    queue_.stop(/*wait=*/false);
    later_releases.flush();
  }
  bool detached_alive() const { return queue_.detached_alive(); }
  bool helping_here() const { return queue_.helping_here(); }
  std::shared_ptr<RunningLock> running() const { return queue_.running(); }

 private:
  CallQueue queue_;
};

// The common case of every collective, checked and run here without Python: a
// contiguous numpy array of a dtype (and op) the Python layer has validated before (for
// a blocking allreduce also a strided one or a scalar, copied into one first), an
// out= that needs no checks beyond a few fields, no asynchronous call in flight. The
// same checks in Python cost a small call as much as the exchange itself (1.5-2.6 us
// against 2.5-2.8 us on 2 ranks). It decides nothing the Python layer has not: its
// tables come from there, and for anything else it returns None, and the Python
// layer's general path serves (or rejects) the call.
class FastPath {
 public:
  FastPath(py::object core, py::object executor, bool threaded, py::dict validated_pairs,
           py::tuple mpi_op_keys, py::dict dtype_codes, py::object shape_tag,
           py::object results_empty,
           py::object scratch_get, int64_t chunk_bytes,
           int64_t fresh_max_bytes, int64_t confirm_bytes)
      : chunk_bytes(chunk_bytes),
        core_object_(core),
        core_(core.cast<RingCommunicator*>()),
        executor_object_(executor),
        executor_(executor.cast<Executor*>()),
        threaded_(threaded),
        validated_pairs_(validated_pairs),
        mpi_op_keys_(mpi_op_keys),
        dtype_codes_(dtype_codes),
        shape_tag_(shape_tag),
        no_row_shape_tag_(shape_tag(py::tuple()).cast<int64_t>()),
        results_empty_(results_empty),
        scratch_get_(scratch_get),
        fresh_max_bytes_(fresh_max_bytes),
        confirm_bytes_(confirm_bytes),
        numpy_scalar_type_(py::module_::import("numpy").attr("generic")) {}

  int64_t chunk_bytes;  // the Communicator's, kept in step by its setter

  // `check`: see RingCommunicator::allreduce().
  py::object allreduce(py::handle x, py::handle op, py::handle out, int64_t check) {
    py::object stand_in;    // (x as an array the core takes, where x is not one)
    bool copy_x = false;  // (a strided x: copied once no call before it is unfinished)
    if (!is_plain(x)) {
      stand_in = scalar_as_array(x);
      if (stand_in) {
        x = stand_in;
      } else if (copyable(x, op)) {
        copy_x = true;
      } else {
        return py::none();
      }
    }
    int dtype, reduce_op;
    if (!copy_x && !allreduce_arguments(x, op, out, &dtype, &reduce_op)) return py::none();
    Running running(*this);
    if (!running.held) return py::none();
    if (copy_x) {
      // Only now: x may be a view of the out= of a call queued before, which writes it
      // until it is over (it was copied before that, and a call that ended meanwhile
      // left the copy stale). Copied straight into the result (out=, or the new array),
      // which the ring then reduces in place: no second array of x's size.
      // (PyArray_CopyInto copies right where out overlaps x.)
      stand_in = contiguous_copy_into(x, out);
      if (!stand_in) return py::none();
      x = out = stand_in;
      if (!allreduce_arguments(x, op, out, &dtype, &reduce_op)) return py::none();
    }
    const Array a(x);
    const int64_t chunk = chunk_bytes;  // (read here, with the GIL)
    py::object result = out.is_none() ? new_result(a, a.nd, a.dims) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    void* dst = Array(result).data;
    if (core_->size() > 1) {
      const int64_t n = a.size();
      keeping_on_departure(*core_, {x, result}, [&] {
        core_->allreduce(a.data, dst, n, DType(dtype), Op(reduce_op), chunk, check);
      });
    } else {  // one rank: x reduced with nothing is x (x / 1 too)
      core_->check_usable("allreduce");
      if (dst != a.data) copy_bytes(dst, a.data, a.nbytes());
    }
    return result;
  }

  // Queues the allreduce on the worker thread and returns its AsyncCall; None for
  // anything the general path serves.
  // `check` given: a call of the library's own (see RingCommunicator::allreduce()), which
  // waits for its own errors; none: the user's (AsyncCall::watch()).
  py::object allreduce_async(py::handle x, py::handle op, py::handle out,
                             std::optional<int64_t> given_check) {
    const int64_t check = given_check.value_or(0);
    if (core_->closed()) return py::none();
    if (core_->size() == 1) return one_rank_async(x, op, out, check);
    if (!threaded_) return py::none();
    int dtype, reduce_op;
    if (!allreduce_arguments(x, op, out, &dtype, &reduce_op)) return py::none();
    const Array a(x);
    later_releases.flush();  // (a kept buffer a finished call let go of may serve again)
    py::object result = out.is_none() ? new_result(a, a.nd, a.dims) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    RingCommunicator* ring = core_;
    const void* input = a.data;
    void* output = Array(result).data;
    const int64_t count = a.size(), chunk = chunk_bytes;
    auto call = std::make_shared<AsyncCall>(
        core_object_, core_, x, result, py::none(),
        [=](AsyncCall&) {
          ring->allreduce(input, output, count, DType(dtype), Op(reduce_op), chunk, check);
        });
    if (!given_check) call->watch();
    return queued(call);
  }

  // reduce_scatter(x, op, out) queued on the worker thread, as allreduce_async(); its
  // AsyncCall, or None where the Python layer serves the call (one rank among them).
  py::object reduce_scatter_async(py::handle x, py::handle op, py::handle out) {
    if (core_->closed() || core_->size() == 1 || !threaded_) return py::none();
    int dtype, reduce_op;
    if (!is_plain(x) || !reduction_codes(x, op, &dtype, &reduce_op)) return py::none();
    const Array a(x);
    const int64_t n = a.size();
    int64_t count;
    bool inline_call;
    if (!reduce_scatter_out(a, out, &count, &inline_call)) return py::none();
    later_releases.flush();
    py::object result = out.is_none() ? new_result(a, 1, &count) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    py::object work = reduce_scatter_workspace(a, inline_call, result);
    if (!work) return py::none();
    void* workspace = Array(work).data;
    RingCommunicator* ring = core_;
    const void* input = a.data;
    void* output = Array(result).data;
    const int64_t chunk = chunk_bytes;
    auto call = std::make_shared<AsyncCall>(
        core_object_, core_, x, result, work, [=](AsyncCall&) {
          ring->reduce_scatter(input, workspace, n, DType(dtype), Op(reduce_op), chunk, output);
        });
    call->watch();
    return queued(call);
  }

  // broadcast(x, root) queued on the worker thread, as allreduce_async().
  py::object broadcast_async(py::handle x, py::handle root_object) {
    if (core_->closed() || core_->size() == 1 || !threaded_) return py::none();
    int dtype;
    long root;
    if (!broadcast_arguments(x, root_object, &dtype, &root)) return py::none();
    const Array a(x);
    later_releases.flush();
    RingCommunicator* ring = core_;
    void* data = a.data;
    const int64_t n = a.size(), chunk = chunk_bytes;
    auto call = std::make_shared<AsyncCall>(
        core_object_, core_, x, x, py::none(),
        [=](AsyncCall&) { ring->broadcast(data, n, DType(dtype), static_cast<int>(root), chunk); });
    call->watch();
    return queued(call);
  }

  py::object reduce_scatter(py::handle x, py::handle op, py::handle out) {
    int dtype, reduce_op;
    if (!is_plain(x) || !reduction_codes(x, op, &dtype, &reduce_op)) return py::none();
    const Array a(x);
    const int64_t n = a.size();
    if (core_->size() == 1) return one_rank_copy("reduce_scatter", a, out, 1, &n);
    int64_t count;
    bool inline_call;
    if (!reduce_scatter_out(a, out, &count, &inline_call)) return py::none();
    Running running(*this);
    if (!running.held) return py::none();
    const int64_t chunk = chunk_bytes;  // (read here, with the GIL)
    py::object result = out.is_none() ? new_result(a, 1, &count) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    py::object work = reduce_scatter_workspace(a, inline_call, result);
    if (!work) return py::none();
    void* dst = Array(result).data;
    void* workspace = Array(work).data;
    keeping_on_departure(*core_, {x, result, work}, [&] {
      core_->reduce_scatter(a.data, workspace, n, DType(dtype), Op(reduce_op), chunk, dst);
    });
    return result;
  }

  py::object allgather(py::handle x, py::handle out) {
    int dtype;
    if (!is_plain(x) || !dtype_code(x, &dtype)) return py::none();
    const Array a(x);
    if (a.nd == 0) return py::none();
    if (core_->size() == 1) return one_rank_copy("allgather", a, out, a.nd, a.dims);
    if (!allgather_out(a, out)) return py::none();
    Running running(*this);
    if (!running.held) return py::none();
    py::object result = allgather_guess(a, out);
    if (!result) return py::none();
    const GuessedGather gather = guessed_gather(a, dtype, out, result);
    const bool departed_before = core_->departed();
    py::object raised;  // (what making the result raised)
    try {
      WithoutGil nogil;
      gather.run(*core_, [&](int64_t rows, RemakeFailure* failure) {
        py::gil_scoped_acquire gil;
        return remade_gather_result(result, results_empty_, x, rows, failure, &raised);
      });
    } catch (const ResultNotMade&) {
      raise_object(raised.ptr());
    } catch (...) {
      if (core_->departed() && !departed_before) {  // (see keeping_on_departure())
        x.inc_ref();
        result.inc_ref();
      }
      throw;
    }
    return result;
  }

  // allgather(x, out) queued on the worker thread, as allreduce_async().
  py::object allgather_async(py::handle x, py::handle out) {
    if (core_->closed() || core_->size() == 1 || !threaded_) return py::none();
    int dtype;
    if (!is_plain(x) || !dtype_code(x, &dtype)) return py::none();
    const Array a(x);
    if (a.nd == 0 || !allgather_out(a, out)) return py::none();
    later_releases.flush();
    py::object result = allgather_guess(a, out);
    if (!result) return py::none();
    const GuessedGather gather = guessed_gather(a, dtype, out, result);
    RingCommunicator* ring = core_;
    auto call = std::make_shared<AsyncCall>(
        core_object_, core_, x, result, py::none(), [=](AsyncCall& self) {
          gather.run(*ring, [&](int64_t rows, RemakeFailure* failure) {
            return self.remade_result(rows, failure);
          });
        });
    call->remakes_with(results_empty_);
    call->watch();
    return queued(call);
  }

  py::object broadcast(py::handle x, py::handle root_object) {
    int dtype;
    long root;
    if (!broadcast_arguments(x, root_object, &dtype, &root)) return py::none();
    const Array a(x);
    Running running(*this);
    if (!running.held) return py::none();
    const int64_t chunk = chunk_bytes;  // (read here, with the GIL)
    if (core_->size() > 1) {
      const int64_t n = a.size();
      keeping_on_departure(*core_, {x}, [&] {
        core_->broadcast(a.data, n, DType(dtype), static_cast<int>(root), chunk);
      });
    } else {  // one rank: x is root's x
      core_->check_usable("broadcast");
    }
    return py::reinterpret_borrow<py::object>(x);
  }

 private:
  // The fields of a numpy array the checks read (numpy's own struct, through pybind11).
  struct Array {
    explicit Array(py::handle h) {
      const auto* proxy = py::detail::array_proxy(h.ptr());
      data = proxy->data;
      nd = proxy->nd;
      dims = reinterpret_cast<const int64_t*>(proxy->dimensions);
      flags = proxy->flags;
      descr = proxy->descr;
      itemsize = py::reinterpret_borrow<py::dtype>(descr).itemsize();
    }
    int64_t size() const {
      int64_t n = 1;
      for (int i = 0; i < nd; ++i) n *= dims[i];
      return n;
    }
    int64_t nbytes() const { return size() * itemsize; }
    bool writeable() const { return flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_; }
    char* data;
    int nd;
    const int64_t* dims;
    int flags;
    PyObject* descr;
    int64_t itemsize;
  };
  static_assert(sizeof(Py_intptr_t) == sizeof(int64_t), "numpy's dimensions as int64");
  static constexpr int kMaxDims = 64;  // numpy's NPY_MAXDIMS (32 before numpy 2)

  // The executor's lock, if no queued call is unfinished and no close has begun: held
  // while the core runs the call, so that the worker thread (or another caller) does not
  // run one meanwhile. (Not "nothing queued": after a wait, the call waited for may be
  // on the queue still.)
  // x and root as the Python layer would take them for a broadcast; their codes.
  bool broadcast_arguments(py::handle x, py::handle root_object, int* dtype,
                           long* root) const {
    if (!is_plain(x) || !PyLong_CheckExact(root_object.ptr()) || !dtype_code(x, dtype))
      return false;
    int overflow = 0;
    *root = PyLong_AsLongAndOverflow(root_object.ptr(), &overflow);
    if (overflow || *root < 0 || *root >= core_->size()) return false;
    // The root only reads its x, which may be read-only.
    return Array(x).writeable() || *root == core_->rank();
  }

  // Whether out (None, or an array) is one reduce_scatter of x writes this rank's block
  // into without the Python layer's checks; the block's length, and whether the call
  // rides in the header exchange. Such a call copies x there before it writes out, so
  // out may overlap x; the ring reads x while it writes, so then out must not.
  bool reduce_scatter_out(const Array& a, py::handle out, int64_t* count,
                          bool* inline_call) const {
    *count = RingCommunicator::segment_of(core_->rank(), core_->size(), a.size()).count;
    *inline_call = core_->rides_inline(a.nbytes());
    return out.is_none() || is_plain_out(out, a, 1, count, false, *inline_call);
  }

  // Whether allgather takes out (None, or an array) without the Python layer's checks;
  // without out=, whether the result is small enough to guess at (below).
  bool allgather_out(const Array& a, py::handle out) const {
    if (!out.is_none()) return is_plain_out(out, a, a.nd, a.dims, true, true);
    // Not from the buffers kept for big results (fresh_max_bytes_ on), where a wrong
    // guess would push out the one the true size could have had, to save microseconds
    // of a call that takes milliseconds. (Rows of no bytes may be as many as int64 holds:
    // their count times the ranks, the guess, must be one too.)
    return a.nbytes() * core_->size() < fresh_max_bytes_ &&
           (a.nd == 0 || a.dims[0] <= std::numeric_limits<int64_t>::max() / core_->size());
  }

  // allgather's result held before the exchange (GuessedGather): out=, or a guess at it,
  // this rank's rows times the ranks; null where that cannot be allocated.
  py::object allgather_guess(const Array& a, py::handle out) const {
    if (!out.is_none()) return py::reinterpret_borrow<py::object>(out);
    int64_t dims[kMaxDims];
    std::copy(a.dims, a.dims + a.nd, dims);
    dims[0] *= core_->size();
    try {
      return new_result(a, a.nd, dims);
    } catch (py::error_already_set& refused) {
      // numpy's ValueError "array is too big" (rows of no bytes, as many as int64
      // holds): no guess, rather than an error raised before the exchange that the
      // other ranks wait in; the general path exchanges first.
      if (!refused.matches(PyExc_ValueError)) throw;
      return py::object();
    }
  }

  GuessedGather guessed_gather(const Array& a, int dtype, py::handle out,
                               py::handle result) const {
    const Array into(result);
    int64_t row_elems = 1;
    for (int i = 1; i < a.nd; ++i) row_elems *= a.dims[i];
    const int64_t tag = a.nd == 1 ? no_row_shape_tag_ : shape_tag_(row_shape(a)).cast<int64_t>();
    return GuessedGather{a.data,        a.dims[0],
                         row_elems,     tag,
                         a.itemsize,    DType(dtype),
                         chunk_bytes,   out.is_none() ? -1 : into.dims[0],
                         into.data,     into.dims[0],
                         confirm_bytes_};
  }

  // An AsyncCall queued on the worker thread, for its Handle; None where calls are
  // refused (a close began: the Python layer says so).
  py::object queued(const std::shared_ptr<AsyncCall>& call) {
    // (Errors of dropped calls to warn of: the general path does so, and serves this.)
    try {
      if (dropped_errors.pending() || !executor_->push_async(call)) return py::none();
    } catch (const NoThreadError&) {
      return py::none();  // the general path tries again, and says so everywhere if it fails
    }
    return py::cast(call);
  }

  // reduce_scatter's workspace, as big as x: the one the Python layer keeps (its
  // _Scratch, which the executor's runs serialise), or the result itself for a call
  // that rides in the header exchange; a null object where the Python layer must serve
  // the call (no memory for it, say).
  py::object reduce_scatter_workspace(const Array& a, bool inline_call, py::handle result) {
    if (inline_call) return py::reinterpret_borrow<py::object>(result);
    py::object work = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(scratch_get_.ptr(), "L", static_cast<long long>(a.nbytes())));
    if (!work) {
      clear_memory_error();
      return py::object();
    }
    if (!is_plain(work) || Array(work).nbytes() < a.nbytes()) return py::object();
    return work;
  }

  struct Running {
    explicit Running(FastPath& path) : lock(*path.executor_->running()) {
      later_releases.flush();  // (what finished calls let go of, big results too)
      if (path.executor_->unfinished() != 0) return;
      acquire_running(lock, true, std::nullopt);  // (a signal handler may raise)
      held = path.executor_->unfinished() == 0 && !path.core_->closed() &&
             !path.executor_->refusing() && !dropped_errors.pending();
      if (!held) lock.unlock();
    }
    ~Running() {
      if (held) lock.unlock();
    }
    RunningLock& lock;
    bool held = false;
  };

  // x, op and out as the Python layer would take them for an allreduce; their codes.
  bool allreduce_arguments(py::handle x, py::handle op, py::handle out, int* dtype,
                           int* reduce_op) const {
    if (!is_plain(x) || !reduction_codes(x, op, dtype, reduce_op)) return false;
    if (out.is_none()) return true;
    const Array a(x);
    if (out.is(x)) return a.writeable();
    return is_plain_out(out, a, a.nd, a.dims, false, false);
  }

  // A numpy scalar or a Python float, int or bool (a loss, np.isnan(loss): reduced once a
  // step, some 4 us each through the general path) as the 0-d array np.asarray() makes
  // of it, which the general path reduces too; null for anything else, or where that
  // fails (the general path then says why).
  py::object scalar_as_array(py::handle x) const {
    PyObject* p = x.ptr();
    if (!PyFloat_CheckExact(p) && !PyLong_CheckExact(p) && !PyBool_Check(p) &&
        !PyObject_TypeCheck(p, reinterpret_cast<PyTypeObject*>(numpy_scalar_type_.ptr()))) {
      return py::object();
    }
    PyObject* array = py::detail::npy_api::get().PyArray_FromAny_(p, nullptr, 0, 0, 0, nullptr);
    if (array == nullptr) PyErr_Clear();
    return py::reinterpret_steal<py::object>(array);
  }

  // Whether x is a strided numpy.ndarray (a column, x[::2]; no subclass) of a dtype and
  // op the general path has validated, which the FastPath serves through contiguous_copy_into().
  // The general path copies such an x too, after some microseconds of Python (a strided
  // 4 KiB allreduce took 6.7 us, against 1.8 us for a contiguous one).
  bool copyable(py::handle x, py::handle op) const {
    int dtype, reduce_op;
    return Py_TYPE(x.ptr()) == py::detail::npy_api::get().PyArray_Type_ &&
           reduction_codes(x, op, &dtype, &reduce_op);
  }

  // The bytes a numpy array spans, from its shape and strides (numpy's byte_bounds).
  static const char* span_begin(py::handle h) {
    const auto* proxy = py::detail::array_proxy(h.ptr());
    const char* begin = proxy->data;
    for (int i = 0; i < proxy->nd; ++i) {
      if (proxy->dimensions[i] == 0) return proxy->data;
      if (proxy->strides[i] < 0) begin += (proxy->dimensions[i] - 1) * proxy->strides[i];
    }
    return begin;
  }
  static const char* span_end(py::handle h) {
    const auto* proxy = py::detail::array_proxy(h.ptr());
    const char* end = proxy->data + py::reinterpret_borrow<py::dtype>(proxy->descr).itemsize();
    for (int i = 0; i < proxy->nd; ++i) {
      if (proxy->dimensions[i] == 0) return proxy->data;
      if (proxy->strides[i] > 0) end += (proxy->dimensions[i] - 1) * proxy->strides[i];
    }
    return end;
  }

  // x copied into out (a plain array of x's shape and dtype: else null), or into a new
  // result shaped like x where out is None: the array the call then reduces in place.
  // Null where that fails (the general path then meets the error and says it).
  py::object contiguous_copy_into(py::handle x, py::handle out) const {
    const Array strided(x);
    py::object into;
    if (out.is_none()) {
      into = new_result(strided, strided.nd, strided.dims);
    } else if (is_plain_out(out, strided, strided.nd, strided.dims, false, true)) {
      // An out that shares x's span gets a copy of x first: numpy's own assignment
      // (2.4) copies wrong between some overlapping strided arrays.
      if (ranges_overlap(Array(out).data, Array(out).nbytes(), span_begin(x),
                         span_end(x) - span_begin(x))) {
        const auto& api = py::detail::npy_api::get();
        py::object copy = py::reinterpret_steal<py::object>(api.PyArray_NewCopy_(x.ptr(), 0));
        if (!copy || api.PyArray_CopyInto_(out.ptr(), copy.ptr()) < 0) {
          PyErr_Clear();  // (the general path meets the error and says it)
          return py::object();
        }
        return py::reinterpret_borrow<py::object>(out);
      }
      into = py::reinterpret_borrow<py::object>(out);
    }
    if (!into) return into;
    if (py::detail::npy_api::get().PyArray_CopyInto_(into.ptr(), x.ptr()) < 0) {
      PyErr_Clear();  // (the general path meets the error and says it)
      return py::object();
    }
    return into;
  }

  // Exactly numpy.ndarray (no subclass: a masked array has its own rules), C-contiguous.
  static bool is_plain(py::handle h) {
    const auto& api = py::detail::npy_api::get();
    return Py_TYPE(h.ptr()) == api.PyArray_Type_ &&
           (py::detail::array_proxy(h.ptr())->flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_);
  }

  // out is a valid result for x by the Python layer's check_out() rules: a plain
  // writeable array of x's dtype shaped `nd` x `dims` (any_rows: any number of rows of
  // that shape).
  // Unless overlap_ok, it shares no memory with x, or is x's own memory exactly.
  static bool is_plain_out(py::handle out, const Array& x, int nd, const int64_t* dims,
                           bool any_rows, bool overlap_ok) {
    if (!is_plain(out)) return false;
    const Array o(out);
    if (!o.writeable() || o.nd != nd) return false;
    if (o.descr != x.descr && !py::detail::npy_api::get().PyArray_EquivTypes_(o.descr, x.descr))
      return false;
    for (int i = any_rows ? 1 : 0; i < nd; ++i)
      if (o.dims[i] != dims[i]) return false;
    if (overlap_ok) return true;
    const int64_t bytes = o.nbytes();
    return !ranges_overlap(o.data, bytes, x.data, x.nbytes()) ||
           (o.data == x.data && bytes == x.nbytes());
  }

  bool dtype_code(py::handle x, int* dtype) const {
    PyObject* code = PyDict_GetItemWithError(dtype_codes_.ptr(), py::detail::array_proxy(x.ptr())->descr);
    if (code == nullptr) {
      PyErr_Clear();
      return false;
    }
    *dtype = static_cast<int>(PyLong_AsLong(code));
    return true;
  }

  // (dtype, op) codes of a pair the Python layer has validated (and noted) before.
  bool reduction_codes(py::handle x, py::handle op, int* dtype, int* reduce_op) const {
    PyObject* by_op =  // borrowed, as codes
        PyDict_GetItemWithError(validated_pairs_.ptr(), py::detail::array_proxy(x.ptr())->descr);
    PyObject* key = op_key(op);  // (null: an op the general path keys nothing for)
    PyObject* codes = by_op != nullptr && PyDict_Check(by_op) && key != nullptr
                          ? PyDict_GetItemWithError(by_op, key)
                          : nullptr;
    if (codes == nullptr || !PyTuple_Check(codes) || PyTuple_GET_SIZE(codes) != 2) {
      PyErr_Clear();  // (an op that cannot be hashed: the general path says so)
      return false;
    }
    *dtype = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(codes, 0)));
    *reduce_op = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(codes, 1)));
    return true;
  }

  // What stands for op in validated_pairs, as ringreduce._types.reduction_codes looks it
  // up: an op string itself; one of mpi4py's ops (unhashable), its key there (see
  // ringreduce._types.MPI_OP_KEYS); null for anything else, which the general path looks
  // up nothing for (an object equal to "sum", or a key itself, must not find "sum"'s).
  PyObject* op_key(py::handle op) const {
    if (PyUnicode_Check(op.ptr())) return op.ptr();
    for (py::handle pair : mpi_op_keys_) {
      PyObject* mpi_op = PyTuple_GET_ITEM(pair.ptr(), 0);
      if (op.ptr() == mpi_op) return PyTuple_GET_ITEM(pair.ptr(), 1);
    }
    return nullptr;
  }

  static py::tuple row_shape(const Array& a) {
    py::tuple shape(a.nd - 1);
    for (int i = 1; i < a.nd; ++i) shape[i - 1] = py::int_(a.dims[i]);
    return shape;
  }

  // A new result of x's dtype: small ones straight from numpy, big ones from the
  // buffers the Python layer keeps (its _Results). Null if that fails (a MemoryError):
  // the call then takes the general path, which tells the other ranks (or, for an
  // allgather, raises only after the exchange that the others need from this rank).
  py::object new_result(const Array& x, int nd, const int64_t* dims) const {
    int64_t bytes = x.itemsize;
    for (int i = 0; i < nd; ++i) bytes *= dims[i];
    if (bytes >= fresh_max_bytes_) {
      py::tuple shape(nd);
      for (int i = 0; i < nd; ++i) shape[i] = py::int_(dims[i]);
      PyObject* array = PyObject_CallFunctionObjArgs(results_empty_.ptr(), shape.ptr(), x.descr,
                                                     nullptr);
      if (array == nullptr) clear_memory_error();
      return py::reinterpret_steal<py::object>(array);
    }
    const auto& api = py::detail::npy_api::get();
    Py_INCREF(x.descr);  // (stolen)
    PyObject* array = api.PyArray_NewFromDescr_(
        api.PyArray_Type_, x.descr, nd,
        reinterpret_cast<Py_intptr_t*>(const_cast<int64_t*>(dims)), nullptr, nullptr, 0, nullptr);
    if (array == nullptr) clear_memory_error();
    return py::reinterpret_steal<py::object>(array);
  }

  // After an allocation failed: a MemoryError is cleared, for the general path to meet
  // (and tell the other ranks); anything else (Ctrl-C in _Results.empty) is raised.
  static void clear_memory_error() {
    if (!PyErr_ExceptionMatches(PyExc_MemoryError)) throw py::error_already_set();
    PyErr_Clear();
  }

  // reduce_scatter or allgather on one rank, where either is a copy of x into a result
  // shaped `nd` x `dims`; out may overlap x.
  py::object one_rank_copy(const char* collective, const Array& a, py::handle out, int nd,
                           const int64_t* dims) {
    if (a.nd == 0) return py::none();
    if (!out.is_none() && !is_plain_out(out, a, nd, dims, false, true)) return py::none();
    Running running(*this);
    if (!running.held) return py::none();
    core_->check_usable(collective);  // (raises as the core would after an earlier error)
    py::object result = out.is_none() ? new_result(a, nd, dims) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    copy_bytes(Array(result).data, a.data, a.nbytes());
    return result;
  }

  // One rank waits for no one: an asynchronous allreduce is a copy, done here and now
  // (handing it to the worker thread costs ten times the copy: some 7 us against 0.7 us
  // for 8 bytes). Its AsyncCall comes back done. Not with calls in flight, which
  // it must follow; nor after an error, which the general path raises from wait().
  py::object one_rank_async(py::handle x, py::handle op, py::handle out, int64_t check) {
    int dtype, reduce_op;
    if (!allreduce_arguments(x, op, out, &dtype, &reduce_op)) return py::none();
    const Array a(x);
    Running running(*this);
    if (!running.held) return py::none();
    try {
      core_->check_usable();
    } catch (const std::exception&) {
      return py::none();
    }
    py::object result = out.is_none() ? new_result(a, a.nd, a.dims) : py::reinterpret_borrow<py::object>(out);
    if (!result) return py::none();
    copy_bytes(Array(result).data, a.data, a.nbytes());  // (x OP nothing is x; x / 1 too)
    auto call = std::make_shared<AsyncCall>(core_object_, core_, x, result, py::none(), nullptr);
    call->done_here();
    return py::cast(call);
  }

  py::object core_object_;  // keeps core_ alive
  RingCommunicator* core_;
  py::object executor_object_;  // keeps executor_ alive
  Executor* executor_;
  bool threaded_;  // MPI has MPI_THREAD_MULTIPLE: asynchronous calls may go to the worker
  py::dict validated_pairs_;
  py::tuple mpi_op_keys_;  // ((op, key), ...): see op_key()
  py::dict dtype_codes_;
  py::object shape_tag_;
  int64_t no_row_shape_tag_;
  py::object results_empty_, scratch_get_;
  int64_t fresh_max_bytes_, confirm_bytes_;
  py::object numpy_scalar_type_;  // numpy.generic (see scalar_as_array())
};

// allreduce_gradients' packing of small gradients into one flat buffer and back, by
// memcpy: numpy's concatenate and a slice assignment an array cost about 1 us an array
// from Python, as much as the all-reduce of 32 gradients of 2 KiB itself. Only the
// common case, checked for every array before any byte moves: each grads[i] (i in
// `indices`) a numpy array (a subclass too) that is C-contiguous and of flat's dtype,
// and writeable where it is written; flat a plain C-contiguous writeable 1-D array in
// native byte order, of exactly their bytes. Anything else: false, nothing
// copied, and the caller does it with numpy.
struct GradientBytes {
  char* data;
  size_t bytes;
};

bool gradient_spans(py::handle grads, py::handle indices, py::handle flat, bool writing,
                    std::vector<GradientBytes>* spans, char** flat_data) {
  const auto& api = py::detail::npy_api::get();
  constexpr int kContiguous = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
  constexpr int kWriteable = py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  constexpr std::uint64_t kHasObject = 0x01;  // numpy's NPY_ITEM_HASOBJECT
  if (!PyList_CheckExact(grads.ptr()) || !PyList_CheckExact(indices.ptr()) ||
      Py_TYPE(flat.ptr()) != api.PyArray_Type_)
    return false;
  const auto* f = py::detail::array_proxy(flat.ptr());
  if ((f->flags & (kContiguous | kWriteable)) != (kContiguous | kWriteable) || f->nd != 1)
    return false;
  const auto dtype = py::reinterpret_borrow<py::dtype>(f->descr);
  // (Bytes only: never objects, whose copies would need references counted.)
  if (dtype.flags() & kHasObject) return false;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (py::detail::array_descriptor_proxy(f->descr)->byteorder == '>') return false;  // (the ring's: native)
#else
  if (py::detail::array_descriptor_proxy(f->descr)->byteorder == '<') return false;
#endif
  const size_t itemsize = dtype.itemsize();
  const Py_ssize_t count = PyList_GET_SIZE(grads.ptr());
  const Py_ssize_t n = PyList_GET_SIZE(indices.ptr());
  spans->reserve(static_cast<size_t>(n));
  size_t total = 0;
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* index = PyList_GET_ITEM(indices.ptr(), k);
    if (!PyLong_CheckExact(index)) return false;
    const Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i < 0 || i >= count) {
      PyErr_Clear();  // (-1 with an error, for an int out of range)
      return false;
    }
    PyObject* g = PyList_GET_ITEM(grads.ptr(), i);
    if (!api.PyArray_Check_(g)) return false;
    const auto* a = py::detail::array_proxy(g);
    const int needed = kContiguous | (writing ? kWriteable : 0);
    if ((a->flags & needed) != needed) return false;
    if (a->descr != f->descr && !api.PyArray_EquivTypes_(a->descr, f->descr)) return false;
    size_t elements = 1;
    for (int d = 0; d < a->nd; ++d) elements *= static_cast<size_t>(a->dimensions[d]);
    spans->push_back({a->data, elements * itemsize});
    total += elements * itemsize;
  }
  if (total != static_cast<size_t>(f->dimensions[0]) * itemsize) return false;
  *flat_data = f->data;
  return true;
}

// The dtype object numpy_layout() names for `descr`: numpy's own instance of its type,
// where descr is that or (a builtin type) equivalent to it; else null. numpy makes
// dtype objects equal to its own anew (an unpickled array's, a ctypes array's, one with
// metadata): keyed by their own addresses, gradients made afresh each step (unpickled,
// say) missed the plan cache on every call, where the tuple key that compares dtypes
// by equality found it (2 ranks, 32 x 2 KiB: 550 us a call against 303 us before).
PyObject* layout_descr(PyObject* descr) {
  const auto& api = py::detail::npy_api::get();
  constexpr int kBuiltin = 24;     // NPY_NTYPES_LEGACY: bool .. half
  constexpr int kUserDef = 256;    // NPY_USERDEF: registered (legacy) user dtypes from here
  constexpr int kNewStyle = 2056;  // NPY_VSTRING: dtypes made anew by DescrFromType
  const int num = py::detail::array_descriptor_proxy(descr)->type_num;
  if (num < 0 || (num >= kBuiltin && num < kUserDef) || num >= kNewStyle) return nullptr;
  PyObject* own = api.PyArray_DescrFromType_(num);
  if (own == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_DECREF(own);  // (numpy keeps its own instances for good)
  if (own == descr) return own;
  // (Never a byte-swapped one: equivalent means no cast at all; nor flexible ones, whose
  // own instance has no size.)
  if (num < kBuiltin && api.PyArray_EquivTypes_(descr, own)) return own;
  return nullptr;
}

// allreduce_gradients' key to the plans it keeps, where every one of grads (a list) is
// a plain writeable numpy array (no subclass: a masked one, say, which the caller must
// look at) of one of numpy's own dtypes (see layout_descr): for each, the address of
// its dtype, its number of dimensions and each dimension, as bytes. Building and
// hashing a tuple of the same took some 0.3 us an array in Python. (numpy keeps its
// own dtypes for good, so no other object takes one of those addresses.) None for
// anything else: the caller looks at each array then, says what is wrong, or keys by
// a tuple of types, shapes and dtypes.
py::object numpy_layout(py::handle grads) {
  const auto& api = py::detail::npy_api::get();
  constexpr int kWriteable = py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  if (!PyList_CheckExact(grads.ptr())) return py::none();
  const Py_ssize_t n = PyList_GET_SIZE(grads.ptr());
  std::vector<int64_t> words;
  words.reserve(static_cast<size_t>(n) * 3);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* g = PyList_GET_ITEM(grads.ptr(), k);
    if (Py_TYPE(g) != api.PyArray_Type_) return py::none();
    const auto* a = py::detail::array_proxy(g);
    if (!(a->flags & kWriteable)) return py::none();
    PyObject* descr = layout_descr(a->descr);
    if (descr == nullptr) return py::none();
    words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(descr)));
    words.push_back(a->nd);
    for (int d = 0; d < a->nd; ++d) words.push_back(a->dimensions[d]);
  }
  return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
}

// Copies grads[i] for each i in indices, one after another, into flat; see above.
bool pack_gradients(py::handle grads, py::handle indices, py::handle flat) {
  std::vector<GradientBytes> spans;
  char* to = nullptr;
  if (!gradient_spans(grads, indices, flat, false, &spans, &to)) return false;
  for (const GradientBytes& g : spans) {
    copy_bytes(to, g.data, g.bytes);
    to += g.bytes;
  }
  return true;
}

// The other way: flat's bytes back into grads[i], i in indices, in order.
bool unpack_gradients(py::handle flat, py::handle grads, py::handle indices) {
  std::vector<GradientBytes> spans;
  const char* from = nullptr;
  char* flat_data = nullptr;
  if (!gradient_spans(grads, indices, flat, true, &spans, &flat_data)) return false;
  from = flat_data;
  for (const GradientBytes& g : spans) {
    copy_bytes(g.data, from, g.bytes);
    from += g.bytes;
  }
  return true;
}

// DistributedOptimizer.grad_ready's usual case, one call a gradient: copies
// grads to targets[index] (params[index]'s place in its bucket) where index is a Python
// int in range, grad a plain numpy array (no subclass) that is C-contiguous with exactly
// the shape and dtype (numpy's equality) of params[index] and of the target, and the
// target a plain C-contiguous writeable numpy array: then the copy is what
// `targets[index][...] = grad` makes (a memmove, so overlap is copied as numpy does).
// Anything else (a None target: PowerSGD's or a GPU's; any gradient to refuse): false,
// nothing copied, and the caller takes its checked way. From Python the same tests and
// the assignment took some 0.2 us a gradient, a quarter of grad_ready's time at 1 KiB.
bool copy_gradient(py::handle params, py::handle targets, py::handle index, py::handle grad) {
  const auto& api = py::detail::npy_api::get();
  constexpr int kContiguous = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
  constexpr int kWriteable = py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  constexpr std::uint64_t kHasObject = 0x01;  // numpy's NPY_ITEM_HASOBJECT
  // From this size on the copy runs without the GIL, as numpy's own copies do: a big
  // gradient then holds up no other Python thread (a data loader's, say).
  constexpr size_t kWithoutGilBytes = 64 << 10;
  if (!PyList_CheckExact(params.ptr()) || !PyList_CheckExact(targets.ptr()) ||
      !PyLong_CheckExact(index.ptr()) || Py_TYPE(grad.ptr()) != api.PyArray_Type_)
    return false;
  const Py_ssize_t i = PyLong_AsSsize_t(index.ptr());
  if (i < 0 || i >= PyList_GET_SIZE(params.ptr()) || i >= PyList_GET_SIZE(targets.ptr())) {
    PyErr_Clear();  // (-1 with an error, for an int out of range)
    return false;
  }
  PyObject* p = PyList_GET_ITEM(params.ptr(), i);
  PyObject* t = PyList_GET_ITEM(targets.ptr(), i);
  if (!api.PyArray_Check_(p) || Py_TYPE(t) != api.PyArray_Type_) return false;
  const auto* g = py::detail::array_proxy(grad.ptr());
  const auto* to = py::detail::array_proxy(t);
  const auto* param = py::detail::array_proxy(p);
  if (!(g->flags & kContiguous) ||
      (to->flags & (kContiguous | kWriteable)) != (kContiguous | kWriteable))
    return false;
  if (g->nd != param->nd || g->nd != to->nd) return false;
  size_t elements = 1;
  for (int d = 0; d < g->nd; ++d) {
    if (g->dimensions[d] != param->dimensions[d] || g->dimensions[d] != to->dimensions[d])
      return false;
    elements *= static_cast<size_t>(g->dimensions[d]);
  }
  for (PyObject* other : {param->descr, to->descr})
    if (g->descr != other && !api.PyArray_EquivTypes_(g->descr, other)) return false;
  const auto target_dtype = py::reinterpret_borrow<py::dtype>(to->descr);
  if (target_dtype.flags() & kHasObject) return false;
  const size_t bytes = elements * static_cast<size_t>(target_dtype.itemsize());
  if (bytes >= kWithoutGilBytes) {
    WithoutGil nogil;
    copy_bytes(to->data, g->data, bytes);
  } else {
    copy_bytes(to->data, g->data, bytes);
  }
  return true;
}

// What this extension was compiled for, from the MPI headers: the family of MPI whose
// ABI it expects, and the size of its communicator handle (an int in MPICH's ABI, a
// pointer in Open MPI's). Asked before any MPI call: where mpi4py loaded another MPI
// (globally), this extension's MPI calls go to that library, with handles it cannot
// read; MPI_Get_library_version there names the loaded library, not the one built for.
py::tuple mpi_built_for() {
#if defined(OPEN_MPI)
  const char* family = "Open MPI";
#elif defined(MPICH_VERSION) || defined(MPICH)
  const char* family = "MPICH";
#else
  const char* family = "other";
#endif
  return py::make_tuple(family, static_cast<int>(sizeof(MPI_Comm)));
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(text, &len);
  return std::string(text, len);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  // pybind11 before 2.12 reads a dtype's itemsize at numpy 1's offset; under numpy 2 it
  // reads 0, and every size and overlap check with it. Refuse to load rather than reduce
  // the wrong bytes (setup.py refuses such a pybind11 too; this catches a stale build).
  if (py::dtype::of<double>().itemsize() != sizeof(double))
    throw py::import_error(
        "ringreduce._core was built with a pybind11 that cannot read this numpy's dtypes "
        "(itemsize of float64 reads " + std::to_string(py::dtype::of<double>().itemsize()) +
        "); rebuild it with pybind11>=2.12");
  pthread_atfork(nullptr, nullptr, [] { later_releases.after_fork_in_child(); });
  py::class_<StallTimer>(m, "StallTimer",
                         "How long a wait has gone without progress (csrc/waiting.h)")
      .def(py::init<double>(), py::arg("seconds"))
      .def(
          "expired",
          [](StallTimer& timer, py::object look_around) {
            return timer.expired([&] {
              if (!look_around.is_none()) look_around();
            });
          },
          py::arg("look_around") = py::none())
      .def("progressed", &StallTimer::progressed);
  py::enum_<Departure>(m, "Departure", "Why a rank left a communicator (csrc/waiting.h)")
      .value("GAVE_UP", Departure::GaveUp)
      .value("LEFT", Departure::Left)
      .value("FOLLOWED", Departure::Followed)
      .value("UNCLOSED", Departure::Unclosed)
      .value("ENDED", Departure::Ended)
      .value("VANISHED", Departure::Vanished);
  py::class_<DepartureNote>(m, "DepartureNote",
                            "What a rank that left tells the others (csrc/waiting.h)")
      .def(py::init([](int rank, Departure why, int64_t completed, int cause,
                       Departure cause_why) {
             return DepartureNote{rank, why, completed, cause, cause_why};
           }),
           py::arg("rank"), py::arg("why"), py::arg("completed"), py::arg("cause") = -1,
           py::arg("cause_why") = Departure::GaveUp)
      .def_readonly("rank", &DepartureNote::rank)
      .def_readonly("why", &DepartureNote::why)
      .def_readonly("completed", &DepartureNote::completed)
      .def_readonly("cause", &DepartureNote::cause)
      .def_readonly("cause_why", &DepartureNote::cause_why)
      .def("holds_up", &DepartureNote::holds_up)
      .def("prefer", &DepartureNote::prefer)
      .def("origin", &DepartureNote::origin)
      .def("text", &DepartureNote::text)
      .def(
          "timeout_kind",
          [](const DepartureNote& note) { return TimeoutError::kind_name(note.timeout().kind); },
          "the `_kind` of the CollectiveTimeoutError a wait raises on learning of it")
      .def("shm_word", &ShmChannel::departure_word)
      .def_static("from_shm_word", &ShmChannel::note_of_word);
  py::class_<WireTuner>(m, "WireTuner", "Which wire a ring call takes (csrc/wire_tuner.h)")
      .def(py::init<bool>(), py::arg("streaming") = true)
      .def("choose", &WireTuner::choose)
      .def("record", &WireTuner::record)
      .def_property_readonly("wires", &WireTuner::wires)
      .def_readonly_static("EXPLORE_EVERY", &WireTuner::kExploreEvery)
      .def_readonly_static("TURNS", &WireTuner::kTurns)
      .def_readonly_static("FAR_SLOWER", &WireTuner::kFarSlower)
      .def_readonly_static("MAX_BACK_OFF", &WireTuner::kMaxBackOff)
      .def("back_off", &WireTuner::back_off, py::arg("bytes"), py::arg("wire"),
           "the wire is looked at once in 2**back_off of its turns, for calls of bytes");
  m.attr("WIRE_SHM") = kWireShm;
  m.attr("WIRE_MPI") = kWireMpi;
  m.attr("WIRE_SHM_STREAMING") = kWireShmStreaming;
  m.attr("STREAMING_STORES") = kStreamingStores;
  m.def(
      "copy_streaming",
      [](py::array dst, py::array src) {  // tests: copy_streaming() on any two buffers
        if (!(dst.flags() & py::array::c_style) || !(src.flags() & py::array::c_style) ||
            !dst.writeable() || dst.nbytes() != src.nbytes())
          throw std::invalid_argument("copy_streaming: two C-contiguous arrays of as many bytes, "
                                      "the first writable");
        char* d = static_cast<char*>(dst.mutable_data());
        const char* s = static_cast<const char*>(src.data());
        const py::ssize_t n = dst.nbytes();
        if (ranges_overlap(d, n, s, n))
          throw std::invalid_argument("copy_streaming: the arrays overlap");
        copy_streaming(d, s, static_cast<size_t>(n));
      },
      py::arg("dst"), py::arg("src"));
  m.def("numpy_layout", &numpy_layout, py::arg("grads"),
        "bytes that differ where the arrays' dtypes or shapes do, if grads is a list of plain "
        "writeable numpy arrays of numpy's own dtypes (or ones equal to them); else None");
  m.def("pack_gradients", &pack_gradients, py::arg("grads"), py::arg("indices"),
        py::arg("flat"),
        "flat = grads[i] for i in indices, one after another, by memcpy, where every one is a "
        "C-contiguous numpy array of flat's dtype and flat has exactly their bytes; else "
        "False, nothing copied");
  m.def("unpack_gradients", &unpack_gradients, py::arg("flat"), py::arg("grads"),
        py::arg("indices"), "pack_gradients() the other way (every grads[i] writeable)");
  m.def("copy_gradient", &copy_gradient, py::arg("params"), py::arg("targets"),
        py::arg("index"), py::arg("grad"),
        "targets[index][...] = grad, by memmove, where index is an int in range and grad a "
        "plain C-contiguous numpy array of params[index]'s and the target's shape and dtype "
        "(the target a plain C-contiguous writeable one); else False, nothing copied");
  m.doc() = "ringreduce's C++ core: ring collectives over MPI (use the ringreduce package)";
  auto& mismatch = py::register_exception<MismatchError>(m, "MismatchError", PyExc_RuntimeError);
  // (After MismatchError's: the translator registered last is tried first.)
  static PyObject* checked_calls_mismatch =
      py::register_exception<CheckedCallsMismatch>(m, "CheckedCallsMismatch", mismatch).ptr();
  static PyObject* mismatch_error = mismatch.ptr();
  // The same types, with every rank's check as their `checks` (a list, by rank), where
  // the ranks' headers met (see MismatchError in errors.h).
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const MismatchError& mismatched) {
      if (mismatched.checks.empty()) throw;  // (to register_exception's translator)
      PyObject* type = dynamic_cast<const CheckedCallsMismatch*>(&mismatched)
                           ? checked_calls_mismatch : mismatch_error;
      py::object raised = py::reinterpret_borrow<py::object>(type)(mismatched.what());
      raised.attr("checks") = py::cast(mismatched.checks);
      PyErr_SetObject(type, raised.ptr());
    }
  });
  py::register_exception<MpiError>(m, "MPIError", PyExc_RuntimeError);
  py::register_exception<NoThreadError>(m, "NoThreadError", PyExc_RuntimeError);
  py::register_exception<OutOfMemoryError>(m, "OutOfMemoryError", PyExc_MemoryError);
  static PyObject* collective_timeout =
      py::register_exception<TimeoutError>(m, "CollectiveTimeoutError", PyExc_TimeoutError)
          .ptr();
  // The same type, with what it waited on as its `_kind` (see TimeoutError::Kind).
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const TimeoutError& timeout) {
      py::object raised =
          py::reinterpret_borrow<py::object>(collective_timeout)(timeout.what());
      raised.attr("_kind") = TimeoutError::kind_name(timeout.kind);
      PyErr_SetObject(collective_timeout, raised.ptr());
    }
  });
  // A call stopped by Ctrl-C raises KeyboardInterrupt on the main thread (Python's
  // handler runs now); anything else stopped raises RuntimeError.
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const StoppedError& stopped) {
      if (PyErr_CheckSignals() != 0) return;  // the handler's exception is set
      PyErr_SetString(PyExc_RuntimeError, stopped.what());
    }
  });
  chain_sigint_handler();
  this_process();  // (its handler registered now, not by a call racing a fork())
  m.def(
      "wait_until_no_thread_without_gil",
      [](double seconds) {
        py::gil_scoped_release nogil;  // (not counted: the caller's own)
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        while (threads_without_gil.load() > 0) {
          if (std::chrono::steady_clock::now() >= end) return false;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return true;
      },
      "at exit: waits (at most `seconds`) until no other thread is inside ringreduce without "
      "the GIL; whether none is");

  py::list dtypes, ops;
  for (int d = 0; d < kNumDTypes; ++d) dtypes.append(dtype_name(static_cast<DType>(d)));
  for (int o = 0; o < kNumOps; ++o) ops.append(op_name(static_cast<Op>(o)));
  m.attr("DTYPES") = dtypes;  // index = the core's dtype code
  m.attr("OPS") = ops;        // index = the core's op code
  py::dict collectives;
  for (Collective c : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                       Collective::Broadcast})
    collectives[collective_name(c)] = static_cast<int>(c);
  m.attr("COLLECTIVES") = collectives;
  m.attr("DEFAULT_CHUNK_BYTES") = RingCommunicator::kDefaultChunkBytes;
  m.attr("MAX_CHUNK_BYTES") = Transport::kMaxMessageBytes;
  m.attr("SHM_SLOT_BYTES") = RingCommunicator::kShmSlotBytes;
  m.attr("SHM_MAX_BYTES") = RingCommunicator::kShmMaxBytes;
  // Over MPI messages the all-gather, which only copies, takes chunks this many times
  // the reduce-scatter's (see RingCommunicator::copy_chunk_elems; ringreduce.sim models it).
  m.attr("COPY_CHUNK_FACTOR") = RingCommunicator::kCopyChunkFactor;
  m.def("mpi_built_for", &mpi_built_for,
        "(family of the MPI headers built against: 'MPICH', 'Open MPI' or 'other', "
        "sizeof(MPI_Comm)); calls no MPI");
  m.def("mpi_library_version", &mpi_library_version,
        "MPI_Get_library_version() of the MPI this extension was linked against");
  m.def("cuda_built", &cuda::built, "whether this build has CUDA kernels");
  m.def("cuda_device_count", &cuda::device_count, "usable GPUs (0 without driver or device)");
  m.def("cuda_status", &cuda::status, "why cuda_device_count() is what it is");
  m.def(
      "cuda_reduce",
      [](uintptr_t dst, uintptr_t a, uintptr_t b, int64_t n, int dtype, int op, uintptr_t stream) {
        WithoutGil nogil;
        cuda::reduce(DType(dtype), Op(op), reinterpret_cast<void*>(dst),
                     reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), n,
                     reinterpret_cast<void*>(stream));
        cuda::synchronize(reinterpret_cast<void*>(stream));
      },
      "dst = a OP b on the GPU (device pointers), for tests; waits for the stream");
  m.def(
      "cuda_divide",
      [](uintptr_t data, int64_t n, int dtype, int64_t divisor, uintptr_t stream) {
        WithoutGil nogil;
        cuda::divide(DType(dtype), reinterpret_cast<void*>(data), n, divisor,
                     reinterpret_cast<void*>(stream));
        cuda::synchronize(reinterpret_cast<void*>(stream));
      },
      "data /= divisor on the GPU (a device pointer), for tests; waits for the stream");
  m.def(
      "set_emulated_gpu_memory", [](int64_t bytes) { host_device_memory_limit = bytes; },
      "tests: the host emulation of a GPU refuses allocations larger than this");
  m.def(
      "set_emulated_copy_fault", [](int64_t n) { host_device_copy_fault = n; },
      "tests: the host emulation of a GPU fails its n-th copy from now (0: none)");
  m.def(
      "set_emulated_stall",
      [](int64_t n, double seconds, int64_t every) {
        host_device_stall = n;
        host_device_stall_s = seconds;
        host_device_stall_every = every;
      },
      py::arg("n"), py::arg("seconds"), py::arg("every") = 0,
      "tests: the host emulation of a GPU stalls its n-th copy or kernel from now (0: none), "
      "then every `every`-th (0: only that one)");
  m.def("process_ended", [](int pid) { return process_ended(static_cast<pid_t>(pid)); },
        py::arg("pid"),
        "tests: whether process pid has ended, as the shared-memory waits judge another "
        "rank's (gone, or a zombie not yet reaped)");
  m.def("set_shm_send_pause", &set_shm_send_pause, py::arg("seconds"),
        "tests: every chunk sent here over shared memory from now on waits this long (0: none)");
  m.def("set_shm_broadcast_pause", &set_shm_broadcast_pause, py::arg("seconds"),
        "tests: the next shared-memory broadcast here sleeps this long before its ring");
  m.def("set_creation_pause", &set_creation_pause, py::arg("step"), py::arg("seconds"),
        "tests: the next Communicator made here pauses before step `step` of its making "
        "after the duplicate (1: the agreement; 2, 3: the shared-memory wire's exchanges)");
  m.def("set_departure_notice_pause", &set_departure_notice_pause, py::arg("seconds"),
        "tests: the next departure notices this process sends over MPI messages wait this "
        "long first (0: none)");
  m.def("mpi_cuda_aware", &mpi_is_cuda_aware,
        "whether device pointers go to MPI directly (RINGREDUCE_CUDA_AWARE, else MPI's answer)");
  m.def("mpi_cuda_aware_reason", &mpi_cuda_aware_reason);
  m.def("op_supported", [](int dtype, int op) { return op_supported(DType(dtype), Op(op)); });

  m.def("set_flush_subnormals", &set_flush_subnormals, py::arg("on"),
        "this thread's flush-to-zero and denormals-are-zero on or off (x86-64); for tests");
  m.def("use_cpu_kernels", &use_cpu_kernels, py::arg("on"),
        "reduce with the loops chosen for this CPU (AVX2, F16C) or the baseline; for tests");
  m.def(
      "reduce",
      [](py::array out, py::array a, py::array b, int dtype, int op) {
        // (a test's entry: still, a strided or short view, or a code of wider elements,
        // would be read past its end)
        if (!is_valid_dtype(dtype) || !is_valid_op(op) ||
            dtype_size(DType(dtype)) != static_cast<size_t>(out.itemsize()))
          throw py::value_error("reduce: the dtype or op code does not fit the arrays");
        for (const py::array* array : {&out, &a, &b}) {
          if (!(array->flags() & py::array::c_style) || array->size() != out.size() ||
              array->itemsize() != out.itemsize()) {
            throw py::value_error("reduce: out, a and b must be C-contiguous, of one size "
                                  "and element size");
          }
        }
        void* dst = out.mutable_data();
        const void* pa = a.data();
        const void* pb = b.data();
        const int64_t n = out.size();
        WithoutGil nogil;
        reduce(DType(dtype), Op(op), dst, pa, pb, n);
      },
      "out = a OP b with the core's kernels (contiguous arrays of one size; the dtype is "
      "the caller's to check)");
  // (PowerSGD's: compression.py hands C-contiguous float32 or float64 arrays.)
  m.def(
      "low_rank_product",
      [](py::array out, py::array p, py::array q) {
        const bool f32 = py::isinstance<py::array_t<float>>(out);
        const bool same = f32 ? py::isinstance<py::array_t<float>>(p) &&
                                    py::isinstance<py::array_t<float>>(q)
                              : py::isinstance<py::array_t<double>>(out) &&
                                    py::isinstance<py::array_t<double>>(p) &&
                                    py::isinstance<py::array_t<double>>(q);
        if (!same || out.ndim() != 2 || p.ndim() != 2 || q.ndim() != 2 ||
            p.shape(0) != out.shape(0) || q.shape(0) != out.shape(1) ||
            p.shape(1) != q.shape(1) || p.shape(1) < 1 ||
            !(out.flags() & py::array::c_style) || !(p.flags() & py::array::c_style) ||
            !(q.flags() & py::array::c_style) || !out.writeable())
          throw py::value_error("low_rank_product: out (n x m), p (n x r) and q (m x r) must "
                                "be C-contiguous, of one dtype, float32 or float64, r >= 1");
        void* dst = out.mutable_data();
        const void* pp = p.data();
        const void* pq = q.data();
        const int64_t n = out.shape(0), m = out.shape(1), r = p.shape(1);
        WithoutGil nogil;
        low_rank_product(f32 ? DType::Float32 : DType::Float64, dst, pp, pq, n, m, r);
      },
      py::arg("out"), py::arg("p"), py::arg("q"),
      "out = p @ q.T, with the same bits on every CPU (csrc/lowrank.h)");
  m.def(
      "orthonormal_columns",
      [](py::array out, py::array p) {
        const bool f32 = py::isinstance<py::array_t<float>>(out);
        const bool same = f32 ? py::isinstance<py::array_t<float>>(p)
                              : py::isinstance<py::array_t<double>>(out) &&
                                    py::isinstance<py::array_t<double>>(p);
        if (!same || out.ndim() != 2 || p.ndim() != 2 || p.shape(0) != out.shape(0) ||
            p.shape(1) != out.shape(1) || p.shape(1) > p.shape(0) ||
            !(out.flags() & py::array::c_style) || !(p.flags() & py::array::c_style) ||
            !out.writeable() || out.data() == p.data())
          throw py::value_error("orthonormal_columns: out and p (n x r, r <= n) must be "
                                "C-contiguous, of one shape and dtype, float32 or float64, "
                                "and not the same array");
        void* dst = out.mutable_data();
        const void* pp = p.data();
        const int64_t n = p.shape(0), r = p.shape(1);
        WithoutGil nogil;
        orthonormal_columns(f32 ? DType::Float32 : DType::Float64, dst, pp, n, r);
      },
      py::arg("out"), py::arg("p"),
      "out = the Q of p's QR, with the same bits on every CPU (csrc/lowrank.h)");
  m.def(
      "divide",
      [](py::array data, int dtype, int64_t divisor) {
        void* p = data.mutable_data();
        const int64_t n = data.size();
        WithoutGil nogil;
        divide(DType(dtype), p, n, divisor);
      },
      "data /= divisor in place with the core's kernels");
  m.def("segment_of", [](int rank, int size, int64_t count) {
    const Span s = RingCommunicator::segment_of(rank, size, count);
    return py::make_tuple(s.offset, s.count);
  });

  // The schedule itself, for ringreduce.explain and ringreduce.sim: the same code that
  // decides what the core sends, so the explanations cannot drift from it.
  py::class_<RingSchedule>(m, "RingSchedule")
      .def(py::init([](int rank, int size, int64_t count, int64_t chunk_elems,
                       std::vector<int> ring) {
             return RingSchedule::split_evenly(rank, size, count, chunk_elems, std::move(ring));
           }),
           py::arg("rank"), py::arg("size"), py::arg("count"), py::arg("chunk_elems"),
           py::arg("ring") = std::vector<int>())
      .def_property_readonly("rank", &RingSchedule::rank)
      .def_property_readonly("size", &RingSchedule::size)
      .def_property_readonly("position", &RingSchedule::position)
      .def_property_readonly("left", &RingSchedule::left)
      .def_property_readonly("right", &RingSchedule::right)
      .def_property_readonly("steps_per_phase", &RingSchedule::steps_per_phase)
      .def_property_readonly("chunk_elems", &RingSchedule::chunk_elems)
      .def("segment", [](const RingSchedule& s, int seg) {
        const Span span = s.segment(seg);
        return py::make_tuple(span.offset, span.count);
      })
      .def("num_chunks", &RingSchedule::num_chunks)
      .def("chunk", [](const RingSchedule& s, int seg, int64_t c) {
        const Span span = s.chunk(seg, c);
        return py::make_tuple(span.offset, span.count);
      })
      .def("reduce_scatter_send_segment", &RingSchedule::reduce_scatter_send_segment)
      .def("reduce_scatter_recv_segment", &RingSchedule::reduce_scatter_recv_segment)
      .def("allgather_send_segment", &RingSchedule::allgather_send_segment)
      .def("allgather_recv_segment", &RingSchedule::allgather_recv_segment)
      // Every chunk one rank sends (or receives) in a phase, in the order the core moves
      // them: (step, segment, chunk) triples, for the pipeline's timeline in ringreduce.sim.
      .def("phase_chunks", [](const RingSchedule& s, const std::string& phase, bool sending) {
        if (phase != "reduce_scatter" && phase != "allgather")
          throw py::value_error("phase must be 'reduce_scatter' or 'allgather', got '" + phase +
                                "'");
        py::list chunks;
        for (const ChunkRef& c : s.phase_chunks(
                 phase == "reduce_scatter" ? Phase::ReduceScatter : Phase::AllGather, sending))
          chunks.append(py::make_tuple(c.step, c.segment, c.chunk));
        return chunks;
      }, py::arg("phase"), py::arg("sending"));

  m.def("note_process_ending", &note_process_ending,
        "an uncaught exception is ending this process: every Communicator left from now "
        "on says so (Departure::Ended)");
  m.def(
      "note_dropped_error", [](std::string text) { dropped_errors.note(std::move(text)); },
      py::arg("text"), "an asynchronous call's error, lost with its dropped Handle (Python's)");
  m.def("dropped_errors_pending", [] { return dropped_errors.pending(); });
  m.def("take_dropped_errors", [] { return dropped_errors.take(); },
        "(how many errors were lost with dropped Handles, the first few); forgets them");
  m.def("hold_dropped_errors", [] { dropped_errors.hold_for_fork(); },
        py::call_guard<py::gil_scoped_release>(),
        "before fork(): holds the dropped errors' lock, which a thread may hold a moment");
  m.def("release_dropped_errors", [] { dropped_errors.release_after_fork(); },
        "after fork(), in parent and child: the lock hold_dropped_errors() took");
  m.def("stop_creations_on_other_threads", &stop_creations_on_other_threads, py::arg("why"),
        "stops the Communicators being made on other threads, now or later, at their next "
        "wait (RuntimeError there, giving why): at exit, for daemon threads, and at "
        "MPI.Finalize()");

  m.def("finish_abandoned_duplicates", [] {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized) finish_abandoned_duplicates();
  }, "completes what creations that gave up left pending, where late ranks came since");
  m.def("unfreed_duplicate_count", &unfreed_duplicate_count,
        "how many duplicates this process leaves to MPI_Finalize (the count the "
        "out-of-communicators hint names); for tests");

  py::class_<RunningLock, std::shared_ptr<RunningLock>>(
      m, "RunningLock", "held while the core runs a collective (csrc/call_queue.h); an RLock's API")
      .def(py::init<>())
      .def("acquire", &acquire_running, py::arg("blocking") = true,
           py::arg("timeout") = std::optional<double>())
      .def("release",
           [](RunningLock& lock) {
             if (!lock.held_here()) throw std::runtime_error("cannot release un-acquired lock");
             lock.unlock();
           })
      .def("held_by_a_caller", &RunningLock::held_by_a_caller,
           "whether a thread other than the worker holds it (running a blocking call)")
      .def("__enter__", [](RunningLock& lock) { acquire_running(lock, true, std::nullopt); })
      .def("__exit__", [](RunningLock& lock, py::args) {
        lock.unlock();
        return false;
      });
  py::class_<Executor>(m, "Executor",
                       "the worker thread of a Communicator's asynchronous calls (csrc/call_queue.h)")
      .def(py::init<std::shared_ptr<RunningLock>>(), py::arg("running") = nullptr,
           "running: a RunningLock shared with other executors (none: one of its own)")
      .def("push", &Executor::push, py::arg("work"), py::arg("anywhere") = false,
           "queue a _Work, whose execute() the worker runs with the GIL (anywhere: or a "
           "caller's wait(), in its own thread)")
      .def("pending", &Executor::pending)
      .def("unfinished", &Executor::unfinished)
      .def("refuse_calls", &Executor::refuse_calls, py::arg("refused"))
      .def("refusing", &Executor::refusing)
      .def_property_readonly("started", &Executor::started)
      .def_property_readonly("run_by_callers", &Executor::run_by_callers,
                             "calls that a caller's wait() ran in its own thread")
      .def_property_readonly("turns_unwoken", &Executor::turns_unwoken,
                             "calls queued without waking a worker that was taking its turn")
      .def("hold_worker", &Executor::hold_worker, py::arg("held"),
           "for tests: while held, the worker starts no call")
      .def("drain", &Executor::drain, "wait until nothing is queued")
      .def("cancel", &Executor::cancel, "calls queued, not started, raise error instead")
      .def("stop", &Executor::stop, "let queued calls run, then end the worker thread")
      .def("stop_later", &Executor::stop_later,
           "the worker thread ends once the queued calls have run; returns at once")
      .def("helping_here", &Executor::helping_here,
           "whether this thread is inside a queued call it runs for its wait() (a signal "
           "handler's Python, in the middle of the Python layer's call)")
      .def_property_readonly("detached_alive", &Executor::detached_alive,
                             "whether a thread stop_later() left is still running")
      .def_property_readonly("running", &Executor::running);
  py::class_<QueuedPythonCall>(m, "QueuedPythonCall", "a _Work's place in its queue")
      .def("run_here", &QueuedPythonCall::run_here,
           "run it, and the calls before it, in this thread, where that may be; whether it ran")
      .def("wake_worker", &QueuedPythonCall::wake_worker);
  py::class_<AsyncCall, std::shared_ptr<AsyncCall>>(
      m, "AsyncCall", "a collective of host arrays queued on the worker thread")
      .def("done", &AsyncCall::done)
      .def("wait", &AsyncCall::wait, py::arg("seconds") = std::optional<double>())
      .def("outcome", &AsyncCall::outcome)
      .def_property_readonly("interrupt_raised", &AsyncCall::interrupt_raised)
      .def_property_readonly("pid", &AsyncCall::pid);

  py::class_<FastPath>(m, "FastPath",
                      "the common case of each collective without Python (None: not taken)")
      .def(py::init<py::object, py::object, bool, py::dict, py::tuple, py::dict, py::object,
                    py::object, py::object, int64_t, int64_t, int64_t>())
      .def_readwrite("chunk_bytes", &FastPath::chunk_bytes)
      .def("allreduce", &FastPath::allreduce, py::arg("x"), py::arg("op"), py::arg("out"),
           py::arg("check") = 0)
      .def("allreduce_async", &FastPath::allreduce_async, py::arg("x"), py::arg("op"),
           py::arg("out"), py::arg("check") = py::none())
      .def("reduce_scatter", &FastPath::reduce_scatter)
      .def("reduce_scatter_async", &FastPath::reduce_scatter_async)
      .def("allgather", &FastPath::allgather)
      .def("allgather_async", &FastPath::allgather_async)
      .def("broadcast", &FastPath::broadcast)
      .def("broadcast_async", &FastPath::broadcast_async);

  py::class_<RingCommunicator>(m, "RingCommunicator")
      .def(py::init([](uintptr_t comm_address, double timeout_s, const std::string& refusal) {
             const MPI_Comm comm = comm_from_address(comm_address);
             chain_sigint_handler();  // again, if Python's handler was replaced since
             WithoutGil nogil;  // it may wait for the other ranks
             return new RingCommunicator(comm, timeout_s, &sigints, refusal);
           }),
           py::arg("comm_address"), py::arg("timeout_s"), py::arg("refusal") = "",
           "collective; refusal: this rank's bad argument, which makes every rank raise "
           "ValueError (see MpiTransport)")
      .def_property_readonly("rank", &RingCommunicator::rank)
      .def_property_readonly("size", &RingCommunicator::size)
      .def_property_readonly("closed", &RingCommunicator::closed)
      .def_property_readonly("departed", &RingCommunicator::departed)
      .def_property("timeout", &RingCommunicator::timeout, &RingCommunicator::set_timeout,
                    "seconds a call waits on another rank before raising (<= 0: forever)")
      .def_property_readonly("transport", &RingCommunicator::transport_name)
      .def_property_readonly("transport_reason", [](const RingCommunicator& ring) {
        // (Host names, cut at 64 bytes: maybe inside a character of a pretended one.)
        const std::string& why = ring.transport_reason();
        return py::reinterpret_steal<py::str>(
            PyUnicode_DecodeUTF8(why.data(), static_cast<Py_ssize_t>(why.size()), "replace"));
      })
      .def_property_readonly("ring_order", &RingCommunicator::ring_order)
      .def_property_readonly("ring_bytes_sent", &RingCommunicator::ring_bytes_sent)
      .def_property_readonly("ring_steps", &RingCommunicator::ring_steps)
      .def_property_readonly("exchanges", &RingCommunicator::exchanges,
                             "header exchanges begun (each call has one; a confirmation is one)")
      .def_property_readonly("device_calls_on_host",
                             &RingCommunicator::device_calls_on_host)
      .def_property_readonly("inline_capacity", &RingCommunicator::inline_capacity)
      .def_property_readonly("broadcast_inline_capacity",
                             &RingCommunicator::broadcast_inline_capacity)
      // Every rank must set the same (tests and benchmarks; see ring_communicator.h).
      .def_property("device_host_reduce_bytes", &RingCommunicator::device_host_reduce_bytes,
                    &RingCommunicator::set_device_host_reduce_bytes)
      .def_readonly_static("DEVICE_HOST_REDUCE_BYTES", &RingCommunicator::kDeviceHostReduceBytes)
      .def_property_readonly("shm_bytes_sent", &RingCommunicator::shm_bytes_sent)
      .def_property_readonly("shm_streaming", &RingCommunicator::shm_streaming)
      .def("record_wire_time",
           [](RingCommunicator& self, int collective, int64_t bytes, py::object wire,
              double seconds) {
             if (collective < 1 || collective > 4)
               throw std::invalid_argument("record_wire_time: no such collective");
             // (A bool was the old argument, shared memory or not: True would now be MPI.)
             const int w = PyBool_Check(wire.ptr()) ? -1 : wire.cast<int>();
             if (w < 0 || w > kWireShmStreaming)
               throw std::invalid_argument("record_wire_time: wire must be one of WIRE_SHM, "
                                           "WIRE_MPI, WIRE_SHM_STREAMING");
             self.record_wire_time(Collective(collective), bytes, w, seconds);
           })
      .def("allreduce",
           [](RingCommunicator& self, py::array x, py::array out, int dtype, int op,
              int64_t chunk_bytes, int64_t check) {
             const void* in = x.data();
             void* dst = out.mutable_data();
             const int64_t n = x.size();
             keeping_on_departure(self, {x, out}, [&] {
               self.allreduce(in, dst, n, DType(dtype), Op(op), chunk_bytes, check);
             });
           },
           py::arg("x"), py::arg("out"), py::arg("dtype"), py::arg("op"),
           py::arg("chunk_bytes"), py::arg("check") = 0)
      .def("reduce_scatter",
           [](RingCommunicator& self, py::array x, py::array work, int dtype, int op,
              int64_t chunk_bytes, std::optional<py::array> out) {
             const int64_t n = x.size();
             const int64_t bytes = n * static_cast<int64_t>(dtype_size(DType(dtype)));
             const int64_t own_bytes = RingCommunicator::segment_of(self.rank(), self.size(), n)
                                           .count * static_cast<int64_t>(x.itemsize());
             // The ring uses all of work; a call small enough for the header exchange
             // writes only out.
             const bool inline_call = out && self.rides_inline(bytes);
             check_buffer(self,
                          x.nbytes() == bytes && (inline_call || work.nbytes() >= bytes) &&
                              (!out || out->nbytes() >= own_bytes),
                          Collective::ReduceScatter, chunk_bytes,
                          "x, work or out does not hold the elements the call needs");
             const void* in = x.data();
             void* dst = work.mutable_data();
             void* own = out ? out->mutable_data() : nullptr;
             keeping_on_departure(self, {x, work, out ? py::handle(*out) : py::handle()}, [&] {
               self.reduce_scatter(in, dst, n, DType(dtype), Op(op), chunk_bytes, own);
             });
           },
           py::arg("x"), py::arg("work"), py::arg("dtype"), py::arg("op"),
           py::arg("chunk_bytes"), py::arg("out") = py::none(),
           "out, if given, receives this rank's block (else it stays in work)")
      .def("allgather_counts",
           [](RingCommunicator& self, int64_t rows, int64_t row_elems, int64_t shape_tag,
              int dtype, int64_t chunk_bytes, int64_t out_rows, bool device,
              std::optional<py::array> x) {
             // x: this rank's rows (a contiguous host array), sent along if small enough.
             if (x)
               check_buffer(self,
                            x->nbytes() == rows * row_elems *
                                               static_cast<int64_t>(dtype_size(DType(dtype))),
                            Collective::AllGather, chunk_bytes, "x does not hold its rows");
             const void* rows_data = x ? x->data() : nullptr;
             return keeping_on_departure(self, {x ? py::handle(*x) : py::handle()}, [&] {
               return self.allgather_counts(rows, row_elems, shape_tag, DType(dtype),
                                            chunk_bytes, device ? kDeviceMemory : kHostMemory,
                                            out_rows, rows_data);
             });
           },
           py::arg("rows"), py::arg("row_elems"), py::arg("shape_tag"), py::arg("dtype"),
           py::arg("chunk_bytes"), py::arg("out_rows") = -1, py::arg("device") = false,
           py::arg("x") = py::none())
      .def_property_readonly("allgather_results_held",
                             &RingCommunicator::allgather_results_held,
                             "whether every rank held a result of the right size (out=, or "
                             "a right guess) before the allgather whose counts were just "
                             "exchanged")
      .def("allgather_confirm",
           [](RingCommunicator& self, bool ok, int64_t out_bytes) {
             WithoutGil nogil;
             self.allgather_confirm(ok, out_bytes);
           })
      .def("allgather_abandon",
           [](RingCommunicator& self, const std::string& why) {
             WithoutGil nogil;
             self.allgather_abandon(why);
           })
      .def("allgather",
           [](RingCommunicator& self, py::array x, py::array out,
              const std::vector<int64_t>& row_counts, int64_t row_elems, int dtype) {
             const void* in = x.data();
             void* dst = out.mutable_data();
             keeping_on_departure(self, {x, out}, [&] {
               self.allgather(in, dst, row_counts, row_elems, DType(dtype));
             });
           })
      .def("broadcast",
           [](RingCommunicator& self, py::array buf, int dtype, int root, int64_t chunk_bytes) {
             // The root only reads its buffer, which may be read-only; the Python layer
             // has checked that every other rank's buffer is writeable.
             void* p = const_cast<void*>(buf.data());
             const int64_t n = buf.size();
             keeping_on_departure(self, {buf},
                                  [&] { self.broadcast(p, n, DType(dtype), root, chunk_bytes); });
           })
      .def("announce_invalid",
           [](RingCommunicator& self, int collective, int64_t chunk_bytes, bool device,
              bool failed) {
             WithoutGil nogil;
             self.announce_invalid(Collective(collective), chunk_bytes,
                                   device ? kDeviceMemory : kHostMemory,
                                   failed ? CallHeader::kFailed : CallHeader::kRejected);
           },
           py::arg("collective"), py::arg("chunk_bytes"), py::arg("device") = false,
           py::arg("failed") = false,
           "this rank's part in the header exchange of a call it rejected (failed: failed "
           "to prepare), before it raises its own error")
      // Device buffers, as addresses (cupy's data.ptr). Every one of these takes the
      // same five arguments ordinal, ready, stream, direct, emulate (allreduce_device's
      // check after them): see device_call() above.
      .def("allreduce_device",
           [](RingCommunicator& self, uintptr_t in, uintptr_t out, int64_t count, int dtype,
              int op, int64_t chunk_bytes, int ordinal, uintptr_t ready, uintptr_t stream,
              bool direct, bool emulate, int64_t check) {
             WithoutGil nogil;
             self.allreduce_device(device_call(self, ordinal, ready, stream, direct, emulate),
                                   ptr<const void>(in), ptr<void>(out), count, DType(dtype),
                                   Op(op), chunk_bytes, check);
           },
           py::arg("input"), py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("chunk_bytes"), py::arg("ordinal"), py::arg("ready"), py::arg("stream"),
           py::arg("direct"), py::arg("emulate"), py::arg("check") = 0)
      .def("reduce_scatter_device",
           [](RingCommunicator& self, uintptr_t in, uintptr_t work, int64_t count, int dtype,
              int op, int64_t chunk_bytes, int ordinal, uintptr_t ready, uintptr_t stream,
              bool direct, bool emulate) {
             WithoutGil nogil;
             self.reduce_scatter_device(
                 device_call(self, ordinal, ready, stream, direct, emulate), ptr<const void>(in),
                 ptr<void>(work), count, DType(dtype), Op(op), chunk_bytes);
           })
      .def("reserve_staging",
           [](RingCommunicator& self, int64_t bytes, int ordinal, uintptr_t ready,
              uintptr_t stream, bool direct, bool emulate) {
             WithoutGil nogil;
             self.reserve_staging(device_call(self, ordinal, ready, stream, direct, emulate),
                                  bytes);
           })
      .def("allgather_device",
           [](RingCommunicator& self, uintptr_t in, uintptr_t out,
              const std::vector<int64_t>& row_counts, int64_t row_elems, int dtype, bool out_ready,
              int ordinal, uintptr_t ready, uintptr_t stream, bool direct, bool emulate) {
             WithoutGil nogil;
             self.allgather_device(device_call(self, ordinal, ready, stream, direct, emulate),
                                   ptr<const void>(in), ptr<void>(out), row_counts, row_elems,
                                   DType(dtype), out_ready);
           })
      .def("broadcast_device",
           [](RingCommunicator& self, uintptr_t buf, int64_t count, int dtype, int root,
              int64_t chunk_bytes, int ordinal, uintptr_t ready, uintptr_t stream, bool direct,
              bool emulate) {
             WithoutGil nogil;
             self.broadcast_device(device_call(self, ordinal, ready, stream, direct, emulate),
                                   ptr<void>(buf), count, DType(dtype), root, chunk_bytes);
           })
      .def_property_readonly("device_name", [](RingCommunicator& self) {
        return std::string(self.device_name());
      })
      .def("close",
           [](RingCommunicator& self) {
             WithoutGil nogil;
             self.close();
           })
      .def("leave", &RingCommunicator::leave, py::arg("over_mpi") = true,
           "stop using it on this rank only, and tell the others (see ring_communicator.h)")
      .def("tell_departure", &RingCommunicator::tell_departure,
           "after leave(over_mpi=False), at exit: tell the ranks over MPI messages too")
      .def("release_scratch", &RingCommunicator::release_scratch,
           "free the ring's receive slots (a dropped communicator kept for its close)")
      .def("begin_close_at_exit", &RingCommunicator::begin_close_at_exit,
           "at a normal exit (or when dropped unclosed, under MPI_THREAD_MULTIPLE): "
           "on shared memory, stop using it and tell the others; over MPI messages, start "
           "a close with the others that a rank waiting in a call this one never made "
           "meets (then it raises); true if finish_close_at_exit() must follow")
      .def("finish_close_at_exit", &RingCommunicator::finish_close_at_exit,
           "true once the close at exit begun is over (it waits for nothing)")
      .def("stop_soon", &RingCommunicator::stop_soon, py::arg("why") = "",
           "from any thread: the call in flight stops at its next wait, and this rank leaves "
           "(why: the reason its error gives)");
}
