// CUDA kernels of the advantage scans (GAE and discounted reward-to-go) over
// contiguous [batch, length] fp32 arrays: one thread per row, scanning the row
// backwards. A position with mask 0 is skipped: it gets 0, the later state
// passes through it, and its inputs (NaN included) are never read.
//
// The arithmetic is that of kernels.h, one rounding per operation and in the
// same order as the torch loops in hybridengine/ops/advantage_scan.py: every
// step uses the __f*_rn intrinsics, which nvcc never contracts into fused
// multiply-adds, so the results match the CPU kernel and a torch loop bit for
// bit (given the same fp32 gamma and gamma * lam).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace hybridflow {
namespace cuda {
namespace {

constexpr int kThreads = 128;

unsigned row_blocks(int64_t batch) {
  const int64_t blocks = (batch + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 0x7fffffff ? blocks : 0x7fffffff);
}

__global__ void __launch_bounds__(kThreads)
    gae_kernel(const float* __restrict__ rewards, const float* __restrict__ values, const float* __restrict__ mask,
               int64_t batch, int64_t length, float gamma, float gamma_lam, float* __restrict__ advantages,
               float* __restrict__ returns) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < batch; row += stride) {
    const int64_t base = row * length;
    float next_value = 0.0f, next_adv = 0.0f;
    for (int64_t t = length - 1; t >= 0; --t) {
      const float m = mask[base + t];
      if (m == 0.0f) {
        advantages[base + t] = 0.0f;
        returns[base + t] = 0.0f;
        continue;
      }
      const float r = rewards[base + t], v = values[base + t];
      // delta = r_t + gamma * next_value - v_t;  a_t = delta + gamma * lam * next_adv
      const float delta = __fsub_rn(__fadd_rn(r, __fmul_rn(gamma, next_value)), v);
      const float a = __fadd_rn(delta, __fmul_rn(gamma_lam, next_adv));
      const float adv = __fmul_rn(a, m);
      advantages[base + t] = adv;
      returns[base + t] = __fmul_rn(__fadd_rn(adv, v), m);
      // A position with mask m passes the later state through in proportion 1 - m.
      const float keep = __fsub_rn(1.0f, m);
      next_value = __fadd_rn(__fmul_rn(m, v), __fmul_rn(keep, next_value));
      next_adv = __fadd_rn(__fmul_rn(m, a), __fmul_rn(keep, next_adv));
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    discounted_returns_kernel(const float* __restrict__ rewards, const float* __restrict__ mask, int64_t batch,
                              int64_t length, float gamma, float* __restrict__ returns) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < batch; row += stride) {
    const int64_t base = row * length;
    float running = 0.0f;  // G at the next valid position
    for (int64_t t = length - 1; t >= 0; --t) {
      const float m = mask[base + t];
      if (m == 0.0f) {
        returns[base + t] = 0.0f;
        continue;
      }
      const float g = __fadd_rn(rewards[base + t], __fmul_rn(gamma, running));
      returns[base + t] = __fmul_rn(g, m);
      running = __fadd_rn(__fmul_rn(m, g), __fmul_rn(__fsub_rn(1.0f, m), running));
    }
  }
}

}  // namespace

void launch_gae(const float* rewards, const float* values, const float* mask, int64_t batch, int64_t length,
                float gamma, float lam, float* advantages, float* returns, cudaStream_t stream) {
  if (batch <= 0 || length <= 0) return;
  // gamma * lam rounded once from the fp32 arguments, as the CPU kernel does.
  // (The Python loop rounds the double product of the unrounded Python floats
  // instead, which can differ from this in the last bit.)
  const float gamma_lam = gamma * lam;
  gae_kernel<<<row_blocks(batch), kThreads, 0, stream>>>(rewards, values, mask, batch, length, gamma, gamma_lam,
                                                         advantages, returns);
}

void launch_discounted_returns(const float* rewards, const float* mask, int64_t batch, int64_t length, float gamma,
                               float* returns, cudaStream_t stream) {
  if (batch <= 0 || length <= 0) return;
  discounted_returns_kernel<<<row_blocks(batch), kThreads, 0, stream>>>(rewards, mask, batch, length, gamma,
                                                                        returns);
}

}  // namespace cuda
}  // namespace hybridflow
