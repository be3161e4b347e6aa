//! `ft-core`: the traits a fine-tuning run is composed of (`Model`, `Task`
//! and its `Dataset` and `Objective`, `ShardingStrategy`, `Offload`,
//! `MetricsSink`), the registry that finds them by name, the configuration,
//! the communicator over PyTorch's c10d, the training engine (`train/`) and
//! the loop (`fit/`). docs/ARCHITECTURE.md maps them.

pub mod abi;
pub mod batches;
pub mod bench;
pub mod checkpoint;
pub mod collectives_bench;
pub mod comm;
pub mod comm_hook;
pub mod config;
pub mod conformance;
pub mod dataset;
pub mod device;
pub mod ds_config;
pub mod env;
pub mod fit;
pub mod flat;
pub mod float8_gather;
pub mod generate;
pub mod gpu;
pub mod kernels;
pub mod launch;
pub mod lora;
pub mod lowrank;
pub mod metrics;
pub mod model;
pub mod names;
pub mod nf4;
pub mod offload;
pub mod packed_base;
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
pub mod strategy;
pub mod task;
pub mod train;
pub mod units;

/// AdamW's hyper-parameters (the fused step itself is in the shim).
pub use ft_sys::AdamW;
/// The CUDA caching allocator's counters (current and peak, allocated and reserved).
pub use ft_sys::{cuda_memory, CudaMemory};
pub use ft_sys::fused_adamw;

pub use comm::{Backend, CommError, CommOptions, Communicator, ProcessGroup, Reduction, Work};
pub use comm_hook::CommHook;
pub use config::Config;
pub use dataset::{Batch, Dataset};
pub use env::DistEnv;
pub use metrics::MetricsSink;
pub use model::Model;
pub use offload::Offload;
pub use registry::Registry;
pub use strategy::ShardingStrategy;
pub use task::{Objective, Task};
