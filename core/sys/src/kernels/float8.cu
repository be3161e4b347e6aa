// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// Float8 casts as torchao's tensorwise and rowwise recipes make them
// (ft-sys's float8.rs holds the ATen version these equal bit for bit): the
// amax — of the tensor, or of each row or column — in one pass, then one
// pass that scales, clamps and rounds x to float8 and writes it row-major,
// transposed, or both, instead of ATen's seven passes and a relayout copy.

// max |x| over n values into `amax` (fp32 bits, zeroed by the caller): a
// grid-stride pass (16 bytes a load where x is 16-byte aligned), then
// `fold_amax`.
template <typename T>
__device__ void fp8_amax(const T* __restrict__ x, long long n, unsigned int* amax) {
  float m = 0.f;
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long scalar_from = 0;
  if (((size_t)x & 15) == 0) {
    const long long packs = n / Pack<T>::N;
    for (long long p = first; p < packs; p += stride) {
      Pack<T> v;
      v.read(x, p * Pack<T>::N);
#pragma unroll
      for (int k = 0; k < Pack<T>::N; ++k) m = max_keeping_nan(m, fabsf(v.get(k)));
    }
    scalar_from = packs * Pack<T>::N;
  }
  for (long long i = scalar_from + first; i < n; i += stride) m = max_keeping_nan(m, fabsf(load(x, i)));
  fold_amax(m, amax);
}

// Two fp32 values, already clamped to the kind's range, rounded to nearest
// even as two float8 bytes (lo first), e4m3fn or e5m2, by Ada's and
// Hopper's conversion instruction (the host refuses float8 before sm_89).
__device__ __forceinline__ unsigned short to_fp8x2(float lo, float hi, int e5m2) {
  unsigned short packed = 0;
#if __CUDA_ARCH__ >= 890
  if (e5m2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  }
#else
  __trap();
#endif
  return packed;
}

// x·scale clamped to ±max (NaN stays NaN, as torch's clamp).
__device__ __forceinline__ float scaled_clamped(float x, float scale, float max_value) {
  const float v = __fmul_rn(x, scale);
  return v > max_value ? max_value : (v < -max_value ? -max_value : v);
}

#define FP8_TILE_ROWS 32
#define FP8_TILE_COLS 64
#define FP8_CAST_THREADS 256

// A tile of x [rows, cols] from (row0, col0), held transposed in shared
// memory, written as 64 rows of 32 bytes of `out_t` [cols, out_t_stride]:
// eight bytes a thread, so the writes are coalesced. Called by all 256
// threads after the tile is filled.
__device__ void fp8_write_transposed_tile(const unsigned char (*tile)[FP8_TILE_ROWS + 8], long long row0, long long col0, long long rows,
                                          long long cols, unsigned char* __restrict__ out_t, long long out_t_stride) {
  const int local_row = threadIdx.x / 4, first = (threadIdx.x % 4) * 8;
  const long long row = col0 + local_row, from = row0 + first;
  if (row >= cols || from >= rows) return;
  unsigned char* to = out_t + row * out_t_stride + from;
  if (from + 8 <= rows && ((size_t)to & 7) == 0) {
    *reinterpret_cast<uint2*>(to) = *reinterpret_cast<const uint2*>(&tile[local_row][first]);
  } else {
    for (int i = 0; i < 8 && from + i < rows; ++i) to[i] = tile[local_row][first + i];
  }
}

// Scale = max / max(amax, 1e-12) computed in fp64 and rounded to fp32
// (torchao's tensor_to_scale); with `power_of_2` (the rowwise recipe)
// rounded down to a power of 2 as torch's exp2(floor(log2(scale))) in fp32.
__device__ __forceinline__ float fp8_scale(float amax, float max_value, int power_of_2) {
  double a = (double)amax;
  a = a < 1e-12 ? 1e-12 : a;  // clamp_min, keeping NaN
  const float scale = (float)__dmul_rn(1.0 / a, (double)max_value);
  return power_of_2 ? exp2f(floorf(log2f(scale))) : scale;
}

// How a cast scales: one scale from one amax (tensorwise), or a scale per
// row or per column of x from `scales` (rowwise, `fp8_scales`).
#define FP8_SCALE_TENSOR 0
#define FP8_SCALE_ROWS 1
#define FP8_SCALE_COLS 2

