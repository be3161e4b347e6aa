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
