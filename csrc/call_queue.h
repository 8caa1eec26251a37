// The worker thread behind asynchronous calls: one per communicator, running calls one
// after another in the order they were queued, so that every rank runs its collectives
// in the same order, as MPI requires.
//
// Why in C++: a Python worker thread needs the GIL before and after every call. While
// the caller is busy in Python (the rest of the backward pass, say), it holds the GIL
// for up to its switch interval (5 ms) at a time, and each handoff costs some 30 us more
// on a busy machine; meanwhile the other ranks wait in the ring. Here a call on host
// arrays runs from queue to completion without the GIL; only calls the Python layer
// queues as Python (GPU arrays, the general path) take it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace ringreduce {

// push() could not start the worker thread (the process's limit on threads, say): the
// call was not queued.
class NoThreadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Held while the core runs a collective, by the worker or by a caller that runs one in
// its own thread (when nothing is queued): the core runs one call at a time. Reentrant
// for its thread, as a signal handler may close a communicator while its thread holds
// it; it knows its holder, so that a release by another thread can be refused.
class RunningLock {
 public:
  bool try_lock() { return note(mutex_.try_lock()); }
  bool try_lock_for(double seconds) {
    return note(mutex_.try_lock_for(std::chrono::duration<double>(seconds)));
  }
  void lock() { note((mutex_.lock(), true)); }
  void unlock() {  // (only by its holder)
    if (--depth_ == 0) holder_.store(std::thread::id());
    mutex_.unlock();
  }
  bool held_here() const { return holder_.load() == std::this_thread::get_id(); }
  // Whether a thread other than a CallQueue's worker holds it: one running a blocking
  // call (at exit, only a daemon thread can).
  bool held_by_a_caller() const {
    return holder_.load() != std::thread::id() && !worker_holds_.load();
  }

 private:
  bool note(bool locked);  // (after CallQueue, whose worker it tells apart)
  std::recursive_timed_mutex mutex_;
  std::atomic<std::thread::id> holder_{};
  std::atomic<bool> worker_holds_{false};
  int depth_ = 0;  // (changed only by the holder, under mutex_)
};

// getpid() without its system call (glibc stopped caching it in 2.25), which every
// asynchronous call would make two or three of (some 70 ns each) to tell a child made by
// fork() from its parent. Renewed in such a child by a pthread_atfork() handler.
pid_t this_process();

class CallQueue {
 public:
  class Call {
   public:
    virtual ~Call() = default;
    // On the worker thread (or a waiting caller's: run_here()), holding running(). It
    // throws nothing: an error is the call's own, for whoever waits for it.
    virtual void run() = 0;
    // After run(), once the running lock is let go: tells whoever waits for it that it
    // is over. Where the waiter shares a core with the worker, it usually runs as soon
    // as it is woken; woken while the worker still held the lock, a blocking call it
    // then made (the loss after the gradients) slept until the worker let go: two
    // context switches more.
    virtual void announce() {}
    // Whether a caller waiting for it may run it in its own thread (run_here()): it
    // needs nothing of the worker's (a call that takes the GIL keeps the worker's
    // Python thread state, so it does not).
    virtual bool runs_anywhere() const { return false; }
    // Whether its run() takes Python's GIL (a call the Python layer queued).
    virtual bool takes_the_gil() const { return false; }
    // Whether its run() is over and announced (thread-safe): a caller that waited for
    // it may go on before the worker has taken it off the queue (see unfinished()).
    virtual bool finished() const { return false; }
  };

  // What the worker thread uses, which it keeps alive until it ends.
  struct State {
    std::mutex mutex;
    std::condition_variable changed;  // a call left the queue (for wait_idle())
    std::condition_variable work;     // for the worker: a call to run, or stop
    bool helping = false;             // a caller runs queued calls (run_here())
    std::thread::id helper;           // which (while helping)
    int64_t run_by_callers = 0;       // calls run_here() ran
    int64_t turns_unwoken = 0;        // calls push() queued without waking the worker
    bool worker_held = false;         // (hold_worker())
    bool worker_waits_for_caller = false;  // to be woken when run_here() ends
    bool worker_takes_a_turn = false;      // looks again within a turn (loop())
    bool caller_ran_calls = false;         // since the worker last took one (loop())
    bool worker_called = false;  // by wake_worker(), or a call only it may run: no turn
    std::deque<std::shared_ptr<Call>> queue;  // the front one is running, or next
    bool front_started = false;
    bool stopping = false;
    bool refusing = false;  // (refuse_calls())
    bool detached = false;  // no stop() joins the stopping thread (see stop())
    int detached_alive = 0;  // detached threads that have not ended yet
    std::unique_ptr<std::thread> thread;
    std::atomic<pid_t> owner{0};  // the process the thread runs in
    bool forgotten = false;       // (in a child made by fork(): see stop())
    std::function<void()> thread_end;
    std::shared_ptr<RunningLock> running = std::make_shared<RunningLock>();
  };

