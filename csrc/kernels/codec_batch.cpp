// Host-side validation and planning of the codec ops (codec_batch.h).
#include "codec_batch.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <string>

namespace swap_optimizer {
namespace {

int64_t blocks_of(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// Checks shared by every list of a call: the count, one device, dense and
// contiguous tensors.
class CallCheck {
 public:
  CallCheck(const char* op, size_t count) : op_(op), count_(count) {}

  void count(const char* what, size_t size) const {
    TORCH_CHECK_VALUE(size == count_, op_, ": ", count_, " tensors but ", size, " ", what,
                      "; pass one entry per tensor in every list");
  }

  void tensor(const char* what, size_t index, const at::Tensor& t, std::initializer_list<c10::ScalarType> dtypes,
              const char* dtype_fix) {
    TORCH_CHECK_VALUE(t.defined(), op_, ": tensor ", index, ": ", what, " is undefined");
    if (!device_.has_value()) {
      device_ = t.device();
      device_source_ = what;
    }
    TORCH_CHECK_VALUE(t.device() == *device_, op_, ": tensor ", index, ": ", what, " is on ", t.device(),
                      " but ", device_source_, " of tensor 0 is on ", *device_,
                      "; put every tensor of one call on the same device");
    TORCH_CHECK_VALUE(t.layout() == c10::kStrided, op_, ": tensor ", index, ": ", what,
                      " is not a dense tensor; pass dense tensors");
    TORCH_CHECK_VALUE(std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(), op_, ": tensor ",
                      index, ": ", what, " is ", t.scalar_type(), "; ", dtype_fix);
    TORCH_CHECK_VALUE(t.is_contiguous(), op_, ": tensor ", index, ": ", what,
                      " is not contiguous; pass a contiguous tensor (.contiguous(), then copy the result back)");
    const int64_t begin = reinterpret_cast<int64_t>(t.const_data_ptr());
    ranges_.push_back({begin, begin + t.numel() * static_cast<int64_t>(t.element_size()), writes(what), index, what});
  }

  // Written memory must not overlap anything else the call touches: a sweep
  // over the ranges sorted by start, against the one reaching furthest.
  void no_overlap() {
    std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
    const Range* furthest = nullptr;
    for (const Range& r : ranges_) {
      if (r.begin == r.end) continue;
      if (furthest != nullptr && r.begin < furthest->end && (r.written || furthest->written)) {
        TORCH_CHECK_VALUE(false, op_, ": tensor ", r.index, "'s ", r.what, " overlaps tensor ", furthest->index,
                          "'s ", furthest->what, " in memory, and one of them is written; pass separate tensors");
      }
      if (furthest == nullptr || r.end > furthest->end) furthest = &r;
    }
  }

  // After every tensor is checked: the overlap check, then an empty batch on the call's device.
  CodecBatch finish() {
    no_overlap();
    CodecBatch batch;
    batch.device = device_.value_or(c10::Device(c10::kCPU));
    return batch;
  }
  void written(std::initializer_list<const char*> names) { written_ = names; }

 private:
  struct Range {
    int64_t begin, end;
    bool written;
    size_t index;
    const char* what;
  };
  bool writes(const char* what) const {
    return std::find_if(written_.begin(), written_.end(), [&](const char* w) { return std::string(w) == what; }) !=
           written_.end();
  }

  const char* op_;
  size_t count_;
  std::optional<c10::Device> device_;
  const char* device_source_ = "";
  std::vector<const char*> written_;
  std::vector<Range> ranges_;
};

int32_t value_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case c10::kBFloat16: return kCodecBFloat16;
    case c10::kHalf: return kCodecHalf;
    default: return kCodecFloat;
  }
}

void check_same_numel(const char* op, size_t index, const char* a, const at::Tensor& ta, const char* b,
                      const at::Tensor& tb) {
  TORCH_CHECK_VALUE(ta.numel() == tb.numel(), op, ": tensor ", index, ": ", a, " has ", ta.numel(),
                    " elements but ", b, " has ", tb.numel(), "; they must have the same number of elements");
}

void check_absmax(const char* op, size_t index, const at::Tensor& absmax, int64_t numel) {
  TORCH_CHECK_VALUE(absmax.numel() == blocks_of(numel), op, ": tensor ", index, ": absmax has ", absmax.numel(),
                    " elements but ", numel, " codes need ceil(", numel, " / ", kQuantBlock, ") = ", blocks_of(numel),
                    " (one float32 scale per block of ", kQuantBlock, " elements from the tensor's first)");
}

void check_map(const char* op, size_t index, int64_t map_kind) {
  TORCH_CHECK_VALUE(map_kind == kSignedMap || map_kind == kUnsignedMap, op, ": tensor ", index, ": code_map ",
                    map_kind, " is neither ", int(kSignedMap), " (signed) nor ", int(kUnsignedMap), " (unsigned)");
}

// The entry converting `in` into `out`; `values` is whichever of them holds values.
CodecEntry make_entry(const at::Tensor& in, const at::Tensor& out, const at::Tensor& values, float* absmax) {
  CodecEntry e{};
  e.in = in.const_data_ptr();
  e.out = out.data_ptr();
  e.absmax = absmax;
  e.numel = in.numel();
  e.value_dtype = value_dtype_of(values);
  return e;
}

// Appends tensor `index`'s entry and its chunks.
void add_entry(const char* op, CodecBatch& batch, size_t index, const CodecEntry& e) {
  const int64_t chunks = (e.numel + kCodecChunkElements - 1) / kCodecChunkElements;
  TORCH_CHECK_VALUE(chunks <= std::numeric_limits<int32_t>::max() &&
                        index <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    op, ": tensor ", index, " is too large (", e.numel, " elements); split it");
  batch.entries.push_back(e);
  for (int64_t c = 0; c < chunks; ++c) batch.chunks.push_back({static_cast<int32_t>(index), static_cast<int32_t>(c)});
}

constexpr const char* kValueDtypeFix = "pass float32, bfloat16 or float16 values";

}  // namespace

