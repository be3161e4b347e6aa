//! CUDA, opened where there are GPUs. What ft calls in libtorch_cuda (NCCL
//! groups, devices and streams, graphs, the allocator's counters) is the
//! shim's other half, `shim/cuda.cpp`, built as libft_cuda.so and carried
//! in this crate: ft links no CUDA library, and a process on a host without
//! NVIDIA device nodes never loads libtorch_cuda and the CUDA libraries it
//! needs — 40% of an ft process's start before (docs/ARCHITECTURE.md).
//!
//! `init` must come before anything asks libtorch about CUDA: libtorch looks
//! up CUDA's hooks once and keeps what it found, and libtorch_cuda registers
//! them as it loads.

use crate::{check, millis, RawGraph, RawGroup, RawStore, Result, ShimError, Store};
use std::ffi::{c_char, c_void};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::OnceLock;

static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libft_cuda.so"));

/// Where the kernel puts NVIDIA GPUs' device nodes (and WSL's GPU-PV device): no GPU, no CUDA.
const GPU_NODES: [&str; 2] = ["/dev/nvidiactl", "/dev/dxg"];

extern "C" {
    fn ft_open_torch_cuda() -> *mut c_char;
}

/// libft_cuda.so's entry points (shim/cuda.cpp).
struct Cuda {
    nccl_group_create: unsafe extern "C" fn(*mut RawStore, i32, i32, i64, i32, *mut *mut RawGroup) -> *mut c_char,
    set_device: unsafe extern "C" fn(i32) -> *mut c_char,
    stream_synchronize: unsafe extern "C" fn(i32) -> *mut c_char,
    current_stream: unsafe extern "C" fn(i32, *mut *mut c_void) -> *mut c_char,
    memory_stats: unsafe extern "C" fn(i32, bool, *mut i64) -> *mut c_char,
    graph_capture_begin: unsafe extern "C" fn(i32, *mut *mut RawGraph) -> *mut c_char,
    graph_capture_end: unsafe extern "C" fn(*mut RawGraph) -> *mut c_char,
    graph_replay: unsafe extern "C" fn(*mut RawGraph) -> *mut c_char,
    graph_free: unsafe extern "C" fn(*mut RawGraph),
    // Kept open for the process's life: the pointers above are its code.
    _library: libloading::Library,
}

/// Why CUDA is not open in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// The host has no NVIDIA device nodes.
    NoGpus,
    /// There are GPUs, but libtorch_cuda or libft_cuda.so did not open.
    Failed(String),
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::NoGpus => write!(f, "this host has no NVIDIA GPU (none of {} exists)", GPU_NODES.join(", ")),
            Unavailable::Failed(reason) => write!(f, "CUDA did not open: {reason}"),
        }
    }
}

static CUDA: OnceLock<std::result::Result<Cuda, Unavailable>> = OnceLock::new();

/// Opens CUDA in this process, once, if the host has NVIDIA GPUs. Before
/// any libtorch call (first thing in `main`); later calls return the first
/// one's outcome.
pub fn init() -> std::result::Result<(), &'static Unavailable> {
    cuda().map(|_| ())
}

/// Whether this host has NVIDIA GPUs: their device nodes exist.
pub fn host_has_gpus() -> bool {
    GPU_NODES.iter().any(|node| std::path::Path::new(node).exists())
}

fn cuda() -> std::result::Result<&'static Cuda, &'static Unavailable> {
    CUDA.get_or_init(|| {
        if !host_has_gpus() {
            return Err(Unavailable::NoGpus);
        }
        open().map_err(Unavailable::Failed)
    })
    .as_ref()
}

/// Opens libtorch_cuda (beside the libtorch_cpu this process runs), then
/// the carried libft_cuda.so: from a memory file, else (a kernel that
/// refuses executable memory files: vm.memfd_noexec=2) from a file in the
/// temporary directory, removed once open.
fn open() -> std::result::Result<Cuda, String> {
    check(unsafe { ft_open_torch_cuda() }).map_err(|e| e.0)?;
    let library = from_memory().or_else(|memory| from_file().map_err(|file| format!("{memory}; {file}")))?;
    // SAFETY: each name is an extern "C" function of shim/cuda.cpp with the type its field declares.
    unsafe {
        Ok(Cuda {
            nccl_group_create: entry(&library, b"ft_nccl_group_create\0")?,
            set_device: entry(&library, b"ft_cuda_set_device\0")?,
            stream_synchronize: entry(&library, b"ft_cuda_stream_synchronize\0")?,
            current_stream: entry(&library, b"ft_cuda_current_stream\0")?,
            memory_stats: entry(&library, b"ft_cuda_memory_stats\0")?,
            graph_capture_begin: entry(&library, b"ft_graph_capture_begin\0")?,
            graph_capture_end: entry(&library, b"ft_graph_capture_end\0")?,
            graph_replay: entry(&library, b"ft_graph_replay\0")?,
            graph_free: entry(&library, b"ft_graph_free\0")?,
            _library: library,
        })
    }
}

/// The entry point `name` (NUL-terminated) of libft_cuda.so, as the field's type.
///
/// # Safety
/// `T` must be the type of the function the library exports under `name`.
unsafe fn entry<T: Copy>(library: &libloading::Library, name: &[u8]) -> std::result::Result<T, String> {
    // SAFETY: the caller's.
    unsafe { library.get::<T>(name) }.map(|symbol| *symbol).map_err(|e| e.to_string())
}

