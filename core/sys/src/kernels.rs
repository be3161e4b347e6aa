//! ft's own CUDA kernels, compiled at run time with NVRTC (the `libnvrtc`
//! that ships with PyTorch's CUDA wheels) and launched on PyTorch's current
//! stream, where ATen's ops leave bandwidth on the table:
//!
//! - `softmax_xent_backward_bf16`: the LM head's loss and d loss / d logits.
//!   A large vocabulary makes the logits the biggest tensor of the step
//!   (BLOOM: 250 880 × tokens). ATen needs four passes over them (log-softmax
//!   in fp32, exp, the cast back, the scale); this kernel reads the bf16
//!   logits twice and writes the gradient over them in place, ~6 instead of
//!   ~34 bytes per logit and no fp32 copy.
//! - `adamw_fp32`: AdamW over one flat fp32 buffer in one pass of float4s,
//!   28 bytes per parameter. ATen's `_fused_adamw_` also writes the unscaled
//!   gradient back whenever a gradient scale (our clipping factor) is given,
//!   32 bytes, through a multi-tensor launcher that reaches ~3 TB/s on H200.
//! - `quantize_int8_*` / `dequantize_int8_*`: blockwise int8 (one fp32
//!   scale, absmax / 127, per block) for compressed collectives, one pass
//!   each way; ATen needs about eight (cast, min/max, divide, round, clamp,
//!   cast; cast, multiply) and a padded copy.
//! - `lowrank_*`: a matrix times a thin factor (P = X Q, Q = Xᵀ P), the
//!   expansion P Qᵀ with the residual, and orthonormal bases of many thin
//!   matrices in one launch, for low-rank compression (PowerSGD).
//!   cuBLAS tiles such thin products for square ones and leaves most of the
//!   GPU idle: on an H100, BLOOM-560m's 97 gradient matrices took 4.0 ms for
//!   X Q, 3.2 for Xᵀ P and 6.7 to expand with the residual, against 0.8 ms
//!   for one pass over them (bench/gpu/powersgd_phases.py).
//! - `rope_*`, `swiglu_*`: rotary embeddings and SwiGLU's gating, one pass
//!   each way. ATen's ops take three kernels forward for RoPE (two
//!   multiplies over a broadcast cos/sin, one roll) and four backward, two
//!   and four for SwiGLU; on an H100 they were 34 and 16 ms of a 269 ms LoRA
//!   step on Llama-7B (bench/results/2026-11-25-h100-single-gpu).
//! - `column_sum_*`: a linear layer's bias gradient, and with LayerNorm's
//!   input and statistics its weight and bias gradients, as column sums in
//!   one pass over dy (and x). ATen's reduction over the leading dimension
//!   and its gamma/beta kernel took 24 and 57 µs a call on BERT's
//!   [12288, 768] on an H200; these take 12 and 18.

use crate::{Result, ShimError};
use cudarc::driver::{result as driver, sys};
use cudarc::nvrtc;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const XENT: &str = "softmax_xent_backward_bf16";
const ADAMW: &str = "adamw_fp32";
const XENT_THREADS: u32 = 512;
const ADAMW_THREADS: u32 = 256;
const QUANTIZE_THREADS: u32 = 256;
const DEQUANTIZE_THREADS: u32 = 256;

/// The kernels' CUDA source. The cross-entropy runs one block per row: pass 1
/// finds the row's log-sum-exp (online max and sum in fp32), pass 2
/// overwrites the row with (softmax − one-hot) · scale. AdamW is a
/// grid-stride loop over float4s (a scalar loop when a buffer is not
/// 16-byte aligned).
const SOURCE: &str = r#"
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

// torch.optim.AdamW's update, element for element as ATen's fused kernel
// computes it (fp32 opmath, fma forms, IEEE sqrt and division); the
// gradient is divided by *grad_scale when given and never written back.
__device__ __forceinline__ void adamw(float& p, float g, float& m, float& v, float lr, float beta1, float beta2,
                                      float weight_decay, float eps, float step_size, float bias_correction2_sqrt,
                                      const float* grad_scale) {
  if (grad_scale != nullptr) g /= *grad_scale;
  if (weight_decay != 0.f) p -= lr * weight_decay * p;
  m = fmaf(beta1, m, fmaf(-beta1, g, g));
  v = fmaf(beta2, v, fmaf(-beta2, g * g, g * g));
  const float denom = (sqrtf(v) / bias_correction2_sqrt) + eps;
  p -= step_size * m / denom;
}

// Four gradients from one aligned word: a float4, or four bf16 in a uint2.
__device__ __forceinline__ float4 load4(const float* g, long long i) { return reinterpret_cast<const float4*>(g)[i]; }
__device__ __forceinline__ float4 load4(const bf16* g, long long i) {
  const uint2 w = reinterpret_cast<const uint2*>(g)[i];
  return make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}

template <typename G>
__device__ void adamw_all(
    float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq, long long n, double lr_, double beta1_, double beta2_, double weight_decay_,
    double eps_, const float* __restrict__ step, const float* __restrict__ grad_scale,
    const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  // Bias corrections in double, the rest in fp32, as ATen's functor does.
  const double t = *step;
  const float bias_correction1 = (float)(1.0 - pow(beta1_, t));
  const float bias_correction2_sqrt = (float)sqrt(1.0 - pow(beta2_, t));
  const float lr = (float)lr_, beta1 = (float)beta1_, beta2 = (float)beta2_;
  const float weight_decay = (float)weight_decay_, eps = (float)eps_;
  const float step_size = lr / bias_correction1;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool aligned = ((((unsigned long long)param) | ((unsigned long long)exp_avg) | ((unsigned long long)exp_avg_sq)) & 15ull) == 0 &&
                       (((unsigned long long)grad) & (4 * sizeof(G) - 1)) == 0;
  long long done = 0;
  if (aligned) {
    float4* p4 = reinterpret_cast<float4*>(param);
    float4* m4 = reinterpret_cast<float4*>(exp_avg);
    float4* v4 = reinterpret_cast<float4*>(exp_avg_sq);
    for (long long i = first; i < n / 4; i += stride) {
      float4 p = p4[i], m = m4[i], v = v4[i];
      const float4 g = load4(grad, i);
      adamw(p.x, g.x, m.x, v.x, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.y, g.y, m.y, v.y, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.z, g.z, m.z, v.z, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.w, g.w, m.w, v.w, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      p4[i] = p; m4[i] = m; v4[i] = v;
    }
    done = n / 4 * 4;
  }
  for (long long i = done + first; i < n; i += stride)
    adamw(param[i], load(grad, i), exp_avg[i], exp_avg_sq[i], lr, beta1, beta2, weight_decay, eps, step_size,
          bias_correction2_sqrt, grad_scale);
}

extern "C" __global__ void adamw_fp32(
    float* param, const float* grad, float* exp_avg, float* exp_avg_sq, long long n, double lr, double beta1, double beta2,
    double weight_decay, double eps, const float* step, const float* grad_scale, const float* found_inf) {
  adamw_all(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, weight_decay, eps, step, grad_scale, found_inf);
}
// fp32 state over a bf16 gradient: one process, one micro-batch, where the
// gradient backward gave is the whole gradient and an fp32 copy adds nothing.
extern "C" __global__ void adamw_fp32_grad_bf16(
    float* param, const bf16* grad, float* exp_avg, float* exp_avg_sq, long long n, double lr, double beta1, double beta2,
    double weight_decay, double eps, const float* step, const float* grad_scale, const float* found_inf) {
  adamw_all(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, weight_decay, eps, step, grad_scale, found_inf);
}

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
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x == 0) {
      shared_scale = fmaxf(m, 1e-30f) * (1.f / 127.f);
      scales[b] = shared_scale;
    }
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

