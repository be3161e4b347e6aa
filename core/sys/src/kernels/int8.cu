// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// Blockwise int8. `x` is `rows` rows of `row_len` elements, each row cut
// into `blocks_per_row` blocks of `block` elements, the last padded with
// zeros. One CUDA block per quantization block: its absmax by a block
// reduction, then q = rint(x / scale) clamped to ±127 with scale =
// max(absmax, 1e-30) · (1/127) — the fp32 ops, in the order, that
// ft-core's ATen fallback uses, so both give the same bits.
template <typename T>
__device__ void quantize_int8(const T* __restrict__ x, long long row_len, int block, int blocks_per_row,
                              signed char* __restrict__ q, float* __restrict__ scales) {
  __shared__ float warp_max[32];
  __shared__ float shared_scale;
  const long long b = blockIdx.x;
  const long long row = b / blocks_per_row, first = (b % blocks_per_row) * (long long)block;
  const int count = (int)max(0LL, min((long long)block, row_len - first));
  const T* in = x + row * row_len + first;
  float m = 0.f;
#pragma unroll 4
  for (int i = threadIdx.x; i < count; i += blockDim.x) m = fmaxf(m, fabsf(load(in, i)));
  m = block_max(m, warp_max, MaxDroppingNan());
  if (threadIdx.x == 0) {
    shared_scale = fmaxf(m, 1e-30f) * (1.f / 127.f);
    scales[b] = shared_scale;
  }
  __syncthreads();
  const float scale = shared_scale;
  signed char* out = q + b * (long long)block;
#pragma unroll 4
  for (int i = threadIdx.x; i < block; i += blockDim.x) {
    const float v = i < count ? rintf(load(in, i) / scale) : 0.f;
    out[i] = (signed char)fminf(fmaxf(v, -127.f), 127.f);
  }
}

// One CUDA block per quantization block of row 0 (x) and row (y): out[r, i]
// = q[r, i] · scale (padding skipped), or, with `sum_rows` (one row of
// blocks in y), out[i] = Σ_r q[r, i] · scale_r in fp32, in row order.
template <typename T>
__device__ void dequantize_int8(const signed char* __restrict__ q, const float* __restrict__ scales, int block,
                                int blocks_per_row, long long row_len, int rows, int sum_rows, T* __restrict__ out) {
  const long long padded_row = (long long)blocks_per_row * block;
  const long long first = (long long)blockIdx.x * block;
  const int count = (int)min((long long)block, row_len - first);
  if (sum_rows) {
#pragma unroll 4
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      float total = 0.f;
      // Rounded product, then rounded sum (no fused multiply-add), as ATen's multiply and sum.
      for (int r = 0; r < rows; ++r)
        total = __fadd_rn(total, __fmul_rn((float)q[r * padded_row + first + i], scales[(long long)r * blocks_per_row + blockIdx.x]));
      store(out, first + i, total);
    }
  } else {
    const long long row = blockIdx.y;
    const float scale = scales[row * blocks_per_row + blockIdx.x];
    const signed char* in = q + row * padded_row + first;
    T* to = out + row * row_len + first;
#pragma unroll 4
    for (int i = threadIdx.x; i < count; i += blockDim.x) store(to, i, (float)in[i] * scale);
  }
}

extern "C" __global__ void quantize_int8_f32(const float* x, long long row_len, int block, int blocks_per_row, signed char* q, float* scales) {
  quantize_int8(x, row_len, block, blocks_per_row, q, scales);
}
extern "C" __global__ void quantize_int8_bf16(const bf16* x, long long row_len, int block, int blocks_per_row, signed char* q, float* scales) {
  quantize_int8(x, row_len, block, blocks_per_row, q, scales);
}
extern "C" __global__ void dequantize_int8_f32(const signed char* q, const float* scales, int block, int blocks_per_row, long long row_len, int rows, int sum_rows, float* out) {
  dequantize_int8(q, scales, block, blocks_per_row, row_len, rows, sum_rows, out);
}
extern "C" __global__ void dequantize_int8_bf16(const signed char* q, const float* scales, int block, int blocks_per_row, long long row_len, int rows, int sum_rows, bf16* out) {
  dequantize_int8(q, scales, block, blocks_per_row, row_len, rows, sum_rows, out);
}
