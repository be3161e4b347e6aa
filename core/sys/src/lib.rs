//! The only crate of `ft` with `unsafe` and C++: a thin, safe face over the
//! shim (`shim/c10d.cpp`; `shim/cuda.cpp` through `cuda`). Every fallible
//! call returns the C++ exception's message as `ShimError`; nothing here
//! aborts the process.
//!
//! Ownership mirrors c10d's: a `Group` keeps its store alive, a `Work` keeps
//! its tensors alive until it is dropped (c10d holds references), so dropping
//! Rust handles early never frees memory a collective still uses.

pub mod cuda;
pub mod float8;
pub mod kernels;
pub mod host_bytes;

pub use cuda::{cuda_current_stream, cuda_memory, cuda_set_device, cuda_stream_synchronize, CudaGraph, CudaMemory};

use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::time::Duration;
use tch::Tensor;

#[repr(C)]
struct RawStore {
    _private: [u8; 0],
}
#[repr(C)]
struct RawGroup {
    _private: [u8; 0],
}
#[repr(C)]
struct RawWork {
    _private: [u8; 0],
}
#[repr(C)]
struct RawGraph {
    _private: [u8; 0],
}
/// tch's `C_tensor` is an `at::Tensor`; the shim takes `at::Tensor*`.
type RawTensor = torch_sys::C_tensor;

