#include "call_queue.h"

#include <unistd.h>

#include <chrono>

namespace ringreduce {

namespace {
thread_local bool worker_thread = false;
}  // namespace

bool CallQueue::on_worker_thread() { return worker_thread; }

void CallQueue::push(std::shared_ptr<Call> call) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.queue.push_back(std::move(call));
    // (While stop() waits, its thread runs this call before it ends.)
    if (s.thread == nullptr && !s.stopping) {
      try {
        start(state_);
      } catch (...) {  // no thread (std::system_error): the call must not run later either
        s.queue.pop_back();
        throw;
      }
    }
  }
  s.changed.notify_all();
}

void CallQueue::start(const std::shared_ptr<State>& state) {
  state->owner = getpid();
  state->thread = std::make_unique<std::thread>([state] { loop(state); });
}

bool CallQueue::started() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->thread != nullptr;
}

int64_t CallQueue::pending() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->queue.size());
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

void CallQueue::stop() {
  State& s = *state_;
  const pid_t owner = s.owner.load();
  if (owner != 0 && owner != getpid()) {
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
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.thread == nullptr || s.stopping) return;
    s.stopping = true;
    thread = std::move(s.thread);
  }
  s.changed.notify_all();
  if (thread->get_id() == std::this_thread::get_id()) {
    thread->detach();  // it ends once the queue is empty (and keeps its State until then)
    std::lock_guard<std::mutex> lock(s.mutex);
    s.detached = true;
    return;
  }
  thread->join();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.stopping = false;
  if (!s.queue.empty()) start(state_);  // queued after the thread had found the queue empty
}

void CallQueue::loop(const std::shared_ptr<State>& state) {
  worker_thread = true;
  State& s = *state;
  for (;;) {
    std::shared_ptr<Call> call;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.changed.wait(lock, [&] { return !s.queue.empty() || s.stopping; });
      if (s.queue.empty()) {  // stopping, with nothing left to run
        if (s.detached) {  // no stop() will join this thread and clear the flags
          s.detached = false;
          s.stopping = false;
        }
        break;
      }
      call = s.queue.front();
      s.front_started = true;
    }
    {
      std::lock_guard<RunningLock> hold(*s.running);
      call->run();
    }
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
}

}  // namespace ringreduce