// Low-rank projections (ft-core's lowrank.rs). X is a row-major rows × cols
// fp32 matrix, P rows × r and Q cols × r (fp32, row-major, r ≤ LOWRANK_MAX);
// each sum runs over k or over the matrix in a fixed order, so a kernel gives
// the same bits every run.
#define LOWRANK_MAX 8

// partial[c, i, :] = Σ X[i, j] Q[j, :] over the columns j of chunk c
// (blockIdx.y): a warp per row of a chunk; the chunks' sum is P = X Q (one
// chunk: P itself). With `g`, X += G first (written back: the error-fed
// gradient), in the same pass.
template <typename T>
__device__ void lowrank_project(const T* __restrict__ g, float* __restrict__ x, long long rows, long long cols,
                                const float* __restrict__ q, int r, long long chunk, float* __restrict__ partial) {
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  const long long first = blockIdx.y * chunk, end = min(cols, first + chunk);
  for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
    float acc[LOWRANK_MAX];
#pragma unroll
    for (int k = 0; k < LOWRANK_MAX; ++k) acc[k] = 0.f;
    float* xr = x + row * cols;
    const T* gr = g != nullptr ? g + row * cols : nullptr;
#pragma unroll 8
    for (long long j = first + lane; j < end; j += 32) {
      float v = xr[j];
      if (gr != nullptr) {
        v = load(gr, j) + v;
        xr[j] = v;
      }
      const float* qj = q + j * r;
#pragma unroll
      for (int k = 0; k < LOWRANK_MAX; ++k)
        if (k < r) acc[k] = fmaf(v, qj[k], acc[k]);
    }
#pragma unroll
    for (int k = 0; k < LOWRANK_MAX; ++k) {
      if (k < r) {
        float s = acc[k];
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (lane == 0) partial[(blockIdx.y * rows + row) * r + k] = s;
      }
    }
  }
}

extern "C" __global__ void lowrank_project_f32(const float* g, float* x, long long rows, long long cols, const float* q, int r, long long chunk, float* partial) {
  lowrank_project(g, x, rows, cols, q, r, chunk, partial);
}
extern "C" __global__ void lowrank_project_bf16(const bf16* g, float* x, long long rows, long long cols, const float* q, int r, long long chunk, float* partial) {
  lowrank_project(g, x, rows, cols, q, r, chunk, partial);
}

// partial[c, j, :] = Σ X[i, j] P[i, :] over the rows i of chunk c (blockIdx.y):
// a thread per column, coalesced along the row; the chunks' sum is Xᵀ P.
extern "C" __global__ void lowrank_project_t(const float* __restrict__ x, long long rows, long long cols,
                                             const float* __restrict__ p, int r, long long chunk,
                                             float* __restrict__ partial) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float acc[LOWRANK_MAX];
#pragma unroll
  for (int k = 0; k < LOWRANK_MAX; ++k) acc[k] = 0.f;
  const long long end = min(rows, (blockIdx.y + 1) * chunk);
#pragma unroll 8
  for (long long i = blockIdx.y * chunk; i < end; ++i) {
    const float v = x[i * cols + j];
    const float* pi = p + i * r;
#pragma unroll
    for (int k = 0; k < LOWRANK_MAX; ++k)
      if (k < r) acc[k] = fmaf(v, pi[k], acc[k]);
  }
  float* to = partial + (blockIdx.y * cols + j) * r;
#pragma unroll
  for (int k = 0; k < LOWRANK_MAX; ++k)
    if (k < r) to[k] = acc[k];
}

// out = P Qᵀ and, with `x`, x -= out / n (the error left after the sum):
// a thread per column (its row of Q in registers) over rows y, y + gridDim.y, …
template <typename T>
__device__ void lowrank_expand(const float* __restrict__ p, const float* __restrict__ q, long long rows, long long cols,
                               int r, T* __restrict__ out, float* __restrict__ x, float n) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float qj[LOWRANK_MAX];
#pragma unroll
  for (int k = 0; k < LOWRANK_MAX; ++k) qj[k] = k < r ? q[j * r + k] : 0.f;
#pragma unroll 8
  for (long long i = blockIdx.y; i < rows; i += gridDim.y) {
    const float* pi = p + i * r;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < LOWRANK_MAX; ++k)
      if (k < r) s = fmaf(pi[k], qj[k], s);
    const long long at = i * cols + j;
    store(out, at, s);
    if (x != nullptr) x[at] = x[at] - s / n;
  }
}

