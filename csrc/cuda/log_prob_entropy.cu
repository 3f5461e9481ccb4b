// CUDA kernels of the fused log-prob / entropy ops: per-row statistics of a
// vocabulary slice of logits (forward) and the gradient with respect to that
// slice (backward). Semantics are those of kernels.h and of the CPU kernels in
// csrc/cpu/log_prob_entropy.cpp; all arithmetic is fp32.
//
// Forward: one thread block per row, a single pass over the row. Each thread
// keeps an online (m, s, w) triple,
//   m = max x,  s = sum exp(x - m),  w = sum exp(x - m) * (x - m),
// rescaling it whenever the running max grows; the block then merges the
// threads' triples (warp shuffles, then one warp over the per-warp results).
// Backward: elementwise over [rows, vocab], one read of the logits and one
// write of the gradient.
//
// Rows are read with 16-byte loads: the few elements before the row's first
// 16-byte boundary (and after its last one) are handled one at a time, so any
// row alignment gets the vector path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace hybridflow {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kVecBytes = 16;

// ---------------------------------------------------------------------------
// Element access in fp32. Elem<T>::kVec elements fill one 16-byte uint4; the
// bfloat16 / half conversions work on the raw bits (little-endian: element 2i
// is the low half of 32-bit word i), which also keeps this file independent of
// the __CUDA_NO_*_CONVERSIONS__ macros that torch's extension builds define.

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static float load(const float* p) { return __ldg(p); }
  __device__ static void store(float* p, float v) { *p = v; }
  __device__ static void unpack(const uint4& raw, float* x) {
    x[0] = __uint_as_float(raw.x);
    x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z);
    x[3] = __uint_as_float(raw.w);
  }
  __device__ static uint4 pack(const float* x) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  }
};

// 16-bit types: eight elements per 16 bytes, two per 32-bit word; Codec
// supplies the per-word conversion.
template <typename Codec>
struct PackedHalves {
  static constexpr int kVec = 8;
  __device__ static void unpack(const uint4& raw, float* x) {
    Codec::unpack_word(raw.x, x);
    Codec::unpack_word(raw.y, x + 2);
    Codec::unpack_word(raw.z, x + 4);
    Codec::unpack_word(raw.w, x + 6);
  }
  __device__ static uint4 pack(const float* x) {
    return make_uint4(Codec::pack_word(x[0], x[1]), Codec::pack_word(x[2], x[3]), Codec::pack_word(x[4], x[5]),
                      Codec::pack_word(x[6], x[7]));
  }
};

struct BFloat16Codec {
  __device__ static void unpack_word(uint32_t word, float* x) {
    x[0] = __uint_as_float(word << 16);
    x[1] = __uint_as_float(word & 0xffff0000u);
  }
  __device__ static uint32_t pack_word(float lo, float hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
  }
};