/// libft_cuda.so from a memory file. MFD_EXEC: where vm.memfd_noexec=1,
/// memory files are otherwise sealed non-executable; a kernel before 6.3
/// knows no such flag (EINVAL), and every memory file is executable there.
fn from_memory() -> std::result::Result<libloading::Library, String> {
    let name = c"libft_cuda.so";
    // SAFETY: a name and flags; the descriptor returned is ours.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_EXEC) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    }
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(LIBRARY).map_err(|e| format!("writing libft_cuda.so to a memory file: {e}"))?;
    open_library(&format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// libft_cuda.so from a file of this process's own in the temporary directory.
fn from_file() -> std::result::Result<libloading::Library, String> {
    let path = std::env::temp_dir().join(format!("libft_cuda-{}.so", std::process::id()));
    std::fs::write(&path, LIBRARY).map_err(|e| format!("writing {}: {e}", path.display()))?;
    let library = open_library(&path.to_string_lossy());
    let _ = std::fs::remove_file(&path);
    library
}

fn open_library(path: &str) -> std::result::Result<libloading::Library, String> {
    // SAFETY: the library's initialisers are libtorch's headers' statics, safe to run once libtorch_cuda is loaded.
    unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) }
        .map(Into::into)
        .map_err(|e| format!("opening libft_cuda.so from {path}: {e}"))
}

/// CUDA's entry points, or why this process has none.
fn opened() -> Result<&'static Cuda> {
    cuda().map_err(|why| ShimError(format!("CUDA is not open in this process: {why}")))
}

/// A ProcessGroupNCCL of `size` ranks bound to CUDA device `device_index`.
pub(crate) fn nccl_group(store: &Store, rank: usize, size: usize, timeout: std::time::Duration, device_index: usize) -> Result<*mut RawGroup> {
    let cuda = opened()?;
    let mut raw = std::ptr::null_mut();
    check(unsafe { (cuda.nccl_group_create)(store.raw, rank as i32, size as i32, millis(timeout), device_index as i32, &mut raw) })?;
    Ok(raw)
}

/// Makes `device_index` the current CUDA device of this thread (tch has no such call).
pub fn cuda_set_device(device_index: usize) -> Result<()> {
    check(unsafe { (opened()?.set_device)(device_index as i32) })
}

/// Blocks until the current CUDA stream of `device_index` has drained.
pub fn cuda_stream_synchronize(device_index: usize) -> Result<()> {
    check(unsafe { (opened()?.stream_synchronize)(device_index as i32) })
}

/// The raw `cudaStream_t` of `device_index`'s current stream.
pub fn cuda_current_stream(device_index: usize) -> Result<*mut c_void> {
    let mut stream = std::ptr::null_mut();
    check(unsafe { (opened()?.current_stream)(device_index as i32, &mut stream) })?;
    Ok(stream)
}

/// The CUDA caching allocator's view of one device, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaMemory {
    pub allocated: i64,
    pub peak_allocated: i64,
    pub reserved: i64,
    pub peak_reserved: i64,
}

/// Reads the allocator's counters; `reset_peak` starts a new peak window.
pub fn cuda_memory(device_index: usize, reset_peak: bool) -> Result<CudaMemory> {
    let mut out = [0i64; 4];
    check(unsafe { (opened()?.memory_stats)(device_index as i32, reset_peak, out.as_mut_ptr()) })?;
    Ok(CudaMemory { allocated: out[0], peak_allocated: out[1], reserved: out[2], peak_reserved: out[3] })
}

/// A recorded sequence of CUDA work that replays with one launch
/// (PyTorch's `torch.cuda.CUDAGraph`): the tensors it touched keep their
/// addresses, so inputs change by writing into them in place. Memory
/// allocated while recording stays the graph's until it is dropped.
pub struct CudaGraph {
    raw: *mut RawGraph,
    cuda: &'static Cuda,
}

impl CudaGraph {
    /// Records what `body` launches on CUDA device `device_index` without
    /// running it, and returns the graph with `body`'s result. Fails, with
    /// the recording discarded and the thread's stream restored, when
    /// `body` panics or launches something a graph cannot hold (a copy to
    /// the host, a synchronisation).
    pub fn capture<T>(device_index: usize, body: impl FnOnce() -> T) -> Result<(CudaGraph, T)> {
        let cuda = opened()?;
        let mut raw = std::ptr::null_mut();
        check(unsafe { (cuda.graph_capture_begin)(device_index as i32, &mut raw) })?;
        let graph = CudaGraph { raw, cuda };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
        let ended = check(unsafe { (cuda.graph_capture_end)(graph.raw) });
        match outcome {
            Ok(value) => ended.map(|()| (graph, value)),
            Err(panic) => {
                let message = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
                Err(ShimError(format!("capture failed: {}", message.unwrap_or_else(|| "the recorded code panicked".into()))))
            }
        }
    }

    /// Runs the recorded work again on the current stream.
    pub fn replay(&self) -> Result<()> {
        check(unsafe { (self.cuda.graph_replay)(self.raw) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        unsafe { (self.cuda.graph_free)(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    /// CI's hosts have no GPU, so `init` opens nothing there: this opens
    /// both libraries anyway, to show that libft_cuda.so links against the
    /// libtorch_cuda beside libtorch_cpu and that its calls reach CUDA.
    #[test]
    fn the_cuda_half_opens_and_its_calls_reach_cuda() {
        let cuda = super::open().unwrap();
        // The way a kernel that refuses executable memory files takes.
        super::from_file().unwrap();
        let set = super::check(unsafe { (cuda.set_device)(0) });
        if super::host_has_gpus() {
            set.unwrap();
        } else {
            let error = set.unwrap_err();
            assert!(error.0.contains("CUDA"), "{error}");
        }
        // Its CUDA runtime is global: where pinning finds cudaHostAlloc.
        assert!(!unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cudaHostAlloc".as_ptr()) }.is_null());
    }
}