CodecBatch plan_decode_8bit(const char* op, at::TensorList codes, at::TensorList absmax, at::TensorList out,
                            at::IntArrayRef code_map) {
  CallCheck check(op, codes.size());
  check.count("absmax tensors", absmax.size());
  check.count("out tensors", out.size());
  check.count("code_map entries", code_map.size());
  check.written({"out"});
  for (size_t i = 0; i < codes.size(); ++i) {
    check.tensor("codes", i, codes[i], {c10::kByte}, "pass uint8 codes");
    check.tensor("absmax", i, absmax[i], {c10::kFloat}, "pass float32 absmax");
    check.tensor("out", i, out[i], {c10::kFloat, c10::kBFloat16, c10::kHalf}, kValueDtypeFix);
    check_same_numel(op, i, "codes", codes[i], "out", out[i]);
    check_absmax(op, i, absmax[i], codes[i].numel());
    check_map(op, i, code_map[i]);
  }
  CodecBatch batch = check.finish();
  for (size_t i = 0; i < codes.size(); ++i) {
    CodecEntry e = make_entry(codes[i], out[i], out[i], absmax[i].data_ptr<float>());
    e.map_kind = static_cast<int32_t>(code_map[i]);
    add_entry(op, batch, i, e);
  }
  return batch;
}