// Each thin matrix of a table ([n, 3]: start in `all`, rows, width r ≤
// LOWRANK_MAX; row-major fp32), in place, by an orthonormal basis of its
// columns: CholeskyQR2 in fp64 — twice P ← P L⁻ᵀ with L Lᵀ = PᵀP + εI, ε
// 1e-15 of the trace (a ridge that keeps a rank-deficient Gram matrix
// definite). The first pass leaves directions weaker than ε attenuated, the
// second restores them. One CUDA block a matrix: the Gram matrix by a block
// reduction in a fixed order, L and L⁻ᵀ by thread 0.
#define GRAM (LOWRANK_MAX * (LOWRANK_MAX + 1) / 2)
#define ORTHO_WARPS 8
extern "C" __global__ void __launch_bounds__(256) lowrank_orthonormalize(float* __restrict__ all, const long long* __restrict__ table) {
  __shared__ double warp_gram[GRAM][ORTHO_WARPS];
  __shared__ float inverse[LOWRANK_MAX][LOWRANK_MAX];
  const long long at = table[3 * blockIdx.x], rows = table[3 * blockIdx.x + 1];
  const int r = (int)table[3 * blockIdx.x + 2];
  float* p = all + at;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int pass = 0; pass < 2; ++pass) {
    double g[GRAM];
#pragma unroll
    for (int e = 0; e < GRAM; ++e) g[e] = 0.0;
    for (long long i = threadIdx.x; i < rows; i += blockDim.x) {
      double v[LOWRANK_MAX];
#pragma unroll
      for (int k = 0; k < LOWRANK_MAX; ++k) v[k] = k < r ? (double)p[i * r + k] : 0.0;
      int e = 0;
#pragma unroll
      for (int a = 0; a < LOWRANK_MAX; ++a)
#pragma unroll
        for (int b = a; b < LOWRANK_MAX; ++b, ++e) g[e] = fma(v[a], v[b], g[e]);
    }
#pragma unroll
    for (int e = 0; e < GRAM; ++e) {
      double x = g[e];
      for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
      if (lane == 0) warp_gram[e][warp] = x;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double G[LOWRANK_MAX][LOWRANK_MAX], L[LOWRANK_MAX][LOWRANK_MAX], inv[LOWRANK_MAX][LOWRANK_MAX];
      int e = 0;
      for (int a = 0; a < LOWRANK_MAX; ++a)
        for (int b = a; b < LOWRANK_MAX; ++b, ++e) {
          double x = 0.0;
          for (int w = 0; w < ORTHO_WARPS; ++w) x += warp_gram[e][w];
          G[a][b] = x;
          G[b][a] = x;
        }
      double trace = 0.0;
      for (int a = 0; a < r; ++a) trace += G[a][a];
      const double ridge = 1e-15 * trace + 1e-300;
      for (int j = 0; j < r; ++j) {
        double d = G[j][j] + ridge;
        for (int k = 0; k < j; ++k) d -= L[j][k] * L[j][k];
        L[j][j] = sqrt(fmax(d, 1e-300));
        for (int i = j + 1; i < r; ++i) {
          double x = G[i][j];
          for (int k = 0; k < j; ++k) x -= L[i][k] * L[j][k];
          L[i][j] = x / L[j][j];
        }
      }
      // inv = L⁻¹ (lower), column by column.
      for (int j = 0; j < r; ++j) {
        inv[j][j] = 1.0 / L[j][j];
        for (int i = j + 1; i < r; ++i) {
          double x = 0.0;
          for (int k = j; k < i; ++k) x += L[i][k] * inv[k][j];
          inv[i][j] = -x / L[i][i];
        }
      }
      // P L⁻ᵀ: inverse[k][c] = (L⁻ᵀ)[k][c] = inv[c][k], zero below the diagonal.
      for (int k = 0; k < LOWRANK_MAX; ++k)
        for (int c = 0; c < LOWRANK_MAX; ++c) inverse[k][c] = (k < r && c < r && k <= c) ? (float)inv[c][k] : 0.f;
    }
    __syncthreads();
    for (long long i = threadIdx.x; i < rows; i += blockDim.x) {
      float v[LOWRANK_MAX], out[LOWRANK_MAX];
#pragma unroll
      for (int k = 0; k < LOWRANK_MAX; ++k) v[k] = k < r ? p[i * r + k] : 0.f;
#pragma unroll
      for (int c = 0; c < LOWRANK_MAX; ++c) {
        float x = 0.f;
#pragma unroll
        for (int k = 0; k <= c; ++k) x = fmaf(v[k], inverse[k][c], x);
        out[c] = x;
      }
#pragma unroll
      for (int c = 0; c < LOWRANK_MAX; ++c)
        if (c < r) p[i * r + c] = out[c];
    }
    // The next pass's thread 0 rewrites `inverse` and `warp_gram`.
    __syncthreads();
  }
}

extern "C" __global__ void lowrank_expand_f32(const float* p, const float* q, long long rows, long long cols, int r, float* out, float* x, float n) {
  lowrank_expand(p, q, rows, cols, r, out, x, n);
}
extern "C" __global__ void lowrank_expand_bf16(const float* p, const float* q, long long rows, long long cols, int r, bf16* out, float* x, float n) {
  lowrank_expand(p, q, rows, cols, r, out, x, n);
}

// 16 bytes of values (4 fp32 or 8 bf16) moved as one word: the
// memory-bound kernels below read and write whole words where the caller
// found every pointer 16-byte aligned and the lengths divisible (`packed`).
template <typename T> struct Pack {
  static constexpr int N = 16 / sizeof(T);
  uint4 word;
  __device__ __forceinline__ void read(const T* x, long long i) { word = *reinterpret_cast<const uint4*>(x + i); }
  __device__ __forceinline__ void write(T* x, long long i) const { *reinterpret_cast<uint4*>(x + i) = word; }
  __device__ __forceinline__ float get(int k) const { return load(reinterpret_cast<const T*>(&word), k); }
  __device__ __forceinline__ void set(int k, float v) { store(reinterpret_cast<T*>(&word), k, v); }
};

// Rotary embeddings over rows of head_dim = 2·half: y[j] = x[j]·cos[j] +
// x[j ⊕ half]·sin[j], j ⊕ half being j's partner in the other half (sin
// carries rotate_half's sign); one cos/sin row per `heads` rows of x. With
// `transpose`, the adjoint (the backward): sin[j ⊕ half] in place of sin[j].
// A thread per W pairs (j, j + half), W = Pack<T>::N when `packed` else 1,
// both outputs rounded once.
template <typename T, int W>
__device__ void rope_pairs(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ y,
                           long long rows, int heads, int half, int transpose) {
  const int groups = half / W;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * groups; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / groups;
    const int j = (int)(i - row * groups) * W;
    const long long at = row * 2 * half + j, angle = (row / heads) * 2 * half + j;
    Pack<T> a, b, c1, c2, s1, s2, y1, y2;
    if (W == 1) {
      a.set(0, load(x, at)); b.set(0, load(x, at + half));
      c1.set(0, load(cos, angle)); c2.set(0, load(cos, angle + half));
      s1.set(0, load(sin, angle)); s2.set(0, load(sin, angle + half));
    } else {
      a.read(x, at); b.read(x, at + half); c1.read(cos, angle); c2.read(cos, angle + half); s1.read(sin, angle); s2.read(sin, angle + half);
    }
    if (transpose) { const Pack<T> t = s1; s1 = s2; s2 = t; }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      y1.set(k, fmaf(a.get(k), c1.get(k), b.get(k) * s1.get(k)));
      y2.set(k, fmaf(b.get(k), c2.get(k), a.get(k) * s2.get(k)));
    }
    if (W == 1) {
      store(y, at, y1.get(0)); store(y, at + half, y2.get(0));
    } else {
      y1.write(y, at); y2.write(y, at + half);
    }
  }
}

template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, long long rows, int heads, int half, int transpose, int packed) {
  if (packed) rope_pairs<T, Pack<T>::N>(x, cos, sin, y, rows, heads, half, transpose);
  else rope_pairs<T, 1>(x, cos, sin, y, rows, heads, half, transpose);
}

extern "C" __global__ void rope_f32(const float* x, const float* cos, const float* sin, float* y, long long rows, int heads, int half, int transpose, int packed) {
  rope(x, cos, sin, y, rows, heads, half, transpose, packed);
}
extern "C" __global__ void rope_bf16(const bf16* x, const bf16* cos, const bf16* sin, bf16* y, long long rows, int heads, int half, int transpose, int packed) {
  rope(x, cos, sin, y, rows, heads, half, transpose, packed);
}

// SwiGLU: y = silu(g)·u forward; backward du = silu(g)·dy and
// dg = dy·u·σ(g)·(1 + g·(1 − σ(g))), silu recomputed from g. A thread per
// W values (as `rope_pairs`).
template <typename T, int W>
__device__ void swiglu_values(const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ grad,
                              T* __restrict__ out, T* __restrict__ grad_up, long long n) {
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += (long long)gridDim.x * blockDim.x * W) {
    Pack<T> g, u, dy, o, du;
    if (W == 1) {
      g.set(0, load(gate, i)); u.set(0, load(up, i));
      if (grad != nullptr) dy.set(0, load(grad, i));
    } else {
      g.read(gate, i); u.read(up, i);
      if (grad != nullptr) dy.read(grad, i);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float gk = g.get(k), sigmoid = 1.f / (1.f + __expf(-gk));
      if (grad == nullptr) {
        o.set(k, gk * sigmoid * u.get(k));
      } else {
        du.set(k, gk * sigmoid * dy.get(k));
        o.set(k, dy.get(k) * u.get(k) * sigmoid * fmaf(gk, 1.f - sigmoid, 1.f));
      }
    }
    if (W == 1) {
      store(out, i, o.get(0));
      if (grad != nullptr) store(grad_up, i, du.get(0));
    } else {
      o.write(out, i);
      if (grad != nullptr) du.write(grad_up, i);
    }
  }
}