extern "C" {
    fn ft_free_error(error: *mut c_char);
    fn ft_store_create(
        host: *const c_char,
        port: u16,
        is_server: bool,
        world_size: i64,
        timeout_ms: i64,
        out: *mut *mut RawStore,
    ) -> *mut c_char;
    fn ft_store_prefixed(base: *mut RawStore, prefix: *const c_char, out: *mut *mut RawStore) -> *mut c_char;
    fn ft_store_free(store: *mut RawStore);
    fn ft_gloo_group_create(
        store: *mut RawStore,
        rank: i32,
        size: i32,
        timeout_ms: i64,
        gloo_hostname: *const c_char,
        out: *mut *mut RawGroup,
    ) -> *mut c_char;
    fn ft_group_free(group: *mut RawGroup);
    fn ft_all_reduce(group: *mut RawGroup, tensor: *mut RawTensor, reduction: i32, out: *mut *mut RawWork) -> *mut c_char;
    fn ft_all_gather_into_tensor(
        group: *mut RawGroup,
        output: *mut RawTensor,
        input: *mut RawTensor,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    fn ft_reduce_scatter_tensor(
        group: *mut RawGroup,
        output: *mut RawTensor,
        input: *mut RawTensor,
        reduction: i32,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    fn ft_all_to_all(
        group: *mut RawGroup,
        output: *mut RawTensor,
        input: *mut RawTensor,
        output_splits: *const i64,
        input_splits: *const i64,
        splits: i32,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    fn ft_broadcast(group: *mut RawGroup, tensor: *mut RawTensor, root: i32, out: *mut *mut RawWork) -> *mut c_char;
    fn ft_barrier(group: *mut RawGroup, out: *mut *mut RawWork) -> *mut c_char;
    fn ft_work_wait(work: *mut RawWork, timeout_ms: i64) -> *mut c_char;
    fn ft_work_free(work: *mut RawWork);
    fn ft_backward(outputs: *const *mut RawTensor, grad_outputs: *const *mut RawTensor, count: i32) -> *mut c_char;
    fn ft_fused_adamw(
        params: *const *mut RawTensor,
        grads: *const *mut RawTensor,
        exp_avgs: *const *mut RawTensor,
        exp_avg_sqs: *const *mut RawTensor,
        steps: *const *mut RawTensor,
        count: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_scale: *mut RawTensor,
        found_inf: *mut RawTensor,
    ) -> *mut c_char;
    fn ft_clear_grad(tensor: *mut RawTensor) -> *mut c_char;
    fn ft_grad_enabled() -> bool;
    fn ft_resize_storage(tensor: *mut RawTensor, nbytes: i64) -> *mut c_char;
    fn ft_storage_alias(tensor: *mut RawTensor, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_pin_memory(tensor: *mut RawTensor, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_pin_memory_exact(tensor: *mut RawTensor, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_copy_async(dst: *mut RawTensor, src: *mut RawTensor) -> *mut c_char;
    fn ft_swiglu(gate: *mut RawTensor, up: *mut RawTensor, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_swiglu_halves(x: *mut RawTensor, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_combine(rows: *mut RawTensor, weights: *mut RawTensor, at: *mut RawTensor, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_lora_linear(
        x: *mut RawTensor,
        weight: *mut RawTensor,
        bias: *mut RawTensor,
        a: *mut RawTensor,
        b: *mut RawTensor,
        scale: f64,
        kernel: Option<FusedKernel>,
        out: *mut *mut RawTensor,
    ) -> *mut c_char;
    fn ft_layer_norm(x: *mut RawTensor, weight: *mut RawTensor, bias: *mut RawTensor, eps: f64, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_rms_norm(x: *mut RawTensor, weight: *mut RawTensor, eps: f64, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_bias_linear(x: *mut RawTensor, weight: *mut RawTensor, bias: *mut RawTensor, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_float8_linear(x: *mut RawTensor, weight: *mut RawTensor, a: *mut RawTensor, b: *mut RawTensor, scale: f64, gemms: Float8Gemms, code: i64, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_rope(x: *mut RawTensor, cos: *mut RawTensor, sin: *mut RawTensor, kernel: Option<FusedKernel>, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_exchange(input: *mut RawTensor, handle: i64, run: ExchangeFn, release: ReleaseFn, out: *mut *mut RawTensor) -> *mut c_char;
    fn ft_profiler_start(cuda: bool) -> *mut c_char;
    fn ft_profiler_stop(trace_path: *const c_char, summary: *mut *mut c_char) -> *mut c_char;
}

/// A C++ exception's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimError(pub String);

impl fmt::Display for ShimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShimError {}

pub type Result<T> = std::result::Result<T, ShimError>;

fn check(error: *mut c_char) -> Result<()> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated malloc'd string that we own.
    let message = unsafe { CStr::from_ptr(error) }.to_string_lossy().into_owned();
    unsafe { ft_free_error(error) };
    Err(ShimError(message))
}

fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| ShimError(format!("{text:?} contains a NUL byte")))
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn tensor_ptr(tensor: &Tensor) -> *mut RawTensor {
    tensor.as_ptr() as *mut RawTensor
}

/// c10d's key-value store (TCPStore, or a prefixed view of one).
pub struct Store {
    raw: *mut RawStore,
}

// SAFETY: c10d stores are thread-safe (their own locks); the handle is an owned pointer.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Connects to (or, with `is_server`, hosts) the TCPStore at host:port and
    /// waits until `world_size` clients have joined or `timeout` passes.
    pub fn tcp(host: &str, port: u16, is_server: bool, world_size: usize, timeout: Duration) -> Result<Store> {
        let host = c_string(host)?;
        let mut raw = std::ptr::null_mut();
        check(unsafe {
            ft_store_create(host.as_ptr(), port, is_server, world_size as i64, millis(timeout), &mut raw)
        })?;
        Ok(Store { raw })
    }

    /// A view of this store whose keys all start with `prefix`, so that each
    /// process group rendezvouses in its own key space.
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let prefix = c_string(prefix)?;
        let mut raw = std::ptr::null_mut();
        check(unsafe { ft_store_prefixed(self.raw, prefix.as_ptr(), &mut raw) })?;
        Ok(Store { raw })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        unsafe { ft_store_free(self.raw) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Gloo = 0,
    Nccl = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    Sum = 0,
    /// Native on NCCL; on Gloo a sum divided by the group size at `wait`.
    Avg = 1,
    Max = 2,
    Min = 3,
}

/// One c10d backend instance (ProcessGroupGloo or ProcessGroupNCCL).
pub struct Group {
    raw: *mut RawGroup,
}

// SAFETY: c10d backends are used from several threads by PyTorch itself.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

/// What a `Group` is made of: who this rank is in it, and how to reach peers.
pub struct GroupOptions<'a> {
    pub kind: BackendKind,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    /// CUDA device this rank drives (NCCL only).
    pub device_index: usize,
    /// Address the Gloo device binds to; "" lets Gloo choose (GLOO_SOCKET_IFNAME or the host name).
    pub gloo_hostname: &'a str,
}

impl Group {
    pub fn new(store: &Store, options: &GroupOptions<'_>) -> Result<Group> {
        let raw = match options.kind {
            BackendKind::Nccl => cuda::nccl_group(store, options.rank, options.size, options.timeout, options.device_index)?,
            BackendKind::Gloo => {
                let hostname = c_string(options.gloo_hostname)?;
                let mut raw = std::ptr::null_mut();
                check(unsafe {
                    ft_gloo_group_create(store.raw, options.rank as i32, options.size as i32, millis(options.timeout), hostname.as_ptr(), &mut raw)
                })?;
                raw
            }
        };
        Ok(Group { raw })
    }

    pub fn all_reduce(&self, tensor: &Tensor, reduction: Reduction) -> Result<Work> {
        self.launch(|out| unsafe { ft_all_reduce(self.raw, tensor_ptr(tensor), reduction as i32, out) })
    }

    pub fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.launch(|out| unsafe { ft_all_gather_into_tensor(self.raw, tensor_ptr(output), tensor_ptr(input), out) })
    }

    pub fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, reduction: Reduction) -> Result<Work> {
        self.launch(|out| unsafe {
            ft_reduce_scatter_tensor(self.raw, tensor_ptr(output), tensor_ptr(input), reduction as i32, out)
        })
    }

    /// Equal chunks: chunk i of this member's `input` goes to member i.
    pub fn all_to_all(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.all_to_all_rows(output, input, &[], &[])
    }

    /// Rows (the first dimension): `input_splits[i]` of `input` to member i,
    /// `output_splits[i]` of `output` from member i, in member order (empty
    /// splits: equal chunks).
    pub fn all_to_all_rows(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<Work> {
        if output_splits.len() != input_splits.len() {
            return Err(ShimError(format!("all_to_all: {} output splits and {} input splits", output_splits.len(), input_splits.len())));
        }
        self.launch(|out| unsafe {
            ft_all_to_all(self.raw, tensor_ptr(output), tensor_ptr(input), output_splits.as_ptr(), input_splits.as_ptr(), input_splits.len() as i32, out)
        })
    }

    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        self.launch(|out| unsafe { ft_broadcast(self.raw, tensor_ptr(tensor), root as i32, out) })
    }

    pub fn barrier(&self) -> Result<Work> {
        self.launch(|out| unsafe { ft_barrier(self.raw, out) })
    }

    fn launch(&self, call: impl FnOnce(*mut *mut RawWork) -> *mut c_char) -> Result<Work> {
        let mut raw = std::ptr::null_mut();
        check(call(&mut raw))?;
        Ok(Work { raw })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        unsafe { ft_group_free(self.raw) }
    }
}

/// An asynchronous collective in flight, or one already done.
pub struct Work {
    /// Null for a collective that completed as it was issued.
    raw: *mut RawWork,
}

// SAFETY: c10d work objects are waited on from other threads by PyTorch itself.
unsafe impl Send for Work {}

impl Work {
    /// A collective that completed as it was issued (ft's own transports).
    pub fn done() -> Work {
        Work { raw: std::ptr::null_mut() }
    }

    /// Gloo: blocks until done. NCCL: orders the current CUDA stream after the
    /// collective without blocking the CPU. `timeout` of zero defers to the group's.
    pub fn wait(self, timeout: Duration) -> Result<()> {
        if self.raw.is_null() {
            return Ok(());
        }
        check(unsafe { ft_work_wait(self.raw, millis(timeout)) })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            unsafe { ft_work_free(self.raw) }
        }
    }
}

fn pointers(tensors: &[&Tensor]) -> Vec<*mut RawTensor> {
    tensors.iter().map(|t| tensor_ptr(t)).collect()
}

/// Backpropagates `grad_outputs[i]` into `outputs[i]`'s graph, accumulating
/// into the leaves' `.grad` (what tch's `backward` cannot: it seeds with ones).
pub fn backward(outputs: &[&Tensor], grad_outputs: &[&Tensor]) -> Result<()> {
    assert_eq!(outputs.len(), grad_outputs.len(), "one gradient per output");
    let (outs, grads) = (pointers(outputs), pointers(grad_outputs));
    check(unsafe { ft_backward(outs.as_ptr(), grads.as_ptr(), outs.len() as i32) })
}

/// Hyper-parameters of one AdamW step (decoupled weight decay, bias correction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// ATen's `_fused_adamw_` over parallel lists; `steps` must already count
/// this step. `grad_scale`, a one-element tensor, divides every gradient;
/// a non-zero `found_inf` (one element) makes the step a no-op.
#[allow(clippy::too_many_arguments)]
pub fn fused_adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    steps: &[&Tensor],
    hyper: AdamW,
    grad_scale: Option<&Tensor>,
    found_inf: Option<&Tensor>,
) -> Result<()> {
    let n = params.len();
    assert!([grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().all(|l| *l == n));
    let (p, g, m, v, t) =
        (pointers(params), pointers(grads), pointers(exp_avgs), pointers(exp_avg_sqs), pointers(steps));
    check(unsafe {
        ft_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            t.as_ptr(),
            n as i32,
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.weight_decay,
            hyper.eps,
            grad_scale.map_or(std::ptr::null_mut(), tensor_ptr),
            found_inf.map_or(std::ptr::null_mut(), tensor_ptr),
        )
    })
}

/// Sets `tensor.grad` to undefined (Python's `p.grad = None`).
pub fn clear_grad(tensor: &Tensor) -> Result<()> {
    check(unsafe { ft_clear_grad(tensor_ptr(tensor)) })
}

/// A page-locked (pinned) copy of a host tensor.
pub fn pin_memory(tensor: &Tensor) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_pin_memory(tensor_ptr(tensor), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// Copies `src` into `dst` without waiting (`copy_(src, non_blocking=True)`):
/// from a GPU into pinned host memory the copy queues on the current stream.
pub fn copy_async(dst: &Tensor, src: &Tensor) -> Result<()> {
    check(unsafe { ft_copy_async(tensor_ptr(dst), tensor_ptr(src)) })
}

/// A pinned copy of `tensor` holding exactly its bytes (`pin_memory` rounds
/// each block up to a power of two): for host state that lives the whole run.
pub fn pin_memory_exact(tensor: &Tensor) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_pin_memory_exact(tensor_ptr(tensor), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// Frees (`nbytes` 0) or re-allocates the storage under `tensor` and every
/// view of it; re-allocated contents are undefined until written.
pub fn resize_storage(tensor: &Tensor, nbytes: usize) -> Result<()> {
    check(unsafe { ft_resize_storage(tensor_ptr(tensor), nbytes as i64) })
}

/// A tensor sharing `tensor`'s storage and shape, outside autograd (its own
/// version counter): in-place writes through it do not invalidate graphs
/// that saved views of `tensor`.
pub fn storage_alias(tensor: &Tensor) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_storage_alias(tensor_ptr(tensor), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// Whether autograd records operations on this thread (false inside
/// `tch::no_grad`): what may read a buffer through a view that a gradient
/// could not flow back through cheaply.
pub fn grad_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { ft_grad_enabled() }
}

/// A low-rank adapted linear layer, x·Wᵀ + bias + scale·(x·Aᵀ)·Bᵀ, as one
/// autograd node: the adapter's product accumulates into the base GEMM's
/// output and its input gradient into the base's (addmm's beta = 1), so no
/// [tokens, features] add runs either way. With `fused` (on a GPU), ft's
/// kernel sums the bias gradient.
pub fn lora_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, a: &Tensor, b: &Tensor, scale: f64, fused: bool) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    let bias = bias.map_or(std::ptr::null_mut(), tensor_ptr);
    let kernel = fused.then_some(fused_kernel as FusedKernel);
    check(unsafe { ft_lora_linear(tensor_ptr(x), tensor_ptr(weight), bias, tensor_ptr(a), tensor_ptr(b), scale, kernel, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// x·Wᵀ + bias as one autograd node whose backward sums the bias gradient
/// with ft's kernel (`kernels::column_sum`; ATen's column reduction reads
/// at a fraction of the bandwidth); the GEMMs are ATen's, as in its linear.
pub fn bias_linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_bias_linear(tensor_ptr(x), tensor_ptr(weight), tensor_ptr(bias), Some(fused_kernel), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// LayerNorm over the last dimension as one autograd node: ATen's forward
/// and input gradient, the weight's and bias's gradients in one pass of
/// ft's kernel (`kernels::column_sum`). On a GPU, fp32 or bf16.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_layer_norm(tensor_ptr(x), tensor_ptr(weight), tensor_ptr(bias), eps, Some(fused_kernel), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// RMSNorm over the last dimension as one autograd node: ft's kernel
/// forward, which also computes the output's amax when float8 layers want
/// it (`float8::fuse_activation_amaxes`), and ATen's fused backward from
/// the rstd it kept. On a GPU, fp32 or bf16.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_rms_norm(tensor_ptr(x), tensor_ptr(weight), eps, Some(fused_kernel), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// silu(gate) · up (SwiGLU's gating) as one autograd node that saves only
/// `gate` and `up` and recomputes silu(gate) in backward: one activation of
/// [tokens, ffn] less per block than ATen's silu and mul keep. With
/// `fused` (on a GPU), ft's kernel does each way in one pass.
pub fn swiglu(gate: &Tensor, up: &Tensor, fused: bool) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    let kernel = fused.then_some(fused_kernel as FusedKernel);
    check(unsafe { ft_swiglu(tensor_ptr(gate), tensor_ptr(up), kernel, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// SwiGLU over the gate and up halves of each row of `x` [rows, 2·width]
/// (a mixture of experts' fused gate-and-up projection) as one autograd
/// node saving only `x`, the halves read in place; with `fused` (on a GPU,
/// fp32 or bf16, contiguous), ft's kernel each way (`kernels::swiglu_halves_`).
pub fn swiglu_halves(x: &Tensor, fused: bool) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    let kernel = fused.then_some(fused_kernel as FusedKernel);
    check(unsafe { ft_swiglu_halves(tensor_ptr(x), kernel, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// A mixture of experts' combine as one autograd node: each token's
/// Σ_i weights[t,i]·rows[at[t·k + i]] ([tokens, width]) from the experts'
/// output `rows` [tokens·k, width], the router's fp32 `weights` [tokens, k]
/// and `at` (int64, where each assignment's row is); with `fused` (on a GPU,
/// k ≤ `kernels::COMBINE_MAX_K`), ft's kernel each way (`kernels::combine_`).
pub fn combine(rows: &Tensor, weights: &Tensor, at: &Tensor, fused: bool) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    let kernel = fused.then_some(fused_kernel as FusedKernel);
    check(unsafe { ft_combine(tensor_ptr(rows), tensor_ptr(weights), tensor_ptr(at), kernel, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// Rotary embeddings of `x` ([batch, seq, heads, head_dim] on a GPU) with
/// `cos` and `sin` ([batch, seq, 1, head_dim], sin carrying rotate_half's
/// sign) as one autograd node of one kernel each way (`kernels::rope_`),
/// saving only cos and sin.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    check(unsafe { ft_rope(tensor_ptr(x), tensor_ptr(cos), tensor_ptr(sin), Some(fused_kernel), &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// Rows exchanged between ranks, as an exchange node runs them (`exchange`).
pub trait Exchanger {
    /// `input`'s rows sent where the exchange sends them, and the rows
    /// received; with `reverse`, `input` is the gradient of what was
    /// received, sent back the way it came.
    fn exchange(&self, input: &Tensor, reverse: bool) -> std::result::Result<Tensor, String>;
}

/// `exchanger`'s exchange of `input` as one autograd node, whose backward
/// is its reverse exchange of the gradient; `exchanger` lives as long as
/// the node (to its backward, or to the forward's end when nothing will
/// call backward).
pub fn exchange(input: &Tensor, exchanger: Box<dyn Exchanger>) -> Result<Tensor> {
    let handle = Box::into_raw(Box::new(exchanger)) as i64;
    let mut raw = std::ptr::null_mut();
    // The shim hands `handle` back through `release_exchanger`, once, whatever happens.
    check(unsafe { ft_exchange(tensor_ptr(input), handle, run_exchanger, release_exchanger, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

type ExchangeFn = unsafe extern "C" fn(i64, i32, *const RawTensor, *mut *mut RawTensor, *mut c_char, usize) -> i32;
type ReleaseFn = unsafe extern "C" fn(i64);

/// The shim's exchange node onto the `Exchanger` behind `handle`: `direction` 1 is backward's.
unsafe extern "C" fn run_exchanger(handle: i64, direction: i32, input: *const RawTensor, output: *mut *mut RawTensor, message: *mut c_char, capacity: usize) -> i32 {
    // SAFETY: `handle` is `exchange`'s box, alive until `release_exchanger`; `input` a live at::Tensor the shim keeps owning.
    let exchanger = unsafe { &*(handle as *const Box<dyn Exchanger>) };
    let input = unsafe { borrowed(&input, 1) };
    let run = || -> Result<()> {
        let mut tensor = exchanger.exchange(&input[0], direction == 1).map_err(ShimError)?;
        // Handed over: the shim owns the at::Tensor from here.
        unsafe { *output = tensor.as_mut_ptr() };
        std::mem::forget(tensor);
        Ok(())
    };
    // SAFETY: the shim's buffer holds `capacity` bytes.
    unsafe { report(run, message, capacity) }
}

unsafe extern "C" fn release_exchanger(handle: i64) {
    // SAFETY: `exchange`'s box, released once by the node's state.
    drop(unsafe { Box::from_raw(handle as *mut Box<dyn Exchanger>) });
}

/// How the shim's autograd nodes call ft's kernels: the op (the shim's
/// `FusedOp`), its tensors (operands, outputs last), and a buffer for an
/// error's message; non-zero on failure.
type FusedKernel = unsafe extern "C" fn(i32, *const *const RawTensor, i32, *mut c_char, usize) -> i32;

/// The shim's `FusedOp`, value for value.
mod fused_op {
    pub const ROPE: i32 = 0;
    pub const ROPE_TRANSPOSE: i32 = 1;
    pub const SWIGLU_FORWARD: i32 = 2;
    pub const SWIGLU_BACKWARD: i32 = 3;
    pub const COLUMN_SUM: i32 = 4;
    pub const LAYER_NORM_PARAMS: i32 = 5;
    pub const RMS_NORM_FORWARD: i32 = 6;
    pub const SWIGLU_HALVES_FORWARD: i32 = 7;
    pub const SWIGLU_HALVES_BACKWARD: i32 = 8;
    pub const COMBINE_FORWARD: i32 = 9;
    pub const COMBINE_BACKWARD: i32 = 10;
}

/// The shim's `FusedOp` onto `kernels`.
unsafe extern "C" fn fused_kernel(op: i32, tensors: *const *const RawTensor, count: i32, message: *mut c_char, capacity: usize) -> i32 {
    // SAFETY: the shim passes `count` live at::Tensors that it keeps owning.
    let tensors = unsafe { borrowed(tensors, count) };
    let run = || -> Result<()> {
        let mut t: Vec<Tensor> = tensors.iter().map(|t| t.shallow_clone()).collect();
        match (op, t.as_mut_slice()) {
            (fused_op::ROPE | fused_op::ROPE_TRANSPOSE, [x, cos, sin, out]) => kernels::rope_(x, cos, sin, out, op == fused_op::ROPE_TRANSPOSE),
            (fused_op::SWIGLU_FORWARD, [gate, up, out]) => {
                // Its output's amax in the same pass, for a float8 layer reading it (`float8::note_activation_amax`).
                let amax = float8::activation_amaxes_wanted().then(|| Tensor::zeros([], (tch::Kind::Float, gate.device())));
                kernels::swiglu_(gate, up, None, out, None, amax.as_ref())?;
                if let Some(amax) = amax {
                    float8::note_activation_amax(out, amax);
                }
                Ok(())
            }
            (fused_op::RMS_NORM_FORWARD, [x, weight, eps, out, rstd]) => {
                // As SwiGLU's: the output's amax in the same pass.
                let amax = float8::activation_amaxes_wanted().then(|| Tensor::zeros([], (tch::Kind::Float, x.device())));
                kernels::rms_norm_(x, weight, eps.double_value(&[]), out, rstd, amax.as_ref())?;
                if let Some(amax) = amax {
                    float8::note_activation_amax(out, amax);
                }
                Ok(())
            }
            (fused_op::SWIGLU_BACKWARD, [gate, up, grad, grad_gate, grad_up]) => kernels::swiglu_(gate, up, Some(grad), grad_gate, Some(grad_up), None),
            (fused_op::SWIGLU_HALVES_FORWARD, [x, out]) => kernels::swiglu_halves_(x, None, out),
            (fused_op::SWIGLU_HALVES_BACKWARD, [x, grad, grad_x]) => kernels::swiglu_halves_(x, Some(grad), grad_x),
            (fused_op::COMBINE_FORWARD, [rows, weights, at, out]) => kernels::combine_(rows, weights, at, None, out, None),
            (fused_op::COMBINE_BACKWARD, [rows, weights, at, grad, grad_rows, grad_weights]) => kernels::combine_(rows, weights, at, Some(grad), grad_rows, Some(grad_weights)),
            (fused_op::COLUMN_SUM, [x, out]) => kernels::column_sum(x, None, out),
            (fused_op::LAYER_NORM_PARAMS, [grad, x, mean, rstd, sums]) => kernels::column_sum(grad, Some((x, mean, rstd)), sums),
            _ => Err(ShimError(format!("no fused op {op} over {count} tensors"))),
        }
    };
    // SAFETY: the shim's buffer holds `capacity` bytes.
    unsafe { report(run, message, capacity) }
}

/// The shim's tensors as tch's, without taking them over.
///
/// # Safety
/// `tensors` must point at `count` live at::Tensors that outlive the result.
unsafe fn borrowed(tensors: *const *const RawTensor, count: i32) -> Vec<std::mem::ManuallyDrop<Tensor>> {
    // The wrappers are never dropped, so they free nothing.
    (0..count.max(0) as usize).map(|i| std::mem::ManuallyDrop::new(unsafe { Tensor::from_ptr(*tensors.add(i) as *mut RawTensor) })).collect()
}

/// A panic inside `report` as its message's first line (a tch panic's
/// libtorch error without its C++ stack, e.g. running out of memory).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
    match text.and_then(|text| text.split("\\n").next()?.lines().next()) {
        Some(first_line) => format!("ft's kernel panicked: {first_line}"),
        None => "ft's kernel panicked".into(),
    }
}

/// Runs `run` for the shim: 0, or 1 with its error (a panic's too) in `message`.
///
/// # Safety
/// `message` must hold `capacity` bytes.
unsafe fn report(run: impl FnOnce() -> Result<()>, message: *mut c_char, capacity: usize) -> i32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|payload| Err(ShimError(panic_text(payload.as_ref()))));
    match result {
        Ok(()) => 0,
        Err(ShimError(text)) if capacity > 0 => {
            let bytes = &text.as_bytes()[..text.len().min(capacity - 1)];
            // SAFETY: at most capacity − 1 bytes plus the NUL are written.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), message as *mut u8, bytes.len());
                *message.add(bytes.len()) = 0;
            }
            1
        }
        Err(_) => 1,
    }
}

/// How the shim's `Float8Linear` node runs its GEMMs: step 0 (forward: x, W
/// in; x·Wᵀ and the two amaxes backward reuses, or none, out) or 1
/// (backward: x, W, dy and those amaxes in), the `float8::Float8` code, the inputs, which outputs are
/// wanted, where each output's at::Tensor goes (handed over), and a buffer
/// for an error's message.
type Float8Gemms = unsafe extern "C" fn(i32, i64, *const *const RawTensor, i32, *const bool, *mut *mut RawTensor, *mut c_char, usize) -> i32;

/// The shim's `Float8Linear` onto `float8`.
unsafe extern "C" fn float8_gemms(
    step: i32,
    code: i64,
    inputs: *const *const RawTensor,
    count: i32,
    wanted: *const bool,
    outputs: *mut *mut RawTensor,
    message: *mut c_char,
    capacity: usize,
) -> i32 {
    // SAFETY: the shim passes `count` live at::Tensors that it keeps owning.
    let inputs = unsafe { borrowed(inputs, count) };
    let (float8, fused, layer) = float8::Float8::from_code(code);
    let run = || -> Result<()> {
        let results: Vec<Option<Tensor>> = match (step, &inputs[..]) {
            (0, [x, weight]) => {
                let (out, [x_amax, w_amax]) = float8.forward(x, weight, fused, layer)?;
                vec![Some(out), x_amax, w_amax]
            }
            (1, [x, weight, grad, x_amax, w_amax]) => {
                let saved = [x_amax, w_amax].map(|t| t.defined().then(|| t.shallow_clone()));
                // SAFETY: backward's node passes two flags.
                float8.backward(x, weight, grad, saved, unsafe { [*wanted, *wanted.add(1)] }, fused, layer)?.into()
            }
            _ => return Err(ShimError(format!("no float8 step {step} over {count} tensors"))),
        };
        for (i, result) in results.into_iter().enumerate() {
            if let Some(mut tensor) = result {
                // SAFETY: the shim has a slot per output and takes over the at::Tensor tch allocated.
                unsafe { *outputs.add(i) = tensor.as_mut_ptr() };
                std::mem::forget(tensor);
            }
        }
        Ok(())
    };
    // SAFETY: the shim's buffer holds `capacity` bytes.
    unsafe { report(run, message, capacity) }
}

/// `float8::linear`'s node, with `adapter` (A, B, scale) `float8::lora_linear`'s.
fn float8_linear(x: &Tensor, weight: &Tensor, adapter: Option<(&Tensor, &Tensor, f64)>, code: i64) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    let (a, b, scale) = adapter.map_or((std::ptr::null_mut(), std::ptr::null_mut(), 0.0), |(a, b, scale)| (tensor_ptr(a), tensor_ptr(b), scale));
    check(unsafe { ft_float8_linear(tensor_ptr(x), tensor_ptr(weight), a, b, scale, float8_gemms, code, &mut raw) })?;
    // SAFETY: the shim returns a heap-allocated at::Tensor, which is what tch's tensors own.
    Ok(unsafe { Tensor::from_ptr(raw) })
}

/// One event name's totals over a profiled span.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfiledEvent {
    /// A CUDA kernel, copy or memset (true), or a host-side call.
    pub on_device: bool,
    pub name: String,
    pub calls: i64,
    pub total_ns: u64,
}

/// Starts PyTorch's Kineto profiler on this thread (with CUDA activity through CUPTI when `cuda`).
pub fn profiler_start(cuda: bool) -> Result<()> {
    check(unsafe { ft_profiler_start(cuda) })
}

/// Stops the profiler started by `profiler_start`, writes the Chrome trace
/// (chrome://tracing, Perfetto) to `trace_path`, and returns the totals per
/// event name.
pub fn profiler_stop(trace_path: &std::path::Path) -> Result<Vec<ProfiledEvent>> {
    let path = c_string(&trace_path.to_string_lossy())?;
    let mut summary: *mut c_char = std::ptr::null_mut();
    check(unsafe { ft_profiler_stop(path.as_ptr(), &mut summary) })?;
    // SAFETY: on success the shim sets `summary` to a malloc'd C string.
    let text = unsafe { CStr::from_ptr(summary) }.to_string_lossy().into_owned();
    unsafe { ft_free_error(summary) };
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let (device, name, calls, total) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
            Some(ProfiledEvent { on_device: device == "cuda", name: name.into(), calls: calls.parse().ok()?, total_ns: total.parse().ok()? })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    fn leaf(shape: &[i64], trained: bool) -> Tensor {
        Tensor::randn(shape, (Kind::Double, tch::Device::Cpu)).set_requires_grad(trained)
    }

    /// The LoRA node gives what autograd over ATen's ops gives — output and
    /// every gradient asked for — with and without a bias, a trained or
    /// frozen base: the node's own backward and its gradient bookkeeping.
    #[test]
    fn lora_linear_matches_autograd_over_atens_ops() {
        tch::manual_seed(0);
        for (with_bias, base_trained) in [(true, false), (false, false), (true, true), (false, true)] {
            let x = leaf(&[2, 3, 4], true);
            let (weight, a, b) = (leaf(&[5, 4], base_trained), leaf(&[2, 4], true), leaf(&[5, 2], true));
            let bias = with_bias.then(|| leaf(&[5], base_trained));
            let grad = Tensor::randn([2, 3, 5], (Kind::Double, tch::Device::Cpu));
            let mut leaves = vec![&x, &weight, &a, &b];
            leaves.extend(bias.as_ref());
            let run = |y: Tensor| -> Vec<Tensor> {
                super::backward(&[&y], &[&grad]).unwrap();
                let mut out = vec![y.detach()];
                for t in &leaves {
                    out.push(if t.requires_grad() { t.grad().copy() } else { Tensor::new() });
                    super::clear_grad(t).unwrap();
                }
                out
            };
            let node = run(super::lora_linear(&x, &weight, bias.as_ref(), &a, &b, 0.5, false).unwrap());
            let reference = run(x.linear(&weight, bias.as_ref()) + (x.linear::<&Tensor>(&a, None) * 0.5).linear::<&Tensor>(&b, None));
            for (i, (ours, theirs)) in node.iter().zip(&reference).enumerate() {
                assert_eq!(ours.defined(), theirs.defined(), "output {i} (bias {with_bias}, base trained {base_trained})");
                if ours.defined() {
                    let diff = (ours - theirs).abs().max().double_value(&[]);
                    assert!(diff < 1e-12, "output {i} differs by {diff} (bias {with_bias}, base trained {base_trained})");
                }
            }
        }
    }
}
