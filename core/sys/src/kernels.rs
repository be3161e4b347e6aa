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

extern "C" __global__ void adamw_fp32(
    float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
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
  const bool aligned = ((((unsigned long long)param) | ((unsigned long long)grad) | ((unsigned long long)exp_avg) |
                         ((unsigned long long)exp_avg_sq)) & 15ull) == 0;
  long long done = 0;
  if (aligned) {
    float4* p4 = reinterpret_cast<float4*>(param);
    const float4* g4 = reinterpret_cast<const float4*>(grad);
    float4* m4 = reinterpret_cast<float4*>(exp_avg);
    float4* v4 = reinterpret_cast<float4*>(exp_avg_sq);
    for (long long i = first; i < n / 4; i += stride) {
      float4 p = p4[i], m = m4[i], v = v4[i];
      const float4 g = g4[i];
      adamw(p.x, g.x, m.x, v.x, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.y, g.y, m.y, v.y, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.z, g.z, m.z, v.z, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      adamw(p.w, g.w, m.w, v.w, lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale);
      p4[i] = p; m4[i] = m; v4[i] = v;
    }
    done = n / 4 * 4;
  }
  for (long long i = done + first; i < n; i += stride)
    adamw(param[i], grad[i], exp_avg[i], exp_avg_sq[i], lr, beta1, beta2, weight_decay, eps, step_size,
          bias_correction2_sqrt, grad_scale);
}

// Blockwise int8. `x` is `rows` rows of `row_len` elements, each row cut
// into `blocks_per_row` blocks of `block` elements, the last padded with
// zeros. One CUDA block per quantization block: its absmax by a block
// reduction, then q = rint(x / scale) clamped to ±127 with scale =
// max(absmax, 1e-30) / 127 — the fp32 ops, in the order, that ft-core's
// ATen fallback uses, so both give the same bits.
__device__ __forceinline__ float load(const float* x, long long i) { return x[i]; }
__device__ __forceinline__ float load(const bf16* x, long long i) { return __uint_as_float(((unsigned int)x[i]) << 16); }
__device__ __forceinline__ void store(float* x, long long i, float v) { x[i] = v; }
__device__ __forceinline__ void store(bf16* x, long long i, float v) { x[i] = (bf16)to_bf16(v); }

template <typename T>
__device__ void quantize_int8(const T* __restrict__ x, long long row_len, int block, int blocks_per_row,
                              signed char* __restrict__ q, float* __restrict__ scales) {
  __shared__ float warp_max[32];
  __shared__ float shared_scale;
  const long long b = blockIdx.x;
  const long long row = b / blocks_per_row, first = (b % blocks_per_row) * (long long)block;
  const long long count = max(0LL, min((long long)block, row_len - first));
  const T* in = x + row * row_len + first;
  float m = 0.f;
  for (long long i = threadIdx.x; i < count; i += blockDim.x) m = fmaxf(m, fabsf(load(in, i)));
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x == 0) {
      shared_scale = fmaxf(m, 1e-30f) / 127.f;
      scales[b] = shared_scale;
    }
  }
  __syncthreads();
  const float scale = shared_scale;
  signed char* out = q + b * (long long)block;
  for (long long i = threadIdx.x; i < block; i += blockDim.x) {
    const float v = i < count ? rintf(load(in, i) / scale) : 0.f;
    out[i] = (signed char)fminf(fmaxf(v, -127.f), 127.f);
  }
}

// out[r, i] = q[r, i] · scale (r < rows, i < row_len; padding skipped), or,
// with `sum_rows`, out[i] = Σ_r q[r, i] · scale in fp32, stored once.
template <typename T>
__device__ void dequantize_int8(const signed char* __restrict__ q, const float* __restrict__ scales, int block,
                                int blocks_per_row, long long row_len, int rows, int sum_rows, T* __restrict__ out) {
  const long long padded_row = (long long)blocks_per_row * block;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long n = sum_rows ? row_len : rows * row_len;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    if (sum_rows) {
      float total = 0.f;
      for (int r = 0; r < rows; ++r) {
        const long long j = r * padded_row + k;
        total += (float)q[j] * scales[j / block];
      }
      store(out, k, total);
    } else {
      const long long j = (k / row_len) * padded_row + k % row_len;
      store(out, k, (float)q[j] * scales[j / block]);
    }
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
"#;

/// The kernels, loaded into one device's (primary) context.
#[derive(Clone, Copy)]
struct Functions {
    xent: sys::CUfunction,
    adamw: sys::CUfunction,
    /// By element kind: [fp32, bf16].
    quantize: [sys::CUfunction; 2],
    dequantize: [sys::CUfunction; 2],
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
            adamw: function(ADAMW)?,
            quantize: [function("quantize_int8_f32")?, function("quantize_int8_bf16")?],
            dequantize: [function("dequantize_int8_f32")?, function("dequantize_int8_bf16")?],
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
unsafe fn launch(function: sys::CUfunction, device_index: usize, grid: u32, threads: u32, params: &mut [*mut c_void]) -> Result<()> {
    let stream = crate::cuda_current_stream(device_index)? as sys::CUstream;
    driver::launch_kernel(function, (grid, 1, 1), (threads, 1, 1), 0, stream, params).map_err(|e| error("launch", e))
}

fn arg<T>(value: &mut T) -> *mut c_void {
    value as *mut T as *mut c_void
}

fn expect(tensor: &Tensor, name: &str, like: &Tensor, size: &[i64], kind: Kind) -> Result<()> {
    if tensor.size() != size || tensor.kind() != kind || tensor.device() != like.device() || !tensor.is_contiguous() {
        return Err(error(
            name,
            format!("expected contiguous {kind:?} {size:?} on {:?}, got {:?} {:?} on {:?}", like.device(), tensor.kind(), tensor.size(), tensor.device()),
        ));
    }
    Ok(())
}

/// One AdamW step in place over `param`, `exp_avg`, `exp_avg_sq` (fp32,
/// contiguous, same length as `grad`), as ATen's `_fused_adamw_` computes
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
    for (tensor, name) in [(param, "param"), (grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")] {
        expect(tensor, name, param, &[n], Kind::Float)?;
    }
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
    unsafe { launch(functions.adamw, index, blocks, ADAMW_THREADS, &mut params) }
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
        other => Err(error("unsupported", format!("no int8 kernel for {other:?} values"))),
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
    let functions = functions(index)?;
    let function = functions.dequantize[by_kind(out.kind())?];
    if n == 0 {
        return Ok(());
    }
    let grid = (n as u64).div_ceil(DEQUANTIZE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
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

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_source_compiles_with_nvrtc() {
        // No GPU is needed to compile: this catches a broken kernel on CPU-only CI.
        let ptx = super::compile("compute_90").expect("NVRTC compiles the kernels");
        for kernel in [super::XENT, super::ADAMW, "quantize_int8_bf16", "dequantize_int8_f32"] {
            assert!(ptx.contains(&format!(".entry {kernel}")), "{kernel} missing from {}", &ptx[..ptx.len().min(400)]);
        }
    }
}