template <typename T>
__device__ void swiglu(const T* gate, const T* up, const T* grad, T* out, T* grad_up, long long n, int packed) {
  if (packed) swiglu_values<T, Pack<T>::N>(gate, up, grad, out, grad_up, n);
  else swiglu_values<T, 1>(gate, up, grad, out, grad_up, n);
}

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

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, const float* grad, float* out, float* grad_up, long long n, int packed) {
  swiglu(gate, up, grad, out, grad_up, n, packed);
}
extern "C" __global__ void swiglu_bf16(const bf16* gate, const bf16* up, const bf16* grad, bf16* out, bf16* grad_up, long long n, int packed) {
  swiglu(gate, up, grad, out, grad_up, n, packed);
}
"#;

/// The kernels, loaded into one device's (primary) context.
#[derive(Clone, Copy)]
struct Functions {
    xent: sys::CUfunction,
    /// By the gradient's kind: [fp32, bf16].
    adamw: [sys::CUfunction; 2],
    /// By element kind: [fp32, bf16].
    quantize: [sys::CUfunction; 2],
    dequantize: [sys::CUfunction; 2],
    /// By the gradient's kind: [fp32, bf16].
    lowrank_project: [sys::CUfunction; 2],
    lowrank_project_t: sys::CUfunction,
    lowrank_orthonormalize: sys::CUfunction,
    /// By the output's kind: [fp32, bf16].
    lowrank_expand: [sys::CUfunction; 2],
    /// By the values' kind: [fp32, bf16].
    rope: [sys::CUfunction; 2],
    swiglu: [sys::CUfunction; 2],
    column_sum_partial: [sys::CUfunction; 2],
    column_sum_finish: [sys::CUfunction; 2],
    multiprocessors: u32,
}
// SAFETY: CUfunction handles are valid in every thread of the process.
unsafe impl Send for Functions {}

fn error(context: &str, detail: impl std::fmt::Display) -> ShimError {
    ShimError(format!("ft's CUDA kernels: {context}: {detail}"))
}

/// NVRTC's PTX of the kernels for compute capability `arch` (e.g. "compute_90").
pub fn compile(arch: &str) -> Result<String> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(error("NVRTC", "libnvrtc.so.13 not found (it ships in the nvidia-cuda-nvrtc wheel; put its lib directory on LD_LIBRARY_PATH)"));
    }
    let options = nvrtc::CompileOptions { options: vec![format!("--gpu-architecture={arch}")], ..Default::default() };
    let ptx = nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|e| error("NVRTC compilation", format!("{e:?}")))?;
    Ok(ptx.to_src())
}

fn load(device_index: usize) -> Result<Functions> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(error("driver", "libcuda.so.1 not found"));
    }
    driver::init().map_err(|e| error("cuInit", e))?;
    let device = driver::device::get(device_index as i32).map_err(|e| error("cuDeviceGet", e))?;
    let attribute = |attribute| unsafe { driver::device::get_attribute(device, attribute) }.map_err(|e| error("device attribute", e));
    let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let multiprocessors = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
    let ptx = std::ffi::CString::new(compile(&format!("compute_{major}{minor}"))?).map_err(|e| error("PTX", e))?;
    // SAFETY: PyTorch runs on the device's primary context; retaining it and
    // making it current lets the module load where PyTorch's tensors live.
    unsafe {
        let context = driver::primary_ctx::retain(device).map_err(|e| error("primary context", e))?;
        driver::ctx::set_current(context).map_err(|e| error("cuCtxSetCurrent", e))?;
        let module = driver::module::load_data(ptx.as_ptr() as *const c_void).map_err(|e| error("cuModuleLoadData", e))?;
        let function = |name: &str| {
            let name = std::ffi::CString::new(name).expect("no NUL");
            driver::module::get_function(module, name).map_err(|e| error("cuModuleGetFunction", e))
        };
        Ok(Functions {
            xent: function(XENT)?,
            adamw: [function(ADAMW)?, function("adamw_fp32_grad_bf16")?],
            quantize: [function("quantize_int8_f32")?, function("quantize_int8_bf16")?],
            dequantize: [function("dequantize_int8_f32")?, function("dequantize_int8_bf16")?],
            lowrank_project: [function("lowrank_project_f32")?, function("lowrank_project_bf16")?],
            lowrank_project_t: function("lowrank_project_t")?,
            lowrank_orthonormalize: function("lowrank_orthonormalize")?,
            lowrank_expand: [function("lowrank_expand_f32")?, function("lowrank_expand_bf16")?],
            rope: [function("rope_f32")?, function("rope_bf16")?],
            swiglu: [function("swiglu_f32")?, function("swiglu_bf16")?],
            column_sum_partial: [function("column_sum_partial_f32")?, function("column_sum_partial_bf16")?],
            column_sum_finish: [function("column_sum_finish_f32")?, function("column_sum_finish_bf16")?],
            multiprocessors,
        })
    }
}

/// The kernels for `device_index`, compiled and loaded on first use.
fn functions(device_index: usize) -> Result<Functions> {
    static LOADED: OnceLock<Mutex<HashMap<usize, std::result::Result<Functions, String>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    loaded.entry(device_index).or_insert_with(|| load(device_index).map_err(|e| e.0)).clone().map_err(ShimError)
}

/// Whether the kernels serve `device`: a GPU where NVRTC and the driver
/// load (they are compiled here, once per process). The error says why not.
pub fn available(device: Device) -> Result<()> {
    match device {
        Device::Cuda(index) => functions(index).map(|_| ()),
        _ => Err(error("unsupported", format!("{device:?} is not a GPU"))),
    }
}

/// Launches `function` on PyTorch's current stream of `device_index`.
///
/// # Safety
/// `params` must point at the kernel's arguments, in order and of its types,
/// and every pointer among them at live device memory the kernel may access.
unsafe fn launch(function: sys::CUfunction, device_index: usize, grid: impl Into<Grid>, threads: u32, params: &mut [*mut c_void]) -> Result<()> {
    unsafe { launch_block(function, device_index, grid, (threads, 1), params) }
}

/// `launch` with a two-dimensional block of `threads` (x, y).
///
/// # Safety
/// As `launch`.
unsafe fn launch_block(function: sys::CUfunction, device_index: usize, grid: impl Into<Grid>, threads: (u32, u32), params: &mut [*mut c_void]) -> Result<()> {
    let stream = crate::cuda_current_stream(device_index)? as sys::CUstream;
    let Grid(x, y) = grid.into();
    driver::launch_kernel(function, (x, y, 1), (threads.0, threads.1, 1), 0, stream, params).map_err(|e| error("launch", e))
}

/// A launch's blocks: x, or x by y.
struct Grid(u32, u32);

impl From<u32> for Grid {
    fn from(x: u32) -> Grid {
        Grid(x, 1)
    }
}

impl From<(u32, u32)> for Grid {
    fn from((x, y): (u32, u32)) -> Grid {
        Grid(x, y)
    }
}

