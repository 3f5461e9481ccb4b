// Validation of copy_blocks arguments, shared by the CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <vector>

namespace hybridflow {

// One row of the blocks table, in elements.
struct BlockSpec {
  int64_t source, src_offset, src_stride, dst_offset, dst_stride, rows, cols;
};

// Checks out / sources / blocks and returns the blocks table. Every block must
// lie inside its source and inside out; all tensors 1-D, contiguous, one dtype
// and device. blocks is an int64 CPU tensor [num_blocks, 7] with columns
// (source_index, src_offset, src_stride, dst_offset, dst_stride, rows, cols).
inline std::vector<BlockSpec> checked_blocks(const at::Tensor& out, at::TensorList sources, const at::Tensor& blocks) {
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "copy_blocks: out must be a 1-D contiguous tensor, got shape ",
              out.sizes());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK(s.dim() == 1 && s.is_contiguous(), "copy_blocks: source ", i,
                " must be a 1-D contiguous tensor, got shape ", s.sizes());
    TORCH_CHECK(s.scalar_type() == out.scalar_type(), "copy_blocks: source ", i, " has dtype ", s.scalar_type(),
                ", out has ", out.scalar_type());
    TORCH_CHECK(s.device() == out.device(), "copy_blocks: source ", i, " is on ", s.device(), ", out on ",
                out.device());
  }
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 7 && blocks.scalar_type() == at::kLong && blocks.is_cpu(),
              "copy_blocks: blocks must be an int64 CPU tensor [num_blocks, 7], got ", blocks.scalar_type(), " ",
              blocks.sizes(), " on ", blocks.device());
  const at::Tensor table = blocks.contiguous();
  const int64_t* p = table.data_ptr<int64_t>();
  std::vector<BlockSpec> specs(table.size(0));
  for (int64_t i = 0; i < table.size(0); ++i) {
    BlockSpec b{p[7 * i], p[7 * i + 1], p[7 * i + 2], p[7 * i + 3], p[7 * i + 4], p[7 * i + 5], p[7 * i + 6]};
    TORCH_CHECK(b.source >= 0 && b.source < static_cast<int64_t>(sources.size()), "copy_blocks: block ", i,
                " names source ", b.source, " but there are ", sources.size());
    TORCH_CHECK(b.rows >= 0 && b.cols >= 0 && b.src_offset >= 0 && b.dst_offset >= 0 && b.src_stride >= b.cols &&
                    b.dst_stride >= b.cols,
                "copy_blocks: block ", i, " has negative sizes or a stride below its width (rows ", b.rows, ", cols ",
                b.cols, ", strides ", b.src_stride, "/", b.dst_stride, ")");
    if (b.rows > 0 && b.cols > 0) {
      // Ends computed with overflow checks: a huge stride must not wrap into range.
      int64_t src_span = 0, dst_span = 0, src_end = 0, dst_end = 0;
      const bool overflow = c10::mul_overflows(b.rows - 1, b.src_stride, &src_span) ||
                            c10::add_overflows(b.src_offset, src_span, &src_end) ||
                            c10::add_overflows(src_end, b.cols, &src_end) ||
                            c10::mul_overflows(b.rows - 1, b.dst_stride, &dst_span) ||
                            c10::add_overflows(b.dst_offset, dst_span, &dst_end) ||
                            c10::add_overflows(dst_end, b.cols, &dst_end);
      TORCH_CHECK(!overflow, "copy_blocks: block ", i, " addresses overflow int64 (offsets ", b.src_offset, "/",
                  b.dst_offset, ", strides ", b.src_stride, "/", b.dst_stride, ", rows ", b.rows, ")");
      TORCH_CHECK(src_end <= sources[b.source].numel(), "copy_blocks: block ", i, " reads up to element ", src_end,
                  " of source ", b.source, " which has ", sources[b.source].numel());
      TORCH_CHECK(dst_end <= out.numel(), "copy_blocks: block ", i, " writes up to element ", dst_end,
                  " of out which has ", out.numel());
    }
    specs[i] = b;
  }
  return specs;
}

}  // namespace hybridflow
