// Output layer + log-prob / entropy without the full logits: hidden states
// [rows, hidden] times the weight slice [vocab, hidden], a tile of
// chunk_rows x chunk_vocab logits at a time. Forward keeps per-row statistics
// only; backward recomputes each tile's logits and folds its gradient into
// d hidden and d weight. Device-generic (GEMMs through ATen, the per-tile work
// through the logit_stats / log_prob_entropy_backward kernels).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace hybridflow {
namespace {

void check_linear(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, int64_t chunk_rows,
                  int64_t chunk_vocab, const char* op) {
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be 2-D [tokens, hidden], got shape ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), op, ": weight must be [vocab, ",
              hidden.size(1), "] to match hidden ", hidden.sizes(), ", got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": hidden (", hidden.scalar_type(),
              ") and weight (", weight.scalar_type(), ") must share a dtype");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), op, ": target must be 1-D with ",
              hidden.size(0), " entries, got shape ", target.sizes());
  TORCH_CHECK(chunk_rows > 0 && chunk_vocab > 0, op, ": chunk_rows and chunk_vocab must be positive, got ",
              chunk_rows, " and ", chunk_vocab);
}

// acc += a @ b, accumulating in acc's dtype (fp32) whatever a and b hold.
void add_matmul(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) {
    acc.addmm_(a, b);
  } else {
    acc.add_(at::mm(a, b));
  }
}

}  // namespace

at::Tensor linear_logit_stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                              int64_t vocab_start, double scale, int64_t chunk_rows, int64_t chunk_vocab) {
  check_linear(hidden, weight, target, chunk_rows, chunk_vocab, "linear_logit_stats");
  const int64_t rows = hidden.size(0), vocab = weight.size(0);
  at::Tensor stats = at::empty({rows, 4}, hidden.options().dtype(at::kFloat));
  std::vector<at::Tensor> tiles;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    const at::Tensor h = hidden.slice(0, r0, r1);
    const at::Tensor t = target.slice(0, r0, r1);
    tiles.clear();
    for (int64_t v0 = 0; v0 < vocab; v0 += chunk_vocab) {
      const int64_t v1 = std::min(vocab, v0 + chunk_vocab);
      const at::Tensor logits = at::mm(h, weight.slice(0, v0, v1).t());
      tiles.push_back(call_logit_stats(logits, t, vocab_start + v0, scale));
    }
    if (tiles.empty()) {
      tiles.push_back(call_logit_stats(at::mm(h, weight.t()), t, vocab_start, scale));
    }
    stats.slice(0, r0, r1).copy_(merge_logit_stats(at::stack(tiles)));
  }
  return stats;
}

std::tuple<at::Tensor, at::Tensor> linear_log_prob_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                           const at::Tensor& target, double scale, int64_t chunk_rows,
                                                           int64_t chunk_vocab) {
  check_linear(hidden, weight, target, chunk_rows, chunk_vocab, "linear_log_prob_entropy");
  check_targets(target, weight.size(0), "linear_log_prob_entropy");
  auto [log_prob, entropy, log_z] =
      finish_logit_stats(linear_logit_stats(hidden, weight, target, 0, scale, chunk_rows, chunk_vocab));
  return {log_prob, entropy};
}

std::tuple<at::Tensor, at::Tensor> linear_log_prob_entropy_backward(
    const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy, const at::Tensor& hidden, const at::Tensor& weight,
    const at::Tensor& target, const at::Tensor& log_z, const at::Tensor& entropy, int64_t vocab_start, double scale,
    int64_t chunk_rows, int64_t chunk_vocab) {
  check_linear(hidden, weight, target, chunk_rows, chunk_vocab, "linear_log_prob_entropy_backward");
  const int64_t rows = hidden.size(0), vocab = weight.size(0);
  at::Tensor grad_hidden = at::zeros(hidden.sizes(), hidden.options().dtype(at::kFloat));
  // With one row tile each vocab tile's d weight is a single product: it is written once, in the
  // weight's dtype (the product rounds to it exactly as the fp32 sum of one term would), which spares
  // a [vocab, hidden] fp32 buffer, its zeroing and the final cast. Several row tiles sum in fp32.
  const bool one_row_tile = rows <= chunk_rows;
  at::Tensor grad_weight = one_row_tile ? at::empty(weight.sizes(), weight.options())
                                        : at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
  if (rows == 0) {
    grad_weight.zero_();
  }
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    const at::Tensor h = hidden.slice(0, r0, r1);
    for (int64_t v0 = 0; v0 < vocab; v0 += chunk_vocab) {
      const int64_t v1 = std::min(vocab, v0 + chunk_vocab);
      const at::Tensor w = weight.slice(0, v0, v1);
      const at::Tensor logits = at::mm(h, w.t());
      const at::Tensor grad_logits = call_log_prob_entropy_backward(
          grad_log_prob.slice(0, r0, r1), grad_entropy.slice(0, r0, r1), logits, target.slice(0, r0, r1),
          log_z.slice(0, r0, r1), entropy.slice(0, r0, r1), vocab_start + v0, scale);
      add_matmul(grad_hidden.slice(0, r0, r1), grad_logits, w);
      if (one_row_tile) {
        at::Tensor grad_w = grad_weight.slice(0, v0, v1);
        at::mm_out(grad_w, grad_logits.t().to(weight.scalar_type()), h);
      } else {
        add_matmul(grad_weight.slice(0, v0, v1), grad_logits.t(), h);
      }
    }
  }
  return {grad_hidden.to(hidden.scalar_type()), grad_weight.to(weight.scalar_type())};  // no copy when one tile
}

}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CPU, m) {
  m.impl("linear_logit_stats", &hybridflow::linear_logit_stats);
  m.impl("linear_log_prob_entropy", &hybridflow::linear_log_prob_entropy);
  m.impl("linear_log_prob_entropy_backward", &hybridflow::linear_log_prob_entropy_backward);
}
