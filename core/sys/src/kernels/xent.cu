// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).
//
// The LM head's cross-entropy: one block per row; pass 1 finds the row's
// log-sum-exp (online max and sum in fp32) and the row's loss, pass 2
// overwrites the row with (softmax − one-hot) · scale — unless grad_scale is
// null: the loss alone (DPO's log-probabilities), the logits left as they are.
__device__ __forceinline__ void add(float& m, float& s, float v) {
  if (v > m) { s = s * __expf(m - v) + 1.f; m = v; }
  else if (v != NEG_INF) { s += __expf(v - m); }
}
__device__ __forceinline__ void merge(float& m, float& s, float om, float os) {
  float top = fmaxf(m, om);
  if (top == NEG_INF) return;
  s = s * __expf(m - top) + os * __expf(om - top);
  m = top;
}

extern "C" __global__ void __launch_bounds__(512) softmax_xent_backward_bf16(
    bf16* __restrict__ logits, const long long* __restrict__ targets, const float* __restrict__ grad_scale,
    float* __restrict__ row_loss, int vocab, long long ignore_index) {
  __shared__ float warp_max[32], warp_sum[32], shared_lse;
  const long long row = blockIdx.x;
  bf16* x = logits + row * (long long)vocab;
  const bool vectorized = (vocab % 8 == 0) && (((unsigned long long)logits & 15ull) == 0);
  float m = NEG_INF, s = 0.f;
  if (vectorized) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
      uint4 p = xv[i];
      add(m, s, bf16_lo(p.x)); add(m, s, bf16_hi(p.x)); add(m, s, bf16_lo(p.y)); add(m, s, bf16_hi(p.y));
      add(m, s, bf16_lo(p.z)); add(m, s, bf16_hi(p.z)); add(m, s, bf16_lo(p.w)); add(m, s, bf16_hi(p.w));
    }
  } else {
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) add(m, s, bf16_lo(x[j]));
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { warp_max[warp] = m; warp_sum[warp] = s; }
  __syncthreads();
  const long long target = targets[row];
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    m = lane < warps ? warp_max[lane] : NEG_INF;
    s = lane < warps ? warp_sum[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1)
      merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    if (lane == 0) {
      const float lse = m + __logf(s);
      shared_lse = lse;
      // Read the target's logit before pass 2 overwrites it; a target outside
      // the vocabulary poisons the loss instead of reading out of bounds.
      if (target == ignore_index) row_loss[row] = 0.f;
      else if (target < 0 || target >= vocab) row_loss[row] = __int_as_float(0x7fc00000);
      else row_loss[row] = lse - bf16_lo(x[target]);
    }
  }
  if (grad_scale == nullptr) return;
  __syncthreads();
  const float lse = shared_lse, scale = grad_scale[row];
  if (vectorized) {
    uint4* xv = reinterpret_cast<uint4*>(x);
    for (int i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
      uint4 p = xv[i];
      unsigned int* w = reinterpret_cast<unsigned int*>(&p);
      for (int k = 0; k < 4; ++k) {
        const long long j = 8ll * i + 2 * k;
        float lo = __expf(bf16_lo(w[k]) - lse) * scale, hi = __expf(bf16_hi(w[k]) - lse) * scale;
        if (j == target) lo -= scale;
        if (j + 1 == target) hi -= scale;
        w[k] = to_bf16(lo) | (to_bf16(hi) << 16);
      }
      xv[i] = p;
    }
  } else {
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
      float g = __expf(bf16_lo(x[j]) - lse) * scale;
      if (j == target) g -= scale;
      x[j] = (bf16)to_bf16(g);
    }
  }
}