struct HalfCodec {
  __device__ static void unpack_word(uint32_t word, float* x) {
    x[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
    x[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
  }
  __device__ static uint32_t pack_word(float lo, float hi) {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
  }
};

template <>
struct Elem<__nv_bfloat16> : PackedHalves<BFloat16Codec> {
  __device__ static float load(const __nv_bfloat16* p) { return __bfloat162float(__ldg(p)); }
  __device__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};

template <>
struct Elem<__half> : PackedHalves<HalfCodec> {
  __device__ static float load(const __half* p) { return __half2float(__ldg(p)); }
  __device__ static void store(__half* p, float v) { *p = __float2half_rn(v); }
};

// Elements of type T before the first 16-byte boundary at or after p (p itself
// is aligned to sizeof(T)).
template <typename T>
__device__ __forceinline__ int64_t head_elems(const T* p) {
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(p) % kVecBytes;
  return misalign == 0 ? 0 : static_cast<int64_t>((kVecBytes - misalign) / sizeof(T));
}

// ---------------------------------------------------------------------------
// Online softmax statistics.
//
// A triple (m, s, w) summarises a set of values x as m = max x,
// s = sum exp(x - m), w = sum exp(x - m) * (x - m). Re-expressed against a
// larger max M (a = exp(m - M)):
//   s' = a * s,  w' = a * (w + (m - M) * s)
// since exp(x - M) = a * exp(x - m) and x - M = (x - m) + (m - M). An empty set
// is (-inf, 0, 0); its shift term (m - M) * s would be -inf * 0, so it is
// skipped (a = exp(-inf) = 0 already zeroes the set). A NaN logit makes s and
// w NaN, and the guards below keep that NaN rather than dropping it. An
// infinite logit gives NaN, as torch's log_softmax does.
struct Stats {
  float m;
  float s;
  float w;
};

__device__ __forceinline__ Stats empty_stats() { return Stats{-INFINITY, 0.0f, 0.0f}; }

// a <- a merged with b.
__device__ __forceinline__ void merge(Stats& a, const Stats& b) {
  const float M = fmaxf(a.m, b.m);
  if (M == -INFINITY) {
    // Both sides empty (s = w = 0, or NaN to be kept): exp(-inf - -inf) must
    // not be evaluated.
    a.s += b.s;
    a.w += b.w;
    return;
  }
  const float ea = __expf(a.m - M);
  const float eb = __expf(b.m - M);
  const float wa = a.m == -INFINITY ? a.w : a.w + (a.m - M) * a.s;
  const float wb = b.m == -INFINITY ? b.w : b.w + (b.m - M) * b.s;
  a.m = M;
  a.s = ea * a.s + eb * b.s;
  a.w = ea * wa + eb * wb;
}

// Adds n values x[0..n) to the running triple: one rescale to the values' max
// (if it exceeds the running one), then one exp per value.
template <int N>
__device__ __forceinline__ void absorb(Stats& st, const float* x) {
  float vmax = x[0];
#pragma unroll
  for (int j = 1; j < N; ++j) vmax = fmaxf(vmax, x[j]);  // fmaxf skips NaN; NaN flows through d below
  if (vmax > st.m) {
    const float a = __expf(st.m - vmax);
    const float shift = st.m == -INFINITY ? 0.0f : (st.m - vmax) * st.s;
    st.w = a * (st.w + shift);
    st.s = a * st.s;
    st.m = vmax;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float d = x[j] - st.m;  // <= 0 (NaN for a NaN logit)
    const float e = __expf(d);
    // A -inf logit contributes exactly nothing; skipping it avoids 0 * -inf and
    // -inf - -inf when the whole row so far is -inf.
    const bool live = x[j] != -INFINITY;
    st.s += live ? e : 0.0f;
    st.w += live ? e * d : 0.0f;
  }
}

__device__ __forceinline__ Stats shfl_xor(const Stats& st, int lane_mask) {
  return Stats{__shfl_xor_sync(kFullMask, st.m, lane_mask), __shfl_xor_sync(kFullMask, st.s, lane_mask),
               __shfl_xor_sync(kFullMask, st.w, lane_mask)};
}

// Merge of every thread's triple; the result is valid in thread 0. blockDim.x
// is a multiple of 32 and at most 32 * 32. Ends with a barrier, so `shared`
// may be reused right away.
__device__ __forceinline__ Stats block_merge(Stats st, Stats* shared) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) merge(st, shfl_xor(st, offset));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) shared[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < static_cast<int>(blockDim.x / kWarp) ? shared[lane] : empty_stats();
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) merge(st, shfl_xor(st, offset));
  }
  __syncthreads();
  return st;
}

// ---------------------------------------------------------------------------
// Forward: one block per row (rows beyond gridDim.x loop).

constexpr int kStatsMaxThreads = 256;
constexpr int kStatsUnroll = 4;  // 16-byte loads in flight per thread

