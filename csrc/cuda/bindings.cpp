// CUDA implementations of the hybridflow kernel ops (schemas in
// csrc/library.cpp): argument checks and tensor plumbing around the launchers
// of kernels.h, on the current CUDA stream of the tensors' device. Compiled by
// the host compiler, only in CUDA builds of the extension.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../copy_blocks_check.h"
#include "../log_prob_entropy_check.h"
#include "../ops.h"
#include "kernels.h"

namespace hybridflow {
namespace cuda {
namespace {

// Launches are asynchronous; this reports a bad launch configuration (or an
// earlier asynchronous error) at the op that caused it.
void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the op runs on ", ref.device(),
              "; move every tensor argument to one CUDA device");
}

ScalarKind scalar_kind(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ScalarKind::kFloat32;
    case at::kBFloat16:
      return ScalarKind::kBFloat16;
    case at::kHalf:
      return ScalarKind::kFloat16;
    default:
      TORCH_CHECK(false, op, ": logits dtype ", t.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
}

// The shared checks, plus: the logits are on a CUDA device.
at::Tensor checked_cuda_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got one on ", logits.device());
  return checked_logits(logits, op);
}

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

at::Tensor logit_stats(const at::Tensor& logits_in, const at::Tensor& target_in, int64_t vocab_start, double scale) {
  const char* op = "logit_stats";
  const at::Tensor logits = checked_cuda_logits(logits_in, op);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_rows({{"target", &target_in}}, logits, op);
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor target = target_in.to(at::kLong).contiguous();
  at::Tensor stats = at::empty({rows, 4}, logits.options().dtype(at::kFloat));
  if (rows == 0) return stats;
  launch_logit_stats(logits.data_ptr(), scalar_kind(logits, op), rows, vocab, logits.stride(0),
                     target.data_ptr<int64_t>(), vocab_start, static_cast<float>(scale), stats.data_ptr<float>(),
                     current_stream());
  check_launch(op);
  return stats;
}

at::Tensor log_prob_entropy_backward(const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                                     const at::Tensor& logits_in, const at::Tensor& target_in, const at::Tensor& log_z,
                                     const at::Tensor& entropy, int64_t vocab_start, double scale) {
  const char* op = "log_prob_entropy_backward";
  const at::Tensor logits = checked_cuda_logits(logits_in, op);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_rows({{"target", &target_in}, {"grad_log_prob", &grad_log_prob}, {"grad_entropy", &grad_entropy},
              {"log_z", &log_z}, {"entropy", &entropy}},
             logits, op);
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor target = target_in.to(at::kLong).contiguous();
  const at::Tensor g_lp = f32(grad_log_prob), g_ent = f32(grad_entropy), lz = f32(log_z), ent = f32(entropy);
  at::Tensor grad = at::empty({rows, vocab}, logits.options());  // contiguous, logits' dtype
  if (rows == 0 || vocab == 0) return grad;
  launch_log_prob_entropy_backward(g_lp.data_ptr<float>(), g_ent.data_ptr<float>(), logits.data_ptr(),
                                   scalar_kind(logits, op), rows, vocab, logits.stride(0), target.data_ptr<int64_t>(),
                                   lz.data_ptr<float>(), ent.data_ptr<float>(), vocab_start,
                                   static_cast<float>(scale), grad.data_ptr(), current_stream());
  check_launch(op);
  return grad;
}

// [batch, length] scan inputs as contiguous fp32 on `ref`'s device.
at::Tensor scan_input(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [batch, length], got shape ", t.sizes());
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " has shape ", t.sizes(), " but rewards has shape ",
              ref.sizes());
  check_device(t, ref, op, name);
  return f32(t);
}

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards_in, const at::Tensor& values_in,
                                       const at::Tensor& mask_in, double gamma, double lam) {
  const char* op = "gae";
  TORCH_CHECK(rewards_in.is_cuda(), op, ": rewards must be a CUDA tensor, got one on ", rewards_in.device());
  c10::cuda::CUDAGuard guard(rewards_in.device());
  const at::Tensor rewards = scan_input(rewards_in, rewards_in, op, "rewards");
  const at::Tensor values = scan_input(values_in, rewards_in, op, "values");
  const at::Tensor mask = scan_input(mask_in, rewards_in, op, "mask");
  const int64_t batch = rewards.size(0), length = rewards.size(1);
  at::Tensor advantages = at::empty({batch, length}, rewards.options());
  at::Tensor returns = at::empty({batch, length}, rewards.options());
  if (batch == 0 || length == 0) return {advantages, returns};
  launch_gae(rewards.data_ptr<float>(), values.data_ptr<float>(), mask.data_ptr<float>(), batch, length,
             static_cast<float>(gamma), static_cast<float>(lam), advantages.data_ptr<float>(),
             returns.data_ptr<float>(), current_stream());
  check_launch(op);
  return {advantages, returns};
}

