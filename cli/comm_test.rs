//! `ft comm-test`: flags → ft_core::distributed::collectives_bench; table and JSON out.

use anyhow::Result;
use clap::Args;
use ft_core::{Backend, Config, Registry};
use ft_core::config::Overrides;
use ft_core::device::DType;
use ft_core::distributed::collectives_bench::{self, Collective, CommTestOptions};
use std::path::PathBuf;

#[derive(Args)]
pub struct CommTestArgs {
    #[command(flatten)]
    pub config: crate::args::ConfigFile,
    /// auto, gloo (on the CPU) or nccl (overrides dist.backend).
    #[arg(long)]
    backend: Option<Backend>,
    /// Seconds rendezvous and each collective may take (overrides dist.timeout_secs).
    #[arg(long)]
    timeout_secs: Option<u64>,
    /// Collectives to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast", value_parser = collectives_bench::parse_collective)]
    ops: Vec<Collective>,
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(long, default_value = "1M", value_parser = collectives_bench::parse_bytes)]
    min_bytes: usize,
    /// Largest size.
    #[arg(long, default_value = "256M", value_parser = collectives_bench::parse_bytes)]
    max_bytes: usize,
    /// Size multiplier between steps of the sweep.
    #[arg(long, default_value_t = 4)]
    factor: usize,
    /// Element types, comma-separated: f32, bf16, f16.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    dtype: Vec<DType>,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Skip the correctness checks (timing only).
    #[arg(long)]
    no_check: bool,
    /// Also test hybrid-sharding sub-groups: shard groups of this many
    /// consecutive ranks and the replica groups across them.
    #[arg(long)]
    group_size: Option<usize>,
    /// Write the results as JSON here (rank 0).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the all-to-all through this communication hook's (expert
    /// parallelism's token exchange), with splits that differ by rank;
    /// its options from `--set comm.NAME.KEY=VALUE` or the config file.
    #[arg(long)]
    comm: Option<String>,
    /// Set a `comm.*` or `dist.*` key, e.g. --set comm.int8.block=64; repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = ft_core::config::parse_assignment)]
    assignments: Vec<ft_core::config::Assignment>,
}

impl CommTestArgs {
    fn config_overrides(&self) -> Overrides {
        let mut overrides = Overrides::default();
        // Gloo moves host tensors: benchmark it on the CPU even on a GPU machine.
        let on_cpu = self.backend == Some(Backend::Gloo);
        overrides.serialized("dist.backend", self.backend).set("train.device", on_cpu.then_some("cpu")).set("dist.timeout_secs", self.timeout_secs);
        overrides
    }
}

pub fn run(args: CommTestArgs, plugins: &[PathBuf]) -> Result<i32> {
    ft_core::config::check_reads(&args.assignments, "comm-test", &["comm", "dist"])?;
    let config = Config::load(args.config.path.as_deref(), &args.config_overrides().0, &args.assignments)?;
    let registry = Registry::with_plugins(plugins)?;
    registry.check_comm(&config.comm)?;
    let hook = args.comm.as_deref().map(|name| registry.named_comm_hook(&config.comm, name)).transpose()?.map(|(hook, _)| hook);
    let options = CommTestOptions {
        collectives: args.ops.clone(),
        sizes: collectives_bench::size_sweep(args.min_bytes, args.max_bytes, args.factor)?,
        kind: tch::Kind::Float,
        warmup: args.warmup,
        iters: args.iters,
        check: !args.no_check,
    };
    let dtypes: Vec<tch::Kind> = args.dtype.iter().map(|d| d.storage_kind()).collect();
    collectives_bench::run_command(&config, &options, &dtypes, args.group_size, args.json.as_deref(), hook)?;
    Ok(0)
}
