//! `ft-core`: the traits a fine-tuning run is composed of (`Model`, `Task`
//! and its `Dataset` and `Objective`, `ShardingStrategy`, `Offload`,
//! `MetricsSink`), the registry that finds them by name, the configuration,
//! what spans ranks (`distributed/`: the communicator over PyTorch's c10d, the
//! strategies' policies and the flat buffers they place), the training engine (`train/`) and
//! the loop (`fit/`). docs/ARCHITECTURE.md maps them.

pub mod abi;
pub mod batches;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod conformance;
pub mod dataset;
pub mod device;
pub mod distributed;
pub mod ds_config;
pub mod env;
pub mod fit;
pub mod generate;
pub mod gpu;
pub mod kernels;
pub mod lora;
pub mod lowrank;
pub mod metrics;
pub mod model;
pub mod names;
pub mod nf4;
pub mod offload;
pub mod panic;
pub mod plan;
pub mod plugin;
pub mod profile;
pub mod progress;
pub mod quantize;
pub mod registry;
pub mod run_dir;
pub mod schedule;
pub mod setup;
pub mod signals;
pub mod task;
pub mod train;
pub mod units;

/// The plug-in API's paths (docs/PLUGINS.md, "Where each type comes from"):
/// what a plug-in imports stays where it was before `distributed/` held it.
pub use distributed::{comm, comm_hook, strategy};

/// AdamW's hyper-parameters (the fused step itself is in the shim).
pub use ft_sys::AdamW;
/// The CUDA caching allocator's counters (current and peak, allocated and reserved).
pub use ft_sys::{cuda_memory, CudaMemory};
pub use ft_sys::fused_adamw;

pub use distributed::comm::{Backend, CommError, CommOptions, Communicator, ProcessGroup, Reduction, Work};
pub use distributed::comm_hook::CommHook;
pub use config::Config;
pub use dataset::{Batch, Dataset};
pub use env::DistEnv;
pub use metrics::MetricsSink;
pub use model::Model;
pub use offload::Offload;
pub use registry::Registry;
pub use distributed::strategy::ShardingStrategy;
pub use task::{Objective, Task};