at::Tensor discounted_returns(const at::Tensor& rewards_in, const at::Tensor& mask_in, double gamma) {
  const char* op = "discounted_returns";
  TORCH_CHECK(rewards_in.is_cuda(), op, ": rewards must be a CUDA tensor, got one on ", rewards_in.device());
  c10::cuda::CUDAGuard guard(rewards_in.device());
  const at::Tensor rewards = scan_input(rewards_in, rewards_in, op, "rewards");
  const at::Tensor mask = scan_input(mask_in, rewards_in, op, "mask");
  const int64_t batch = rewards.size(0), length = rewards.size(1);
  at::Tensor returns = at::empty({batch, length}, rewards.options());
  if (batch == 0 || length == 0) return returns;
  launch_discounted_returns(rewards.data_ptr<float>(), mask.data_ptr<float>(), batch, length,
                            static_cast<float>(gamma), returns.data_ptr<float>(), current_stream());
  check_launch(op);
  return returns;
}

// Validation (csrc/copy_blocks_check.h) is shared with the CPU kernel, so one
// blocks table is valid or invalid on both devices. `out` is taken by value,
// as by the CPU kernel: every kernel of an op must have the same C++ signature.
void copy_blocks(at::Tensor out, at::TensorList sources, const at::Tensor& blocks) {
  TORCH_CHECK(out.is_cuda(), "copy_blocks: out must be a CUDA tensor, got one on ", out.device());
  const std::vector<BlockSpec> specs = checked_blocks(out, sources, blocks);
  const int64_t elem = static_cast<int64_t>(out.element_size());
  std::vector<BlockCopy> copies;
  copies.reserve(specs.size());
  for (const BlockSpec& b : specs) {
    if (b.rows == 0 || b.cols == 0) continue;
    // checked_blocks keeps the block inside tensors that exist, so these byte counts fit in int64.
    BlockCopy copy;
    copy.src = static_cast<const char*>(sources[static_cast<size_t>(b.source)].data_ptr());
    copy.src_offset = b.src_offset * elem;
    copy.src_stride = b.src_stride * elem;
    copy.dst_offset = b.dst_offset * elem;
    copy.dst_stride = b.dst_stride * elem;
    copy.rows = b.rows;
    copy.row_bytes = b.cols * elem;
    copies.push_back(copy);
  }
  if (copies.empty()) return;
  c10::cuda::CUDAGuard guard(out.device());
  launch_copy_blocks(static_cast<char*>(out.data_ptr()), copies.data(), static_cast<int64_t>(copies.size()),
                     current_stream());
  check_launch("copy_blocks");
}

}  // namespace
}  // namespace cuda
}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CUDA, m) {
  m.impl("logit_stats", &hybridflow::cuda::logit_stats);
  m.impl("log_prob_entropy_backward", &hybridflow::cuda::log_prob_entropy_backward);
  m.impl("gae", &hybridflow::cuda::gae);
  m.impl("discounted_returns", &hybridflow::cuda::discounted_returns);
  m.impl("copy_blocks", &hybridflow::cuda::copy_blocks);
  // Device-generic composites (csrc/log_prob_entropy.cpp, csrc/linear_log_prob_entropy.cpp).
  m.impl("merge_logit_stats", &hybridflow::merge_logit_stats);
  m.impl("log_prob_entropy", &hybridflow::log_prob_entropy);
  m.impl("linear_logit_stats", &hybridflow::linear_logit_stats);
  m.impl("linear_log_prob_entropy", &hybridflow::linear_log_prob_entropy);
  m.impl("linear_log_prob_entropy_backward", &hybridflow::linear_log_prob_entropy_backward);
}
