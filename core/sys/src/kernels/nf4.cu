// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// 4-bit dequantization, NF4 or FP4 in bitsandbytes' layout (ft-core's
// nf4.rs holds the ATen version this equals bit for bit): n values packed
// two a byte, the first in the high nibble, in blocks of 2^block_shift
// values with one fp32 absmax each. A value is code[index] · absmax in
// fp32, rounded to the original tensor's dtype (`rounding`: 0 fp32, 1
// bf16, 2 fp16), then stored as T. With double quantization
// (`absmax_indices` not null) a block's absmax is itself
// nested_code[index] · nested_absmax[block / nested_blocksize] + offset,
// rounded after the product and after the sum as ATen's two ops round.
//
// A thread takes 8 values at a time (4 packed bytes; blocks are powers of
// two from 8, so the 8 share an absmax), DEQUANTIZE_4BIT_UNROLL groups a pass, a
// block's width apart, every load issued before the first store: a warp
// reads 128 contiguous bytes and writes 512 (bf16) a group. One 4-byte
// load where the packed bytes are 4-byte aligned (`packed_aligned`), one
// or two 16-byte stores where `out` is 16-byte aligned (`out_aligned`),
// else byte by byte and value by value (an offset slice of a bigger
// buffer). Indices are 64-bit: a weight may hold more than 2^31 values.
#define DEQUANTIZE_4BIT_UNROLL 4

struct Code4bit {
  float value[16];
};

__device__ __forceinline__ float round_to(float v, int rounding) {
  if (rounding == 1) return bf16_lo(to_bf16(v));
  if (rounding == 2) return from_f16(to_f16(v));
  return v;
}

// 8 values stored at out + at (16-byte aligned): one or two 16-byte words.
__device__ __forceinline__ void store8(float* out, long long at, const float* v) {
  reinterpret_cast<float4*>(out + at)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(out + at)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ unsigned int bits16(const bf16*, float v) { return to_bf16(v); }
__device__ __forceinline__ unsigned int bits16(const f16*, float v) { return to_f16(v); }
template <typename T>
__device__ __forceinline__ void store8(T* out, long long at, const float* v) {
  const auto pair = [&](int k) { return bits16(out, v[k]) | (bits16(out, v[k + 1]) << 16); };
  *reinterpret_cast<uint4*>(out + at) = make_uint4(pair(0), pair(2), pair(4), pair(6));
}

template <typename T>
__device__ void dequantize_4bit(const unsigned char* __restrict__ packed, const float* __restrict__ absmax,
                                const unsigned char* __restrict__ absmax_indices, const float* __restrict__ nested_absmax,
                                const float* __restrict__ nested_code, long long nested_blocksize, float offset, const Code4bit& code,
                                int block_shift, long long n, int rounding, int packed_aligned, int out_aligned, T* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code.value[threadIdx.x];
  __syncthreads();
  const long long groups = (n + 7) / 8, pass = (long long)blockDim.x * DEQUANTIZE_4BIT_UNROLL;
  for (long long base = (long long)blockIdx.x * pass; base < groups; base += (long long)gridDim.x * pass) {
    // Byte k of a group in bits 8k..8k+7.
    unsigned int bytes[DEQUANTIZE_4BIT_UNROLL];
    float scale[DEQUANTIZE_4BIT_UNROLL];
#pragma unroll
    for (int u = 0; u < DEQUANTIZE_4BIT_UNROLL; ++u) {
      const long long g = base + u * blockDim.x + threadIdx.x;
      if (g >= groups) break;
      const long long block = (g * 8) >> block_shift;
      scale[u] = absmax_indices
          ? __fadd_rn(__fmul_rn(nested_code[absmax_indices[block]], nested_absmax[block / nested_blocksize]), offset)
          : absmax[block];
      if (packed_aligned && g * 8 + 8 <= n) {
        bytes[u] = *reinterpret_cast<const unsigned int*>(packed + g * 4);
      } else {
        bytes[u] = 0;
        for (int k = 0; k < 4 && g * 8 + 2 * k < n; ++k) bytes[u] |= (unsigned int)packed[g * 4 + k] << (8 * k);
      }
    }
#pragma unroll
    for (int u = 0; u < DEQUANTIZE_4BIT_UNROLL; ++u) {
      const long long g = base + u * blockDim.x + threadIdx.x, first = g * 8;
      if (g >= groups) break;
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const unsigned int index = (bytes[u] >> (8 * (k / 2) + (k % 2 ? 0 : 4))) & 15u;
        v[k] = round_to(__fmul_rn(table[index], scale[u]), rounding);
      }
      if (out_aligned && first + 8 <= n) {
        store8(out, first, v);
      } else {
        for (int k = 0; k < 8 && first + k < n; ++k) store(out, first + k, v[k]);
      }
    }
  }
}
#define DEQUANTIZE_4BIT(NAME, T)                                                                                                         \
  extern "C" __global__ void NAME(const unsigned char* packed, const float* absmax, const unsigned char* absmax_indices,               \
                                  const float* nested_absmax, const float* nested_code, long long nested_blocksize, float offset,       \
                                  Code4bit code, int block_shift, long long n, int rounding, int packed_aligned, int out_aligned, T* out) { \
    dequantize_4bit(packed, absmax, absmax_indices, nested_absmax, nested_code, nested_blocksize, offset, code, block_shift, n,        \
                    rounding, packed_aligned, out_aligned, out);                                                                          \
  }
DEQUANTIZE_4BIT(dequantize_4bit_f32, float)
DEQUANTIZE_4BIT(dequantize_4bit_bf16, bf16)
DEQUANTIZE_4BIT(dequantize_4bit_f16, f16)
