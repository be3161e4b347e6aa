//! `ft comm-test`: flags → ft_core::comm_test, table and JSON out.

use anyhow::{bail, Context, Result};
use clap::Args;
use figment::value::Value;
use ft_core::comm_test::{self, Collective, CommTestOptions, CommTestRow};
use ft_core::{Backend, CommOptions, Communicator, Config, DistEnv, Reduction};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct CommTestArgs {
    #[command(flatten)]
    pub config: crate::ConfigFile,
    /// auto, gloo or nccl (overrides dist.backend).
    #[arg(long)]
    backend: Option<Backend>,
    /// Seconds rendezvous and each collective may take (overrides dist.timeout_secs).
    #[arg(long)]
    timeout_secs: Option<u64>,
    /// Collectives to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce,all_gather,reduce_scatter,broadcast")]
    ops: Vec<String>,
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(long, default_value = "1M")]
    min_bytes: String,
    /// Largest size.
    #[arg(long, default_value = "256M")]
    max_bytes: String,
    /// Size multiplier between steps of the sweep.
    #[arg(long, default_value_t = 4)]
    factor: usize,
    /// Element types, comma-separated: f32, bf16, f16.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    dtype: Vec<String>,
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
}

impl CommTestArgs {
    pub fn config_overrides(&self) -> Vec<(&'static str, Value)> {
        let mut overrides = vec![];
        if let Some(backend) = self.backend {
            overrides.push(("dist.backend", Value::serialize(backend).expect("enum serializes")));
        }
        if let Some(timeout) = self.timeout_secs {
            overrides.push(("dist.timeout_secs", timeout.into()));
        }
        overrides
    }
}

pub fn run(args: CommTestArgs, config: &Config) -> Result<i32> {
    let collectives = args.ops.iter().map(|o| Collective::parse(o)).collect::<Result<Vec<_>>>()?;
    let kinds = args.dtype.iter().map(|d| comm_test::parse_dtype(d)).collect::<Result<Vec<_>>>()?;
    let sizes = comm_test::size_sweep(
        comm_test::parse_bytes(&args.min_bytes)?,
        comm_test::parse_bytes(&args.max_bytes)?,
        args.factor,
    )?;
    let env = DistEnv::from_env()?;
    let options = CommOptions { backend: config.dist.backend, timeout: Duration::from_secs(config.dist.timeout_secs) };
    let comm = Communicator::init(env, &options)?;
    let (rank, world) = (comm.env().rank, comm.env().world_size);
    tracing::info!("rendezvous complete: rank {rank} of {world}, backend {}", comm.backend_name());

    let mut groups = vec![];
    if let Some(size) = args.group_size {
        let (shard, replica) = comm.hybrid_groups(size)?;
        groups.push(shard);
        groups.push(replica);
    }
    let mut rows: Vec<CommTestRow> = vec![];
    for kind in kinds {
        let options = CommTestOptions {
            collectives: collectives.clone(),
            sizes: sizes.clone(),
            kind,
            warmup: args.warmup,
            iters: args.iters,
            check: !args.no_check,
        };
        rows.extend(comm_test::run(comm.world(), comm.device(), &options)?);
        for group in &groups {
            rows.extend(comm_test::run(group, comm.device(), &options)?);
        }
    }

    // Rank 0 prints only its own groups' rows; every rank's checks count.
    let failed: Vec<&CommTestRow> = rows.iter().filter(|r| r.correct == Some(false)).collect();
    for row in &failed {
        eprintln!("rank {rank}: {} on {} ({} bytes, {}) gave wrong values", row.op, row.group, row.bytes, row.dtype);
    }
    let mut failures = tch::Tensor::from_slice(&[failed.len() as f64]).to_device(comm.device());
    comm.world().all_reduce(&mut failures, Reduction::Sum)?.wait()?;
    let total_failures = failures.double_value(&[]) as usize;

    if rank == 0 {
        print!("{}", comm_test::format_table(&rows));
        if let Some(path) = &args.json {
            let report = serde_json::json!({
                "tool": "ft",
                "backend": comm.backend_name(),
                "world_size": world,
                "nodes": comm.env().num_nodes(),
                "warmup": args.warmup,
                "iters": args.iters,
                "rows": rows,
            });
            std::fs::write(path, serde_json::to_string_pretty(&report)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    if total_failures > 0 {
        bail!("{total_failures} collective check(s) failed across the ranks (see the lines above)");
    }
    if rank == 0 && !args.no_check {
        println!("all collectives gave the expected values on all {world} ranks");
    }
    Ok(0)
}
