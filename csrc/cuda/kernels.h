// Launchers of the CUDA kernels, in plain C++ types.
//
// The .cu files under csrc/cuda include only the CUDA runtime and this header,
// never torch: they compile with nvcc alone (make test compiles each one for
// sm_80 and sm_90). csrc/cuda/bindings.cpp, compiled only in CUDA builds of
// the extension, turns tensors into these calls on the current stream.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace hybridflow {
namespace cuda {

// Element type of a logits / weight tensor; all math is fp32.
enum class ScalarKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per-row statistics of scaled logits x_v = scale * logits[r, v] over this
// slice of the vocabulary (ids vocab_start .. vocab_start + vocab - 1):
//   stats[r, 0] = m = max_v x_v
//   stats[r, 1] = s = sum_v exp(x_v - m)
//   stats[r, 2] = w = sum_v exp(x_v - m) * (x_v - m)
//   stats[r, 3] = x_target if vocab_start <= target[r] < vocab_start + vocab, else 0
// logits rows are `row_stride` elements apart (unit stride within a row);
// stats is a contiguous [rows, 4] fp32 array.
void launch_logit_stats(const void* logits, ScalarKind kind, int64_t rows, int64_t vocab, int64_t row_stride,
                        const int64_t* target, int64_t vocab_start, float scale, float* stats,
                        cudaStream_t stream);

// Gradient of (log p_target, entropy) with respect to the logits slice, given
// the global log-normaliser log_z[r] and entropy[r] of the scaled logits:
//   lp_v = x_v - log_z,  p_v = exp(lp_v)
//   grad[r, v] = scale * (g_lp * (1[v == target - vocab_start] - p_v) - g_ent * p_v * (lp_v + entropy))
// grad_logits is a contiguous [rows, vocab] array of the logits' element type.
void launch_log_prob_entropy_backward(const float* grad_log_prob, const float* grad_entropy, const void* logits,
                                      ScalarKind kind, int64_t rows, int64_t vocab, int64_t row_stride,
                                      const int64_t* target, const float* log_z, const float* entropy,
                                      int64_t vocab_start, float scale, void* grad_logits, cudaStream_t stream);

// Generalised advantage estimation over contiguous [batch, length] fp32 arrays,
// scanning each row backwards; a position with mask m passes the later state
// through in proportion (1 - m):
//   delta = r_t + gamma * next_value - v_t;  a_t = delta + gamma * lam * next_adv
//   advantages_t = a_t * m_t;  returns_t = (advantages_t + v_t) * m_t
//   next_value = m_t * v_t + (1 - m_t) * next_value;  next_adv = m_t * a_t + (1 - m_t) * next_adv
void launch_gae(const float* rewards, const float* values, const float* mask, int64_t batch, int64_t length,
                float gamma, float lam, float* advantages, float* returns, cudaStream_t stream);

// Discounted reward-to-go, G_t = m_t * (r_t + gamma * G_{t+1}), G_length = 0,
// over contiguous [batch, length] fp32 arrays.
void launch_discounted_returns(const float* rewards, const float* mask, int64_t batch, int64_t length, float gamma,
                               float* returns, cudaStream_t stream);

// One rectangular copy: `rows` rows of `row_bytes` bytes, from src + src_offset
// (rows src_stride bytes apart) to dst + dst_offset (rows dst_stride bytes apart).
struct BlockCopy {
  const char* src;
  int64_t src_offset;
  int64_t src_stride;
  int64_t dst_offset;
  int64_t dst_stride;
  int64_t rows;
  int64_t row_bytes;
};

// Every block copied into dst; blocks is a host array (its entries travel as
// kernel arguments, so no device memory is allocated). Blocks must not overlap
// in dst.
void launch_copy_blocks(char* dst, const BlockCopy* blocks, int64_t num_blocks, cudaStream_t stream);

}  // namespace cuda
}  // namespace hybridflow
