//! ft's own CUDA kernels, compiled at run time with NVRTC (the `libnvrtc`
//! that ships with PyTorch's CUDA wheels) and launched on PyTorch's current
//! stream, where ATen's ops leave bandwidth on the table:
//!
//! - `softmax_xent_backward_bf16`: the LM head's loss and d loss / d logits
//!   (or, forward only, the loss alone in one read: DPO's log-probabilities).
//!   A large vocabulary makes the logits the biggest tensor of the step
//!   (BLOOM: 250 880 × tokens). ATen needs four passes over them (log-softmax
//!   in fp32, exp, the cast back, the scale); this kernel reads the bf16
//!   logits twice and writes the gradient over them in place, ~6 instead of
//!   ~34 bytes per logit and no fp32 copy.
//! - `adamw_fp32`: AdamW over one flat fp32 buffer in one pass of float4s,
//!   28 bytes per parameter. ATen's `_fused_adamw_` also writes the unscaled
//!   gradient back whenever a gradient scale (our clipping factor) is given,
//!   32 bytes, through a multi-tensor launcher that reaches ~3 TB/s on H200.
//!   It also writes the updated parameters' bf16 compute copy when asked
//!   (2 bytes more a parameter, where a cast after the step reads 4 and
//!   writes 2).
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
//! - `fp8_amax_*`, `fp8_cast_*`: float8 linears' casts (`float8.rs`), an
//!   amax pass and one pass that scales, clamps, rounds and writes the
//!   float8 copy row-major, transposed or both. ATen's eager ops took seven
//!   passes a cast — about 470 ms of a 692 ms Llama-7B step on an H200
//!   (bench/results/2026-11-26-h200-fp8.md). The rowwise recipe's amaxes
//!   per row or per column (`fp8_amax_rows_*`, `fp8_amax_cols_*`), their
//!   scales (`fp8_scales`), and the same cast reading a scale per row or
//!   column. `fp8_transpose`: float8 bytes gathered row-major into the
//!   transposed layout, through the cast's shared-memory tile.
//!   `fp8_scale_outer_bf16`: a rowwise GEMM's scales applied after it, one
//!   pass where ATen's `y *= a * b` takes two (one over fp32).
//! - `rms_norm_*`: RMSNorm's forward, which also writes its output's amax
//!   for the float8 layers reading it (ATen's rms_norm is one kernel too,
//!   but its amax would take another pass over the output).
//! - `widen_bf16`: bf16 to fp32 in one vectorised pass (an fp32 reduction's
//!   input); ATen's copy between the kinds does not vectorise.
//! - `dequantize_4bit_*`: QLoRA's 4-bit base weights (NF4 or FP4, double
//!   quantization or not) into a bf16, fp16 or fp32 buffer in one pass,
//!   ~2.5 bytes moved per bf16 value. ATen's ops (`nf4.rs`) gather each
//!   byte's two values, pad, multiply, cast and copy, a chunk at a time.

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

/// The kernels' CUDA source, one file per family under `kernels/`: NVRTC
/// compiles them as one source, `common.cuh`'s helpers first.
const SOURCE: &str = concat!(
    include_str!("kernels/common.cuh"),
    include_str!("kernels/xent.cu"),
    include_str!("kernels/adamw.cu"),
    include_str!("kernels/int8.cu"),
    include_str!("kernels/lowrank.cu"),
    include_str!("kernels/rope_swiglu.cu"),
    include_str!("kernels/moe.cu"),
    include_str!("kernels/decode_attention.cu"),
    include_str!("kernels/column_sum.cu"),
    include_str!("kernels/float8.cu"),
    include_str!("kernels/nf4.cu"),
    include_str!("kernels/widen.cu"),
    include_str!("kernels/rms_norm.cu"),
);

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
    rope_cache: [sys::CUfunction; 2],
    swiglu: [sys::CUfunction; 2],
    swiglu_halves: [sys::CUfunction; 2],
    combine: [sys::CUfunction; 2],
    decode_attention_split: [sys::CUfunction; 2],
    decode_attention_merge: [sys::CUfunction; 2],
    rms_norm: [sys::CUfunction; 2],
    column_sum_partial: [sys::CUfunction; 2],
    column_sum_finish: [sys::CUfunction; 2],
    /// By the values' kind: [fp32, bf16].
    fp8_amax: [sys::CUfunction; 2],
    fp8_cast: [sys::CUfunction; 2],
    fp8_transpose: sys::CUfunction,
    /// By the values' kind: [fp32, bf16].
    fp8_amax_rows: [sys::CUfunction; 2],
    fp8_amax_cols: [sys::CUfunction; 2],
    fp8_scales: sys::CUfunction,
    fp8_scale_outer_bf16: sys::CUfunction,
    widen_bf16: sys::CUfunction,
    /// By the output's kind: [fp32, bf16, fp16].
    dequantize_4bit: [sys::CUfunction; 3],
    multiprocessors: u32,
}
// SAFETY: CUfunction handles are valid in every thread of the process.
unsafe impl Send for Functions {}

fn error(context: &str, detail: impl std::fmt::Display) -> ShimError {
    ShimError(format!("ft's CUDA kernels: {context}: {detail}"))
}

/// NVRTC's output for the kernels: for a real GPU (`arch` "sm_90") its
/// machine code (a cubin); for a virtual one ("compute_80") nothing, the
/// source only checked for that GPU by NVRTC's front end (its preprocessor
/// branches included), in 0.1 s of CPU against a PTX compilation's 7.8. Machine code
/// rather than PTX is what loads: the driver compiles PTX again in every
/// process whose driver cache (~/.nv/ComputeCache) lacks it — every process
/// of a fresh machine or container.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(error("NVRTC", "libnvrtc.so.13 not found (it ships in the nvidia-cuda-nvrtc wheel; put its lib directory on LD_LIBRARY_PATH)"));
    }
    let source = std::ffi::CString::new(SOURCE).expect("the kernels' source holds no NUL");
    let program = nvrtc::result::create_program(&source, None).map_err(|e| error("nvrtcCreateProgram", format!("{e:?}")))?;
    let virtual_arch = arch.starts_with("compute_");
    // A virtual architecture's source is only checked; --split-compile=0: NVRTC optimises the kernels on every core (26.7 -> 17.8 s on 2 cores).
    let mode = if virtual_arch { "--fdevice-syntax-only" } else { "--split-compile=0" };
    // SAFETY: `program` is valid until destroyed below; the size is read before the buffer is filled.
    let cubin = unsafe {
        match nvrtc::result::compile_program(program, &[format!("--gpu-architecture={arch}"), mode.into()]) {
            Ok(()) if virtual_arch => Ok(vec![]),
            Ok(()) => {
                let mut size = 0usize;
                nvrtc::sys::nvrtcGetCUBINSize(program, &mut size).result().map_err(|e| error("nvrtcGetCUBINSize", format!("{e:?}"))).and_then(|()| {
                    let mut cubin = vec![0u8; size];
                    nvrtc::sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut std::ffi::c_char).result().map_err(|e| error("nvrtcGetCUBIN", format!("{e:?}")))?;
                    Ok(cubin)
                })
            }
            Err(e) => {
                let log = nvrtc::result::get_program_log(program).map(|log| std::ffi::CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned()).unwrap_or_default();
                Err(error("NVRTC compilation", format!("{e:?}: {log}")))
            }
        }
    };
    // SAFETY: created above, used no more.
    let _ = unsafe { nvrtc::result::destroy_program(program) };
    cubin
}

/// Where compiled kernels are kept between processes: `FT_KERNEL_CACHE`
/// (empty: nowhere), else `$XDG_CACHE_HOME/ft/kernels`, else
/// `~/.cache/ft/kernels`. NVRTC takes seconds of CPU for them.
fn cache_directory() -> Option<std::path::PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    match std::env::var_os("FT_KERNEL_CACHE") {
        Some(dir) => (!dir.is_empty()).then(|| dir.into()),
        None => var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|home| home.join(".cache"))).map(|cache| cache.join("ft/kernels")),
    }
}

