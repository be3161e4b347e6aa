// Decoding's attention (flash-decoding): one query per row and head over a
// KV cache's keys and values ([rows, kv_heads, capacity, head_dim]), the
// `groups` = heads / kv_heads query heads of a key head together
// (grouped-query attention), an additive fp32 bias per key ([rows,
// bias_heads, capacity]: the padding mask, one for every head, or ALiBi's,
// one per head). The keys are split among blocks: block (row·kv_heads +
// kv)·splits + split runs an online softmax over its keys, each warp a key at a time
// with each lane holding E = head_dim / 32 dimensions, and writes its
// maximum, sum and weighted values per query head to `partial`
// ([rows·kv_heads, splits, groups, head_dim + 2]); `decode_attention_merge`
// combines the splits. A key whose bias is -inf for every query head (a
// padding or unwritten slot) is not read.
#define DECODE_MAX_GROUPS 8
// -inf (NVRTC has no <math.h> INFINITY).
#define NEGATIVE_INFINITY __int_as_float(0xff800000)
#define DECODE_WARPS 4

template <typename T, int E>
__device__ void decode_attention_split_values(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                              const float* __restrict__ bias, float* __restrict__ partial, int kv_heads, int groups,
                                              long long capacity, int splits, int bias_heads, float scale) {
  constexpr int head_dim = 32 * E;
  __shared__ float merged[DECODE_WARPS][DECODE_MAX_GROUPS][head_dim + 2];
  const long long row_kv = blockIdx.x / splits, row = row_kv / kv_heads;
  const int kv = (int)(row_kv % kv_heads), split = (int)(blockIdx.x % splits);
  const long long chunk = (capacity + splits - 1) / splits, start = split * chunk, end = min(capacity, start + chunk);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float qv[DECODE_MAX_GROUPS][E], acc[DECODE_MAX_GROUPS][E], m[DECODE_MAX_GROUPS], l[DECODE_MAX_GROUPS];
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
    m[g] = NEGATIVE_INFINITY; l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[g][e] = 0.f;
      qv[g][e] = g < groups ? load(q, ((row * kv_heads + kv) * groups + g) * head_dim + lane * E + e) * scale : 0.f;
    }
  }
  const long long cache = row_kv * capacity * head_dim;
  for (long long j = start + warp; j < end; j += DECODE_WARPS) {
    float b[DECODE_MAX_GROUPS];
    bool any = false;
#pragma unroll
    for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
      b[g] = g < groups ? bias[(row * bias_heads + (bias_heads == 1 ? 0 : kv * groups + g)) * capacity + j] : NEGATIVE_INFINITY;
      any |= b[g] > NEGATIVE_INFINITY;
    }
    if (!any) continue;
    float key[E], value[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      key[e] = load(k, cache + j * head_dim + lane * E + e);
      value[e] = load(v, cache + j * head_dim + lane * E + e);
    }
#pragma unroll
    for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
      if (g >= groups || b[g] == NEGATIVE_INFINITY) continue;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) s = fmaf(qv[g][e], key[e], s);
      for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
      s += b[g];
      const float top = fmaxf(m[g], s), correction = __expf(m[g] - top), p = __expf(s - top);
      l[g] = fmaf(l[g], correction, p);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = fmaf(acc[g][e], correction, p * value[e]);
      m[g] = top;
    }
  }
  // The warps' states merged: each warp's into shared memory, then per query head over the warps.
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
    if (g >= groups) break;
#pragma unroll
    for (int e = 0; e < E; ++e) merged[warp][g][lane * E + e] = acc[g][e];
    if (lane == 0) { merged[warp][g][head_dim] = m[g]; merged[warp][g][head_dim + 1] = l[g]; }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < groups * head_dim; i += blockDim.x) {
    const int g = i / head_dim, d = i % head_dim;
    float top = NEGATIVE_INFINITY;
    for (int w = 0; w < DECODE_WARPS; ++w) top = fmaxf(top, merged[w][g][head_dim]);
    float sum = 0.f, value = 0.f;
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const float weight = top == NEGATIVE_INFINITY ? 0.f : __expf(merged[w][g][head_dim] - top);
      sum = fmaf(weight, merged[w][g][head_dim + 1], sum);
      value = fmaf(weight, merged[w][g][d], value);
    }
    float* out = partial + ((row_kv * splits + split) * groups + g) * (head_dim + 2);
    out[d] = value;
    if (d == 0) { out[head_dim] = top; out[head_dim + 1] = sum; }
  }
}

template <typename T>
__device__ void decode_attention_split(const T* q, const T* k, const T* v, const float* bias, float* partial, int kv_heads, int groups,
                                       long long capacity, int splits, int bias_heads, float scale, int head_dim) {
  if (head_dim == 128) decode_attention_split_values<T, 4>(q, k, v, bias, partial, kv_heads, groups, capacity, splits, bias_heads, scale);
  else decode_attention_split_values<T, 2>(q, k, v, bias, partial, kv_heads, groups, capacity, splits, bias_heads, scale);
}

extern "C" __global__ void decode_attention_split_f32(const float* q, const float* k, const float* v, const float* bias, float* partial, int kv_heads,
                                                      int groups, long long capacity, int splits, int bias_heads, float scale, int head_dim) {
  decode_attention_split(q, k, v, bias, partial, kv_heads, groups, capacity, splits, bias_heads, scale, head_dim);
}
extern "C" __global__ void decode_attention_split_bf16(const bf16* q, const bf16* k, const bf16* v, const float* bias, float* partial, int kv_heads,
                                                       int groups, long long capacity, int splits, int bias_heads, float scale, int head_dim) {
  decode_attention_split(q, k, v, bias, partial, kv_heads, groups, capacity, splits, bias_heads, scale, head_dim);
}

// The splits of `decode_attention_split` combined: a block per row and
// query head (row·heads + head), a thread per dimension, into `out`
// [rows, heads, head_dim].
template <typename T>
__device__ void decode_attention_merge(const float* __restrict__ partial, T* __restrict__ out, int kv_heads, int groups, int splits, int head_dim) {
  const long long row_head = blockIdx.x, heads = (long long)kv_heads * groups, row = row_head / heads;
  const int head = (int)(row_head % heads), d = threadIdx.x;
  if (d >= head_dim) return;
  const long long row_kv = row * kv_heads + head / groups;
  const float* first = partial + (row_kv * splits * groups + head % groups) * (head_dim + 2);
  const long long stride = (long long)groups * (head_dim + 2);
  float top = NEGATIVE_INFINITY;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, first[s * stride + head_dim]);
  float sum = 0.f, value = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float* split = first + s * stride;
    const float weight = top == NEGATIVE_INFINITY ? 0.f : __expf(split[head_dim] - top);
    sum = fmaf(weight, split[head_dim + 1], sum);
    value = fmaf(weight, split[d], value);
  }
  store(out, row_head * head_dim + d, sum > 0.f ? value / sum : 0.f);
}

extern "C" __global__ void decode_attention_merge_f32(const float* partial, float* out, int kv_heads, int groups, int splits, int head_dim) {
  decode_attention_merge(partial, out, kv_heads, groups, splits, head_dim);
}
extern "C" __global__ void decode_attention_merge_bf16(const float* partial, bf16* out, int kv_heads, int groups, int splits, int head_dim) {
  decode_attention_merge(partial, out, kv_heads, groups, splits, head_dim);
}
