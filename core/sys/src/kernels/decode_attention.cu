// Decoding's attention (flash-decoding): one query per row and head over a
// KV cache's keys and values ([rows, kv_heads, capacity, head_dim]), the
// `groups` = heads / kv_heads query heads of a key head together
// (grouped-query attention), an additive bias per key in the queries' kind
// ([rows, bias_heads, capacity]: the padding mask, one for every head, or
// ALiBi's, one per head). Block (row·kv_heads + kv)·chunks + chunk takes
// DECODE_CHUNK keys: a thread per key for the scores (its key's dimensions
// loaded at once, so a warp has many loads in flight rather than one key's
// at a time), the chunk's softmax in shared memory, then a warp per quarter
// of the keys for the values, each lane holding head_dim / 32 dimensions.
// It writes its maximum, sum and weighted values per query head to
// `partial` ([rows·kv_heads, chunks, groups, head_dim + 2]);
// `decode_attention_merge` combines the chunks. A key hidden from every
// query head (a padding or unwritten slot) is not read for its scores, and a
// chunk hidden whole reads no values either.
#define DECODE_MAX_GROUPS 8
#define DECODE_CHUNK 128
#define DECODE_WARPS (DECODE_CHUNK / 32)

// Eight consecutive values as fp32 (16-byte aligned loads).
__device__ __forceinline__ void load8(const float* x, float* out) {
  const float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16* x, float* out) {
  const uint4 w = *(const uint4*)x;
  out[0] = bf16_lo(w.x); out[1] = bf16_hi(w.x); out[2] = bf16_lo(w.y); out[3] = bf16_hi(w.y);
  out[4] = bf16_lo(w.z); out[5] = bf16_hi(w.z); out[6] = bf16_lo(w.w); out[7] = bf16_hi(w.w);
}

template <typename T, int HD>
__device__ void decode_attention_split_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             const T* __restrict__ bias, float* __restrict__ partial, int kv_heads, int groups,
                                             long long capacity, int chunks, int bias_heads, float scale) {
  constexpr int E = HD / 32;
  __shared__ float queries[DECODE_MAX_GROUPS][HD];
  __shared__ float weights[DECODE_MAX_GROUPS][DECODE_CHUNK];  // scores, then exp(score - max)
  __shared__ float top[DECODE_MAX_GROUPS], total[DECODE_MAX_GROUPS];
  __shared__ float sums[DECODE_WARPS][DECODE_MAX_GROUPS][HD];
  const long long row_kv = blockIdx.x / chunks, row = row_kv / kv_heads;
  const int kv = (int)(row_kv % kv_heads), chunk = (int)(blockIdx.x % chunks);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const long long start = (long long)chunk * DECODE_CHUNK, cache = row_kv * capacity * HD;
  for (int i = t; i < groups * HD; i += DECODE_CHUNK) queries[i / HD][i % HD] = load(q, (row_kv * groups) * HD + i) * scale;
  __syncthreads();

  // Scores: thread t takes key start + t.
  const long long j = start + t;
  float s[DECODE_MAX_GROUPS];
  bool seen = false;
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
    s[g] = g < groups && j < capacity ? load(bias, (row * bias_heads + (bias_heads == 1 ? 0 : kv * groups + g)) * capacity + j) : NEG_INF;
    seen |= s[g] > NEG_INF;
  }
  if (seen) {
    float key[HD];
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) load8(k + cache + j * HD + c * 8, key + c * 8);
#pragma unroll
    for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
      if (g >= groups || s[g] == NEG_INF) continue;
      float dot = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) dot = fmaf(queries[g][d], key[d], dot);
      s[g] += dot;
    }
  }
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g)
    if (g < groups) weights[g][t] = s[g];
  __syncthreads();

  // The chunk's softmax per query head, a warp a head.
  for (int g = warp; g < groups; g += DECODE_WARPS) {
    float m = NEG_INF;
    for (int i = lane; i < DECODE_CHUNK; i += 32) m = fmaxf(m, weights[g][i]);
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    float l = 0.f;
    for (int i = lane; i < DECODE_CHUNK; i += 32) {
      const float p = m == NEG_INF ? 0.f : __expf(weights[g][i] - m);
      weights[g][i] = p;
      l += p;
    }
    for (int offset = 16; offset > 0; offset /= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
    if (lane == 0) { top[g] = m; total[g] = l; }
  }
  __syncthreads();
  bool any = false;
  for (int g = 0; g < groups; ++g) any |= total[g] > 0.f;

  // Values: warp w takes the chunk's w-th quarter of the keys, lane the dimensions lane·E … lane·E + E - 1.
  float acc[DECODE_MAX_GROUPS][E];
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  if (any) {
    const int first = warp * (DECODE_CHUNK / DECODE_WARPS);
#pragma unroll 8
    for (int i = 0; i < DECODE_CHUNK / DECODE_WARPS; ++i) {
      const int key = first + i;
      if (start + key >= capacity) break;
      float value[E];
#pragma unroll
      for (int e = 0; e < E; ++e) value[e] = load(v, cache + (start + key) * HD + lane * E + e);
#pragma unroll
      for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
        if (g >= groups) break;
        const float p = weights[g][key];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, value[e], acc[g][e]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < DECODE_MAX_GROUPS; ++g) {
    if (g >= groups) break;
#pragma unroll
    for (int e = 0; e < E; ++e) sums[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = t; i < groups * HD; i += DECODE_CHUNK) {
    const int g = i / HD, d = i % HD;
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) value += sums[w][g][d];
    float* out = partial + ((row_kv * chunks + chunk) * groups + g) * (HD + 2);
    out[d] = value;
    if (d == 0) { out[HD] = top[g]; out[HD + 1] = total[g]; }
  }
}

template <typename T>
__device__ void decode_attention_split(const T* q, const T* k, const T* v, const T* bias, float* partial, int kv_heads, int groups,
                                       long long capacity, int chunks, int bias_heads, float scale, int head_dim) {
  if (head_dim == 128) decode_attention_split_chunk<T, 128>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale);
  else decode_attention_split_chunk<T, 64>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale);
}