/// The cubin for `arch` and where it is cached: named by a hash of the
/// source, the target and NVRTC's version, so a changed kernel or NVRTC
/// never reads an old one.
fn cache_path(arch: &str) -> Option<std::path::PathBuf> {
    use sha2::{Digest, Sha256};
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result().ok()?;
    let hash = Sha256::new().chain_update(SOURCE).chain_update(format!("\0{arch}\0nvrtc {major}.{minor}")).finalize();
    let name: String = hash[..16].iter().map(|byte| format!("{byte:02x}")).collect();
    Some(cache_directory()?.join(format!("{arch}-{name}.cubin")))
}

/// The cubin for `arch`, `fresh` from NVRTC or from the `cached` file; a
/// fresh one is written there (`store`), and the note is why it could not be.
fn cubin(arch: &str, cached: Option<&std::path::Path>, fresh: bool) -> Result<(Vec<u8>, Option<String>)> {
    if let (false, Some(cubin)) = (fresh, cached.and_then(|path| std::fs::read(path).ok())) {
        return Ok((cubin, None));
    }
    let cubin = compile(arch)?;
    let note = cached.and_then(|path| store(path, &cubin));
    Ok((cubin, note))
}

/// Writes `cubin` to `path`, renamed into place so that a process never
/// reads half a file. A cache that cannot be written costs every process the
/// compilation: the note says where and how to mend it.
fn store(path: &std::path::Path, cubin: &[u8]) -> Option<String> {
    let partial = path.with_extension(format!("{}.partial", std::process::id()));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&partial, cubin))
        .and_then(|()| std::fs::rename(&partial, path));
    let _ = std::fs::remove_file(&partial);
    written.err().map(|e| {
        format!(
            "cannot keep ft's compiled CUDA kernels in {} ({e}): every process compiles them again (~20 s of CPU); \
             set FT_KERNEL_CACHE to a writable directory (empty: no cache, and no warning)",
            path.display()
        )
    })
}

/// GPU `device_index` through the driver, and a reader of its attributes.
fn driver_device(device_index: usize) -> Result<(sys::CUdevice, impl Fn(sys::CUdevice_attribute) -> Result<i32>)> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(error("driver", "libcuda.so.1 not found"));
    }
    driver::init().map_err(|e| error("cuInit", e))?;
    let device = driver::device::get(device_index as i32).map_err(|e| error("cuDeviceGet", e))?;
    let attribute = move |attribute| unsafe { driver::device::get_attribute(device, attribute) }.map_err(|e| error("device attribute", e));
    Ok((device, attribute))
}

