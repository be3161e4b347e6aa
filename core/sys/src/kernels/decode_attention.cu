// Decoding's attention (flash-decoding): one query per row and head over a
// KV cache's keys and values ([rows, kv_heads, capacity, head_dim]), the
// `groups` = heads / kv_heads query heads of a key head together
// (grouped-query attention), an additive bias per key in the queries' kind
// ([rows, bias_heads, capacity]: the padding mask, one for every head, or
// ALiBi's, one per head). Block (row·kv_heads + kv)·chunks + chunk takes
// DECODE_CHUNK keys: a thread per key for the scores (its key's dimensions
// loaded at once, so a warp has many loads in flight rather than one key's
// at a time, and every query head's dot product side by side), the chunk's
// softmax in shared memory, then a warp per quarter of the keys for the
// values, each lane holding head_dim / 32 dimensions in one load a key.
// The block is latency-bound (a wave of blocks covers the GPU), so the
// loops never branch: their loads all issue before the first is waited on.
// It writes its maximum, sum and weighted values per query head to
// `partial` ([rows·kv_heads, chunks, groups, head_dim + 2]);
// `decode_attention_merge` combines the chunks. A key hidden from every
// query head (a padding or unwritten slot) is not read for its scores, and a
// chunk hidden whole ends once its masks are read.
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

// A lane's N (4 or 2) consecutive values as fp32, in one load (`load4`, `load2`).
template <int N, typename T> __device__ __forceinline__ void load_lane(const T* x, float* out) {
  if constexpr (N == 4) {
    const float4 a = load4(x, 0);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  } else {
    const float2 a = load2(x, 0);
    out[0] = a.x; out[1] = a.y;
  }
}

// G: the query heads a key head serves (`groups`) rounded up to 1, 2, 4 or
// 8. Every loop runs all G heads, the padding ones with zero queries and
// no visible key, so that no loop branches: its loads are all issued
// before their arithmetic waits on any of them.
template <typename T, int HD, int G>
__device__ void decode_attention_split_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             const T* __restrict__ bias, float* __restrict__ partial, int kv_heads, int groups,
                                             long long capacity, int chunks, int bias_heads, float scale, float* space) {
  constexpr int E = HD / 32, KEYS_PER_WARP = DECODE_CHUNK / DECODE_WARPS;
  // Keys whose values a lane loads before it waits on the first: all of its
  // warp's where the registers have room for them (few query heads, 2-byte
  // values: 64 registers of loads).
  constexpr int UNROLL = G <= 2 && sizeof(T) == 2 ? KEYS_PER_WARP : 8;
  float(*queries)[HD] = reinterpret_cast<float(*)[HD]>(space);
  float(*weights)[DECODE_CHUNK] = reinterpret_cast<float(*)[DECODE_CHUNK]>(space + G * HD);  // scores, then exp(score - max)
  float *top = space + G * (HD + DECODE_CHUNK), *total = top + G;
  float(*sums)[G][HD] = reinterpret_cast<float(*)[G][HD]>(total + G);
  const long long row_kv = blockIdx.x / chunks, row = row_kv / kv_heads;
  const int kv = (int)(row_kv % kv_heads), chunk = (int)(blockIdx.x % chunks);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const long long start = (long long)chunk * DECODE_CHUNK, cache = row_kv * capacity * HD;
  // This chunk's results: per query head, its weighted values, maximum and sum.
  float* const out = partial + (row_kv * chunks + chunk) * groups * (HD + 2);
  for (int i = t; i < G * HD; i += DECODE_CHUNK) queries[i / HD][i % HD] = i / HD < groups ? load(q, (row_kv * groups) * HD + i) * scale : 0.f;
  __syncthreads();

  // Scores: thread t takes key start + t, eight of its dimensions at a time.
  const long long j = start + t;
  float s[G];
  bool seen = false;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    s[g] = g < groups && j < capacity ? load(bias, (row * bias_heads + (bias_heads == 1 ? 0 : kv * groups + g)) * capacity + j) : NEG_INF;
    seen |= s[g] > NEG_INF;
  }
  if (seen) {
    float dot[G];
#pragma unroll
    for (int g = 0; g < G; ++g) dot[g] = 0.f;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      float key[8];
      load8(k + cache + j * HD + c * 8, key);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int d = 0; d < 8; ++d) dot[g] = fmaf(queries[g][c * 8 + d], key[d], dot[g]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] += dot[g];
  }
