//! The LM head's softmax cross-entropy backward as one CUDA kernel, compiled
//! at run time with NVRTC (the `libnvrtc` that ships with PyTorch's CUDA
//! wheels) and launched on PyTorch's current stream.
//!
//! Why a kernel of our own: a large vocabulary makes the logits the biggest
//! tensor of the step (BLOOM: 250 880 × tokens). ATen needs four passes over
//! them for the loss and d loss / d logits (log-softmax in fp32, exp, the cast
//! back, the scale); this kernel reads the bf16 logits twice and writes the
//! bf16 gradient over them in place, so the head's elementwise traffic drops
//! from ~34 to 6 bytes per logit and no fp32 copy is ever allocated.

use crate::{Result, ShimError};
use cudarc::driver::{result as driver, sys};
use cudarc::nvrtc;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const KERNEL: &str = "softmax_xent_backward_bf16";
const THREADS: u32 = 512;

/// One block per row: pass 1 finds the row's log-sum-exp (online max and sum
/// in fp32), pass 2 overwrites the row with (softmax − one-hot) · scale.
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
"#;

/// A loaded kernel of one device's (primary) context.
#[derive(Clone, Copy)]
struct Function(sys::CUfunction);
// SAFETY: a CUfunction is a handle valid in every thread of the process.
unsafe impl Send for Function {}

fn error(context: &str, detail: impl std::fmt::Display) -> ShimError {
    ShimError(format!("fused cross-entropy kernel: {context}: {detail}"))
}

/// NVRTC's PTX of the kernel for compute capability `arch` (e.g. "compute_90").
pub fn compile(arch: &str) -> Result<String> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(error("NVRTC", "libnvrtc.so.13 not found (it ships in the nvidia-cuda-nvrtc wheel; put its lib directory on LD_LIBRARY_PATH)"));
    }
    let options = nvrtc::CompileOptions { options: vec![format!("--gpu-architecture={arch}")], ..Default::default() };
    let ptx = nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|e| error("NVRTC compilation", format!("{e:?}")))?;
    Ok(ptx.to_src())
}

fn load(device_index: usize) -> Result<Function> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(error("driver", "libcuda.so.1 not found"));
    }
    driver::init().map_err(|e| error("cuInit", e))?;
    let device = driver::device::get(device_index as i32).map_err(|e| error("cuDeviceGet", e))?;
    let capability = |attribute| unsafe { driver::device::get_attribute(device, attribute) };
    let major = capability(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(|e| error("device attribute", e))?;
    let minor = capability(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(|e| error("device attribute", e))?;
    let ptx = std::ffi::CString::new(compile(&format!("compute_{major}{minor}"))?).map_err(|e| error("PTX", e))?;
    // SAFETY: PyTorch runs on the device's primary context; retaining it and
    // making it current lets the module load where PyTorch's tensors live.
    unsafe {
        let context = driver::primary_ctx::retain(device).map_err(|e| error("primary context", e))?;
        driver::ctx::set_current(context).map_err(|e| error("cuCtxSetCurrent", e))?;
        let module = driver::module::load_data(ptx.as_ptr() as *const c_void).map_err(|e| error("cuModuleLoadData", e))?;
        let name = std::ffi::CString::new(KERNEL).expect("no NUL");
        let function = driver::module::get_function(module, name).map_err(|e| error("cuModuleGetFunction", e))?;
        Ok(Function(function))
    }
}

/// The kernel for `device_index`, compiled and loaded on first use.
fn function(device_index: usize) -> Result<Function> {
    static LOADED: OnceLock<Mutex<HashMap<usize, std::result::Result<Function, String>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    loaded.entry(device_index).or_insert_with(|| load(device_index).map_err(|e| e.0)).clone().map_err(ShimError)
}

/// Whether the fused kernel serves logits of `kind` on `device`: bf16 on a
/// GPU where NVRTC and the driver load. The error says why not.
pub fn available(device: Device, kind: Kind) -> Result<()> {
    match (device, kind) {
        (Device::Cuda(index), Kind::BFloat16) => function(index).map(|_| ()),
        _ => Err(error("unsupported", format!("{kind:?} logits on {device:?} (bf16 on CUDA only)"))),
    }
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
    let expect = |tensor: &Tensor, name: &str, kind: Kind| -> Result<()> {
        if tensor.size() != [rows] || tensor.kind() != kind || tensor.device() != logits.device() || !tensor.is_contiguous() {
            return Err(error(name, format!("expected contiguous {kind:?} [{rows}] on {:?}, got {:?} {:?} on {:?}", logits.device(), tensor.kind(), tensor.size(), tensor.device())));
        }
        Ok(())
    };
    if logits.kind() != Kind::BFloat16 || !logits.is_contiguous() {
        return Err(error("logits", format!("expected contiguous bf16, got {:?}", logits.kind())));
    }
    expect(targets, "targets", Kind::Int64)?;
    expect(grad_scale, "grad_scale", Kind::Float)?;
    expect(row_loss, "row_loss", Kind::Float)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab = i32::try_from(vocab).map_err(|_| error("logits", "vocabulary over 2^31"))?;
    let function = function(index)?;
    let stream = crate::cuda_current_stream(index)? as sys::CUstream;
    let (mut logits_ptr, mut targets_ptr, mut scale_ptr, mut loss_ptr) = (logits.data_ptr(), targets.data_ptr(), grad_scale.data_ptr(), row_loss.data_ptr());
    let (mut vocab, mut ignore_index) = (vocab, ignore_index);
    let mut params: [*mut c_void; 6] = [
        &mut logits_ptr as *mut _ as *mut c_void,
        &mut targets_ptr as *mut _ as *mut c_void,
        &mut scale_ptr as *mut _ as *mut c_void,
        &mut loss_ptr as *mut _ as *mut c_void,
        &mut vocab as *mut _ as *mut c_void,
        &mut ignore_index as *mut _ as *mut c_void,
    ];
    // SAFETY: the pointers are live tensors of the checked shapes and dtypes
    // on this device; the launch is ordered on PyTorch's current stream, so
    // the caching allocator sees the same stream use as for ATen's kernels.
    unsafe { driver::launch_kernel(function.0, (rows as u32, 1, 1), (THREADS, 1, 1), 0, stream, &mut params) }.map_err(|e| error("launch", e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_source_compiles_with_nvrtc() {
        // No GPU is needed to compile: this catches a broken kernel on CPU-only CI.
        let ptx = super::compile("compute_90").expect("NVRTC compiles the kernel");
        assert!(ptx.contains(".entry softmax_xent_backward_bf16"), "{}", &ptx[..ptx.len().min(400)]);
    }
}