fn arg<T>(value: &mut T) -> *mut c_void {
    value as *mut T as *mut c_void
}

fn expect(tensor: &Tensor, name: &str, like: &Tensor, size: &[i64], kind: Kind) -> Result<()> {
    if tensor.size() != size || tensor.kind() != kind || tensor.device() != like.device() || !tensor.is_contiguous() {
        let layout = if tensor.is_contiguous() { "" } else { ", not contiguous" };
        return Err(error(
            name,
            format!("expected contiguous {kind:?} {size:?} on {:?}, got {:?} {:?} on {:?}{layout}", like.device(), tensor.kind(), tensor.size(), tensor.device()),
        ));
    }
    Ok(())
}

/// One AdamW step in place over `param`, `exp_avg`, `exp_avg_sq` (fp32,
/// contiguous, same length as `grad`, which is fp32 or bf16), as ATen's `_fused_adamw_` computes
/// it: `step` (one float, on the device) already counts this step,
/// `grad_scale` (one float) divides the gradient, a non-zero `found_inf`
/// (one float) skips the update.
#[allow(clippy::too_many_arguments)]
pub fn adamw_(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    hyper: crate::AdamW,
    step: &Tensor,
    grad_scale: Option<&Tensor>,
    found_inf: Option<&Tensor>,
) -> Result<()> {
    let Device::Cuda(index) = param.device() else {
        return Err(error("unsupported", "parameters are not on a GPU"));
    };
    let n = param.numel() as i64;
    for (tensor, name) in [(param, "param"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")] {
        expect(tensor, name, param, &[n], Kind::Float)?;
    }
    let by_grad = by_kind(grad.kind())?;
    expect(grad, "grad", param, &[n], grad.kind())?;
    for (tensor, name) in [(Some(step), "step"), (grad_scale, "grad_scale"), (found_inf, "found_inf")] {
        if let Some(tensor) = tensor {
            if tensor.numel() != 1 || tensor.kind() != Kind::Float || tensor.device() != param.device() {
                return Err(error(name, format!("expected one float on {:?}", param.device())));
            }
        }
    }
    if n == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let blocks = (n as u64).div_ceil(4 * ADAMW_THREADS as u64).min(functions.multiprocessors as u64 * 8) as u32;
    let pointer = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), Tensor::data_ptr);
    let (mut p, mut g, mut m, mut v) = (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr());
    let (mut step_ptr, mut scale_ptr, mut inf_ptr) = (step.data_ptr(), pointer(grad_scale), pointer(found_inf));
    let mut n = n;
    let crate::AdamW { mut lr, mut beta1, mut beta2, mut weight_decay, mut eps } = hyper;
    let mut params = [
        arg(&mut p),
        arg(&mut g),
        arg(&mut m),
        arg(&mut v),
        arg(&mut n),
        arg(&mut lr),
        arg(&mut beta1),
        arg(&mut beta2),
        arg(&mut weight_decay),
        arg(&mut eps),
        arg(&mut step_ptr),
        arg(&mut scale_ptr),
        arg(&mut inf_ptr),
    ];
    // SAFETY: the arguments match adamw_fp32's signature; the tensors were
    // checked above and stay alive until the launch is queued, after which the
    // caching allocator keeps their memory for this stream's queued work.
    unsafe { launch(functions.adamw[by_grad], index, blocks, ADAMW_THREADS, &mut params) }
}

/// In place: each row of `logits` [rows, vocab] (bf16, CUDA, contiguous)
/// becomes (softmax(row) − one-hot(target)) · `grad_scale[row]`, and
/// `row_loss[row]` (fp32) = logsumexp(row) − row[target], 0 where the target
/// is `ignore_index` and NaN where it is outside the vocabulary.
pub fn softmax_xent_backward_(logits: &mut Tensor, targets: &Tensor, grad_scale: &Tensor, row_loss: &mut Tensor, ignore_index: i64) -> Result<()> {
    let Device::Cuda(index) = logits.device() else {
        return Err(error("unsupported", "logits are not on a GPU"));
    };
    let (rows, vocab) = logits.size2().map_err(|e| error("logits", e))?;
    expect(logits, "logits", logits, &[rows, vocab], Kind::BFloat16)?;
    expect(targets, "targets", logits, &[rows], Kind::Int64)?;
    expect(grad_scale, "grad_scale", logits, &[rows], Kind::Float)?;
    expect(row_loss, "row_loss", logits, &[rows], Kind::Float)?;
    if rows == 0 {
        return Ok(());
    }
    let mut vocab = i32::try_from(vocab).map_err(|_| error("logits", "vocabulary over 2^31"))?;
    let functions = functions(index)?;
    let (mut logits_ptr, mut targets_ptr, mut scale_ptr, mut loss_ptr) = (logits.data_ptr(), targets.data_ptr(), grad_scale.data_ptr(), row_loss.data_ptr());
    let mut ignore_index = ignore_index;
    let mut params = [arg(&mut logits_ptr), arg(&mut targets_ptr), arg(&mut scale_ptr), arg(&mut loss_ptr), arg(&mut vocab), arg(&mut ignore_index)];
    // SAFETY: the arguments match softmax_xent_backward_bf16's signature and
    // the tensors were checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.xent, index, rows as u32, XENT_THREADS, &mut params) }
}

/// Which of a kernel pair serves `kind`: fp32 and bf16 values have kernels.
fn by_kind(kind: Kind) -> Result<usize> {
    match kind {
        Kind::Float => Ok(0),
        Kind::BFloat16 => Ok(1),
        other => Err(error("unsupported", format!("no kernel for {other:?} values"))),
    }
}

/// Blockwise int8 of `x` ([rows · row_len], fp32 or bf16, CUDA, contiguous):
/// each row in blocks of `block` elements, the last padded with zeros, into
/// `q` (int8, rows · blocks_per_row · block) and `scales` (fp32, one a block).
pub fn quantize_int8(x: &Tensor, rows: i64, block: i64, q: &mut Tensor, scales: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = x.device() else {
        return Err(error("unsupported", "values are not on a GPU"));
    };
    let row_len = x.numel() as i64 / rows.max(1);
    let blocks_per_row = (row_len + block - 1) / block;
    expect(x, "x", x, &[rows * row_len], x.kind())?;
    expect(q, "q", x, &[rows * blocks_per_row * block], Kind::Int8)?;
    expect(scales, "scales", x, &[rows * blocks_per_row], Kind::Float)?;
    let function = functions(index)?.quantize[by_kind(x.kind())?];
    if rows * blocks_per_row == 0 {
        return Ok(());
    }
    let (mut x_ptr, mut q_ptr, mut scales_ptr) = (x.data_ptr(), q.data_ptr(), scales.data_ptr());
    let (mut row_len, mut block_, mut blocks_per_row_) = (row_len, block as i32, blocks_per_row as i32);
    let mut params = [arg(&mut x_ptr), arg(&mut row_len), arg(&mut block_), arg(&mut blocks_per_row_), arg(&mut q_ptr), arg(&mut scales_ptr)];
    // SAFETY: the arguments match quantize_int8_*'s signature and the
    // tensors were checked above (see `adamw_` on their lifetime).
    unsafe { launch(function, index, (rows * blocks_per_row) as u32, QUANTIZE_THREADS, &mut params) }
}

