//! `ft launch`: flags → ft_core::distributed::launch.

use anyhow::Result;
use clap::Args;
use ft_core::distributed::launch::LaunchOptions;

#[derive(Args)]
pub struct LaunchArgs {
    /// Worker processes on this node (one per GPU for NCCL).
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job; run `ft launch` once on each.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, where rank 0 hosts the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (default: a free port on one node, 29500 on several).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds a worker gets to exit after the others are told to stop.
    #[arg(long, default_value_t = 5)]
    grace_secs: u64,
    /// Seconds the workers get to save a checkpoint and exit after a
    /// stopping signal (SIGINT, SIGTERM, SIGUSR1, …), passed on to them.
    #[arg(long, default_value_t = ft_core::distributed::launch::DEFAULT_SAVE_GRACE_SECS)]
    save_grace_secs: u64,
    /// Run an arbitrary program instead of an `ft` subcommand (like torchrun --no-python).
    #[arg(long)]
    exec: bool,
    /// The `ft` subcommand (or, with --exec, the program) and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// `run_ft` runs an `ft` command line in a worker (`cli/main.rs`).
pub fn run(args: LaunchArgs, run_ft: &dyn Fn(&[String]) -> Result<i32>) -> Result<i32> {
    let LaunchArgs { nproc_per_node, nnodes, node_rank, master_addr, master_port, grace_secs, save_grace_secs, exec, command } = args;
    let options = LaunchOptions { nproc_per_node, nnodes, node_rank, master_addr, master_port, grace_secs, save_grace_secs, exec, command };
    ft_core::distributed::launch::run(options, run_ft)
}
