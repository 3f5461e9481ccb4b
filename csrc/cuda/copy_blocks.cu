// CUDA kernel of copy_blocks: rectangular byte copies into one destination
// buffer, the layout transforms of weight resharding.
//
// The blocks travel as kernel arguments, kBatch per launch (no device memory,
// no host-to-device copy): grid.y picks the block within the batch and grid.x
// tiles it. Each block is copied in the widest unit (16, 8, 4, 2 or 1 bytes)
// that divides both addresses, the row length and (for more than one row) both
// row strides. Blocks are sorted by size before batching so that one launch's
// blocks need similar numbers of tiles and few thread blocks find no work.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace hybridflow {
namespace cuda {
namespace {

// One block resolved to device addresses, in copy units of 2^log2_unit bytes.
struct Job {
  const char* src;
  char* dst;
  int64_t src_stride;  // bytes
  int64_t dst_stride;  // bytes
  int64_t rows;
  int64_t units_per_row;
  int64_t log2_unit;
};

// 32 jobs of 56 bytes: 1792 bytes of kernel parameters, well under the 4 KB
// that every CUDA version accepts.
constexpr int kBatch = 32;
struct Batch {
  Job jobs[kBatch];
};
static_assert(sizeof(Batch) <= 2048, "copy_blocks batch must stay well below the 4 KB kernel-parameter limit");

constexpr int kThreads = 256;
constexpr int64_t kUnitsPerThread = 4;  // per tile; larger blocks loop
constexpr int64_t kMaxTiles = 8192;

// Copies job's rectangle with units of type U; thread (blockIdx.x, threadIdx.x)
// takes units idx, idx + step, ... of the row-major [rows, units_per_row]
// index space. (row, col) advance incrementally, so there are only two
// divisions per thread.
template <typename U>
__device__ __forceinline__ void copy_rect(const Job& job) {
  const int64_t upr = job.units_per_row;
  const int64_t total = job.rows * upr;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first >= total) return;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t step_rows = step / upr, step_cols = step - step_rows * upr;
  int64_t row = first / upr, col = first - row * upr;
  while (row < job.rows) {
    const U* s = reinterpret_cast<const U*>(job.src + row * job.src_stride) + col;
    U* d = reinterpret_cast<U*>(job.dst + row * job.dst_stride) + col;
    *d = __ldg(s);
    row += step_rows;
    col += step_cols;
    if (col >= upr) {
      col -= upr;
      ++row;
    }
  }
}

// __grid_constant__: the batch is read in place from parameter memory even
// though it is indexed by blockIdx.y (otherwise it would be copied to local
// memory first).
__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(const __grid_constant__ Batch batch) {
  const Job& job = batch.jobs[blockIdx.y];
  switch (job.log2_unit) {
    case 4:
      copy_rect<uint4>(job);
      break;
    case 3:
      copy_rect<uint2>(job);
      break;
    case 2:
      copy_rect<unsigned int>(job);
      break;
    case 1:
      copy_rect<unsigned short>(job);
      break;
    default:
      copy_rect<unsigned char>(job);
      break;
  }
}

// log2 of the widest unit (at most 16 bytes) dividing every value OR-ed into `bits`.
int64_t log2_unit(uint64_t bits) {
  int64_t k = 0;
  while (k < 4 && (bits & ((uint64_t{2} << k) - 1)) == 0) ++k;
  return k;
}

}  // namespace

void launch_copy_blocks(char* dst, const BlockCopy* blocks, int64_t num_blocks, cudaStream_t stream) {
  if (num_blocks <= 0) return;
  std::vector<Job> jobs;
  jobs.reserve(static_cast<size_t>(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) {
    const BlockCopy& b = blocks[i];
    if (b.rows <= 0 || b.row_bytes <= 0) continue;
    Job job;
    job.src = b.src + b.src_offset;
    job.dst = dst + b.dst_offset;
    job.src_stride = b.src_stride;
    job.dst_stride = b.dst_stride;
    job.rows = b.rows;
    uint64_t bits = reinterpret_cast<uintptr_t>(job.src) | reinterpret_cast<uintptr_t>(job.dst) |
                    static_cast<uint64_t>(b.row_bytes);
    if (b.rows > 1) bits |= static_cast<uint64_t>(b.src_stride) | static_cast<uint64_t>(b.dst_stride);
    job.log2_unit = log2_unit(bits);
    job.units_per_row = b.row_bytes >> job.log2_unit;
    jobs.push_back(job);
  }
  // Largest first, so each batch holds blocks of similar size.
  std::sort(jobs.begin(), jobs.end(),
            [](const Job& a, const Job& b) { return a.rows * a.units_per_row > b.rows * b.units_per_row; });

  for (size_t start = 0; start < jobs.size(); start += kBatch) {
    const size_t count = std::min<size_t>(kBatch, jobs.size() - start);
    Batch batch{};
    std::copy(jobs.begin() + start, jobs.begin() + start + count, batch.jobs);
    // The first job of the batch is its largest (in units).
    const int64_t units = jobs[start].rows * jobs[start].units_per_row;
    const int64_t per_tile = kThreads * kUnitsPerThread;
    const int64_t tiles = std::min<int64_t>((units + per_tile - 1) / per_tile, kMaxTiles);
    copy_blocks_kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(count)), kThreads, 0, stream>>>(
        batch);
  }
}

}  // namespace cuda
}  // namespace hybridflow
