#include "pipeline.h"

#include <algorithm>
#include <unordered_map>

namespace swap_optimizer::runtime {

void stage_out_step_table(Transport& transport, BatchWork& work) {
  transport.record(Queue::kCompute, kUpdatesDoneMarker);
  transport.wait(Queue::kDeviceToHost, kUpdatesDoneMarker);
  // After a failure before any update, nothing else orders it after its copy in.
  transport.wait(Queue::kDeviceToHost, kStepTableInMarker);
  work.stage_out_step_table();
  transport.record(Queue::kDeviceToHost, kStepTableOutMarker);
}

void run_pipeline(Transport& transport, BatchWork& work, const std::vector<int>& slot_of_batch) {
  const int64_t batches = static_cast<int64_t>(slot_of_batch.size());
  if (batches == 0) return;

  // previous_user[b]: the batch that used b's slot before b, or -1.
  std::vector<int64_t> previous_user(batches, -1);
  std::unordered_map<int, int64_t> last_user_of_slot;
  for (int64_t b = 0; b < batches; ++b) {
    auto it = last_user_of_slot.find(slot_of_batch[b]);
    if (it != last_user_of_slot.end()) previous_user[b] = it->second;
    last_user_of_slot[slot_of_batch[b]] = b;
  }

  int64_t staged = 0;               // batches [0, staged) have their copy in enqueued
  // A batch whose arena may hold new states not yet enqueued for copy out. Its
  // arena holds, param by param, either the old states copied in or the new
  // states matching the updated param, so copying it out is always right.
  int64_t updated_not_out = -1;
  // Enqueues copies in for every next batch whose slot is free: never used in
  // this step, or its previous batch's copy out (up to `unstaged_through`) is enqueued.
  auto stage_ready = [&](int64_t unstaged_through) {
    while (staged < batches &&
           (previous_user[staged] < 0 || previous_user[staged] <= unstaged_through)) {
      const int slot = slot_of_batch[staged];
      if (previous_user[staged] >= 0) {
        transport.wait(Queue::kHostToDevice, slot_marker(Marker::kUnstaged, slot));
      }
      work.stage_in(staged, slot);
      transport.record(Queue::kHostToDevice, slot_marker(Marker::kStaged, slot));
      ++staged;
    }
  };
  auto stage_out = [&](int64_t batch) {
    const int slot = slot_of_batch[batch];
    transport.wait(Queue::kDeviceToHost, slot_marker(Marker::kUpdated, slot));
    work.stage_out(batch, slot);
    transport.record(Queue::kDeviceToHost, slot_marker(Marker::kUnstaged, slot));
  };

  bool step_table_in = false;  // its copy out would otherwise write garbage to the host

  try {
    transport.begin_step();
    // Copies in write arenas just allocated on the compute queue and read host
    // regions the previous step wrote. The previous step's end is on the compute
    // queue it ran on, which may not be this step's (a caller's stream context):
    // wait for it, then everything before this point is ordered.
    transport.wait(Queue::kCompute, kStepEndMarker);
    transport.record(Queue::kCompute, kStepBeginMarker);
    transport.wait(Queue::kHostToDevice, kStepBeginMarker);
    work.stage_in_step_table();
    transport.record(Queue::kHostToDevice, kStepTableInMarker);
    step_table_in = true;
    stage_ready(-1);
    for (int64_t b = 0; b < batches; ++b) {
      if (b > 0) work.between_batches(b);
      const int slot = slot_of_batch[b];
      transport.wait(Queue::kCompute, slot_marker(Marker::kStaged, slot));
      updated_not_out = b;
      work.update(b, slot);
      transport.record(Queue::kCompute, slot_marker(Marker::kUpdated, slot));
      stage_out(b);
      updated_not_out = -1;
      stage_ready(b);
    }
    stage_out_step_table(transport, work);
    for (const auto& [slot, batch] : last_user_of_slot) {
      transport.wait(Queue::kCompute, slot_marker(Marker::kUnstaged, slot));
    }
    transport.wait(Queue::kCompute, kStepTableOutMarker);
    transport.record(Queue::kCompute, kStepEndMarker);
  } catch (...) {
    // Params updated in that batch are new: their states must reach the host too.
    // The step counts of params whose last piece was updated are new too.
    try {
      if (updated_not_out >= 0) {
        transport.record(Queue::kCompute, slot_marker(Marker::kUpdated, slot_of_batch[updated_not_out]));
        stage_out(updated_not_out);
      }
      if (step_table_in) stage_out_step_table(transport, work);
    } catch (...) {
      // Nothing more can be done here; the first error is the one reported.
    }
    transport.drain();
    throw;
  }
}

}  // namespace swap_optimizer::runtime