template <typename T>
__global__ void __launch_bounds__(kStatsMaxThreads)
    logit_stats_kernel(const char* __restrict__ logits, int64_t rows, int64_t vocab, int64_t row_stride_bytes,
                       const int64_t* __restrict__ target, int64_t vocab_start, float scale,
                       float* __restrict__ stats) {
  constexpr int N = Elem<T>::kVec;
  __shared__ Stats shared[kStatsMaxThreads / kWarp];
  const int64_t tid = threadIdx.x, nthreads = blockDim.x;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = reinterpret_cast<const T*>(logits + row * row_stride_bytes);

    // Thread 0 fetches the target logit first, so its latency hides behind the pass.
    float x_target = 0.0f;
    if (tid == 0) {
      const int64_t local = target[row] - vocab_start;
      if (local >= 0 && local < vocab) x_target = Elem<T>::load(z + local) * scale;
    }

    Stats st = empty_stats();
    const int64_t head = min(vocab, head_elems(z));
    const int64_t nvec = (vocab - head) / N;
    const int64_t tail_start = head + nvec * N;
    const uint4* vz = reinterpret_cast<const uint4*>(z + head);

    if (tid < head) {
      const float x = Elem<T>::load(z + tid) * scale;
      absorb<1>(st, &x);
    }
    // Main loop: kStatsUnroll independent loads, then the math.
    int64_t i = tid;
    for (; i + (kStatsUnroll - 1) * nthreads < nvec; i += kStatsUnroll * nthreads) {
      uint4 raw[kStatsUnroll];
#pragma unroll
      for (int u = 0; u < kStatsUnroll; ++u) raw[u] = __ldg(vz + i + u * nthreads);
#pragma unroll
      for (int u = 0; u < kStatsUnroll; ++u) {
        float x[N];
        Elem<T>::unpack(raw[u], x);
#pragma unroll
        for (int j = 0; j < N; ++j) x[j] *= scale;
        absorb<N>(st, x);
      }
    }
    for (; i < nvec; i += nthreads) {
      float x[N];
      Elem<T>::unpack(__ldg(vz + i), x);
#pragma unroll
      for (int j = 0; j < N; ++j) x[j] *= scale;
      absorb<N>(st, x);
    }
    if (tail_start + tid < vocab) {
      const float x = Elem<T>::load(z + tail_start + tid) * scale;
      absorb<1>(st, &x);
    }

    st = block_merge(st, shared);
    if (tid == 0) {
      float* out = stats + row * 4;
      out[0] = st.m;
      out[1] = st.s;
      out[2] = st.w;
      out[3] = x_target;
    }
  }
}

// Threads per row: enough for about kStatsUnroll vectors each, 32 to 256.
int stats_threads(int64_t vocab, int vec) {
  const int64_t vectors = (vocab + vec - 1) / vec;
  int threads = kWarp;
  while (threads < kStatsMaxThreads && static_cast<int64_t>(threads) * kStatsUnroll < vectors) threads *= 2;
  return threads;
}

template <typename T>
void logit_stats_impl(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride, const int64_t* target,
                      int64_t vocab_start, float scale, float* stats, cudaStream_t stream) {
  const int threads = stats_threads(vocab, Elem<T>::kVec);
  const unsigned blocks = static_cast<unsigned>(rows < 0x7fffffff ? rows : 0x7fffffff);
  logit_stats_kernel<T><<<blocks, threads, 0, stream>>>(static_cast<const char*>(logits), rows, vocab,
                                                          row_stride * static_cast<int64_t>(sizeof(T)), target,
                                                          vocab_start, scale, stats);
}

// ---------------------------------------------------------------------------
// Backward: grid x tiles the vocabulary, grid y the rows (rows beyond gridDim.y
// loop). With lp = x - log_z and p = exp(lp), the gradient of kernels.h,
//   scale * (g_lp * (1[v = t] - p) - g_ent * p * (lp + H)),
// is p * (a + b * lp) with a = -scale * (g_lp + g_ent * H), b = -scale * g_ent,
// plus scale * g_lp at the target, added in fp32 before the rounding to T.

constexpr int kBackwardThreads = 256;
constexpr unsigned kMaxGridY = 65535;

struct RowGrad {
  float scale, log_z, a, b, target_extra;
  int64_t target;  // local column of the target, or -1 (or out of range) when not in this slice

  __device__ __forceinline__ float operator()(int64_t v, float logit) const {
    const float lp = logit * scale - log_z;
    // A -inf logit has p = 0 and gradient 0 (p * (a + b * lp) would be 0 * inf).
    float g = lp == -INFINITY ? 0.0f : __expf(lp) * (a + b * lp);
    if (v == target) g += target_extra;
    return g;
  }
};