  // thread_end: run by the worker thread as it ends (its last use of anything).
  // running: the lock to hold while a call runs, if shared with other queues (none:
  // one of its own).
  explicit CallQueue(std::function<void()> thread_end = nullptr,
                     std::shared_ptr<RunningLock> running = nullptr)
      : state_(std::make_shared<State>()) {
    state_->thread_end = std::move(thread_end);
    if (running) state_->running = std::move(running);
  }
  ~CallQueue() { stop(); }
  CallQueue(const CallQueue&) = delete;
  CallQueue& operator=(const CallQueue&) = delete;

  // Queues call after those queued before, and starts the worker thread if it is not
  // running; unless refuse_calls(true) came first: then queues nothing, and says so.
  // Throws NoThreadError, queueing nothing, where no thread can be made.
  bool push(std::shared_ptr<Call> call);
  // While refused, push() queues nothing; the calls queued before still run. For a
  // communicator being closed: a call that another thread makes meanwhile, and that
  // got past the Python layer's own check just before the close began, must raise then,
  // not run after the calls in flight were drained (into the close's exchange) or on a
  // freed communicator (raising only at its wait).
  void refuse_calls(bool refused);
  bool refusing() const;
  // Calls in the queue (the one running among them, and one whose run() is over that
  // the worker has not taken off yet).
  int64_t pending() const;
  // Calls in the queue whose run() is not over. The worker takes a call off the queue
  // only after its run() has told its waiter so; where the two threads share a core,
  // the waiter often runs first, and the worker does so only at its next time slice,
  // some 7-9 ms later here: a caller that waited for every call it made, and would run
  // its next one at once, in its own thread, asks this, not pending().
  int64_t unfinished() const;
  bool started() const;
  // Waits until nothing is pending, for at most `seconds`; whether nothing is.
  bool wait_idle(double seconds) const;
  // f(call) for each queued call that has not started (under the queue's lock: f must not
  // wait for the worker).
  void for_each_waiting(const std::function<void(Call&)>& f);
  // Lets the queued calls run, then ends the worker thread (push() starts a new one).
  // With wait=false, or called by the worker itself (a call that drops the last
  // reference to its communicator) or by a caller inside a call it runs for the worker
  // (helping_here(): a signal handler's close()), it returns at once, and the thread ends after the
  // queue is empty (detached_alive() until then): a communicator dropped with calls in
  // flight must not wait for them, as they may wait for ranks that wait for what this
  // thread does next. In a child made by fork(), where the thread does not exist, it
  // touches nothing.
  void stop(bool wait = true);
  // Whether a thread that stop() left to end on its own is still running.
  bool detached_alive() const;
  // Whether this thread is running queued calls (run_here()), and so inside one of them
  // (a signal handler's Python, run in the middle of a call of the Python layer's): the
  // queue cannot empty before it returns, nor the worker take over; stop() then leaves
  // the worker to end on its own.
  bool helping_here() const;
  const std::shared_ptr<RunningLock>& running() const { return state_->running; }

  // For a caller about to wait for `target`: if the worker has not started the call at
  // the front, and every call up to `target` runs_anywhere(), runs them in this thread,
  // in order, the worker standing by, unless stop() says so before one. Whether it ran
  // `target`. Never the calls queued after it: one of those may wait for ranks that wait
  // for what this thread does once `target` is done.
  //
  // Why: where a rank has one core, the worker and the caller share it, and every call
  // handed from one thread to the other costs two context switches (some 15 us a call
  // here); a caller that would only sleep until the worker is done does the work itself.
  // Where the worker has a core of its own it has taken the call long before.
  static bool run_here(const std::weak_ptr<State>& queue, const Call& target,
                       const std::function<bool()>& stop);
  // For a caller about to wait for a call that it leaves to the worker: wakes a worker
  // taking its turn (push() did not, for a call a caller may run).
  static void wake_worker(const std::weak_ptr<State>& queue);
  std::weak_ptr<State> state() const { return state_; }
  // How many calls callers ran (run_here()).
  int64_t run_by_callers() const;
  // How many calls push() queued without waking the worker (it was taking its turn).
  int64_t turns_unwoken() const;
  // For tests: while held, the worker starts no call (those waited for run in their
  // callers' threads; the others wait).
  void hold_worker(bool held);
  // Whether this thread is a CallQueue's worker (which holds no GIL but when a call
  // takes it).
  static bool on_worker_thread();

 private:
  // How long the worker lets a caller's run_here() go on before it asks to be woken
  // at its end (see loop()): the most that a call queued behind those the caller ran,
  // or queued meanwhile for a caller to run (see push()), waits for the worker.
  static constexpr std::chrono::microseconds kCallerTurn{200};
  // How long the worker leaves a call that takes the GIL to a caller that has just run
  // calls itself (see loop()): longer, so that a caller running one such call after
  // another, some 100 us each, does so with the worker asleep throughout.
  static constexpr std::chrono::microseconds kGilCallerTurn{2000};
  static void start(const std::shared_ptr<State>& state);  // (under its mutex)
  static void loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
};

inline bool RunningLock::note(bool locked) {
  if (locked && depth_++ == 0) {
    worker_holds_.store(CallQueue::on_worker_thread());
    holder_.store(std::this_thread::get_id());
  }
  return locked;
}

}  // namespace ringreduce