extern "C" __global__ void __launch_bounds__(DECODE_CHUNK) decode_attention_split_f32(const float* q, const float* k, const float* v, const float* bias, float* partial,
                                                                                   int kv_heads, int groups, long long capacity, int chunks, int bias_heads,
                                                                                   float scale, int head_dim) {
  decode_attention_split(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, head_dim);
}
extern "C" __global__ void __launch_bounds__(DECODE_CHUNK) decode_attention_split_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* bias, float* partial,
                                                                                    int kv_heads, int groups, long long capacity, int chunks, int bias_heads,
                                                                                    float scale, int head_dim) {
  decode_attention_split(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, head_dim);
}

// The chunks of `decode_attention_split` combined: a block per row and
// query head (row·heads + head), a thread per dimension, into `out`
// [rows, heads, head_dim].
template <typename T>
__device__ void decode_attention_merge(const float* __restrict__ partial, T* __restrict__ out, int kv_heads, int groups, int chunks, int head_dim) {
  const long long row_head = blockIdx.x, heads = (long long)kv_heads * groups, row = row_head / heads;
  const int head = (int)(row_head % heads), d = threadIdx.x;
  if (d >= head_dim) return;
  const long long row_kv = row * kv_heads + head / groups;
  const float* first = partial + (row_kv * chunks * groups + head % groups) * (head_dim + 2);
  const long long stride = (long long)groups * (head_dim + 2);
  float m = NEG_INF;
  for (int c = 0; c < chunks; ++c) m = fmaxf(m, first[c * stride + head_dim]);
  float sum = 0.f, value = 0.f;
  for (int c = 0; c < chunks; ++c) {
    const float* chunk = first + c * stride;
    const float weight = m == NEG_INF ? 0.f : __expf(chunk[head_dim] - m);
    sum = fmaf(weight, chunk[head_dim + 1], sum);
    value = fmaf(weight, chunk[d], value);
  }
  store(out, row_head * head_dim + d, sum > 0.f ? value / sum : 0.f);
}

extern "C" __global__ void decode_attention_merge_f32(const float* partial, float* out, int kv_heads, int groups, int chunks, int head_dim) {
  decode_attention_merge(partial, out, kv_heads, groups, chunks, head_dim);
}
extern "C" __global__ void decode_attention_merge_bf16(const float* partial, bf16* out, int kv_heads, int groups, int chunks, int head_dim) {
  decode_attention_merge(partial, out, kv_heads, groups, chunks, head_dim);
}
