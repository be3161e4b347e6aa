// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// The sum of every thread's `s` in the block, in every thread, in a fixed
// order (the same bits each run); `warp_sums` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float s, float* warp_sums) {
  for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) total += warp_sums[w];
  return total;
}

// RMSNorm's forward, a block a row of `cols`: y = w·(x·rstd), rstd =
// 1/√(mean(x²) + eps), in fp32 and rounded once, as ATen's rms_norm computes
// it. A thread holds its values of a row of up to HELD words per thread in
// registers between the two passes (Llama's 4096 bf16 take 2); a longer
// row is read twice (the second time from cache). `rstd` [rows] is what
// ATen's `_fused_rms_norm_backward` reads. With `amax` (fp32 bits, zeroed
// by the caller; may be null) the largest |y| as stored, NaN if any: the
// float8 layers reading y (q, k, v, or gate and up) then need no amax pass
// of their own (float8.cu's fp8_amax).
#define RMS_NORM_HELD 4
template <typename T, int W>
__device__ void rms_norm_row(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y, float* __restrict__ rstd,
                             unsigned int* amax, int cols, float eps) {
  __shared__ float warp_sums[32];
  const long long row = blockIdx.x;
  const T* in = x + row * cols;
  T* out = y + row * cols;
  const int stride = blockDim.x * W;
  const bool held = cols <= stride * RMS_NORM_HELD;
  Pack<T> values[RMS_NORM_HELD];
  auto read = [&](Pack<T>& v, const T* from, int j) {
    if (W == 1) v.set(0, load(from, j)); else v.read(from, j);
  };
  float squares = 0.f;
  auto add_squares = [&](const Pack<T>& v) {
#pragma unroll
    for (int k = 0; k < W; ++k) squares = fmaf(v.get(k), v.get(k), squares);
  };
  if (held) {
#pragma unroll
    for (int p = 0; p < RMS_NORM_HELD; ++p) {
      const int j = threadIdx.x * W + p * stride;
      if (j < cols) { read(values[p], in, j); add_squares(values[p]); }
    }
  } else {
    for (int j = threadIdx.x * W; j < cols; j += stride) { read(values[0], in, j); add_squares(values[0]); }
  }
  const float r = rsqrtf(block_sum(squares, warp_sums) / cols + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  float m = 0.f;
  auto normalize = [&](const Pack<T>& v, int j) {
    Pack<T> w, o;
    read(w, weight, j);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      o.set(k, w.get(k) * (v.get(k) * r));
      m = max_keeping_nan(m, fabsf(o.get(k)));
    }
    if (W == 1) store(out, j, o.get(0)); else o.write(out, j);
  };
  if (held) {
#pragma unroll
    for (int p = 0; p < RMS_NORM_HELD; ++p) {
      const int j = threadIdx.x * W + p * stride;
      if (j < cols) normalize(values[p], j);
    }
  } else {
    for (int j = threadIdx.x * W; j < cols; j += stride) { read(values[0], in, j); normalize(values[0], j); }
  }
  if (amax != nullptr) fold_amax(m, amax);
}

template <typename T>
__device__ void rms_norm(const T* x, const T* weight, T* y, float* rstd, unsigned int* amax, int cols, float eps, int packed) {
  if (packed) rms_norm_row<T, Pack<T>::N>(x, weight, y, rstd, amax, cols, eps);
  else rms_norm_row<T, 1>(x, weight, y, rstd, amax, cols, eps);
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* weight, float* y, float* rstd, unsigned int* amax, int cols, float eps,
                                        int packed) {
  rms_norm(x, weight, y, rstd, amax, cols, eps, packed);
}
extern "C" __global__ void rms_norm_bf16(const bf16* x, const bf16* weight, bf16* y, float* rstd, unsigned int* amax, int cols, float eps,
                                         int packed) {
  rms_norm(x, weight, y, rstd, amax, cols, eps, packed);
}