// x [rows, cols] (cols even) cast to float8: tensorwise with fp8_scale of
// `amax` (the first block also writes the scale and its reciprocal, what
// `_scaled_mm` multiplies by), or with `scales` per row or per column;
// into `out` [rows, cols] row-major and/or `out_t` [cols, out_t_stride],
// x's transpose (the columns past `rows` left as they are: the caller's
// zeros). A block of 256 threads a tile of 32 rows × 64 columns, each
// thread N neighbours of a row: 16 bytes read as one word and N bytes
// written as one where `PACKED` (x 16-byte aligned, cols a multiple of N),
// else two values at a time. The transpose goes through shared memory so
// both writes are coalesced.
template <typename T, bool PACKED, int SCALES>
__device__ void fp8_cast(const T* __restrict__ x, long long rows, long long cols, const unsigned int* __restrict__ amax,
                         const float* __restrict__ scales, float max_value, int e5m2, unsigned char* __restrict__ out,
                         unsigned char* __restrict__ out_t, long long out_t_stride, float* __restrict__ scale_out,
                         float* __restrict__ inverse_out) {
  constexpr int N = PACKED ? Pack<T>::N : 2;
  constexpr int THREADS_PER_ROW = FP8_TILE_COLS / N, ROWS_PER_PASS = FP8_CAST_THREADS / THREADS_PER_ROW;
  __shared__ __align__(8) unsigned char tile[FP8_TILE_COLS][FP8_TILE_ROWS + 8];
  const float tensor_scale = SCALES == FP8_SCALE_TENSOR ? fp8_scale(__uint_as_float(*amax), max_value, 0) : 0.f;
  const long long row0 = (long long)blockIdx.x * FP8_TILE_ROWS, col0 = (long long)blockIdx.y * FP8_TILE_COLS;
  if (SCALES == FP8_SCALE_TENSOR && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *scale_out = tensor_scale;
    *inverse_out = 1.f / tensor_scale;
  }
  const int local_col = (threadIdx.x % THREADS_PER_ROW) * N;
  const long long col = col0 + local_col;
  for (int local_row = threadIdx.x / THREADS_PER_ROW; local_row < FP8_TILE_ROWS; local_row += ROWS_PER_PASS) {
    const long long row = row0 + local_row;
    if (row >= rows || col >= cols) continue;
    const long long at = row * cols + col;
    float v[N];
    if constexpr (PACKED) {
      Pack<T> p;
      p.read(x, at);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = p.get(k);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = load(x, at + k);
    }
    union {
      unsigned short pairs[N / 2];
      unsigned char bytes[N];
    } cast;
    float scale[N];
#pragma unroll
    for (int k = 0; k < N; ++k) scale[k] = SCALES == FP8_SCALE_ROWS ? scales[row] : (SCALES == FP8_SCALE_COLS ? scales[col + k] : tensor_scale);
#pragma unroll
    for (int k = 0; k < N; k += 2)
      cast.pairs[k / 2] = to_fp8x2(scaled_clamped(v[k], scale[k], max_value), scaled_clamped(v[k + 1], scale[k + 1], max_value), e5m2);
    if (out) {
      if constexpr (N == 8) *reinterpret_cast<uint2*>(out + at) = *reinterpret_cast<const uint2*>(cast.bytes);
      else if constexpr (N == 4) *reinterpret_cast<unsigned int*>(out + at) = *reinterpret_cast<const unsigned int*>(cast.bytes);
      else *reinterpret_cast<unsigned short*>(out + at) = cast.pairs[0];
    }
#pragma unroll
    for (int k = 0; k < N; ++k) tile[local_col + k][local_row] = cast.bytes[k];
  }
  if (!out_t) return;
  __syncthreads();
  fp8_write_transposed_tile(tile, row0, col0, rows, cols, out_t, out_t_stride);
}

