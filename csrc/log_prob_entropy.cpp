// Device-generic parts of the fused log-prob / entropy op: merging the row
// statistics of several vocabulary slices, and the whole-vocabulary op built
// from the logit_stats kernel. Registered for CPU here and for CUDA in
// csrc/cuda/bindings.cpp.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <limits>

#include "ops.h"

namespace hybridflow {

void check_targets(const at::Tensor& target, int64_t vocab, const char* op) {
  if (target.numel() == 0) return;
  const auto [min_id, max_id] = at::aminmax(target);  // one pass (and one device sync) for both
  const int64_t low = min_id.item<int64_t>();
  const int64_t high = max_id.item<int64_t>();
  TORCH_CHECK(low >= 0 && high < vocab, op, ": target ids must lie in [0, ", vocab, ") (the vocabulary of the ",
              "logits / weight), got ids from ", low, " to ", high);
}

at::Tensor merge_logit_stats(const at::Tensor& stats) {
  // stats [slices, rows, 4] -> [rows, 4] as if one slice had held them all:
  //   M = max m_i, a_i = exp(m_i - M), S = sum a_i s_i,
  //   W = sum a_i (w_i + (m_i - M) s_i), T = sum t_i.
  // A slice with no columns (m = -inf, s = 0) contributes nothing.
  TORCH_CHECK(stats.dim() == 3 && stats.size(2) == 4,
              "merge_logit_stats: stats must be [slices, rows, 4], got shape ", stats.sizes());
  const at::Tensor s32 = stats.to(at::kFloat);
  const at::Tensor m = s32.select(2, 0);
  const at::Tensor big_m = std::get<0>(m.max(0));
  const at::Tensor empty = m.eq(-std::numeric_limits<float>::infinity());
  const at::Tensor offset = at::where(empty, at::zeros_like(m), m - big_m);
  const at::Tensor a = at::where(empty, at::zeros_like(m), offset.exp());
  const at::Tensor s = s32.select(2, 1);
  const at::Tensor w = s32.select(2, 2);
  return at::stack({big_m, (a * s).sum(0), (a * (w + offset * s)).sum(0), s32.select(2, 3).sum(0)}, 1);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_logit_stats(const at::Tensor& stats) {
  // log Z = m + log s; log p_t = x_t - log Z; H = log Z - E[x] = log s - w / s.
  const at::Tensor log_s = stats.select(1, 1).log();
  const at::Tensor log_z = stats.select(1, 0) + log_s;
  const at::Tensor log_prob = stats.select(1, 3) - log_z;
  const at::Tensor entropy = log_s - stats.select(1, 2) / stats.select(1, 1);
  return {log_prob, entropy, log_z};
}

std::tuple<at::Tensor, at::Tensor> log_prob_entropy(const at::Tensor& logits, const at::Tensor& target, double scale) {
  TORCH_CHECK(logits.dim() == 2, "log_prob_entropy: logits must be 2-D [tokens, vocab], got shape ", logits.sizes());
  check_targets(target, logits.size(1), "log_prob_entropy");
  auto [log_prob, entropy, log_z] = finish_logit_stats(call_logit_stats(logits, target, 0, scale));
  return {log_prob, entropy};
}

}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CPU, m) {
  m.impl("merge_logit_stats", &hybridflow::merge_logit_stats);
  m.impl("log_prob_entropy", &hybridflow::log_prob_entropy);
}
