// A deferred step (SwapRuntime::step with deferred=true): enqueued whole on
// the update queue, waited for by position or whole, and finished, raising
// what stopped it, at the next call that needs it done.
#include "runtime_step.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <optional>
#include <thread>

namespace swap_optimizer::runtime {

void SwapRuntime::enqueue_deferred(const std::shared_ptr<Step>& work) {
  const int64_t grad_bytes = work->grad_bytes();  // before the update thread may read the grads
  if (device_.is_cpu()) {
    if (update_thread_.joinable()) update_thread_.join();  // (the last step's, finished: it has ended)
    allocate_arenas();  // held until the step is finished (finish_deferred)
    transport_->open_ready(static_cast<int64_t>(order_.size()));
    // The pipeline runs on the update thread with this thread's thread-local
    // state (grad mode, dispatch keys), below Python's dispatch keys: a
    // Python mode active here must not make the update thread need the GIL,
    // which a waiting caller may hold. Its failure is kept for the next wait.
    // The caller's intra-op thread count too (OpenMP's is per thread).
    auto job = [this, work = std::shared_ptr<Step>(work), state = std::make_optional(at::ThreadLocalState()),
                threads = at::get_num_threads()]() mutable {
      update_thread_id_ = std::this_thread::get_id();
      {
        const at::ThreadLocalStateGuard guard(*state);
        const c10::impl::ExcludeDispatchKeyGuard no_python(
            c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
        if (at::get_num_threads() != threads) at::set_num_threads(threads);
        try {
          run_pipeline(*transport_, *work, slot_of_batch_);
        } catch (...) {
          work->failure = std::current_exception();
        }
        // deferred_ is then the last owner: the step, and any grad it still
        // holds, is freed on a caller's thread, never here (freeing a tensor
        // whose Python object outlived its last Python reference takes the GIL,
        // which a thread waiting for this one may hold).
        work.reset();
      }
      // The caller's thread-local state (Python modes among it) is let go
      // before the waiters wake, as the step is: one of them joins this
      // thread, and letting go of a Python object takes the GIL. (Every
      // caller that may join releases the GIL first; this keeps a later one
      // that does not from deadlocking.)
      state.reset();
      transport_->release_ready();  // wakes every waiter, also after a failure
      update_thread_id_ = std::thread::id();  // (an ended thread's id may be a later thread's)
    };
    try {
      update_thread_ = std::thread(std::move(job));
    } catch (...) {
      transport_->release_ready();
      release_arenas();
      throw;
    }
    deferred_ = work;
    held_grad_bytes_ = grad_bytes;
    return;
  }
  // CUDA: enqueued now on the update stream, which waits for the caller's
  // stream first; a failure to enqueue shows here. The grads and snapshots
  // stay the caller stream's: the step holds them until a wait has ordered
  // that stream after their last reader (release_deferred_through).
  transport_->enter_update_queue();
  struct Leave {
    Transport& transport;
    ~Leave() { transport.leave_update_queue(); }
  } leave{*transport_};
  // Allocated on the update stream, which is current: the caching allocator
  // hands their blocks out again only to later work on that stream.
  allocate_arenas();
  transport_->open_ready(static_cast<int64_t>(order_.size()));
  try {
    run_pipeline(*transport_, *work, slot_of_batch_);
  } catch (...) {
    rethrow_failure(*work, std::current_exception());
  }
  if (!options_.keep_arenas) {
    // The update stream waited for every copy before the step's end, so
    // freeing them now is in its order: the next deferred step's arenas are
    // these blocks, however far the host runs ahead.
    const int64_t live = stats_.staging_bytes;
    release_arenas();
    stats_.staging_bytes = live;  // still in use until the step is waited for
  }
  deferred_ = work;
  held_grad_bytes_ = grad_bytes;
}

void SwapRuntime::release_deferred_through(int64_t position) {
  if (position <= deferred_->released_through()) return;
  transport_->order_release(position);
  held_grad_bytes_ -= deferred_->release_through(position);
}

void SwapRuntime::finish_deferred() {
  if (!deferred_) return;
  TORCH_CHECK(!on_update_thread(), "SwapRuntime: the update of an overlapped step called an optimizer method that "
              "needs that step finished (step, synchronize, state edits); it cannot wait for itself");
  if (update_thread_.joinable()) update_thread_.join();
  if (!deferred_->failure) release_deferred_through(static_cast<int64_t>(order_.size()) - 1);
  const std::shared_ptr<Step> work = std::move(deferred_);
  deferred_.reset();
  held_grad_bytes_ = 0;
  if (work->failure) rethrow_failure(*work, work->failure);
  if (!options_.keep_arenas) release_arenas();
}

void SwapRuntime::wait_ready(int64_t position) {
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return;  // see wait_step
  const std::lock_guard<std::mutex> lock(step_mutex_);
  TORCH_CHECK_INDEX(position >= 0 && position < static_cast<int64_t>(order_.size()), "SwapRuntime: no batch at ",
                    "position ", position, " of ", order_.size());
  const c10::DeviceGuard guard(device_);
  if (!deferred_) {
    // Finished by a wait on another stream: on CUDA this one must still wait
    // for the step's end (a no-op on the host, where finishing joined it).
    if (step_pending_) transport_->wait(Queue::kCaller, kStepEndMarker);
    return;
  }
  if (transport_->wait_ready(position)) {
    finish_deferred();  // the step stopped short of it: raise why
    return;
  }
  release_deferred_through(position);
}

bool SwapRuntime::has_deferred_step() const {
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return false;  // see wait_step
  const std::lock_guard<std::mutex> lock(step_mutex_);
  return deferred_ != nullptr;
}

bool SwapRuntime::deferred_step_updated() {
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return false;  // see wait_step
  // Never blocks, so it runs with the GIL held (asked at every op outside the
  // model's calls: releasing the GIL there would hand it to the update
  // thread's Python for a switch interval): busy lock, not known yet.
  const std::unique_lock<std::mutex> lock(step_mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (!deferred_ || order_.empty()) return true;
  const c10::DeviceGuard guard(device_);
  return transport_->ready_now(static_cast<int64_t>(order_.size()) - 1);
}

void SwapRuntime::wait_step() {
  // A signal handler inside this thread's own whole step (check_interrupt):
  // that step began by finishing any deferred one, so nothing is deferred, and
  // waiting for the step lock it holds would never end. Nor can the update
  // thread wait for the step it runs (Python code in its update rule).
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return;
  const std::lock_guard<std::mutex> lock(step_mutex_);
  const c10::DeviceGuard guard(device_);
  finish_deferred();
  // CUDA: a stream wait, also when another stream's wait finished the step;
  // host: the step has run.
  if (step_pending_) transport_->wait(Queue::kCaller, kStepEndMarker);
}

}  // namespace swap_optimizer::runtime
