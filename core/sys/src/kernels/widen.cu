// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

// bf16 → fp32, exact: a grid-stride pass, eight values a thread from one
// 16-byte load (`Pack` in rope_swiglu.cu) and two 16-byte stores where both
// tensors start on 16 bytes. ATen's copy between the two kinds is its
// unvectorised dynamic-cast loop: widening each unit's bf16 gradient for an
// fp32 reduce-scatter took 21.7 ms of a 315 ms two-GPU Llama-7B step
// (bench/results/2026-11-27-h200x2-fp8-gathers.md).
extern "C" __global__ void widen_bf16(const bf16* __restrict__ x, float* __restrict__ out, long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long scalar_from = 0;
  if (((size_t)x & 15) == 0 && ((size_t)out & 15) == 0) {
    const long long packs = n / Pack<bf16>::N;
    for (long long p = first; p < packs; p += stride) {
      Pack<bf16> v;
      v.read(x, p * Pack<bf16>::N);
      float4* to = reinterpret_cast<float4*>(out + p * Pack<bf16>::N);
      to[0] = make_float4(v.get(0), v.get(1), v.get(2), v.get(3));
      to[1] = make_float4(v.get(4), v.get(5), v.get(6), v.get(7));
    }
    scalar_from = packs * Pack<bf16>::N;
  }
  for (long long i = scalar_from + first; i < n; i += stride) out[i] = load(x, i);
}
