#include "call_queue.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <system_error>

namespace ringreduce {

namespace {
thread_local bool worker_thread = false;

// Runs a call that the queue marked started, then tells its waiters, once the lock is
// let go (see Call::announce()). noexcept: if it threw (a call's run() keeps its errors;
// a lock that cannot be taken), the queue would keep that mark for good and wait for
// nothing, where this ends the process.
void run_holding(RunningLock& running, CallQueue::Call& call) noexcept {
  {
    std::lock_guard<RunningLock> hold(running);
    call.run();
  }
  call.announce();
}
// Whether this thread runs queued calls (run_here()), and so is inside one of them.
// (Under s.mutex.)
bool helped_by_this_thread(const CallQueue::State& s) {
  return s.helping && s.helper == std::this_thread::get_id();
}
}  // namespace

pid_t this_process() {
  static std::atomic<pid_t> cached{0};
  pid_t pid = cached.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  static std::once_flag registered;
  std::call_once(registered, [] {
    pthread_atfork(nullptr, nullptr, [] { cached.store(getpid(), std::memory_order_relaxed); });
  });
  pid = getpid();
  cached.store(pid, std::memory_order_relaxed);
  return pid;
}

bool CallQueue::on_worker_thread() { return worker_thread; }

bool CallQueue::push(std::shared_ptr<Call> call) {
  State& s = *state_;
  bool wake = true;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.refusing) return false;
    // A worker taking its turn (see loop()) looks again within kCallerTurn: a call that
    // a caller may run itself (run_here()), which a caller about to wait for it does at
    // once, need not wake it first. Waking it for each such call cost two context
    // switches a call, where the two threads share a core (13-16 us against 3.3-3.7 us
    // for an 8-byte call and its wait on 2 ranks).
    wake = !(s.worker_takes_a_turn && call->runs_anywhere());
    if (!wake) ++s.turns_unwoken;
    if (!call->runs_anywhere()) s.worker_called = true;  // (a call only it may run)
    s.queue.push_back(std::move(call));
    // (While stop() waits, its thread runs this call before it ends; once that thread
    // has found the queue empty, it has cleared `stopping`, and a new one starts here.)
    if (s.thread == nullptr && !s.stopping) {
      try {
        start(state_);
      } catch (const std::system_error& error) {  // the call must not run later either
        s.queue.pop_back();
        throw NoThreadError(std::string("could not start ringreduce's worker thread (") +
                            error.what() + ")");
      } catch (...) {  // (std::bad_alloc)
        s.queue.pop_back();
        throw;
      }
    }
  }
  if (wake) s.work.notify_all();
  return true;
}

void CallQueue::refuse_calls(bool refused) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->refusing = refused;
}

bool CallQueue::refusing() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->refusing;
}

void CallQueue::wake_worker(const std::weak_ptr<State>& queue) {
  const std::shared_ptr<State> state = queue.lock();
  if (state == nullptr) return;
  State& s = *state;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.worker_called = true;  // (also for a turn about to begin: see loop())
    if (!s.worker_takes_a_turn) return;
  }
  s.work.notify_all();
}

void CallQueue::start(const std::shared_ptr<State>& state) {
  state->owner = this_process();
  state->thread = std::make_unique<std::thread>([state] { loop(state); });
}

bool CallQueue::started() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->thread != nullptr;
}

bool CallQueue::helping_here() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return helped_by_this_thread(*state_);
}

bool CallQueue::detached_alive() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->detached_alive > 0;
}

int64_t CallQueue::pending() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->queue.size());
}

int64_t CallQueue::unfinished() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto& queue = state_->queue;
  // (In order: only the front one can have run.)
  const bool front_over = state_->front_started && queue.front()->finished();
  return static_cast<int64_t>(queue.size()) - (front_over ? 1 : 0);
}

bool CallQueue::wait_idle(double seconds) const {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  return s.changed.wait_for(lock, std::chrono::duration<double>(seconds),
                            [&] { return s.queue.empty(); });
}

void CallQueue::for_each_waiting(const std::function<void(Call&)>& f) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  for (size_t i = s.front_started ? 1 : 0; i < s.queue.size(); ++i) f(*s.queue[i]);
}

void CallQueue::stop(bool wait) {
  State& s = *state_;
  const pid_t owner = s.owner.load();
  if (owner != 0 && owner != this_process()) {
    // A child made by fork(), where only the forking thread lives on: the worker is
    // the parent's, and its lock and condition may be as that thread left them (held,
    // or waited on, which would make destroying them wait for good). So the State is
    // never freed here.
    if (!s.forgotten) {
      s.forgotten = true;
      (void)s.thread.release();
      new std::shared_ptr<State>(state_);  // (leaked on purpose)
    }
    return;
  }
  std::unique_ptr<std::thread> thread;
  bool detach = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.thread == nullptr || s.stopping) return;
    s.stopping = true;
    thread = std::move(s.thread);
    // Marked together with `stopping`: a worker that finds the queue empty the moment
    // the lock is let go must see that no stop() will join it (and clear the flags).
    // (The worker waits for a helping caller: that one cannot wait for it.)
    detach = !wait || thread->get_id() == std::this_thread::get_id() ||
             helped_by_this_thread(s);
    if (detach) {
      s.detached = true;
      ++s.detached_alive;
    }
  }
  s.work.notify_all();
  if (detach) {
    thread->detach();  // it ends once the queue is empty (and keeps its State until then)
    return;
  }
  thread->join();  // (a call queued after it had found the queue empty started a new one)
}

