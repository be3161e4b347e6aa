// Part of ft's CUDA kernels (core/sys/src/kernels.rs compiles them with NVRTC as one
// source: common.cuh first, then each family's file, so each may use common.cuh's helpers).
//
// AdamW: a grid-stride loop over float4s (a scalar loop when a buffer is not
// 16-byte aligned). With `compute` (may be null) it also writes each updated
// parameter rounded to bf16 there: the model's compute copy, which would
// otherwise take a pass of its own over the fp32 master after the step.

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

template <typename G>
__device__ void adamw_all(
    float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq, long long n, double lr_, double beta1_, double beta2_, double weight_decay_,
    double eps_, const float* __restrict__ step, const float* __restrict__ grad_scale,
    const float* __restrict__ found_inf, bf16* __restrict__ compute) {
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
                       (((unsigned long long)grad) & (4 * sizeof(G) - 1)) == 0 && (((unsigned long long)compute) & 7ull) == 0;
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
      if (compute != nullptr)
        reinterpret_cast<uint2*>(compute)[i] = make_uint2(to_bf16(p.x) | (to_bf16(p.y) << 16), to_bf16(p.z) | (to_bf16(p.w) << 16));
    }
    done = n / 4 * 4;
  }
  for (long long i = done + first; i < n; i += stride) {
    adamw(param[i], load(grad, i), exp_avg[i], exp_avg_sq[i], lr, beta1, beta2, weight_decay, eps, step_size,
          bias_correction2_sqrt, grad_scale);
    if (compute != nullptr) store(compute, i, param[i]);
  }
}

extern "C" __global__ void adamw_fp32(
    float* param, const float* grad, float* exp_avg, float* exp_avg_sq, long long n, double lr, double beta1, double beta2,
    double weight_decay, double eps, const float* step, const float* grad_scale, const float* found_inf, bf16* compute) {
  adamw_all(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, weight_decay, eps, step, grad_scale, found_inf, compute);
}
// fp32 state over a bf16 gradient: one process, one micro-batch, where the
// gradient backward gave is the whole gradient and an fp32 copy adds nothing.
extern "C" __global__ void adamw_fp32_grad_bf16(
    float* param, const bf16* grad, float* exp_avg, float* exp_avg_sq, long long n, double lr, double beta1, double beta2,
    double weight_decay, double eps, const float* step, const float* grad_scale, const float* found_inf, bf16* compute) {
  adamw_all(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, weight_decay, eps, step, grad_scale, found_inf, compute);
}