// x [rows, cols] float8 bytes into `out` [cols, out_stride], x's transpose:
// the cast's tile, filled eight bytes a thread (one 8-byte load where x
// allows it). The input gradient's GEMM reads a weight gathered as float8
// bytes so; ATen's copy of the transposed view runs an uncoalesced
// elementwise kernel, 47 ms of a 357 ms step of Llama-7B on two H100s
// (bench/results/2026-11-27-h100x2-fp8-gathers.md).
extern "C" __global__ void fp8_transpose(const unsigned char* __restrict__ x, long long rows, long long cols,
                                         unsigned char* __restrict__ out, long long out_stride) {
  __shared__ __align__(8) unsigned char tile[FP8_TILE_COLS][FP8_TILE_ROWS + 8];
  const long long row0 = (long long)blockIdx.x * FP8_TILE_ROWS, col0 = (long long)blockIdx.y * FP8_TILE_COLS;
  // 32 rows of 64 bytes: eight bytes a thread.
  const int local_row = threadIdx.x / 8, local_col = (threadIdx.x % 8) * 8;
  const long long row = row0 + local_row, col = col0 + local_col;
  if (row < rows && col < cols) {
    const unsigned char* from = x + row * cols + col;
    if (col + 8 <= cols && ((size_t)from & 7) == 0) {
      const uint2 word = *reinterpret_cast<const uint2*>(from);
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&word);
#pragma unroll
      for (int k = 0; k < 8; ++k) tile[local_col + k][local_row] = bytes[k];
    } else {
      for (int k = 0; k < 8 && col + k < cols; ++k) tile[local_col + k][local_row] = from[k];
    }
  }
  __syncthreads();
  fp8_write_transposed_tile(tile, row0, col0, rows, cols, out, out_stride);
}

extern "C" __global__ void fp8_amax_f32(const float* x, long long n, unsigned int* amax) { fp8_amax(x, n, amax); }
extern "C" __global__ void fp8_amax_bf16(const bf16* x, long long n, unsigned int* amax) { fp8_amax(x, n, amax); }
// The cast's instantiations by `packed` and `by` (FP8_SCALE_*).
template <typename T>
__device__ void fp8_cast_by(const T* x, long long rows, long long cols, const unsigned int* amax, const float* scales, float max_value,
                            int e5m2, unsigned char* out, unsigned char* out_t, long long out_t_stride, float* scale, float* inverse,
                            int packed, int by) {
#define FP8_CAST(P, S) fp8_cast<T, P, S>(x, rows, cols, amax, scales, max_value, e5m2, out, out_t, out_t_stride, scale, inverse)
  if (by == FP8_SCALE_ROWS) packed ? FP8_CAST(true, FP8_SCALE_ROWS) : FP8_CAST(false, FP8_SCALE_ROWS);
  else if (by == FP8_SCALE_COLS) packed ? FP8_CAST(true, FP8_SCALE_COLS) : FP8_CAST(false, FP8_SCALE_COLS);
  else packed ? FP8_CAST(true, FP8_SCALE_TENSOR) : FP8_CAST(false, FP8_SCALE_TENSOR);
#undef FP8_CAST
}
extern "C" __global__ void fp8_cast_f32(const float* x, long long rows, long long cols, const unsigned int* amax, const float* scales,
                                        float max_value, int e5m2, unsigned char* out, unsigned char* out_t, long long out_t_stride,
                                        float* scale, float* inverse, int packed, int by) {
  fp8_cast_by(x, rows, cols, amax, scales, max_value, e5m2, out, out_t, out_t_stride, scale, inverse, packed, by);
}
extern "C" __global__ void fp8_cast_bf16(const bf16* x, long long rows, long long cols, const unsigned int* amax, const float* scales,
                                         float max_value, int e5m2, unsigned char* out, unsigned char* out_t, long long out_t_stride,
                                         float* scale, float* inverse, int packed, int by) {
  fp8_cast_by(x, rows, cols, amax, scales, max_value, e5m2, out, out_t, out_t_stride, scale, inverse, packed, by);
}

