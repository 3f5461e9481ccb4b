// CPU kernels of the fused log-prob / entropy ops: per-row statistics of a
// vocab slice of logits (forward) and the gradient with respect to that slice
// (backward). Neither materialises a [rows, vocab] log-softmax; rows run in
// parallel, each row in two (forward) or one (backward) vectorised passes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "../log_prob_entropy_check.h"
#include "../ops.h"
#include "vec_math.h"

namespace hybridflow {
namespace cpu {
namespace {

constexpr int64_t kTile = 1024;  // columns converted to fp32 at a time (4 KiB, stays in L1)

#define HYBRIDFLOW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// x[i] = scale * z[i] in fp32, for one tile.
template <typename T>
void scaled_tile(const T* z, int64_t n, float scale, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = load(z, i) * scale;
}

HYBRIDFLOW_CLONES float tile_max(const float* x, int64_t n, float m) {
  float lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = m;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (int j = 0; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  return m;
}

// Adds sum exp(x - m) to *s and sum exp(x - m) * (x - m) to *w.
HYBRIDFLOW_CLONES void tile_sum_exp(const float* x, int64_t n, float m, float* s, float* w) {
  float lane_s[kLanes] = {0.0f};
  float lane_w[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float shifted = x[i + j] - m;
      const float d = shifted < kShiftFloor ? kShiftFloor : shifted;
      const float e = exp_approx(d);
      lane_s[j] += e;
      lane_w[j] += e * d;
    }
  }
  for (; i < n; ++i) {
    const float shifted = x[i] - m;
    const float d = shifted < kShiftFloor ? kShiftFloor : shifted;
    const float e = exp_approx(d);
    lane_s[0] += e;
    lane_w[0] += e * d;
  }
  for (int j = 0; j < kLanes; ++j) {
    *s += lane_s[j];
    *w += lane_w[j];
  }
}

// g[i] = p_i * (a + b * lp_i) with lp_i = x_i - log_z, p_i = exp(lp_i), in place over x.
HYBRIDFLOW_CLONES void tile_backward(float* x, int64_t n, float log_z, float a, float b) {
  for (int64_t i = 0; i < n; ++i) {
    const float raw = x[i] - log_z;
    const float lp = raw < kShiftFloor ? kShiftFloor : raw;
    x[i] = exp_approx(lp) * (a + b * lp);
  }
}

template <typename T>
void store_tile(const float* g, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) store(out, i, g[i]);
}

// One row's (max, sum exp, sum exp * shifted) of x = scale * z: a max pass,
// then a sum pass, each over fp32 tiles.
template <typename T>
void row_stats(const T* z, int64_t vocab, float scale, float* out) {
  float x[kTile];
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; v += kTile) {
    const int64_t n = std::min(kTile, vocab - v);
    scaled_tile(z + v, n, scale, x);
    m = tile_max(x, n, m);
  }
  float s = 0.0f, w = 0.0f;
  if (m == -std::numeric_limits<float>::infinity()) {  // every logit masked: no mass here
    out[0] = m;
    out[1] = out[2] = 0.0f;
    return;
  }
  for (int64_t v = 0; v < vocab; v += kTile) {
    const int64_t n = std::min(kTile, vocab - v);
    scaled_tile(z + v, n, scale, x);
    tile_sum_exp(x, n, m, &s, &w);
  }
  out[0] = m;
  out[1] = s;
  out[2] = w;
}

// One row of d(g_lp * log p_t + g_ent * H) / dz over z's vocab slice, without
// the target's own term:  -scale * p_v * (g_lp + g_ent * (lp_v + H)).
template <typename T>
void row_backward(const T* z, int64_t vocab, float scale, float log_z, float entropy, float g_lp, float g_ent,
                  T* grad) {
  const float a = -scale * (g_lp + g_ent * entropy);
  const float b = -scale * g_ent;
  float x[kTile];
  for (int64_t v = 0; v < vocab; v += kTile) {
    const int64_t n = std::min(kTile, vocab - v);
    scaled_tile(z + v, n, scale, x);
    tile_backward(x, n, log_z, a, b);
    store_tile(x, n, grad + v);
  }
}

// Calls f(T{}) with T the element type of float32 / bfloat16 / float16 logits.
template <typename F>
void dispatch_logits(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported logits dtype ", type);
  }
}

