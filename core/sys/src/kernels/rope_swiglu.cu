// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).

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

// W values at x[i..]: a whole word when W is a Pack's, else one value.
template <typename T, int W> __device__ __forceinline__ void read_values(Pack<T>& p, const T* x, long long i) {
  if (W == 1) p.set(0, load(x, i)); else p.read(x, i);
}
template <typename T, int W> __device__ __forceinline__ void write_values(const Pack<T>& p, T* x, long long i) {
  if (W == 1) store(x, i, p.get(0)); else p.write(x, i);
}

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

// SwiGLU of one value: y = silu(g)·u forward; backward du = silu(g)·dy and
// dg = dy·u·σ(g)·(1 + g·(1 − σ(g))), silu recomputed from g (`dg` in `y`'s place).
__device__ __forceinline__ void swiglu_one(float g, float u, const float* dy, float* y, float* du) {
  const float sigmoid = 1.f / (1.f + __expf(-g));
  if (dy == nullptr) {
    *y = g * sigmoid * u;
  } else {
    *du = g * sigmoid * *dy;
    *y = *dy * u * sigmoid * fmaf(g, 1.f - sigmoid, 1.f);
  }
}

// `swiglu_one` over W values: y (dg in backward, `dy` given) into `o`, du into `du`;
// returns the largest |y| (forward).
template <typename T, int W>
__device__ __forceinline__ float swiglu_pack(const Pack<T>& g, const Pack<T>& u, const Pack<T>* dy, Pack<T>& o, Pack<T>& du) {
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float dyk = dy != nullptr ? dy->get(k) : 0.f;
    float ok, duk = 0.f;
    swiglu_one(g.get(k), u.get(k), dy != nullptr ? &dyk : nullptr, &ok, &duk);
    o.set(k, ok);
    du.set(k, duk);
    m = max_keeping_nan(m, fabsf(o.get(k)));
  }
  return m;
}

// SwiGLU over `gate` and `up` (`swiglu_one`). A thread per W values (as
// `rope_pairs`). Returns the largest |y| as stored (NaN if any), which the
// forward folds into `amax` when asked: a float8 layer reading y then
// needs no pass of its own (float8.cu's fp8_amax).
template <typename T, int W>
__device__ float swiglu_values(const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ grad,
                               T* __restrict__ out, T* __restrict__ grad_up, long long n) {
  float m = 0.f;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += (long long)gridDim.x * blockDim.x * W) {
    Pack<T> g, u, dy, o, du;
    read_values<T, W>(g, gate, i);
    read_values<T, W>(u, up, i);
    if (grad != nullptr) read_values<T, W>(dy, grad, i);
    const float pack_max = swiglu_pack<T, W>(g, u, grad != nullptr ? &dy : nullptr, o, du);
    write_values<T, W>(o, out, i);
    if (grad == nullptr) {
      m = max_keeping_nan(m, pack_max);
    } else {
      write_values<T, W>(du, grad_up, i);
    }
  }
  return m;
}

// `amax` (fp32 bits, zeroed by the caller; forward only, may be null): the
// output's max |y| (`fold_amax`).
template <typename T>
__device__ void swiglu(const T* gate, const T* up, const T* grad, T* out, T* grad_up, long long n, int packed, unsigned int* amax) {
  float m = packed ? swiglu_values<T, Pack<T>::N>(gate, up, grad, out, grad_up, n) : swiglu_values<T, 1>(gate, up, grad, out, grad_up, n);
  if (amax != nullptr) fold_amax(m, amax);
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, const float* grad, float* out, float* grad_up, long long n, int packed,
                                      unsigned int* amax) {
  swiglu(gate, up, grad, out, grad_up, n, packed, amax);
}
extern "C" __global__ void swiglu_bf16(const bf16* gate, const bf16* up, const bf16* grad, bf16* out, bf16* grad_up, long long n, int packed,
                                       unsigned int* amax) {
  swiglu(gate, up, grad, out, grad_up, n, packed, amax);
}

// A decoding step's queries, keys and values (one token a row, each row's
// heads at a stride of the joined q/k/v projection's width: views of it,
// never copied) into what attention reads: the queries rotated into `q_out`
// [rows, heads, head_dim], the keys rotated and the values as they are
// written at cache slot `*slot` of `keys`/`values` [rows, kv_heads,
// capacity, head_dim]. One kernel where RoPE's two, their inputs' copies
// and the cache's two index copies were six; the rotation is `rope_pairs`'
// arithmetic, so its outputs are the same bits. A thread per pair (j, j +
// half) of a query or key head, or per two values of a value head.
template <typename T>
__device__ void rope_cache(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ cos,
                           const T* __restrict__ sin, const long long* __restrict__ slot, T* __restrict__ q_out, T* __restrict__ keys,
                           T* __restrict__ values, int rows, int heads, int kv_heads, int half, long long q_stride, long long k_stride,
                           long long v_stride, long long capacity) {
  const long long at_slot = *slot;
  const long long per_row = (long long)(heads + 2 * kv_heads) * half;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * per_row; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / per_row;
    long long head = (i - row * per_row) / half;
    const int j = (int)(i - row * per_row - head * half);
    const long long angle = row * 2 * half + j;
    if (head < heads + kv_heads) {
      const bool query = head < heads;
      if (!query) head -= heads;
      const T* x = query ? q + row * q_stride : k + row * k_stride;
      const float a = load(x, head * 2 * half + j), b = load(x, head * 2 * half + j + half);
      const float y1 = fmaf(a, load(cos, angle), b * load(sin, angle));
      const float y2 = fmaf(b, load(cos, angle + half), a * load(sin, angle + half));
      T* y = query ? q_out + (row * heads + head) * 2 * half : keys + ((row * kv_heads + head) * capacity + at_slot) * 2 * half;
      store(y, j, y1);
      store(y, j + half, y2);
    } else {
      head -= heads + kv_heads;
      T* y = values + ((row * kv_heads + head) * capacity + at_slot) * 2 * half;
      const T* x = v + row * v_stride + head * 2 * half;
      store(y, j, load(x, j));
      store(y, j + half, load(x, j + half));
    }
  }
}

extern "C" __global__ void rope_cache_f32(const float* q, const float* k, const float* v, const float* cos, const float* sin, const long long* slot,
                                          float* q_out, float* keys, float* values, int rows, int heads, int kv_heads, int half,
                                          long long q_stride, long long k_stride, long long v_stride, long long capacity) {
  rope_cache(q, k, v, cos, sin, slot, q_out, keys, values, rows, heads, kv_heads, half, q_stride, k_stride, v_stride, capacity);
}
extern "C" __global__ void rope_cache_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* cos, const bf16* sin, const long long* slot,
                                           bf16* q_out, bf16* keys, bf16* values, int rows, int heads, int kv_heads, int half,
                                           long long q_stride, long long k_stride, long long v_stride, long long capacity) {
  rope_cache(q, k, v, cos, sin, slot, q_out, keys, values, rows, heads, kv_heads, half, q_stride, k_stride, v_stride, capacity);
}