#pragma unroll
  for (int g = 0; g < G; ++g) weights[g][t] = s[g];
  // A chunk no query head sees ends here, as its softmax would: no weight,
  // no values. The grid covers the cache's capacity, so while a rollout is
  // young most chunks are slots not yet written.
  if (!__syncthreads_or(seen)) {
    for (int i = t; i < groups * (HD + 2); i += DECODE_CHUNK) out[i] = i % (HD + 2) == HD ? NEG_INF : 0.f;
    return;
  }

  // The chunk's softmax per query head, a warp a head.
  for (int g = warp; g < G; g += DECODE_WARPS) {
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

  // Values: warp w takes the chunk's w-th quarter of the keys, lane the
  // dimensions lane·E … lane·E + E - 1. A key past the cache's end reads
  // its last slot under a weight of 0, again so that the loop never
  // branches.
  float acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  if (any) {
    const int first = warp * KEYS_PER_WARP;
#pragma unroll UNROLL
    for (int i = 0; i < KEYS_PER_WARP; ++i) {
      const int key = first + i;
      float value[E];
      load_lane<E>(v + cache + min(start + key, capacity - 1) * HD + lane * E, value);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = weights[g][key];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, value[e], acc[g][e]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < E; ++e) sums[warp][g][lane * E + e] = acc[g][e];
  __syncthreads();
  for (int i = t; i < groups * HD; i += DECODE_CHUNK) {
    const int g = i / HD, d = i % HD;
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) value += sums[w][g][d];
    float* head = out + g * (HD + 2);
    head[d] = value;
    if (d == 0) { head[HD] = top[g]; head[HD + 1] = total[g]; }
  }
}

// The shared memory of the largest instance (8 heads of 128 dimensions):
// one buffer that every instance carves, where each instance's own arrays
// would add up in the kernel.
#define DECODE_SPACE (DECODE_MAX_GROUPS * (128 + DECODE_CHUNK + 2 + DECODE_WARPS * 128))

template <typename T, int HD>
__device__ void decode_attention_split_heads(const T* q, const T* k, const T* v, const T* bias, float* partial, int kv_heads, int groups,
                                             long long capacity, int chunks, int bias_heads, float scale, float* space) {
  if (groups == 1) decode_attention_split_chunk<T, HD, 1>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
  else if (groups == 2) decode_attention_split_chunk<T, HD, 2>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
  else if (groups <= 4) decode_attention_split_chunk<T, HD, 4>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
  else decode_attention_split_chunk<T, HD, DECODE_MAX_GROUPS>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
}

template <typename T>
__device__ void decode_attention_split(const T* q, const T* k, const T* v, const T* bias, float* partial, int kv_heads, int groups,
                                       long long capacity, int chunks, int bias_heads, float scale, int head_dim) {
  __shared__ float space[DECODE_SPACE];
  if (head_dim == 128) decode_attention_split_heads<T, 128>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
  else decode_attention_split_heads<T, 64>(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, space);
}

extern "C" __global__ void __launch_bounds__(DECODE_CHUNK, 4) decode_attention_split_f32(const float* q, const float* k, const float* v, const float* bias, float* partial,
                                                                                   int kv_heads, int groups, long long capacity, int chunks, int bias_heads,
                                                                                   float scale, int head_dim) {
  decode_attention_split(q, k, v, bias, partial, kv_heads, groups, capacity, chunks, bias_heads, scale, head_dim);
}
extern "C" __global__ void __launch_bounds__(DECODE_CHUNK, 4) decode_attention_split_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* bias, float* partial,
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
