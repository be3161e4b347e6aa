// Helpers every family of ft's CUDA kernels uses: bf16 as raw 16-bit words,
// loads and stores of either kind as fp32 (core/sys/src/kernels.rs puts this
// file first in the source NVRTC compiles).
typedef unsigned short bf16;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned int to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays a (quiet) NaN
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                 // round to nearest even
}
// One value of either kind, as fp32 (stored back rounded to nearest even).
__device__ __forceinline__ float load(const float* x, long long i) { return x[i]; }
__device__ __forceinline__ float load(const bf16* x, long long i) { return __uint_as_float(((unsigned int)x[i]) << 16); }
__device__ __forceinline__ void store(float* x, long long i, float v) { x[i] = v; }
__device__ __forceinline__ void store(bf16* x, long long i, float v) { x[i] = (bf16)to_bf16(v); }
// Word i of four values (a float4, or four bf16 in a uint2), or of two (a
// float2, or two bf16 in 32 bits), as fp32: one aligned load.
__device__ __forceinline__ float4 load4(const float* x, long long i) { return reinterpret_cast<const float4*>(x)[i]; }
__device__ __forceinline__ float4 load4(const bf16* x, long long i) {
  const uint2 w = reinterpret_cast<const uint2*>(x)[i];
  return make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}
__device__ __forceinline__ float2 load2(const float* x, long long i) { return reinterpret_cast<const float2*>(x)[i]; }
__device__ __forceinline__ float2 load2(const bf16* x, long long i) {
  const unsigned int w = reinterpret_cast<const unsigned int*>(x)[i];
  return make_float2(bf16_lo(w), bf16_hi(w));
}

// NaN-propagating max, as torch's max and amax: once NaN, stays NaN.
__device__ __forceinline__ float max_keeping_nan(float m, float v) { return (v > m || v != v) ? v : m; }
struct MaxKeepingNan {
  __device__ float operator()(float m, float v) const { return max_keeping_nan(m, v); }
};
// fmaxf: a NaN loses to any number.
struct MaxDroppingNan {
  __device__ float operator()(float m, float v) const { return fmaxf(m, v); }
};

// The largest of every thread's `m` in the block by `max`, valid in thread
// 0; `warp_max` is 32 floats of shared memory. Every thread calls it.
template <typename Max>
__device__ __forceinline__ float block_max(float m, float* warp_max, Max max) {
  for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  return m;
}

// Every thread's m (a max of |values|: non-negative, or NaN) folded into
// *amax (fp32 bits, zeroed by the caller): a block reduction, then one
// atomicMax on the bits, which order as the values do for non-negative
// floats (NaN's above infinity). Every thread calls it.
__device__ __forceinline__ void fold_amax(float m, unsigned int* amax) {
  __shared__ float warp_max[32];
  m = block_max(m, warp_max, MaxKeepingNan());
  if (threadIdx.x == 0) atomicMax(amax, __float_as_uint(m));
}

// fp16 as raw 16-bit words (a type of its own, apart from bf16), converted
// by the instructions CUDA's __float2half_rn and __half2float compile to.
struct f16 {
  unsigned short bits;
};
__device__ __forceinline__ unsigned short to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float from_f16(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float load(const f16* x, long long i) { return from_f16(x[i].bits); }
__device__ __forceinline__ void store(f16* x, long long i, float v) { x[i].bits = to_f16(v); }