/// The values of `quantize_int8`'s `q` and `scales` ([rows] rows of
/// `row_len`, blocks of `block`) into `out` (fp32 or bf16, CUDA,
/// contiguous): rows · row_len values, or with `sum_rows` their sum over
/// rows (row_len values, summed in fp32).
pub fn dequantize_int8(q: &Tensor, scales: &Tensor, rows: i64, row_len: i64, block: i64, sum_rows: bool, out: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = q.device() else {
        return Err(error("unsupported", "values are not on a GPU"));
    };
    let blocks_per_row = (row_len + block - 1) / block;
    expect(q, "q", q, &[rows * blocks_per_row * block], Kind::Int8)?;
    expect(scales, "scales", q, &[rows * blocks_per_row], Kind::Float)?;
    let n = if sum_rows { row_len } else { rows * row_len };
    expect(out, "out", q, &[n], out.kind())?;
    let function = functions(index)?.dequantize[by_kind(out.kind())?];
    if n == 0 {
        return Ok(());
    }
    // One CUDA block per quantization block of a row, and one row of them per row (or one in all, summing).
    let grid_rows = if sum_rows { 1 } else { u32::try_from(rows).ok().filter(|&r| r <= 65_535).ok_or_else(|| error("q", format!("{rows} rows: at most 65535")))? };
    let grid = (u32::try_from(blocks_per_row).map_err(|_| error("q", "too many blocks a row"))?, grid_rows);
    let (mut q_ptr, mut scales_ptr, mut out_ptr) = (q.data_ptr(), scales.data_ptr(), out.data_ptr());
    let (mut block_, mut blocks_per_row_, mut row_len, mut rows_, mut sum_rows_) = (block as i32, blocks_per_row as i32, row_len, rows as i32, sum_rows as i32);
    let mut params = [
        arg(&mut q_ptr),
        arg(&mut scales_ptr),
        arg(&mut block_),
        arg(&mut blocks_per_row_),
        arg(&mut row_len),
        arg(&mut rows_),
        arg(&mut sum_rows_),
        arg(&mut out_ptr),
    ];
    // SAFETY: as in `quantize_int8`.
    unsafe { launch(function, index, grid, DEQUANTIZE_THREADS, &mut params) }
}

/// The widest factors the low-rank kernels take.
pub const LOWRANK_MAX: i64 = 8;
const LOWRANK_THREADS: u32 = 256;

fn gpu_index(tensor: &Tensor, what: &str) -> Result<usize> {
    match tensor.device() {
        Device::Cuda(index) => Ok(index),
        _ => Err(error("unsupported", format!("{what} is not on a GPU"))),
    }
}

/// The width r of a factor [n, r], which the kernels take from 1 to LOWRANK_MAX.
fn lowrank_width(factor: &Tensor, name: &str) -> Result<i64> {
    let r = factor.size2().map_err(|e| error(name, e))?.1;
    if !(1..=LOWRANK_MAX).contains(&r) {
        return Err(error(name, format!("width {r}: the kernels take 1 to {LOWRANK_MAX}")));
    }
    Ok(r)
}

/// The GPU, rows, columns and width of `x` [rows, cols] and its factors
/// `q` [cols, r] and `p` [rows, r], all fp32, contiguous, on one GPU.
fn lowrank_operands(x: &Tensor, q: &Tensor, p: &Tensor) -> Result<(usize, i64, i64, i64)> {
    let index = gpu_index(x, "x")?;
    let (rows, cols) = x.size2().map_err(|e| error("x", e))?;
    let r = lowrank_width(q, "q")?;
    expect(x, "x", x, &[rows, cols], Kind::Float)?;
    expect(q, "q", x, &[cols, r], Kind::Float)?;
    expect(p, "p", x, &[rows, r], Kind::Float)?;
    Ok((index, rows, cols, r))
}

/// P = X Q: `x` [rows, cols], `q` [cols, r], `p` [rows, r] (fp32, CUDA,
/// contiguous, r ≤ LOWRANK_MAX). With `add` (the shape of `x`, fp32 or
/// bf16), X += add first, written back, in the same pass. A matrix of few
/// rows is cut into chunks of columns summed apart, then added in chunk
/// order, so the result has the same bits every run.
pub fn lowrank_project(add: Option<&Tensor>, x: &mut Tensor, q: &Tensor, p: &mut Tensor) -> Result<()> {
    let (index, rows, cols, r) = lowrank_operands(x, q, p)?;
    if let Some(add) = add {
        expect(add, "add", x, &[rows, cols], add.kind())?;
    }
    let functions = functions(index)?;
    let function = functions.lowrank_project[by_kind(add.map_or(Kind::Float, Tensor::kind))?];
    if rows * cols == 0 {
        let _ = p.zero_();
        return Ok(());
    }
    // A warp a row of a chunk: enough chunks (of at least 256 columns) for
    // 32 warps a multiprocessor, then as many blocks of 8 warps as that takes.
    let warps_per_block = (LOWRANK_THREADS / 32) as u64;
    let warps_wanted = functions.multiprocessors as u64 * 32;
    let chunks = warps_wanted.div_ceil(rows as u64).min((cols as u64).div_ceil(256)).clamp(1, 65_535);
    let chunk = (cols as u64).div_ceil(chunks);
    let chunks = (cols as u64).div_ceil(chunk);
    let row_blocks = (rows as u64).div_ceil(warps_per_block).min(functions.multiprocessors as u64 * 16) as u32;
    let partial = match chunks {
        1 => p.shallow_clone(),
        _ => Tensor::empty([chunks as i64, rows, r], (Kind::Float, x.device())),
    };
    let (mut add_ptr, mut x_ptr, mut q_ptr, mut partial_ptr) = (add.map_or(std::ptr::null_mut(), Tensor::data_ptr), x.data_ptr(), q.data_ptr(), partial.data_ptr());
    let (mut rows, mut cols, mut r, mut chunk) = (rows, cols, r as i32, chunk as i64);
    let mut params = [arg(&mut add_ptr), arg(&mut x_ptr), arg(&mut rows), arg(&mut cols), arg(&mut q_ptr), arg(&mut r), arg(&mut chunk), arg(&mut partial_ptr)];
    // SAFETY: the arguments match lowrank_project_*'s signature and the
    // tensors were checked above (see `adamw_` on their lifetime).
    unsafe { launch(function, index, (row_blocks, chunks as u32), LOWRANK_THREADS, &mut params)? };
    if chunks > 1 {
        let _sum = partial.f_sum_intlist_out(p, [0i64].as_slice(), false, Kind::Float).map_err(|e| error("sum", e))?;
    }
    Ok(())
}

