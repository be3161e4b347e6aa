// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// Column sums of a row-major [rows, cols] matrix dy (a linear layer's bias
// gradient) in two passes, each sum in a fixed order: partial[c, j] sums
// column j over the rows of chunk c (blockIdx.y), a warp across 32 columns
// and COLUMN_LANES row lanes; then a thread per column adds the chunks.
// (Eight-byte loads of four columns a thread measured no faster on BERT's
// [12288, 768].)
// With x, mean and rstd (LayerNorm's input and per-row statistics), also
// the sums of dy·(x − mean)·rstd: LayerNorm's weight gradient beside its
// bias gradient, the second sums after the first in `partial` and `out`.
#define COLUMN_LANES 8
template <typename T>
__device__ void column_sum_partial(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, long long rows, int cols, long long chunk,
                                   float* __restrict__ partial) {
  __shared__ float sums[2][COLUMN_LANES][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const long long first = blockIdx.y * chunk, end = min(rows, first + chunk);
  float s = 0.f, t = 0.f;
  if (col < cols) {
#pragma unroll 4
    for (long long r = first + threadIdx.y; r < end; r += COLUMN_LANES) {
      const float g = load(dy, r * cols + col);
      s += g;
      if (x != nullptr) t += g * (load(x, r * cols + col) - mean[r]) * rstd[r];
    }
  }
  sums[0][threadIdx.y][threadIdx.x] = s;
  sums[1][threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f, weighted = 0.f;
#pragma unroll
    for (int k = 0; k < COLUMN_LANES; ++k) { total += sums[0][k][threadIdx.x]; weighted += sums[1][k][threadIdx.x]; }
    partial[blockIdx.y * cols + col] = total;
    if (x != nullptr) partial[((long long)gridDim.y + blockIdx.y) * cols + col] = weighted;
  }
}

template <typename T>
__device__ void column_sum_finish(const float* __restrict__ partial, int chunks, int cols, int sums, T* __restrict__ out) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (int k = 0; k < sums; ++k) {
    float total = 0.f;
    for (int c = 0; c < chunks; ++c) total += partial[((long long)k * chunks + c) * cols + col];
    store(out, (long long)k * cols + col, total);
  }
}

extern "C" __global__ void column_sum_partial_f32(const float* dy, const float* x, const float* mean, const float* rstd, long long rows, int cols, long long chunk, float* partial) {
  column_sum_partial(dy, x, mean, rstd, rows, cols, chunk, partial);
}
extern "C" __global__ void column_sum_partial_bf16(const bf16* dy, const bf16* x, const float* mean, const float* rstd, long long rows, int cols, long long chunk, float* partial) {
  column_sum_partial(dy, x, mean, rstd, rows, cols, chunk, partial);
}
extern "C" __global__ void column_sum_finish_f32(const float* partial, int chunks, int cols, int sums, float* out) {
  column_sum_finish(partial, chunks, cols, sums, out);
}
extern "C" __global__ void column_sum_finish_bf16(const float* partial, int chunks, int cols, int sums, bf16* out) {
  column_sum_finish(partial, chunks, cols, sums, out);
}
