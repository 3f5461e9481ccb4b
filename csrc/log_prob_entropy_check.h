// Argument checks of the log-prob / entropy kernels, shared by the CPU and
// CUDA kernels so that both refuse the same inputs with the same words.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

namespace hybridflow {

// 2-D float32 / bfloat16 / float16 logits, returned with unit stride along the
// vocabulary (copied only when they lack it).
inline at::Tensor checked_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [tokens, vocab], got shape ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              op, ": logits dtype ", logits.scalar_type(), " is not supported (float32, bfloat16, float16)");
  return logits.stride(1) == 1 ? logits : logits.contiguous();
}

// Every (name, tensor) must be 1-D with one entry per logits row, on the logits' device.
inline void check_rows(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors, const at::Tensor& logits,
                       const char* op) {
  const int64_t rows = logits.size(0);
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows, op, ": ", name, " must be 1-D with ", rows,
                " entries (one per logits row), got shape ", t->sizes());
    TORCH_CHECK(t->device() == logits.device(), op, ": ", name, " is on ", t->device(), " but the logits are on ",
                logits.device(), "; move every tensor argument to one device");
  }
}

}  // namespace hybridflow