template <typename T>
__global__ void __launch_bounds__(kBackwardThreads)
    log_prob_entropy_backward_kernel(const float* __restrict__ grad_log_prob, const float* __restrict__ grad_entropy,
                                     const char* __restrict__ logits, int64_t rows, int64_t vocab,
                                     int64_t row_stride_bytes, const int64_t* __restrict__ target,
                                     const float* __restrict__ log_z, const float* __restrict__ entropy,
                                     int64_t vocab_start, float scale, T* __restrict__ grad_logits) {
  constexpr int N = Elem<T>::kVec;
  const int64_t gx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;

  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* z = reinterpret_cast<const T*>(logits + row * row_stride_bytes);
    T* g = grad_logits + row * vocab;
    const float g_lp = grad_log_prob[row], g_ent = grad_entropy[row];
    RowGrad f;
    f.scale = scale;
    f.log_z = log_z[row];
    f.a = -scale * (g_lp + g_ent * entropy[row]);
    f.b = -scale * g_ent;
    f.target_extra = scale * g_lp;
    f.target = target[row] - vocab_start;

    const int64_t head = min(vocab, head_elems(z));
    if (head != min(vocab, head_elems(g))) {
      // Input and output rows are misaligned differently: element by element.
      for (int64_t v = gx; v < vocab; v += gstride) Elem<T>::store(g + v, f(v, Elem<T>::load(z + v)));
      continue;
    }
    const int64_t nvec = (vocab - head) / N;
    const int64_t tail_start = head + nvec * N;
    const uint4* vz = reinterpret_cast<const uint4*>(z + head);
    uint4* vg = reinterpret_cast<uint4*>(g + head);
    for (int64_t i = gx; i < nvec; i += gstride) {
      float x[N];
      Elem<T>::unpack(__ldg(vz + i), x);
      const int64_t v0 = head + i * N;
#pragma unroll
      for (int j = 0; j < N; ++j) x[j] = f(v0 + j, x[j]);
      vg[i] = Elem<T>::pack(x);
    }
    // At most N - 1 elements on each side.
    if (gx < head) Elem<T>::store(g + gx, f(gx, Elem<T>::load(z + gx)));
    if (tail_start + gx < vocab) {
      const int64_t v = tail_start + gx;
      Elem<T>::store(g + v, f(v, Elem<T>::load(z + v)));
    }
  }
}

template <typename T>
void backward_impl(const float* grad_log_prob, const float* grad_entropy, const void* logits, int64_t rows,
                   int64_t vocab, int64_t row_stride, const int64_t* target, const float* log_z,
                   const float* entropy, int64_t vocab_start, float scale, void* grad_logits, cudaStream_t stream) {
  // One vector per thread along the row; capped, the kernel loops past the cap.
  const int64_t vectors = (vocab + Elem<T>::kVec - 1) / Elem<T>::kVec;
  const int64_t tiles = (vectors + kBackwardThreads - 1) / kBackwardThreads;
  const dim3 grid(static_cast<unsigned>(tiles < 65535 ? tiles : 65535),
                  static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
  log_prob_entropy_backward_kernel<T><<<grid, kBackwardThreads, 0, stream>>>(
      grad_log_prob, grad_entropy, static_cast<const char*>(logits), rows, vocab,
      row_stride * static_cast<int64_t>(sizeof(T)), target, log_z, entropy, vocab_start, scale,
      static_cast<T*>(grad_logits));
}

}  // namespace

void launch_logit_stats(const void* logits, ScalarKind kind, int64_t rows, int64_t vocab, int64_t row_stride,
                        const int64_t* target, int64_t vocab_start, float scale, float* stats,
                        cudaStream_t stream) {
  // vocab == 0 still launches: every row gets the empty statistics (-inf, 0, 0, 0).
  if (rows <= 0 || vocab < 0) return;
  switch (kind) {
    case ScalarKind::kFloat32:
      logit_stats_impl<float>(logits, rows, vocab, row_stride, target, vocab_start, scale, stats, stream);
      break;
    case ScalarKind::kBFloat16:
      logit_stats_impl<__nv_bfloat16>(logits, rows, vocab, row_stride, target, vocab_start, scale, stats, stream);
      break;
    case ScalarKind::kFloat16:
      logit_stats_impl<__half>(logits, rows, vocab, row_stride, target, vocab_start, scale, stats, stream);
      break;
  }
}

void launch_log_prob_entropy_backward(const float* grad_log_prob, const float* grad_entropy, const void* logits,
                                      ScalarKind kind, int64_t rows, int64_t vocab, int64_t row_stride,
                                      const int64_t* target, const float* log_z, const float* entropy,
                                      int64_t vocab_start, float scale, void* grad_logits, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return;
  switch (kind) {
    case ScalarKind::kFloat32:
      backward_impl<float>(grad_log_prob, grad_entropy, logits, rows, vocab, row_stride, target, log_z, entropy,
                           vocab_start, scale, grad_logits, stream);
      break;
    case ScalarKind::kBFloat16:
      backward_impl<__nv_bfloat16>(grad_log_prob, grad_entropy, logits, rows, vocab, row_stride, target, log_z,
                                   entropy, vocab_start, scale, grad_logits, stream);
      break;
    case ScalarKind::kFloat16:
      backward_impl<__half>(grad_log_prob, grad_entropy, logits, rows, vocab, row_stride, target, log_z, entropy,
                            vocab_start, scale, grad_logits, stream);
      break;
  }
}

}  // namespace cuda
}  // namespace hybridflow
