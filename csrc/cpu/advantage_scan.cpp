// CPU advantage scans over [batch, length]: GAE and the discounted
// reward-to-go. Each row is one backward scan; rows run in parallel. The
// arithmetic is the same, step for step, as the torch loops they replace.
// A position with mask 0 is skipped: it gets 0, the later state passes
// through it, and its inputs (NaN included) are never read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

namespace hybridflow {
namespace cpu {
namespace {

at::Tensor checked_2d(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [batch, length], got shape ", t.sizes());
  TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " has shape ", t.sizes(), " but rewards have ", like.sizes());
  return t.to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards_in, const at::Tensor& values_in,
                                       const at::Tensor& mask_in, double gamma_d, double lam_d) {
  const at::Tensor rewards = checked_2d(rewards_in, rewards_in, "gae", "rewards");
  const at::Tensor values = checked_2d(values_in, rewards_in, "gae", "values");
  const at::Tensor mask = checked_2d(mask_in, rewards_in, "gae", "mask");
  const int64_t batch = rewards.size(0), length = rewards.size(1);
  at::Tensor advantages = at::empty_like(rewards);
  at::Tensor returns = at::empty_like(rewards);
  const float gamma = static_cast<float>(gamma_d), lam = static_cast<float>(lam_d);
  const float *r = rewards.data_ptr<float>(), *v = values.data_ptr<float>(), *m = mask.data_ptr<float>();
  float *adv = advantages.data_ptr<float>(), *ret = returns.data_ptr<float>();
  at::parallel_for(0, batch, std::max<int64_t>(1, 4096 / std::max<int64_t>(length, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * length;
      float next_value = 0.0f, next_adv = 0.0f;
      for (int64_t t = length - 1; t >= 0; --t) {
        const float mt = m[o + t];
        if (mt == 0.0f) {
          adv[o + t] = 0.0f;
          ret[o + t] = 0.0f;
          continue;
        }
        const float delta = r[o + t] + gamma * next_value - v[o + t];
        const float a = delta + gamma * lam * next_adv;
        adv[o + t] = a * mt;
        ret[o + t] = (a * mt + v[o + t]) * mt;
        next_value = mt * v[o + t] + (1.0f - mt) * next_value;
        next_adv = mt * a + (1.0f - mt) * next_adv;
      }
    }
  });
  return {advantages, returns};
}

at::Tensor discounted_returns(const at::Tensor& rewards_in, const at::Tensor& mask_in, double gamma_d) {
  const at::Tensor rewards = checked_2d(rewards_in, rewards_in, "discounted_returns", "rewards");
  const at::Tensor mask = checked_2d(mask_in, rewards_in, "discounted_returns", "mask");
  const int64_t batch = rewards.size(0), length = rewards.size(1);
  at::Tensor returns = at::empty_like(rewards);
  const float gamma = static_cast<float>(gamma_d);
  const float *r = rewards.data_ptr<float>(), *m = mask.data_ptr<float>();
  float* ret = returns.data_ptr<float>();
  at::parallel_for(0, batch, std::max<int64_t>(1, 4096 / std::max<int64_t>(length, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * length;
      float running = 0.0f;  // G at the next valid position
      for (int64_t t = length - 1; t >= 0; --t) {
        const float mt = m[o + t];
        if (mt == 0.0f) {
          ret[o + t] = 0.0f;
          continue;
        }
        const float g = r[o + t] + gamma * running;
        ret[o + t] = g * mt;
        running = mt * g + (1.0f - mt) * running;
      }
    }
  });
  return returns;
}

}  // namespace
}  // namespace cpu
}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CPU, m) {
  m.impl("gae", &hybridflow::cpu::gae);
  m.impl("discounted_returns", &hybridflow::cpu::discounted_returns);
}