CodecBatch plan_encode_8bit(const char* op, at::TensorList values, at::TensorList codes, at::TensorList absmax,
                            at::IntArrayRef code_map, at::IntArrayRef rounding) {
  CallCheck check(op, values.size());
  check.count("codes tensors", codes.size());
  check.count("absmax tensors", absmax.size());
  check.count("code_map entries", code_map.size());
  check.count("rounding entries", rounding.size());
  check.written({"codes", "absmax"});
  for (size_t i = 0; i < values.size(); ++i) {
    check.tensor("values", i, values[i], {c10::kFloat, c10::kBFloat16, c10::kHalf}, kValueDtypeFix);
    check.tensor("codes", i, codes[i], {c10::kByte}, "pass uint8 codes");
    check.tensor("absmax", i, absmax[i], {c10::kFloat}, "pass float32 absmax");
    check_same_numel(op, i, "values", values[i], "codes", codes[i]);
    check_absmax(op, i, absmax[i], values[i].numel());
    check_map(op, i, code_map[i]);
    const int64_t r = rounding[i];
    TORCH_CHECK_VALUE(r == kRoundNearest || r == kRoundNearestNonzero || r == kRoundUp, op, ": tensor ", i,
                      ": rounding ", r, " is none of ", int(kRoundNearest), " (nearest), ", int(kRoundNearestNonzero),
                      " (nearest, never 0 for a positive value), ", int(kRoundUp), " (up)");
    TORCH_CHECK_VALUE(r == kRoundNearest || code_map[i] == kUnsignedMap, op, ": tensor ", i, ": rounding ",
                      r == kRoundUp ? "up" : "nearest-nonzero",
                      " is a rule for states that are never negative and needs the unsigned map (code_map ",
                      int(kUnsignedMap), "); signed states round to nearest");
  }
  CodecBatch batch = check.finish();
  for (size_t i = 0; i < values.size(); ++i) {
    CodecEntry e = make_entry(values[i], codes[i], values[i], absmax[i].data_ptr<float>());
    e.map_kind = static_cast<int32_t>(code_map[i]);
    e.rounding = static_cast<int32_t>(rounding[i]);
    add_entry(op, batch, i, e);
  }
  return batch;
}

CodecBatch plan_encode_bf16(const char* op, at::TensorList values, at::TensorList out, int64_t seed,
                            at::IntArrayRef param_index, at::IntArrayRef state_index,
                            at::IntArrayRef global_offset, at::IntArrayRef step) {
  CallCheck check(op, values.size());
  check.count("out tensors", out.size());
  check.count("param_index entries", param_index.size());
  check.count("state_index entries", state_index.size());
  check.count("global_offset entries", global_offset.size());
  check.count("step entries", step.size());
  check.written({"out"});
  for (size_t i = 0; i < values.size(); ++i) {
    check.tensor("values", i, values[i], {c10::kFloat}, "pass float32 values");
    check.tensor("out", i, out[i], {c10::kBFloat16}, "pass a bfloat16 out tensor");
    check_same_numel(op, i, "values", values[i], "out", out[i]);
    TORCH_CHECK_VALUE(state_index[i] >= 0 && state_index[i] <= 3, op, ": tensor ", i, ": state_index ",
                      state_index[i], " is outside 0..3; number a param's states 0 to 3 (at most four per param "
                      "share its rounding key space)");
    TORCH_CHECK_VALUE(param_index[i] >= 0 && param_index[i] <= std::numeric_limits<int64_t>::max() / 4, op,
                      ": tensor ", i, ": param_index ", param_index[i], " is negative or too large");
    TORCH_CHECK_VALUE(global_offset[i] >= 0 &&
                          global_offset[i] <= std::numeric_limits<int64_t>::max() - values[i].numel(),
                      op, ": tensor ", i, ": global_offset ", global_offset[i],
                      " must be >= 0 (the index of the tensor's first element in the whole state)");
    TORCH_CHECK_VALUE(step[i] >= 0 && step[i] <= std::numeric_limits<uint32_t>::max(), op, ": tensor ", i,
                      ": step ", step[i], " is outside 0..2^32-1");
  }
  CodecBatch batch = check.finish();
  for (size_t i = 0; i < values.size(); ++i) {
    CodecEntry e = make_entry(values[i], out[i], values[i], nullptr);
    e.global_offset = global_offset[i];
    e.rounding_key = rounding_key(static_cast<uint64_t>(seed), param_index[i], static_cast<int>(state_index[i]));
    e.step = static_cast<uint32_t>(step[i]);
    add_entry(op, batch, i, e);
  }
  return batch;
}

}  // namespace swap_optimizer
