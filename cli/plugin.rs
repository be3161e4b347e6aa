//! `ft plugin check`: flags → the conformance kit (ft_core::conformance::run).

use anyhow::Result;
use ft_core::conformance;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PluginArgs {
    #[command(subcommand)]
    command: PluginCommand,
}

#[derive(clap::Subcommand)]
enum PluginCommand {
    /// Check a communication plug-in on 2 and 3 local CPU ranks: it loads, equals
    /// the built-in (or stays within its declared tolerance at every step; both
    /// runs' losses are shown step by step), every rank issues the same
    /// collectives, a killed rank resumes to the plug-in's own uninterrupted
    /// losses. A failed run's output is kept in a log its row names. Exit 1 if any check fails.
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The plug-in (a cdylib built against this ft-core).
    library: PathBuf,
    /// The hook to check (default: every hook the library registers).
    #[arg(long)]
    comm: Option<String>,
    /// Strategies to run it under (a strategy the hook refuses is skipped, as it may).
    #[arg(long, value_delimiter = ',', default_value = "ddp,zero1,full_shard")]
    strategy: Vec<String>,
    /// Options for every run, e.g. comm.powersgd.rank=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Keep the built-in runs' losses in DIR, and reuse those of a later check
    /// whose built-in run is the same (ft, plug-ins, flags, environment).
    #[arg(long, value_name = "DIR")]
    cache: Option<PathBuf>,
}

pub fn run(args: PluginArgs, plugins: &[PathBuf]) -> Result<i32> {
    let PluginCommand::Check(args) = args.command;
    conformance::run(args.library, plugins, args.comm, args.strategy, args.settings, args.steps, args.cache)
}
