// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

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
