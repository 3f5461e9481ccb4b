// The hybridflow op library: device-generic entry points shared by the CPU
// registration files and, in CUDA builds, csrc/cuda/bindings.cpp.
//
// Kernel ops (one implementation per device): logit_stats,
// log_prob_entropy_backward, gae, discounted_returns, copy_blocks.
// Composite ops (written once on top of the kernel ops and ATen, registered
// for CPU and CUDA): merge_logit_stats, log_prob_entropy, linear_logit_stats,
// linear_log_prob_entropy, linear_log_prob_entropy_backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>

namespace hybridflow {

// ---- composites (csrc/log_prob_entropy.cpp, csrc/linear_log_prob_entropy.cpp)
at::Tensor merge_logit_stats(const at::Tensor& stats);
std::tuple<at::Tensor, at::Tensor> log_prob_entropy(const at::Tensor& logits, const at::Tensor& target, double scale);
at::Tensor linear_logit_stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                              int64_t vocab_start, double scale, int64_t chunk_rows, int64_t chunk_vocab);
std::tuple<at::Tensor, at::Tensor> linear_log_prob_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                           const at::Tensor& target, double scale, int64_t chunk_rows,
                                                           int64_t chunk_vocab);
std::tuple<at::Tensor, at::Tensor> linear_log_prob_entropy_backward(
    const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy, const at::Tensor& hidden, const at::Tensor& weight,
    const at::Tensor& target, const at::Tensor& log_z, const at::Tensor& entropy, int64_t vocab_start, double scale,
    int64_t chunk_rows, int64_t chunk_vocab);

// (log_prob, entropy, log_z) from one row-statistics tensor [rows, 4] covering
// the whole vocabulary.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_logit_stats(const at::Tensor& stats);

// Every target id must lie in [0, vocab) when one tensor holds the whole vocabulary.
void check_targets(const at::Tensor& target, int64_t vocab, const char* op);

// ---- kernel ops, called through the dispatcher so each device gets its own.
inline at::Tensor call_logit_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                                   double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hybridflow::logit_stats", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op.call(logits, target, vocab_start, scale);
}

inline at::Tensor call_log_prob_entropy_backward(const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                                                 const at::Tensor& logits, const at::Tensor& target,
                                                 const at::Tensor& log_z, const at::Tensor& entropy,
                                                 int64_t vocab_start, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hybridflow::log_prob_entropy_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op.call(grad_log_prob, grad_entropy, logits, target, log_z, entropy, vocab_start, scale);
}

}  // namespace hybridflow