/// Q = Xᵀ P into `q`: `x` [rows, cols], `p` [rows, r], `q` [cols, r] (fp32,
/// CUDA, contiguous, r ≤ LOWRANK_MAX). Chunks of rows are summed apart,
/// then added in chunk order, so the result has the same bits every run.
pub fn lowrank_project_t(x: &Tensor, p: &Tensor, q: &mut Tensor) -> Result<()> {
    let (index, rows, cols, r) = lowrank_operands(x, q, p)?;
    let functions = functions(index)?;
    if rows * cols == 0 {
        let _ = q.zero_();
        return Ok(());
    }
    // A thread a column; enough chunks of rows (at least 32 each) to give every multiprocessor four blocks.
    let column_blocks = (cols as u64).div_ceil(LOWRANK_THREADS as u64);
    let chunks = (functions.multiprocessors as u64 * 4).div_ceil(column_blocks).min((rows as u64).div_ceil(32)).clamp(1, 65_535);
    let chunk = (rows as u64).div_ceil(chunks);
    let chunks = (rows as u64).div_ceil(chunk);
    let partial = Tensor::empty([chunks as i64, cols, r], (Kind::Float, x.device()));
    let grid = (u32::try_from(column_blocks).map_err(|_| error("x", "too many columns"))?, chunks as u32);
    let (mut x_ptr, mut p_ptr, mut partial_ptr) = (x.data_ptr(), p.data_ptr(), partial.data_ptr());
    let (mut rows, mut cols, mut r, mut chunk) = (rows, cols, r as i32, chunk as i64);
    let mut params = [arg(&mut x_ptr), arg(&mut rows), arg(&mut cols), arg(&mut p_ptr), arg(&mut r), arg(&mut chunk), arg(&mut partial_ptr)];
    // SAFETY: as in `lowrank_project`; `partial` was made above.
    unsafe { launch(functions.lowrank_project_t, index, grid, LOWRANK_THREADS, &mut params)? };
    let _sum = partial.f_sum_intlist_out(q, [0i64].as_slice(), false, Kind::Float).map_err(|e| error("sum", e))?;
    Ok(())
}

/// Each thin matrix that `table` lists (int64 [n, 3] on `all`'s device:
/// its first element in `all`, rows, width ≤ LOWRANK_MAX; row-major) made,
/// in place, an orthonormal basis of its columns (CholeskyQR2 in fp64; see
/// the kernel). The caller vouches that every matrix lies inside `all`.
pub fn lowrank_orthonormalize(all: &mut Tensor, table: &Tensor) -> Result<()> {
    let index = gpu_index(all, "all")?;
    let n = table.size2().map_err(|e| error("table", e))?.0;
    expect(all, "all", all, &[all.numel() as i64], Kind::Float)?;
    expect(table, "table", all, &[n, 3], Kind::Int64)?;
    let functions = functions(index)?;
    if n == 0 {
        return Ok(());
    }
    let (mut all_ptr, mut table_ptr) = (all.data_ptr(), table.data_ptr());
    let mut params = [arg(&mut all_ptr), arg(&mut table_ptr)];
    let grid = u32::try_from(n).map_err(|_| error("table", "too many matrices"))?;
    // SAFETY: the arguments match lowrank_orthonormalize's signature and
    // were checked above, the table's contents by the caller.
    unsafe { launch(functions.lowrank_orthonormalize, index, grid, LOWRANK_THREADS, &mut params) }
}

/// `out` = P Qᵀ (`out` [rows, cols], fp32 or bf16; `p` [rows, r] and `q`
/// [cols, r], fp32; CUDA, contiguous, r ≤ LOWRANK_MAX), and with `residual`
/// (fp32, the shape of `out`, another buffer) residual −= (P Qᵀ) / n, in the
/// same pass.
pub fn lowrank_expand(p: &Tensor, q: &Tensor, out: &mut Tensor, residual: Option<&mut Tensor>, n: f32) -> Result<()> {
    let index = gpu_index(out, "out")?;
    let (rows, cols) = out.size2().map_err(|e| error("out", e))?;
    let r = lowrank_width(p, "p")?;
    expect(out, "out", out, &[rows, cols], out.kind())?;
    expect(p, "p", out, &[rows, r], Kind::Float)?;
    expect(q, "q", out, &[cols, r], Kind::Float)?;
    if let Some(residual) = &residual {
        expect(residual, "residual", out, &[rows, cols], Kind::Float)?;
    }
    let functions = functions(index)?;
    let function = functions.lowrank_expand[by_kind(out.kind())?];
    if rows * cols == 0 {
        return Ok(());
    }
    // A thread a column, its blocks down the rows: eight blocks a multiprocessor.
    let column_blocks = (cols as u64).div_ceil(LOWRANK_THREADS as u64);
    let row_blocks = (functions.multiprocessors as u64 * 8).div_ceil(column_blocks).min(rows as u64).min(65_535) as u32;
    let grid = (u32::try_from(column_blocks).map_err(|_| error("out", "too many columns"))?, row_blocks);
    let (mut p_ptr, mut q_ptr, mut out_ptr) = (p.data_ptr(), q.data_ptr(), out.data_ptr());
    let mut residual_ptr = residual.map_or(std::ptr::null_mut(), |t| t.data_ptr());
    let (mut rows, mut cols, mut r, mut n) = (rows, cols, r as i32, n);
    let mut params = [arg(&mut p_ptr), arg(&mut q_ptr), arg(&mut rows), arg(&mut cols), arg(&mut r), arg(&mut out_ptr), arg(&mut residual_ptr), arg(&mut n)];
    // SAFETY: as in `lowrank_project`.
    unsafe { launch(function, index, grid, LOWRANK_THREADS, &mut params) }
}

const ELEMENTWISE_THREADS: u32 = 256;

/// How many values a thread of `rope_*` / `swiglu_*` moves at once: a
/// 16-byte word's worth (the kernels' `Pack`) when every tensor starts
/// 16-byte aligned and `length` (the run each thread's words stay within)
/// divides into words, else 1.
fn packing<'a>(kind: Kind, length: i64, tensors: impl IntoIterator<Item = &'a Tensor>) -> i64 {
    let width = 16 / kind.elt_size_in_bytes() as i64;
    let aligned = tensors.into_iter().all(|t| t.data_ptr() as usize % 16 == 0);
    if aligned && length % width == 0 { width } else { 1 }
}

/// Rotary embeddings of `x` ([batch, seq, heads, head_dim], contiguous, fp32
/// or bf16) into `out` (same shape): x·cos + x[j ⊕ half]·sin, with `cos`
/// and `sin` [batch, seq, 1, head_dim] of x's kind (sin carrying
/// rotate_half's sign), or with `transpose` the adjoint, RoPE's backward.
pub fn rope_(x: &Tensor, cos: &Tensor, sin: &Tensor, out: &mut Tensor, transpose: bool) -> Result<()> {
    let Device::Cuda(index) = x.device() else {
        return Err(error("unsupported", "RoPE's input is not on a GPU"));
    };
    let (batch, seq, heads, head_dim) = x.size4().map_err(|e| error("RoPE's input", e))?;
    if head_dim % 2 != 0 {
        return Err(error("RoPE's input", format!("head_dim {head_dim} is odd")));
    }
    let kind = x.kind();
    let which = by_kind(kind)?;
    expect(x, "RoPE's input", x, &[batch, seq, heads, head_dim], kind)?;
    expect(out, "RoPE's output", x, &[batch, seq, heads, head_dim], kind)?;
    expect(cos, "cos", x, &[batch, seq, 1, head_dim], kind)?;
    expect(sin, "sin", x, &[batch, seq, 1, head_dim], kind)?;
    let mut rows = batch * seq * heads;
    if rows == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let half = head_dim / 2;
    let width = packing(kind, half, [x, cos, sin, &*out]);
    let blocks = ((rows * half / width) as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut x_ptr, mut cos_ptr, mut sin_ptr, mut out_ptr) = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr());
    let (mut heads, mut half, mut transpose, mut packed) = (heads as i32, half as i32, i32::from(transpose), i32::from(width > 1));
    let mut params = [
        arg(&mut x_ptr),
        arg(&mut cos_ptr),
        arg(&mut sin_ptr),
        arg(&mut out_ptr),
        arg(&mut rows),
        arg(&mut heads),
        arg(&mut half),
        arg(&mut transpose),
        arg(&mut packed),
    ];
    // SAFETY: the arguments match rope_*'s signature and the tensors were
    // checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.rope[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// SwiGLU's gating of `gate` and `up` (same shape, contiguous, fp32 or bf16
