// CPU resharding copies: rectangular blocks of flat source tensors written
// into a flat output tensor, one memcpy per block row, blocks in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../copy_blocks_check.h"

namespace hybridflow {
namespace cpu {
namespace {

void copy_blocks(at::Tensor out, at::TensorList sources, const at::Tensor& blocks) {
  const std::vector<BlockSpec> specs = checked_blocks(out, sources, blocks);
  const int64_t element = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  std::vector<const char*> src(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) src[i] = static_cast<const char*>(sources[i].data_ptr());
  int64_t total = 0;
  for (const BlockSpec& b : specs) total += b.rows * b.cols;
  // Small layouts are not worth a thread hand-off.
  const int64_t grain = total * element < (1 << 20) ? static_cast<int64_t>(specs.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(specs.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const BlockSpec& b = specs[i];
      const char* s = src[b.source] + b.src_offset * element;
      char* d = dst + b.dst_offset * element;
      const size_t bytes = static_cast<size_t>(b.cols * element);
      if (b.src_stride == b.cols && b.dst_stride == b.cols) {
        std::memcpy(d, s, bytes * b.rows);
        continue;
      }
      for (int64_t row = 0; row < b.rows; ++row) {
        std::memcpy(d + row * b.dst_stride * element, s + row * b.src_stride * element, bytes);
      }
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace hybridflow

TORCH_LIBRARY_IMPL(hybridflow, CPU, m) { m.impl("copy_blocks", &hybridflow::cpu::copy_blocks); }