at::Tensor logit_stats(const at::Tensor& logits_in, const at::Tensor& target_in, int64_t vocab_start, double scale) {
  const at::Tensor logits = checked_logits(logits_in, "logit_stats");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_rows({{"target", &target_in}}, logits, "logit_stats");
  const at::Tensor target = target_in.to(at::kLong).contiguous();
  at::Tensor stats = at::empty({rows, 4}, logits.options().dtype(at::kFloat));
  if (rows == 0) return stats;
  const int64_t* tgt = target.data_ptr<int64_t>();
  float* out = stats.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1));
  dispatch_logits(logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* base = logits.data_ptr<scalar_t>();
    const float fscale = static_cast<float>(scale);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* z = base + r * stride;
        float* o = out + r * 4;
        if (vocab == 0) {
          o[0] = -std::numeric_limits<float>::infinity();
          o[1] = o[2] = 0.0f;
        } else {
          row_stats(z, vocab, fscale, o);
        }
        const int64_t local = tgt[r] - vocab_start;
        o[3] = (local >= 0 && local < vocab) ? load(z, local) * fscale : 0.0f;
      }
    });
  });
  return stats;
}

at::Tensor log_prob_entropy_backward(const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                                     const at::Tensor& logits_in, const at::Tensor& target_in, const at::Tensor& log_z,
                                     const at::Tensor& entropy, int64_t vocab_start, double scale) {
  const char* op = "log_prob_entropy_backward";
  const at::Tensor logits = checked_logits(logits_in, op);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_rows({{"target", &target_in}, {"grad_log_prob", &grad_log_prob}, {"grad_entropy", &grad_entropy},
              {"log_z", &log_z}, {"entropy", &entropy}},
             logits, op);
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor target = target_in.to(at::kLong).contiguous();
  const at::Tensor g_lp = f32(grad_log_prob), g_ent = f32(grad_entropy), lz = f32(log_z), ent = f32(entropy);
  at::Tensor grad = at::empty({rows, vocab}, logits.options());
  if (rows == 0 || vocab == 0) return grad;
  const int64_t stride = logits.stride(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / vocab);
  const float fscale = static_cast<float>(scale);
  dispatch_logits(logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* base = logits.data_ptr<scalar_t>();
    scalar_t* out = grad.data_ptr<scalar_t>();
    const int64_t* tgt = target.data_ptr<int64_t>();
    const float *glp = g_lp.data_ptr<float>(), *gent = g_ent.data_ptr<float>();
    const float *lzp = lz.data_ptr<float>(), *entp = ent.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* z = base + r * stride;
        scalar_t* g = out + r * vocab;
        row_backward(z, vocab, fscale, lzp[r], entp[r], glp[r], gent[r], g);
        const int64_t local = tgt[r] - vocab_start;
        if (local >= 0 && local < vocab) {
          // The target's extra term, added in fp32 before the final rounding.
          const float raw = load(z, local) * fscale - lzp[r];
          const float lp = raw < kShiftFloor ? kShiftFloor : raw;
          const float p = exp_approx(lp);
          const float base_grad = -fscale * p * (glp[r] + gent[r] * (lp + entp[r]));
          store(g, local, base_grad + fscale * glp[r]);
        }
      }
    });
  });
  return grad;
}

}  // namespace
}  // namespace cpu
}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CPU, m) {
  m.impl("logit_stats", &hybridflow::cpu::logit_stats);
  m.impl("log_prob_entropy_backward", &hybridflow::cpu::log_prob_entropy_backward);
}