// The rowwise recipe's amaxes. max |x| of each row of x [rows, cols] into
// amax[rows]: a block a row (grid-stride over rows), 16 bytes a load where
// the rows start on 16 bytes, then a block reduction.
template <typename T>
__device__ void fp8_amax_rows(const T* __restrict__ x, long long rows, long long cols, float* __restrict__ amax) {
  __shared__ float warp_max[32];
  const bool packed = ((size_t)x & 15) == 0 && (cols * sizeof(T)) % 16 == 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* r = x + row * cols;
    float m = 0.f;
    if (packed) {
      for (long long p = threadIdx.x; p < cols / Pack<T>::N; p += blockDim.x) {
        Pack<T> v;
        v.read(r, p * Pack<T>::N);
#pragma unroll
        for (int k = 0; k < Pack<T>::N; ++k) m = max_keeping_nan(m, fabsf(v.get(k)));
      }
    } else {
      for (long long c = threadIdx.x; c < cols; c += blockDim.x) m = max_keeping_nan(m, fabsf(load(r, c)));
    }
    m = block_max(m, warp_max, MaxKeepingNan());
    if (threadIdx.x == 0) amax[row] = m;
    __syncthreads();  // warp_max is the next row's
  }
}

// max |x| of each column of x [rows, cols] into amax[cols] (fp32 bits,
// zeroed by the caller): a thread a column of `chunk` rows, then an
// atomicMax on the bits (ordered as the values for non-negative floats).
template <typename T>
__device__ void fp8_amax_cols(const T* __restrict__ x, long long rows, long long cols, long long chunk, unsigned int* __restrict__ amax) {
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x, from = (long long)blockIdx.y * chunk;
  if (col >= cols) return;
  const long long to = from + chunk < rows ? from + chunk : rows;
  float m = 0.f;
  for (long long row = from; row < to; ++row) m = max_keeping_nan(m, fabsf(load(x, row * cols + col)));
  atomicMax(amax + col, __float_as_uint(m));
}

extern "C" __global__ void fp8_amax_rows_f32(const float* x, long long rows, long long cols, float* amax) { fp8_amax_rows(x, rows, cols, amax); }
extern "C" __global__ void fp8_amax_rows_bf16(const bf16* x, long long rows, long long cols, float* amax) { fp8_amax_rows(x, rows, cols, amax); }
extern "C" __global__ void fp8_amax_cols_f32(const float* x, long long rows, long long cols, long long chunk, unsigned int* amax) {
  fp8_amax_cols(x, rows, cols, chunk, amax);
}
extern "C" __global__ void fp8_amax_cols_bf16(const bf16* x, long long rows, long long cols, long long chunk, unsigned int* amax) {
  fp8_amax_cols(x, rows, cols, chunk, amax);
}

// Each of n amaxes' scale (fp8_scale) and its reciprocal.
extern "C" __global__ void fp8_scales(const float* amax, long long n, float max_value, int power_of_2, float* scale, float* inverse) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float s = fp8_scale(amax[i], max_value, power_of_2);
    scale[i] = s;
    inverse[i] = 1.f / s;
  }
}

// A rowwise float8 GEMM's output without fast accumulation (float8.rs's
// scaled_mm runs the tensorwise kernel with unit scales and scales after):
// y[i, j] = y[i, j]·(a[i]·b[j]) in place, the two scales' product rounded
// to fp32 first and the result once to bf16, as ATen's `y *= a * b`
// computes it — without its [rows, cols] fp32 tensor of products and the
// passes over it. A thread per W values of a row (W = Pack's when `packed`:
// `cols` divisible and y 16-byte aligned).
template <int W>
__device__ void fp8_scale_outer(bf16* __restrict__ y, const float* __restrict__ a, const float* __restrict__ b, long long rows, int cols) {
  const long long groups = rows * (cols / W);
  for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
    const long long at = g * W, row = at / cols;
    const int col = (int)(at - row * cols);
    const float scale = a[row];
    Pack<bf16> v;
    if (W == 1) v.set(0, load(y, at)); else v.read(y, at);
#pragma unroll
    for (int k = 0; k < W; ++k) v.set(k, v.get(k) * (scale * b[col + k]));
    if (W == 1) store(y, at, v.get(0)); else v.write(y, at);
  }
}

extern "C" __global__ void fp8_scale_outer_bf16(bf16* y, const float* a, const float* b, long long rows, int cols, int packed) {
  if (packed) fp8_scale_outer<Pack<bf16>::N>(y, a, b, rows, cols);
  else fp8_scale_outer<1>(y, a, b, rows, cols);
}