bool CallQueue::run_here(const std::weak_ptr<State>& queue, const Call& target,
                         const std::function<bool()>& stop) {
  const std::shared_ptr<State> state = queue.lock();
  if (state == nullptr) return false;
  State& s = *state;
  if (s.running->held_here()) return false;  // (a call of this thread's own runs)
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.helping || s.front_started || s.owner.load() != this_process()) return false;
  size_t upto = 0;  // target's place
  while (upto < s.queue.size() && s.queue[upto].get() != &target) ++upto;
  if (upto == s.queue.size()) return false;  // (running, or done)
  for (size_t i = 0; i <= upto; ++i)
    if (!s.queue[i]->runs_anywhere()) return false;
  // Whatever happens, the worker takes over from here when this thread is done.
  struct Helping {
    State& s;
    const bool was_worker = worker_thread;
    explicit Helping(State& state) : s(state) {
      s.helping = true;
      s.helper = std::this_thread::get_id();
      worker_thread = true;  // (what the calls let go of goes where the worker's does)
    }
    ~Helping() {  // (under the lock: run_holding() throws nothing)
      worker_thread = was_worker;
      s.helping = false;
      s.helper = std::thread::id();
      s.caller_ran_calls = true;
      if ((!s.queue.empty() && s.worker_waits_for_caller) || s.stopping) s.work.notify_all();
    }
  } helping(s);
  // Only up to target: a call queued after it may wait for ranks that wait for what
  // this thread does once target is done, as the worker would not.
  size_t ran = 0;
  for (; ran <= upto && !stop(); ++ran) {
    std::shared_ptr<Call> call = s.queue.front();  // (the worker stands by: ours, in order)
    s.front_started = true;
    lock.unlock();
    run_holding(*s.running, *call);
    call.reset();
    lock.lock();
    s.queue.pop_front();
    s.front_started = false;
    ++s.run_by_callers;
    s.changed.notify_all();
  }
  return ran > upto;
}

void CallQueue::hold_worker(bool held) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.worker_held = held;
  }
  s.work.notify_all();
}

int64_t CallQueue::run_by_callers() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->run_by_callers;
}

int64_t CallQueue::turns_unwoken() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->turns_unwoken;
}

void CallQueue::loop(const std::shared_ptr<State>& state) {
  worker_thread = true;
  State& s = *state;
  bool was_detached = false;
  for (;;) {
    std::shared_ptr<Call> call;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      const auto ready = [&] {
        return !s.queue.empty() && !s.front_started && !s.helping &&
               (!s.worker_held || s.stopping);
      };
      for (;;) {
        // While a caller runs calls (run_here()), it wakes this thread at its end only
        // if that took longer than kCallerTurn: a caller that runs a short call and
        // then the next (waiting for each in turn) would wake it each time, for two
        // context switches a call where the two threads share a core. So this thread
        // looks again kCallerTurn after a caller began, and then waits to be woken.
        // Nor do calls queued during that turn that a caller may run wake it (see
        // push()): the caller that queued one usually waits for it next, and runs it.
        bool waited_a_turn = false;
        while (!ready() && !(s.stopping && s.queue.empty())) {
          if (s.helping && !waited_a_turn) {
            s.worker_takes_a_turn = true;
            waited_a_turn = s.work.wait_for(lock, kCallerTurn) == std::cv_status::timeout;
            s.worker_takes_a_turn = false;
          } else {
            s.worker_waits_for_caller = s.helping;
            s.work.wait(lock);
            s.worker_waits_for_caller = false;
            waited_a_turn = false;
          }
        }
        // A caller that asked for this thread (wake_worker(): a wait with a timeout,
        // which leaves its call here) will not run the call itself: the yield below
        // would only cost a system call (some 0.5 us a call here).
        if (!ready() || !s.queue.front()->runs_anywhere() || s.worker_called) break;
        if (s.queue.front()->takes_the_gil() && s.caller_ran_calls) {
          // A caller that has just run calls itself usually waits for this one next,
          // and runs it too. Taken here, the call would take the GIL from that caller,
          // who then waits for this thread to hand it back, and each such call wakes
          // this thread: context switches, on the core the two share, that cost a
          // 1 MiB allgather_async waited for at once 40% (180 us against 110 us with
          // this turn). It ends early where a wait with a timeout leaves its call to
          // this thread (wake_worker()), or a call that needs this thread is queued.
          s.caller_ran_calls = false;
          s.worker_takes_a_turn = true;
          s.work.wait_for(lock, kGilCallerTurn,
                          [&] { return !ready() || s.stopping || s.worker_called; });
          s.worker_takes_a_turn = false;
          continue;
        }
        // Lets a caller that shares this core come first: one about to wait for the
        // call runs it in its own thread (run_here()), which saves two context switches
        // a call. Where this thread has a core of its own, the yield returns at once.
        lock.unlock();
        sched_yield();
        lock.lock();
        if (ready()) break;
      }
      if (s.queue.empty()) {  // stopping, with nothing left to run
        // From here on this thread runs no call: one queued now needs a new thread,
        // which push() starts (and, where none can be made, refuses the call, as it
        // would any time), not the stop() that joins this one (if any), after the join:
        // a thread it could not make there left the call queued for no thread at all.
        s.stopping = false;
        if (s.detached) {  // no stop() will join this thread
          s.detached = false;
          was_detached = true;
        }
        break;
      }
      call = s.queue.front();
      s.front_started = true;
      s.caller_ran_calls = false;
      s.worker_called = false;  // (whoever called it, it has come)
    }
    run_holding(*s.running, *call);
    // Let go of it before it leaves the queue: whoever waits for the queue to empty then
    // finds everything the call held released (or handed to whoever releases it).
    call.reset();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.queue.pop_front();
      s.front_started = false;
    }
    s.changed.notify_all();
  }
  if (s.thread_end) s.thread_end();
  if (was_detached) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      --s.detached_alive;
    }
    s.changed.notify_all();
  }
}

}  // namespace ringreduce