/// GPU `device_index`'s compute capability, (major, minor).
pub fn compute_capability(device_index: usize) -> Result<(i32, i32)> {
    let (_, attribute) = driver_device(device_index)?;
    Ok((
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// The kernels loaded on `device_index`, and why they could not be cached
/// for the next process (`store`), if they could not.
fn load(device_index: usize) -> Result<(Functions, Option<String>)> {
    let (device, attribute) = driver_device(device_index)?;
    let (major, minor) = compute_capability(device_index)?;
    let multiprocessors = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
    let arch = format!("sm_{major}{minor}");
    let cached = cache_path(&arch);
    // SAFETY: PyTorch runs on the device's primary context; retaining it and
    // making it current lets the module load where PyTorch's tensors live.
    unsafe {
        let context = driver::primary_ctx::retain(device).map_err(|e| error("primary context", e))?;
        driver::ctx::set_current(context).map_err(|e| error("cuCtxSetCurrent", e))?;
        // A cached cubin the driver refuses (a damaged file) is compiled afresh.
        let load = |cubin: Vec<u8>| driver::module::load_data(cubin.as_ptr() as *const c_void);
        let (first, mut cache_note) = cubin(&arch, cached.as_deref(), false)?;
        let module = match load(first) {
            Ok(module) => module,
            Err(_) => {
                let (fresh, note) = cubin(&arch, cached.as_deref(), true)?;
                cache_note = note;
                load(fresh).map_err(|e| error("cuModuleLoadData", e))?
            }
        };
        let function = |name: &str| {
            let name = std::ffi::CString::new(name).expect("no NUL");
            driver::module::get_function(module, name).map_err(|e| error("cuModuleGetFunction", e))
        };
        let functions = Functions {
            xent: function(XENT)?,
            adamw: [function(ADAMW)?, function("adamw_fp32_grad_bf16")?],
            quantize: [function("quantize_int8_f32")?, function("quantize_int8_bf16")?],
            dequantize: [function("dequantize_int8_f32")?, function("dequantize_int8_bf16")?],
            lowrank_project: [function("lowrank_project_f32")?, function("lowrank_project_bf16")?],
            lowrank_project_t: function("lowrank_project_t")?,
            lowrank_orthonormalize: function("lowrank_orthonormalize")?,
            lowrank_expand: [function("lowrank_expand_f32")?, function("lowrank_expand_bf16")?],
            rope: [function("rope_f32")?, function("rope_bf16")?],
            rope_cache: [function("rope_cache_f32")?, function("rope_cache_bf16")?],
            swiglu: [function("swiglu_f32")?, function("swiglu_bf16")?],
            swiglu_halves: [function("swiglu_halves_f32")?, function("swiglu_halves_bf16")?],
            combine: [function("combine_f32")?, function("combine_bf16")?],
            decode_attention_split: [function("decode_attention_split_f32")?, function("decode_attention_split_bf16")?],
            decode_attention_merge: [function("decode_attention_merge_f32")?, function("decode_attention_merge_bf16")?],
            rms_norm: [function("rms_norm_f32")?, function("rms_norm_bf16")?],
            column_sum_partial: [function("column_sum_partial_f32")?, function("column_sum_partial_bf16")?],
            column_sum_finish: [function("column_sum_finish_f32")?, function("column_sum_finish_bf16")?],
            fp8_amax: [function("fp8_amax_f32")?, function("fp8_amax_bf16")?],
            fp8_cast: [function("fp8_cast_f32")?, function("fp8_cast_bf16")?],
            fp8_transpose: function("fp8_transpose")?,
            fp8_amax_rows: [function("fp8_amax_rows_f32")?, function("fp8_amax_rows_bf16")?],
            fp8_amax_cols: [function("fp8_amax_cols_f32")?, function("fp8_amax_cols_bf16")?],
            fp8_scales: function("fp8_scales")?,
            fp8_scale_outer_bf16: function("fp8_scale_outer_bf16")?,
            widen_bf16: function("widen_bf16")?,
            dequantize_4bit: [function("dequantize_4bit_f32")?, function("dequantize_4bit_bf16")?, function("dequantize_4bit_f16")?],
            multiprocessors,
        };
        Ok((functions, cache_note))
    }
}

/// The kernels for `device_index`, compiled and loaded on first use.
fn functions(device_index: usize) -> Result<Functions> {
    with_loaded(device_index, |(functions, _)| *functions)
}

/// `read` of what `load` gave for `device_index`, loading on first use: the
/// kernels (copied out at every launch) and the cache's note.
fn with_loaded<T>(device_index: usize, read: impl FnOnce(&(Functions, Option<String>)) -> T) -> Result<T> {
    static LOADED: OnceLock<Mutex<HashMap<usize, std::result::Result<(Functions, Option<String>), String>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match loaded.entry(device_index).or_insert_with(|| load(device_index).map_err(|e| e.0)) {
        Ok(kernels) => Ok(read(kernels)),
        Err(why) => Err(ShimError(why.clone())),
    }
}

/// Why the kernels `device` loaded could not be cached for the next
/// process, if they could not (`store`).
pub fn cache_note(device: Device) -> Option<String> {
    match device {
        Device::Cuda(index) => with_loaded(index, |(_, note)| note.clone()).ok()?,
        _ => None,
    }
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
/// (one float) skips the update. With `compute` (bf16, `param`'s length)
/// each updated parameter is also written there rounded to bf16, as
/// `compute.copy_(param)` would after the step.
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
    compute: Option<&Tensor>,
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
    if let Some(compute) = compute {
        expect(compute, "compute", param, &[n], Kind::BFloat16)?;
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
    let (mut step_ptr, mut scale_ptr, mut inf_ptr, mut compute_ptr) = (step.data_ptr(), pointer(grad_scale), pointer(found_inf), pointer(compute));
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
        arg(&mut compute_ptr),
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
    softmax_xent(logits, targets, Some(grad_scale), row_loss, ignore_index)
}

/// `row_loss` as [`softmax_xent_backward_`] gives it, in one read of the
/// logits and without writing them.
pub fn softmax_xent_loss(logits: &Tensor, targets: &Tensor, row_loss: &mut Tensor, ignore_index: i64) -> Result<()> {
    softmax_xent(logits, targets, None, row_loss, ignore_index)
}

/// The cross-entropy kernel; without `grad_scale` (a null pointer to it) it
/// stops after the loss and only reads the logits.
fn softmax_xent(logits: &Tensor, targets: &Tensor, grad_scale: Option<&Tensor>, row_loss: &mut Tensor, ignore_index: i64) -> Result<()> {
    let Device::Cuda(index) = logits.device() else {
        return Err(error("unsupported", "logits are not on a GPU"));
    };
    let (rows, vocab) = logits.size2().map_err(|e| error("logits", e))?;
    expect(logits, "logits", logits, &[rows, vocab], Kind::BFloat16)?;
    expect(targets, "targets", logits, &[rows], Kind::Int64)?;
    if let Some(grad_scale) = grad_scale {
        expect(grad_scale, "grad_scale", logits, &[rows], Kind::Float)?;
    }
    expect(row_loss, "row_loss", logits, &[rows], Kind::Float)?;
    if rows == 0 {
        return Ok(());
    }
    let mut vocab = i32::try_from(vocab).map_err(|_| error("logits", "vocabulary over 2^31"))?;
    let functions = functions(index)?;
    let mut scale_ptr = grad_scale.map_or(std::ptr::null_mut(), Tensor::data_ptr);
    let (mut logits_ptr, mut targets_ptr, mut loss_ptr) = (logits.data_ptr(), targets.data_ptr(), row_loss.data_ptr());
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

/// A decoding step's `q` [rows, 1, heads, head_dim], `k` and `v` [rows, 1,
/// kv_heads, head_dim] (each head's values contiguous, the rows at any
/// stride: views of one joined projection) into attention's inputs: `q`
/// rotated into `q_out` [rows, heads, head_dim] (contiguous), `k` rotated
/// and `v` as it is written at cache slot `slot` (one int64 on the device,
/// read there: a CUDA graph replays it) of `keys` and `values` [rows,
/// kv_heads, capacity, head_dim] (contiguous). The rotation is `rope_`'s
/// (`cos`, `sin` [rows, 1, 1, head_dim]), to the bit.
#[allow(clippy::too_many_arguments)] // each tensor a separate operand of the one kernel
pub fn rope_cache_(q: &Tensor, k: &Tensor, v: &Tensor, cos: &Tensor, sin: &Tensor, slot: &Tensor, q_out: &mut Tensor, keys: &mut Tensor, values: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = q.device() else {
        return Err(error("unsupported", "decoding's RoPE and cache write is not on a GPU"));
    };
    let (rows, _, heads, head_dim) = q.size4().map_err(|e| error("decoding's queries", e))?;
    let (_, kv_heads, capacity, _) = keys.size4().map_err(|e| error("the key cache", e))?;
    let kind = q.kind();
    let which = by_kind(kind)?;
    // Rows at a stride, each row's heads one after another.
    let token_rows = |t: &Tensor, name: &str, heads: i64| {
        let (size, stride) = (t.size(), t.stride());
        let fits = size == [rows, 1, heads, head_dim] && stride[2] == head_dim && stride[3] == 1 && t.kind() == kind && t.device() == q.device();
        if fits { Ok(stride[0]) } else { Err(error(name, format!("expected {kind:?} [{rows}, 1, {heads}, {head_dim}] with each row's heads contiguous, got {:?} {size:?} strides {stride:?}", t.kind()))) }
    };
    let (mut q_stride, mut k_stride, mut v_stride) = (token_rows(q, "decoding's queries", heads)?, token_rows(k, "decoding's keys", kv_heads)?, token_rows(v, "decoding's values", kv_heads)?);
    if head_dim % 2 != 0 {
        return Err(error("decoding's queries", format!("head_dim {head_dim} is odd")));
    }
    expect(cos, "cos", q, &[rows, 1, 1, head_dim], kind)?;
    expect(sin, "sin", q, &[rows, 1, 1, head_dim], kind)?;
    expect(slot, "the cache slot", q, &[1], Kind::Int64)?;
    expect(q_out, "the rotated queries", q, &[rows, heads, head_dim], kind)?;
    expect(keys, "the key cache", q, &[rows, kv_heads, capacity, head_dim], kind)?;
    expect(values, "the value cache", q, &[rows, kv_heads, capacity, head_dim], kind)?;
    let half = head_dim / 2;
    let work = rows * (heads + 2 * kv_heads) * half;
    if work == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let blocks = (work as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut q_ptr, mut k_ptr, mut v_ptr, mut cos_ptr, mut sin_ptr, mut slot_ptr) = (q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot.data_ptr());
    let (mut q_out_ptr, mut keys_ptr, mut values_ptr) = (q_out.data_ptr(), keys.data_ptr(), values.data_ptr());
    let (mut rows, mut heads, mut kv_heads, mut half, mut capacity) = (rows as i32, heads as i32, kv_heads as i32, half as i32, capacity);
    let mut params = [
        arg(&mut q_ptr),
        arg(&mut k_ptr),
        arg(&mut v_ptr),
        arg(&mut cos_ptr),
        arg(&mut sin_ptr),
        arg(&mut slot_ptr),
        arg(&mut q_out_ptr),
        arg(&mut keys_ptr),
        arg(&mut values_ptr),
        arg(&mut rows),
        arg(&mut heads),
        arg(&mut kv_heads),
        arg(&mut half),
        arg(&mut q_stride),
        arg(&mut k_stride),
        arg(&mut v_stride),
        arg(&mut capacity),
    ];
    // SAFETY: the arguments match rope_cache_*'s signature and the tensors
    // were checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.rope_cache[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// SwiGLU's gating of `gate` and `up` (same shape, contiguous, fp32 or bf16
/// on a GPU): with `grad` None, `out` = silu(gate)·up, and with `amax` (one
/// fp32, zeroed) max |out| into it, NaN if any (`amax`'s value, in the same
/// pass); with `grad` (dy), `out` = d/d gate and `grad_up` = d/d up.
pub fn swiglu_(gate: &Tensor, up: &Tensor, grad: Option<&Tensor>, out: &mut Tensor, grad_up: Option<&mut Tensor>, amax: Option<&Tensor>) -> Result<()> {
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
    let mut amax_ptr = match (amax, grad) {
        (Some(amax), None) => expect(amax, "SwiGLU's amax", gate, &[], Kind::Float).map(|()| amax.data_ptr())?,
        (None, _) => std::ptr::null_mut(),
        (Some(_), Some(_)) => return Err(error("SwiGLU", "the amax is its forward's output's")),
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
    let mut params = [
        arg(&mut gate_ptr),
        arg(&mut up_ptr),
        arg(&mut grad_ptr),
        arg(&mut out_ptr),
        arg(&mut grad_up_ptr),
        arg(&mut n),
        arg(&mut packed),
        arg(&mut amax_ptr),
    ];
    // SAFETY: the arguments match swiglu_*'s signature and the tensors were
    // checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.swiglu[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// SwiGLU over the halves of each row of `x` ([rows, 2·width], contiguous,
/// fp32 or bf16 on a GPU: a mixture's fused gate-and-up projection, gate
/// first): with `grad` None, `out` [rows, width] = silu(gate)·up; with
/// `grad` (dy, [rows, width]), `out` [rows, 2·width] = the gradient of x,
/// gate's half then up's (moe.cu's `swiglu_halves`).
pub fn swiglu_halves_(x: &Tensor, grad: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = x.device() else {
        return Err(error("unsupported", "SwiGLU's input is not on a GPU"));
    };
    let (rows, doubled) = x.size2().map_err(|e| error("SwiGLU's fused input", e))?;
    if doubled % 2 != 0 {
        return Err(error("SwiGLU's fused input", format!("{doubled} columns do not split into gate and up halves")));
    }
    let (kind, width) = (x.kind(), doubled / 2);
    let which = by_kind(kind)?;
    expect(x, "SwiGLU's fused input", x, &[rows, doubled], kind)?;
    let mut grad_ptr = match grad {
        Some(grad) => expect(grad, "SwiGLU's output gradient", x, &[rows, width], kind).map(|()| grad.data_ptr())?,
        None => std::ptr::null_mut(),
    };
    expect(out, "SwiGLU's output", x, &[rows, if grad.is_some() { doubled } else { width }], kind)?;
    if rows * width == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let pack = packing(kind, width, [x, &*out].into_iter().chain(grad));
    let blocks = ((rows * width / pack) as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut x_ptr, mut out_ptr, mut rows, mut width, mut packed) = (x.data_ptr(), out.data_ptr(), rows, width as i32, i32::from(pack > 1));
    let mut params = [arg(&mut x_ptr), arg(&mut grad_ptr), arg(&mut out_ptr), arg(&mut rows), arg(&mut width), arg(&mut packed)];
    // SAFETY: the arguments match swiglu_halves_*'s signature and the tensors
    // were checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.swiglu_halves[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// The most assignments per token `combine_` takes (moe.cu's COMBINE_MAX_K).
pub const COMBINE_MAX_K: i64 = 16;
const COMBINE_THREADS: u32 = 256;

/// A mixture of experts' combine (moe.cu's `combine`): `rows` [tokens·k,
/// width] (the experts' outputs, sorted by expert; contiguous, fp32 or
/// bf16 on a GPU), `weights` [tokens, k] (fp32), `at` [tokens·k] (int64:
/// where each token's assignment sits among the rows). With `grad` None,
/// `out` [tokens, width] = Σ_i w[t,i]·rows[at[t·k+i]]; with `grad` (dy,
/// [tokens, width]), `out` [tokens·k, width] = the rows' gradient and
/// `grad_weights` [tokens, k] (fp32) the weights'.
pub fn combine_(rows: &Tensor, weights: &Tensor, at: &Tensor, grad: Option<&Tensor>, out: &mut Tensor, grad_weights: Option<&mut Tensor>) -> Result<()> {
    let Device::Cuda(index) = rows.device() else {
        return Err(error("unsupported", "the experts' outputs are not on a GPU"));
    };
    let (kind, (tokens, k), width) = (rows.kind(), weights.size2().map_err(|e| error("the router's weights", e))?, rows.size().last().copied().unwrap_or(0));
    let which = by_kind(kind)?;
    if k > COMBINE_MAX_K {
        return Err(error("combine", format!("{k} experts a token is more than the kernel's {COMBINE_MAX_K}")));
    }
    expect(rows, "the experts' outputs", rows, &[tokens * k, width], kind)?;
    expect(weights, "the router's weights", rows, &[tokens, k], Kind::Float)?;
    expect(at, "the assignments' rows", rows, &[tokens * k], Kind::Int64)?;
    let (mut grad_ptr, mut grad_weights_ptr) = match (grad, grad_weights) {
        (Some(grad), Some(grad_weights)) => {
            expect(grad, "the combined gradient", rows, &[tokens, width], kind)?;
            expect(grad_weights, "the weights' gradient", rows, &[tokens, k], Kind::Float)?;
            expect(out, "the outputs' gradient", rows, &[tokens * k, width], kind)?;
            (grad.data_ptr(), grad_weights.data_ptr())
        }
        (None, None) => {
            expect(out, "the combined rows", rows, &[tokens, width], kind)?;
            (std::ptr::null_mut(), std::ptr::null_mut())
        }
        _ => return Err(error("combine", "backward takes both the combined gradient and the weights' gradient")),
    };
    if tokens * width == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let pack = packing(kind, width, [rows, &*out].into_iter().chain(grad));
    let blocks = (tokens as u64).min(functions.multiprocessors as u64 * 32) as u32;
    let (mut rows_ptr, mut weights_ptr, mut at_ptr, mut out_ptr) = (rows.data_ptr(), weights.data_ptr(), at.data_ptr(), out.data_ptr());
    let (mut tokens, mut k, mut width, mut packed) = (tokens, k as i32, width as i32, i32::from(pack > 1));
    let mut params = [
        arg(&mut rows_ptr),
        arg(&mut weights_ptr),
        arg(&mut at_ptr),
        arg(&mut grad_ptr),
        arg(&mut out_ptr),
        arg(&mut grad_weights_ptr),
        arg(&mut tokens),
        arg(&mut k),
        arg(&mut width),
        arg(&mut packed),
    ];
    // SAFETY: the arguments match combine_*'s signature and the tensors were
    // checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.combine[which], index, blocks, COMBINE_THREADS, &mut params) }
}

/// The most query heads a key head serves that `decode_attention_` takes
/// (decode_attention.cu's DECODE_MAX_GROUPS), and the head sizes it takes.
pub const DECODE_MAX_GROUPS: i64 = 8;
pub const DECODE_HEAD_DIMS: [i64; 2] = [64, 128];
/// Keys a block of `decode_attention_split_*` takes, a thread each (DECODE_CHUNK).
const DECODE_CHUNK: i64 = 128;

/// Decoding's attention (decode_attention.cu): `q` [rows, heads, head_dim]
/// (one query per row and head) over the cache's `k` and `v` [rows,
/// kv_heads, capacity, head_dim] (heads a multiple of kv_heads, at most
/// `DECODE_MAX_GROUPS` times; head_dim one of `DECODE_HEAD_DIMS`; 16-byte
/// aligned), plus `bias` [rows, 1 or heads, capacity] (-inf where a key is
/// hidden), scores scaled by `scale`, into `out` [rows, heads, head_dim];
/// all contiguous, of one kind, fp32 or bf16, on a GPU. A block per
/// `DECODE_CHUNK` keys of a row's key head, then one per row and head to
/// merge them.
pub fn decode_attention_(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64, out: &mut Tensor) -> Result<()> {
    let Device::Cuda(index) = q.device() else {
        return Err(error("unsupported", "decoding's attention is not on a GPU"));
    };
    let (rows, heads, head_dim) = q.size3().map_err(|e| error("decoding's queries", e))?;
    let (_, kv_heads, capacity, _) = k.size4().map_err(|e| error("decoding's keys", e))?;
    let kind = q.kind();
    let which = by_kind(kind)?;
    if kv_heads == 0 || heads % kv_heads != 0 || heads / kv_heads > DECODE_MAX_GROUPS || !DECODE_HEAD_DIMS.contains(&head_dim) {
        return Err(error("decoding's attention", format!("{heads} query heads over {kv_heads} key heads of {head_dim} dimensions")));
    }
    let bias_heads = bias.size().get(1).copied().unwrap_or(0);
    expect(k, "decoding's keys", q, &[rows, kv_heads, capacity, head_dim], kind)?;
    expect(v, "decoding's values", q, &[rows, kv_heads, capacity, head_dim], kind)?;
    expect(bias, "decoding's attention bias", q, &[rows, if bias_heads == heads { heads } else { 1 }, capacity], kind)?;
    expect(out, "decoding's attention output", q, &[rows, heads, head_dim], kind)?;
    if k.data_ptr() as usize % 16 != 0 {
        return Err(error("decoding's keys", "not 16-byte aligned"));
    }
    if rows * capacity == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let groups = heads / kv_heads;
    let chunks = (capacity + DECODE_CHUNK - 1) / DECODE_CHUNK;
    let blocks = rows * kv_heads * chunks;
    let partial = Tensor::empty([blocks * groups * (head_dim + 2)], (Kind::Float, q.device()));
    let (mut q_ptr, mut k_ptr, mut v_ptr, mut bias_ptr, mut partial_ptr, mut out_ptr) = (q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr(), partial.data_ptr(), out.data_ptr());
    let (mut kv_heads, mut groups, mut capacity, mut chunks_arg, mut bias_heads, mut scale, mut head_dim) = (kv_heads as i32, groups as i32, capacity, chunks as i32, bias_heads as i32, scale as f32, head_dim as i32);
    let mut params = [
        arg(&mut q_ptr),
        arg(&mut k_ptr),
        arg(&mut v_ptr),
        arg(&mut bias_ptr),
        arg(&mut partial_ptr),
        arg(&mut kv_heads),
        arg(&mut groups),
        arg(&mut capacity),
        arg(&mut chunks_arg),
        arg(&mut bias_heads),
        arg(&mut scale),
        arg(&mut head_dim),
    ];
    // SAFETY: the arguments match decode_attention_split_*'s signature and
    // the tensors were checked above (see `adamw_` on their lifetime;
    // `partial` lives to the merge's launch, on the same stream).
    unsafe { launch(functions.decode_attention_split[which], index, blocks as u32, DECODE_CHUNK as u32, &mut params)? };
    let mut params = [arg(&mut partial_ptr), arg(&mut out_ptr), arg(&mut kv_heads), arg(&mut groups), arg(&mut chunks_arg), arg(&mut head_dim)];
    // SAFETY: as above, for decode_attention_merge_*.
    unsafe { launch(functions.decode_attention_merge[which], index, (rows * heads) as u32, head_dim as u32, &mut params) }
}

/// Words (16 bytes, or one value where unpacked) an `rms_norm_*` thread
/// holds in registers (rms_norm.cu's RMS_NORM_HELD).
const RMS_NORM_HELD: u32 = 4;

/// RMSNorm's forward over the rows of `x` ([rows, cols], contiguous, fp32
/// or bf16) into `out` (the same) with `weight` ([cols], x's kind):
/// w·(x·rstd), rstd = 1/√(mean(x²) + eps) in fp32, written to `rstd`
/// ([rows, 1], fp32: what ATen's `_fused_rms_norm_backward` reads). With
/// `amax` (one fp32, zeroed) also the output's max |y|, NaN if any.
pub fn rms_norm_(x: &Tensor, weight: &Tensor, eps: f64, out: &mut Tensor, rstd: &mut Tensor, amax: Option<&Tensor>) -> Result<()> {
    let index = gpu_index(x, "RMSNorm's input")?;
    let (rows, cols) = x.size2().map_err(|e| error("RMSNorm's input", e))?;
    let kind = x.kind();
    let which = by_kind(kind)?;
    expect(x, "RMSNorm's input", x, &[rows, cols], kind)?;
    expect(weight, "RMSNorm's weight", x, &[cols], kind)?;
    expect(out, "RMSNorm's output", x, &[rows, cols], kind)?;
    expect(rstd, "RMSNorm's rstd", x, &[rows, 1], Kind::Float)?;
    let mut amax_ptr = match amax {
        Some(amax) => expect(amax, "RMSNorm's amax", x, &[], Kind::Float).map(|()| amax.data_ptr())?,
        None => std::ptr::null_mut(),
    };
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let width = packing(kind, cols, [x, weight, &*out]);
    let mut packed = i32::from(width > 1);
    let (mut x_ptr, mut weight_ptr, mut out_ptr, mut rstd_ptr) = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr());
    let (mut cols, mut eps) = (i32::try_from(cols).map_err(|_| error("RMSNorm's input", format!("{cols} columns")))?, eps as f32);
    let blocks = u32::try_from(rows).map_err(|_| error("RMSNorm's input", format!("{rows} rows")))?;
    // Enough threads that each holds at most RMS_NORM_HELD words of its row
    // (more blocks resident per SM than a fixed 256 would leave), whole warps.
    let threads = (cols as u32 / width as u32).div_ceil(RMS_NORM_HELD).next_multiple_of(32).clamp(32, 1024);
    let mut params = [arg(&mut x_ptr), arg(&mut weight_ptr), arg(&mut out_ptr), arg(&mut rstd_ptr), arg(&mut amax_ptr), arg(&mut cols), arg(&mut eps), arg(&mut packed)];
    // SAFETY: the arguments match rms_norm_*'s signature and the tensors
    // were checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.rms_norm[which], index, blocks, threads, &mut params) }
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

/// max |x| of `x` (fp32 or bf16, CUDA, contiguous) as one fp32 on its
/// device, NaN when any value is: what a float8 cast scales from.
pub fn amax(x: &Tensor) -> Result<Tensor> {
    let index = gpu_index(x, "x")?;
    expect(x, "x", x, &x.size(), x.kind())?;
    let functions = functions(index)?;
    let function = functions.fp8_amax[by_kind(x.kind())?];
    let amax = Tensor::zeros([], (Kind::Float, x.device()));
    let mut n = x.numel() as i64;
    if n == 0 {
        return Ok(amax);
    }
    let blocks = (n as u64).div_ceil(8 * ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 8) as u32;
    let (mut x_ptr, mut amax_ptr) = (x.data_ptr(), amax.data_ptr());
    let mut params = [arg(&mut x_ptr), arg(&mut n), arg(&mut amax_ptr)];
    // SAFETY: the arguments match fp8_amax_*'s signature; `x` was checked
    // above and `amax` made here (see `adamw_` on lifetimes).
    unsafe { launch(function, index, blocks, ELEMENTWISE_THREADS, &mut params)? };
    Ok(amax)
}

/// `x` (bf16, CUDA, contiguous) as a new fp32 tensor of its shape, exactly.
pub fn widen_bf16(x: &Tensor) -> Result<Tensor> {
    let index = gpu_index(x, "x")?;
    expect(x, "x", x, &x.size(), Kind::BFloat16)?;
    let out = Tensor::empty(x.size(), (Kind::Float, x.device()));
    let mut n = x.numel() as i64;
    if n == 0 {
        return Ok(out);
    }
    let functions = functions(index)?;
    let blocks = (n as u64).div_ceil(8 * ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 8) as u32;
    let (mut x_ptr, mut out_ptr) = (x.data_ptr(), out.data_ptr());
    let mut params = [arg(&mut x_ptr), arg(&mut out_ptr), arg(&mut n)];
    // SAFETY: the arguments match widen_bf16's signature; `x` was checked
    // above and `out` made here (see `adamw_` on lifetimes).
    unsafe { launch(functions.widen_bf16, index, blocks, ELEMENTWISE_THREADS, &mut params)? };
    Ok(out)
}

/// fp8_cast's block (float8.cu's FP8_CAST_THREADS).
const FP8_CAST_THREADS: u32 = 256;

/// `x` [rows, cols] cast to float8 by `fp8_cast`: the copies asked for and
/// the scale (x ≈ data / scale) with its reciprocal, each one fp32.
pub struct Float8Cast {
    /// [rows, cols], row-major.
    pub data: Option<Tensor>,
    /// [cols, rows rounded up to 16], x's transpose, zeros past `rows`
    /// (float8 GEMMs need inner dimensions that are multiples of 16).
    pub transposed: Option<Tensor>,
    pub scale: Tensor,
    pub inverse: Tensor,
}

/// `x` [rows, cols] (fp32 or bf16, CUDA, contiguous, cols even) times
/// max(`kind`) / max(`amax`, 1e-12) (the scale in fp64, stored as fp32),
/// clamped to ±max and rounded to `kind` (e4m3fn or e5m2): row-major when
/// `rows_major`, transposed when `transposed`, one read of x for both.
pub fn cast_float8(x: &Tensor, amax: &Tensor, kind: Kind, max_value: f32, row_major: bool, transposed: bool) -> Result<Float8Cast> {
    let (data, transposed) = float8_outputs(x, kind, row_major, transposed)?;
    launch_cast_float8(x, Scaling::Tensor(amax), kind, max_value, data, transposed)
}

/// Which of x's dimensions a rowwise cast's scales run along: one scale a
/// row (the amax over its columns) or one a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Along {
    Rows,
    Cols,
}

/// How a cast scales x: by one amax, or by a scale (and its reciprocal) a row or column.
enum Scaling<'a> {
    Tensor(&'a Tensor),
    Along(Along, &'a Tensor, &'a Tensor),
}

/// [`cast_float8`] with a scale per row or per column of x (`scale`,
/// [rows] or [cols] fp32, from [`float8_scales`]), which the returned cast
/// carries as they are.
#[allow(clippy::too_many_arguments)] // the cast's own options, as cast_float8's
pub fn cast_float8_along(x: &Tensor, along: Along, scale: &Tensor, inverse: &Tensor, kind: Kind, max_value: f32, row_major: bool, transposed: bool) -> Result<Float8Cast> {
    let (data, transposed) = float8_outputs(x, kind, row_major, transposed)?;
    launch_cast_float8(x, Scaling::Along(along, scale, inverse), kind, max_value, data, transposed)
}

/// A float8 cast's outputs for x [rows, cols]: row-major [rows, cols], transposed [cols, rows padded to 16] (zeros past rows).
fn float8_outputs(x: &Tensor, kind: Kind, row_major: bool, transposed: bool) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (rows, cols) = x.size2().map_err(|e| error("x", e))?;
    let options = (kind, x.device());
    let data = row_major.then(|| Tensor::empty([rows, cols], options));
    let padded = (rows + 15) / 16 * 16;
    let transposed = transposed.then(|| if padded == rows { Tensor::empty([cols, padded], options) } else { Tensor::zeros([cols, padded], options) });
    Ok((data, transposed))
}

/// max |x| of each row of `x` [rows, cols] (`Along::Rows`: [rows] fp32)
/// or of each column ([cols]), NaN where a value is: the rowwise recipe's amaxes.
pub fn amax_along(x: &Tensor, along: Along) -> Result<Tensor> {
    let index = gpu_index(x, "x")?;
    let (rows, cols) = x.size2().map_err(|e| error("x", e))?;
    expect(x, "x", x, &[rows, cols], x.kind())?;
    let functions = functions(index)?;
    let which = by_kind(x.kind())?;
    let amax = Tensor::zeros([if along == Along::Rows { rows } else { cols }], (Kind::Float, x.device()));
    if rows * cols == 0 {
        return Ok(amax);
    }
    let (mut x_ptr, mut amax_ptr, mut rows_, mut cols_) = (x.data_ptr(), amax.data_ptr(), rows, cols);
    match along {
        Along::Rows => {
            let blocks = (rows as u64).min(functions.multiprocessors as u64 * 16) as u32;
            let mut params = [arg(&mut x_ptr), arg(&mut rows_), arg(&mut cols_), arg(&mut amax_ptr)];
            // SAFETY: the arguments match fp8_amax_rows_*'s signature; `x` was
            // checked above and `amax` made here (see `adamw_` on lifetimes).
            unsafe { launch(functions.fp8_amax_rows[which], index, blocks, ELEMENTWISE_THREADS, &mut params) }?;
        }
        Along::Cols => {
            // A thread a column; enough chunks of rows for ~8 blocks a multiprocessor, each at least 16 rows.
            let column_blocks = (cols as u64).div_ceil(ELEMENTWISE_THREADS as u64) as u32;
            let chunks = (functions.multiprocessors * 8).div_ceil(column_blocks).clamp(1, (rows as u64).div_ceil(16) as u32).min(65_535);
            let mut chunk = (rows as u64).div_ceil(chunks as u64) as i64;
            let mut params = [arg(&mut x_ptr), arg(&mut rows_), arg(&mut cols_), arg(&mut chunk), arg(&mut amax_ptr)];
            // SAFETY: the arguments match fp8_amax_cols_*'s signature (as above).
            unsafe { launch(functions.fp8_amax_cols[which], index, (column_blocks, chunks), ELEMENTWISE_THREADS, &mut params) }?;
        }
    }
    Ok(amax)
}

/// Each of `amax`'s values (fp32, 1-D) as a float8 scale for a kind whose
/// largest value is `max_value` (torchao's `tensor_to_scale`; with
/// `power_of_2`, rounded down to a power of two as the rowwise recipe
/// does), and their reciprocals.
pub fn float8_scales(amax: &Tensor, max_value: f32, power_of_2: bool) -> Result<(Tensor, Tensor)> {
    let index = gpu_index(amax, "amax")?;
    expect(amax, "amax", amax, &[amax.numel() as i64], Kind::Float)?;
    let functions = functions(index)?;
    let (scale, inverse) = (Tensor::empty_like(amax), Tensor::empty_like(amax));
    let mut n = amax.numel() as i64;
    if n == 0 {
        return Ok((scale, inverse));
    }
    let blocks = (n as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 8) as u32;
    let (mut amax_ptr, mut scale_ptr, mut inverse_ptr, mut max_value, mut power_of_2) = (amax.data_ptr(), scale.data_ptr(), inverse.data_ptr(), max_value, power_of_2 as i32);
    let mut params = [arg(&mut amax_ptr), arg(&mut n), arg(&mut max_value), arg(&mut power_of_2), arg(&mut scale_ptr), arg(&mut inverse_ptr)];
    // SAFETY: the arguments match fp8_scales's signature; `amax` was checked
    // above and the outputs made here (see `adamw_` on lifetimes).
    unsafe { launch(functions.fp8_scales, index, blocks, ELEMENTWISE_THREADS, &mut params)? };
    Ok((scale, inverse))
}

/// `y` ([rows, cols] bf16, contiguous) times the outer product of `a`
/// ([rows, 1] fp32) and `b` ([1, cols] fp32), in place: ATen's `y *= a * b`,
/// bit for bit, in one pass (a rowwise float8 GEMM's scales applied after it).
pub fn scale_outer_(y: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    let index = gpu_index(y, "y")?;
    let (rows, cols) = y.size2().map_err(|e| error("y", e))?;
    expect(y, "y", y, &[rows, cols], Kind::BFloat16)?;
    expect(a, "a", y, &[rows, 1], Kind::Float)?;
    expect(b, "b", y, &[1, cols], Kind::Float)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let functions = functions(index)?;
    let width = packing(Kind::BFloat16, cols, [&*y]);
    let blocks = ((rows * cols / width) as u64).div_ceil(ELEMENTWISE_THREADS as u64).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut y_ptr, mut a_ptr, mut b_ptr, mut rows, mut packed) = (y.data_ptr(), a.data_ptr(), b.data_ptr(), rows, i32::from(width > 1));
    let mut cols = i32::try_from(cols).map_err(|_| error("y", format!("{cols} columns")))?;
    let mut params = [arg(&mut y_ptr), arg(&mut a_ptr), arg(&mut b_ptr), arg(&mut rows), arg(&mut cols), arg(&mut packed)];
    // SAFETY: the arguments match fp8_scale_outer_bf16's signature and the
    // tensors were checked above (see `adamw_` on their lifetime).
    unsafe { launch(functions.fp8_scale_outer_bf16, index, blocks, ELEMENTWISE_THREADS, &mut params) }
}

/// [`cast_float8`]'s row-major cast written into `out` ([rows, cols] of
/// `kind`, contiguous: a float8 gather's send buffer) instead of a new tensor.
pub fn cast_float8_into(x: &Tensor, amax: &Tensor, kind: Kind, max_value: f32, out: &Tensor) -> Result<()> {
    expect(out, "out", x, &x.size(), kind)?;
    launch_cast_float8(x, Scaling::Tensor(amax), kind, max_value, Some(out.shallow_clone()), None).map(|_| ())
}

/// The fp8_cast launch behind [`cast_float8`] and [`cast_float8_into`], into
/// the outputs given: `data` [rows, cols], `transposed` [cols, rows padded to 16].
fn launch_cast_float8(x: &Tensor, scaling: Scaling, kind: Kind, max_value: f32, data: Option<Tensor>, transposed: Option<Tensor>) -> Result<Float8Cast> {
    let index = gpu_index(x, "x")?;
    let (rows, cols) = x.size2().map_err(|e| error("x", e))?;
    expect(x, "x", x, &[rows, cols], x.kind())?;
    // The kernel's mode (float8.cu's FP8_SCALE_*), its amax and scales, and the scale and reciprocal the cast carries.
    let (mut by, amax, scales, (scale, inverse)) = match scaling {
        Scaling::Tensor(amax) => {
            expect(amax, "amax", x, &[], Kind::Float)?;
            let scalar = || Tensor::empty([], (Kind::Float, x.device()));
            (0i32, Some(amax), None, (scalar(), scalar()))
        }
        Scaling::Along(along, scale, inverse) => {
            let n = if along == Along::Rows { rows } else { cols };
            expect(scale, "scale", x, &[n], Kind::Float)?;
            expect(inverse, "inverse", x, &[n], Kind::Float)?;
            (if along == Along::Rows { 1 } else { 2 }, None, Some(scale), (scale.shallow_clone(), inverse.shallow_clone()))
        }
    };
    if cols % 2 != 0 {
        return Err(error("x", format!("{cols} columns: the float8 cast takes an even number")));
    }
    let mut e5m2: i32 = match kind {
        Kind::Float8e4m3fn => 0,
        Kind::Float8e5m2 => 1,
        other => return Err(error("unsupported", format!("no float8 cast to {other:?}"))),
    };
    let functions = functions(index)?;
    let function = functions.fp8_cast[by_kind(x.kind())?];
    let padded = (rows + 15) / 16 * 16;
    let (row_tiles, col_tiles) = fp8_tiles(rows, cols)?;
    if rows * cols == 0 {
        if by == 0 {
            let _ = scale.shallow_clone().fill_(1.0);
            let _ = inverse.shallow_clone().fill_(1.0);
        }
        return Ok(Float8Cast { data, transposed, scale, inverse });
    }
    let pointer = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), Tensor::data_ptr);
    let (mut x_ptr, mut amax_ptr, mut scales_ptr) = (x.data_ptr(), pointer(amax), pointer(scales));
    let (mut out_ptr, mut out_t_ptr) = (pointer(data.as_ref()), pointer(transposed.as_ref()));
    let (mut scale_ptr, mut inverse_ptr) = (scale.data_ptr(), inverse.data_ptr());
    // 16 bytes a load where x allows it (`Pack` in rope_swiglu.cu).
    let per_word = 16 / x.kind().elt_size_in_bytes() as i64;
    let mut packed = (x.data_ptr() as usize % 16 == 0 && cols % per_word == 0) as i32;
    let (mut rows_, mut cols_, mut max_value, mut stride) = (rows, cols, max_value, padded);
    let mut params = [
        arg(&mut x_ptr),
        arg(&mut rows_),
        arg(&mut cols_),
        arg(&mut amax_ptr),
        arg(&mut scales_ptr),
        arg(&mut max_value),
        arg(&mut e5m2),
        arg(&mut out_ptr),
        arg(&mut out_t_ptr),
        arg(&mut stride),
        arg(&mut scale_ptr),
        arg(&mut inverse_ptr),
        arg(&mut packed),
        arg(&mut by),
    ];
    // SAFETY: the arguments match fp8_cast_*'s signature; `x` and the amax
    // or scales were checked above and the outputs made here (see `adamw_`
    // on lifetimes); the kernel reads `amax` only tensorwise, `scales` only not.
    unsafe { launch(function, index, (row_tiles, col_tiles), FP8_CAST_THREADS, &mut params)? };
    Ok(Float8Cast { data, transposed, scale, inverse })
}

/// The float8 kernels' grid over [rows, cols]: tiles of 32 rows × 64 columns.
fn fp8_tiles(rows: i64, cols: i64) -> Result<(u32, u32)> {
    let row_tiles = u32::try_from((rows as u64).div_ceil(32)).map_err(|_| error("x", "too many rows"))?;
    let col_tiles = u32::try_from((cols as u64).div_ceil(64)).ok().filter(|&t| t <= 65_535).ok_or_else(|| error("x", format!("{cols} columns: at most 4194240")))?;
    Ok((row_tiles, col_tiles))
}

/// `x` [rows, cols] (float8, CUDA, contiguous) transposed: a new [cols,
/// rows] tensor of the same bytes, by `fp8_transpose`.
pub fn transpose_float8(x: &Tensor) -> Result<Tensor> {
    let index = gpu_index(x, "x")?;
    let (rows, cols) = x.size2().map_err(|e| error("x", e))?;
    expect(x, "x", x, &[rows, cols], x.kind())?;
    if !matches!(x.kind(), Kind::Float8e4m3fn | Kind::Float8e5m2) {
        return Err(error("x", format!("{:?}: fp8_transpose moves float8 bytes", x.kind())));
    }
    let out = Tensor::empty([cols, rows], (x.kind(), x.device()));
    if rows * cols == 0 {
        return Ok(out);
    }
    let functions = functions(index)?;
    let (row_tiles, col_tiles) = fp8_tiles(rows, cols)?;
    let (mut x_ptr, mut out_ptr, mut rows_, mut cols_, mut stride) = (x.data_ptr(), out.data_ptr(), rows, cols, rows);
    let mut params = [arg(&mut x_ptr), arg(&mut rows_), arg(&mut cols_), arg(&mut out_ptr), arg(&mut stride)];
    // SAFETY: the arguments match fp8_transpose's signature; `x` was checked
    // above and `out` made here (see `adamw_` on lifetimes).
    unsafe { launch(functions.fp8_transpose, index, (row_tiles, col_tiles), FP8_CAST_THREADS, &mut params)? };
    Ok(out)
}

/// A 4-bit weight's absmaxes, one a block of values, as `dequantize_4bit`
/// reads them (bitsandbytes' `QuantState`).
pub enum Absmax4bit<'a> {
    /// fp32, one a block.
    Plain(&'a Tensor),
    /// Double quantization: one uint8 index a block into `code` (256 fp32),
    /// times the fp32 `absmax` of its run of `blocksize` indices, plus `offset`.
    Nested { indices: &'a Tensor, absmax: &'a Tensor, code: &'a Tensor, blocksize: i64, offset: f32 },
}

const DEQUANTIZE_4BIT_THREADS: u32 = 256;
/// Groups of 8 values a thread takes a pass (nf4.cu's DEQUANTIZE_4BIT_UNROLL).
const DEQUANTIZE_4BIT_UNROLL: u64 = 4;

/// `out` (1-D, contiguous, fp32, bf16 or fp16, on a GPU; a slice of a
/// bigger buffer is fine) = the 4-bit values of `packed` (uint8, 1-D, two a
/// byte, the first in the high nibble) in blocks of `blocksize` (a power of
/// two, at least 8): `code[index] · absmax` in fp32, rounded to `rounding`
/// (the original dtype: fp32, bf16 or fp16), then to `out`'s kind — the
/// bits ft-core's `nf4.rs` computes with ATen's ops.
pub fn dequantize_4bit(packed: &Tensor, absmax: Absmax4bit, code: &[f32; 16], blocksize: i64, rounding: Kind, out: &mut Tensor) -> Result<()> {
    let index = gpu_index(out, "out")?;
    let n = out.numel() as i64;
    let by_out = match out.kind() {
        Kind::Float => 0,
        Kind::BFloat16 => 1,
        Kind::Half => 2,
        other => return Err(error("unsupported", format!("no 4-bit dequantization into {other:?}"))),
    };
    let mut rounding = match rounding {
        Kind::Float => 0i32,
        Kind::BFloat16 => 1,
        Kind::Half => 2,
        other => return Err(error("unsupported", format!("4-bit values round to fp32, bf16 or fp16, not {other:?}"))),
    };
    if blocksize < 8 || blocksize.count_ones() != 1 {
        return Err(error("blocksize", format!("{blocksize}: the kernel takes powers of two from 8")));
    }
    let blocks = (n + blocksize - 1) / blocksize;
    expect(out, "out", out, &[n], out.kind())?;
    expect(packed, "packed", out, &[(n + 1) / 2], Kind::Uint8)?;
    let null = std::ptr::null_mut;
    let (mut absmax_ptr, mut indices_ptr, mut nested_absmax_ptr, mut nested_code_ptr, mut nested_blocksize, mut offset) = (null(), null(), null(), null(), 1i64, 0f32);
    match absmax {
        Absmax4bit::Plain(absmax) => {
            expect(absmax, "absmax", out, &[blocks], Kind::Float)?;
            absmax_ptr = absmax.data_ptr();
        }
        Absmax4bit::Nested { indices, absmax, code, blocksize: run, offset: nested_offset } => {
            if run < 1 {
                return Err(error("nested absmax", format!("blocks of {run} indices")));
            }
            expect(indices, "absmax indices", out, &[blocks], Kind::Uint8)?;
            expect(absmax, "nested absmax", out, &[(blocks + run - 1) / run], Kind::Float)?;
            expect(code, "nested code", out, &[256], Kind::Float)?;
            (indices_ptr, nested_absmax_ptr, nested_code_ptr, nested_blocksize, offset) = (indices.data_ptr(), absmax.data_ptr(), code.data_ptr(), run, nested_offset);
        }
    }
    let functions = functions(index)?;
    if n == 0 {
        return Ok(());
    }
    let groups = (n as u64).div_ceil(8);
    let grid = groups.div_ceil(DEQUANTIZE_4BIT_THREADS as u64 * DEQUANTIZE_4BIT_UNROLL).min(functions.multiprocessors as u64 * 16) as u32;
    let (mut packed_ptr, mut out_ptr) = (packed.data_ptr(), out.data_ptr());
    let mut code = *code;
    let (mut block_shift, mut n) = (blocksize.trailing_zeros() as i32, n);
    let (mut packed_aligned, mut out_aligned) = ((packed_ptr as usize % 4 == 0) as i32, (out_ptr as usize % 16 == 0) as i32);
    let mut params = [
        arg(&mut packed_ptr),
        arg(&mut absmax_ptr),
        arg(&mut indices_ptr),
        arg(&mut nested_absmax_ptr),
        arg(&mut nested_code_ptr),
        arg(&mut nested_blocksize),
        arg(&mut offset),
        arg(&mut code),
        arg(&mut block_shift),
        arg(&mut n),
        arg(&mut rounding),
        arg(&mut packed_aligned),
        arg(&mut out_aligned),
        arg(&mut out_ptr),
    ];
    // SAFETY: the arguments match dequantize_4bit_*'s signature (`code` is
    // its Code4bit, 16 fp32 by value); the tensors were checked above (see
    // `adamw_` on their lifetime).
    unsafe { launch(functions.dequantize_4bit[by_out], index, grid, DEQUANTIZE_4BIT_THREADS, &mut params) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_source_compiles_with_nvrtc_and_is_cached() {
        // No GPU is needed to compile: this catches a broken kernel on CPU-only CI.
        // Before Ada the float8 conversion is compiled out (float8 is refused there), the rest stays.
        super::compile("compute_80").expect("the kernels' source is sound for Ampere");
        let cache = std::env::temp_dir().join(format!("ft-kernel-cache-test-{}", std::process::id()));
        let path = cache.join("sm_90.cubin");
        let (cubin, note) = super::cubin("sm_90", Some(&path), false).expect("NVRTC compiles the kernels");
        assert_eq!(note, None);
        // The machine code names every kernel in its symbol table.
        let names = String::from_utf8_lossy(&cubin);
        for kernel in [super::XENT, super::ADAMW, "quantize_int8_bf16", "dequantize_int8_f32", "lowrank_project_bf16", "lowrank_project_t", "lowrank_orthonormalize", "lowrank_expand_f32", "rope_bf16", "swiglu_f32", "adamw_fp32_grad_bf16", "column_sum_partial_bf16", "column_sum_finish_f32", "fp8_amax_bf16", "fp8_cast_f32", "fp8_transpose", "fp8_amax_rows_bf16", "fp8_amax_cols_f32", "fp8_scales", "dequantize_4bit_f16", "widen_bf16", "rms_norm_bf16", "fp8_scale_outer_bf16", "swiglu_halves_bf16", "combine_f32", "combine_bf16", "decode_attention_split_bf16", "decode_attention_merge_f32", "rope_cache_bf16", "rope_cache_f32"] {
            assert!(names.contains(&format!("{kernel}\0")), "{kernel} missing from the cubin");
        }
        // The next process reads the file instead of compiling: what it holds is what was compiled.
        assert_eq!(std::fs::read(&path).unwrap(), cubin);
        std::fs::write(&path, b"written by the test").unwrap();
        assert_eq!(super::cubin("sm_90", Some(&path), false).unwrap(), (b"written by the test".to_vec(), None));
        std::fs::remove_dir_all(&cache).unwrap();
        // The source, the target and NVRTC's version name the file.
        let (a, b) = (super::cache_path("sm_90").unwrap(), super::cache_path("sm_80").unwrap());
        assert!(a != b && a.file_name().unwrap().to_str().unwrap().starts_with("sm_90-"), "{a:?} {b:?}");
    }

    #[test]
    fn a_cache_that_cannot_be_written_is_named_with_the_variable_that_mends_it() {
        let scratch = std::env::temp_dir().join(format!("ft-kernel-store-test-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        let file = scratch.join("a-file");
        std::fs::write(&file, b"").unwrap();
        // A directory cannot be made below a file.
        let path = file.join("kernels/sm_90.cubin");
        let note = super::store(&path, b"cubin").expect("a note");
        assert!(note.contains(&path.display().to_string()) && note.contains("FT_KERNEL_CACHE"), "{note}");
        let path = scratch.join("kernels/sm_90.cubin");
        assert_eq!(super::store(&path, b"cubin"), None);
        assert_eq!(std::fs::read(&path).unwrap(), b"cubin");
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "no partial file left");
        std::fs::remove_dir_all(&scratch).unwrap();
    }
}