/// on a GPU): with `grad` None, `out` = silu(gate)·up; with `grad` (dy),
/// `out` = d/d gate and `grad_up` = d/d up.
pub fn swiglu_(gate: &Tensor, up: &Tensor, grad: Option<&Tensor>, out: &mut Tensor, grad_up: Option<&mut Tensor>) -> Result<()> {
    let Device::Cuda(index) = gate.device() else {
        return Err(error("unsupported", "SwiGLU's input is not on a GPU"));
    };
    let (size, kind) = (gate.size(), gate.kind());
    let which = by_kind(kind)?;
    expect(gate, "gate", gate, &size, kind)?;
    expect(up, "up", gate, &size, kind)?;
    expect(out, "SwiGLU's output", gate, &size, kind)?;
    let mut grad_ptr = match grad {
        Some(grad) => expect(grad, "SwiGLU's output gradient", gate, &size, kind).map(|()| grad.data_ptr())?,
        None => std::ptr::null_mut(),
    };
    let mut grad_up_ptr = match (&grad_up, grad) {
        (Some(grad_up), Some(_)) => expect(grad_up, "up's gradient", gate, &size, kind).map(|()| grad_up.data_ptr())?,
        (None, None) => std::ptr::null_mut(),
        _ => return Err(error("SwiGLU", "backward takes both the output gradient and up's gradient")),
    };
    let mut n = gate.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let tensors = [Some(gate), Some(up), grad, Some(&*out), grad_up.as_deref()];
    let width = packing(kind, n, tensors.into_iter().flatten());
    let blocks = ((n / width) as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut gate_ptr, mut up_ptr, mut out_ptr, mut packed) = (gate.data_ptr(), up.data_ptr(), out.data_ptr(), i32::from(width > 1));
    let mut params =
        [arg(&mut gate_ptr), arg(&mut up_ptr), arg(&mut grad_ptr), arg(&mut out_ptr), arg(&mut grad_up_ptr), arg(&mut n), arg(&mut packed)];
    // SAFETY: the arguments match swiglu_*'s signature and the tensors were
    // checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.swiglu[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// Row lanes of a `column_sum_partial_*` block (the source's COLUMN_LANES).
const COLUMN_LANES: u32 = 8;

/// `out` ([cols]) = the column sums of `dy` ([rows, cols], contiguous,
/// fp32 or bf16, `out` of the same kind) in fp32, in a fixed order: a
/// linear layer's bias gradient. With `normalized` = (x, mean, rstd) —
/// LayerNorm's input [rows, cols] and fp32 statistics [rows] — `out` is
/// [2 · cols]: those sums, then the sums of dy·(x − mean)·rstd (LayerNorm's
/// bias and weight gradients).
pub fn column_sum(dy: &Tensor, normalized: Option<(&Tensor, &Tensor, &Tensor)>, out: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = dy.device() else {
        return Err(error("unsupported", "the summed matrix is not on a GPU"));
    };
    let (rows, cols) = dy.size2().map_err(|e| error("column sum's input", e))?;
    let kind = dy.kind();
    let which = by_kind(kind)?;
    expect(dy, "column sum's input", dy, &[rows, cols], kind)?;
    let sums: i64 = if normalized.is_some() { 2 } else { 1 };
    expect(out, "column sums", dy, &[sums * cols], kind)?;
    let (mut x_ptr, mut mean_ptr, mut rstd_ptr) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    if let Some((x, mean, rstd)) = normalized {
        expect(x, "LayerNorm's input", dy, &[rows, cols], kind)?;
        expect(mean, "LayerNorm's mean", dy, &[rows], Kind::Float)?;
        expect(rstd, "LayerNorm's rstd", dy, &[rows], Kind::Float)?;
        (x_ptr, mean_ptr, rstd_ptr) = (x.data_ptr(), mean.data_ptr(), rstd.data_ptr());
    }
    if cols == 0 {
        return Ok(());
    }
    let mut cols = i32::try_from(cols).map_err(|_| error("column sum's input", "over 2^31 columns"))?;
    let functions = functions(index)?;
    // Enough chunks of rows for ~8 blocks a multiprocessor, each lane
    // reading at least 16 rows.
    let column_blocks = (cols as u32).div_ceil(32);
    let rows_per_chunk = 16 * COLUMN_LANES as u64;
    let chunks = (functions.multiprocessors * 8).div_ceil(column_blocks).clamp(1, (rows.max(1) as u64).div_ceil(rows_per_chunk) as u32).min(65_535);
    let mut chunk = (rows.max(1) as u64).div_ceil(chunks as u64) as i64;
    let partial = Tensor::empty([sums * chunks as i64, cols as i64], (Kind::Float, dy.device()));
    let (mut dy_ptr, mut partial_ptr, mut out_ptr, mut rows) = (dy.data_ptr(), partial.data_ptr(), out.data_ptr(), rows);
    let (mut chunks_arg, mut sums) = (chunks as i32, sums as i32);
    let mut params =
        [arg(&mut dy_ptr), arg(&mut x_ptr), arg(&mut mean_ptr), arg(&mut rstd_ptr), arg(&mut rows), arg(&mut cols), arg(&mut chunk), arg(&mut partial_ptr)];
    // SAFETY: the arguments match column_sum_partial_*'s signature; `partial`
    // lives until both launches are queued (see `adamw_` on lifetimes).
    unsafe { launch_block(functions.column_sum_partial[which], index, (column_blocks, chunks), (32, COLUMN_LANES), &mut params)? };
    let mut params = [arg(&mut partial_ptr), arg(&mut chunks_arg), arg(&mut cols), arg(&mut sums), arg(&mut out_ptr)];
    // SAFETY: the arguments match column_sum_finish_*'s signature.
    unsafe { launch(functions.column_sum_finish[which], index, (cols as u32).div_ceil(256), 256, &mut params) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_source_compiles_with_nvrtc() {
        // No GPU is needed to compile: this catches a broken kernel on CPU-only CI.
        let ptx = super::compile("compute_90").expect("NVRTC compiles the kernels");
        for kernel in [super::XENT, super::ADAMW, "quantize_int8_bf16", "dequantize_int8_f32", "lowrank_project_bf16", "lowrank_project_t", "lowrank_orthonormalize", "lowrank_expand_f32", "rope_bf16", "swiglu_f32", "adamw_fp32_grad_bf16", "column_sum_partial_bf16", "column_sum_finish_f32"] {
            assert!(ptx.contains(&format!(".entry {kernel}")), "{kernel} missing from {}", &ptx[..ptx.len().min(400)]);
        }
    }
}
