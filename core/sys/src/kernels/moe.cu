// A mixture of experts' passes over the assignments' rows (moe.rs), each
// one pass where ATen's ops take two or three.

// SwiGLU over the two halves of each row of `x` [rows, 2·width]: the
// experts' fused gate-and-up projection, gate first (`swiglu_one`). Forward
// writes y [rows, width]; backward (grad = dy [rows, width]) writes the
// gradient of x [rows, 2·width], gate's half and up's, so neither half is
// copied out first nor its gradient concatenated after. A thread per W
// values of a row's half.
template <typename T, int W>
__device__ void swiglu_halves_values(const T* __restrict__ x, const T* __restrict__ grad, T* __restrict__ out, long long rows, int width) {
  const int groups = width / W;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * groups; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / groups;
    const int j = (int)(i - row * groups) * W;
    const long long gate_at = row * 2 * width + j, up_at = gate_at + width, y_at = row * width + j;
    Pack<T> g, u, dy, o, du;
    read_values<T, W>(g, x, gate_at);
    read_values<T, W>(u, x, up_at);
    if (grad != nullptr) read_values<T, W>(dy, grad, y_at);
    swiglu_pack<T, W>(g, u, grad != nullptr ? &dy : nullptr, o, du);
    if (grad == nullptr) {
      write_values<T, W>(o, out, y_at);
    } else {
      write_values<T, W>(o, out, gate_at);
      write_values<T, W>(du, out, up_at);
    }
  }
}

template <typename T>
__device__ void swiglu_halves(const T* x, const T* grad, T* out, long long rows, int width, int packed) {
  if (packed) swiglu_halves_values<T, Pack<T>::N>(x, grad, out, rows, width);
  else swiglu_halves_values<T, 1>(x, grad, out, rows, width);
}

extern "C" __global__ void swiglu_halves_f32(const float* x, const float* grad, float* out, long long rows, int width, int packed) {
  swiglu_halves(x, grad, out, rows, width, packed);
}
extern "C" __global__ void swiglu_halves_bf16(const bf16* x, const bf16* grad, bf16* out, long long rows, int width, int packed) {
  swiglu_halves(x, grad, out, rows, width, packed);
}

// The most assignments a token may have for `combine` (top-k), its
// gradient's dot products held in registers.
#define COMBINE_MAX_K 16

// The experts' outputs combined into each token's: y[t] = Σ_i w[t,i]·rows[at[t·k + i]]
// over its k assignments (`at`: where assignment i of token t sits among
// the rows, sorted by expert; w fp32), summed in fp32 and rounded once.
// Backward (grad = dy [tokens, width]): the rows' gradient w[t,i]·dy[t]
// into `out` at at[t·k + i] (each row written once: `at` is a permutation)
// and w's, ⟨rows[at[t·k + i]], dy[t]⟩, into `grad_weights`. A block per
// token (striding over tokens), its threads over the width W values at a time.
template <typename T, int W>
__device__ void combine_rows(const T* __restrict__ rows, const float* __restrict__ weights, const long long* __restrict__ at,
                             const T* __restrict__ grad, T* __restrict__ out, float* __restrict__ grad_weights, long long tokens, int k,
                             int width) {
  __shared__ float partial[COMBINE_MAX_K][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
    float dot[COMBINE_MAX_K];
#pragma unroll
    for (int i = 0; i < COMBINE_MAX_K; ++i) dot[i] = 0.f;
    for (int j = threadIdx.x * W; j < width; j += blockDim.x * W) {
      if (grad == nullptr) {
        float sum[W];
#pragma unroll
        for (int c = 0; c < W; ++c) sum[c] = 0.f;
        for (int i = 0; i < k; ++i) {
          const float w = weights[t * k + i];
          Pack<T> v;
          read_values<T, W>(v, rows, at[t * k + i] * width + j);
#pragma unroll
          for (int c = 0; c < W; ++c) sum[c] = fmaf(w, v.get(c), sum[c]);
        }
        Pack<T> y;
#pragma unroll
        for (int c = 0; c < W; ++c) y.set(c, sum[c]);
        write_values<T, W>(y, out, t * width + j);
      } else {
        Pack<T> dy;
        read_values<T, W>(dy, grad, t * width + j);
#pragma unroll
        for (int i = 0; i < COMBINE_MAX_K; ++i) {
          if (i >= k) break;
          const long long row = at[t * k + i] * width + j;
          const float w = weights[t * k + i];
          Pack<T> v, d;
          read_values<T, W>(v, rows, row);
#pragma unroll
          for (int c = 0; c < W; ++c) {
            dot[i] = fmaf(v.get(c), dy.get(c), dot[i]);
            d.set(c, w * dy.get(c));
          }
          write_values<T, W>(d, out, row);
        }
      }
    }
    if (grad != nullptr) {
      // Each dot product summed over the block: within each warp, then over the warps.
#pragma unroll
      for (int i = 0; i < COMBINE_MAX_K; ++i) {
        if (i >= k) break;
        float v = dot[i];
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
        if (lane == 0) partial[i][warp] = v;
      }
      __syncthreads();
      if (threadIdx.x < k) {
        float v = 0.f;
        for (int w = 0; w < warps; ++w) v += partial[threadIdx.x][w];
        grad_weights[t * k + threadIdx.x] = v;
      }
      __syncthreads();
    }
  }
}

template <typename T>
__device__ void combine(const T* rows, const float* weights, const long long* at, const T* grad, T* out, float* grad_weights, long long tokens,
                        int k, int width, int packed) {
  if (packed) combine_rows<T, Pack<T>::N>(rows, weights, at, grad, out, grad_weights, tokens, k, width);
  else combine_rows<T, 1>(rows, weights, at, grad, out, grad_weights, tokens, k, width);
}

extern "C" __global__ void combine_f32(const float* rows, const float* weights, const long long* at, const float* grad, float* out,
                                       float* grad_weights, long long tokens, int k, int width, int packed) {
  combine(rows, weights, at, grad, out, grad_weights, tokens, k, width, packed);
}
extern "C" __global__ void combine_bf16(const bf16* rows, const float* weights, const long long* at, const bf16* grad, bf16* out,
                                        float* grad_weights, long long tokens, int k, int width, int packed) {
  combine(rows, weights, at, grad, out, grad_weights, tokens, k, width, packed);
}
