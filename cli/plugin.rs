//! `ft plugin check`: flags → the conformance kit (ft_core::conformance) → its table.

use anyhow::Result;
use ft_core::conformance::{self, CheckRequest, Outcome, Row};
use ft_core::Registry;
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
    println!("ft plugin check {}", args.library.display());
    let mut all = plugins.to_vec();
    if !all.contains(&args.library) {
        all.push(args.library.clone());
    }
    let registry = match Registry::with_plugins(&all) {
        Ok(registry) => registry,
        Err(error) => {
            print!("{}", conformance::table(&[Row { hook: "-".into(), check: "loads".into(), outcome: Outcome::Fail(format!("{error:#}")), details: vec![] }]));
            return Ok(1);
        }
    };
    let settings = args.settings.iter().map(|s| ft_core::config::parse_assignment(s).map_err(anyhow::Error::msg)).collect::<Result<_>>()?;
    let work = std::env::temp_dir().join(format!("ft-plugin-check-{}", std::process::id()));
    let request = CheckRequest {
        ft: std::env::current_exe()?,
        library: args.library,
        plugins: all,
        comm: args.comm,
        strategies: args.strategy,
        settings,
        raw_settings: args.settings,
        steps: args.steps.max(6),
        scratch: work.join("runs"),
        logs: work.join("logs"),
        cache: args.cache,
    };
    let rows = conformance::check(&request, &registry)?;
    // Gone unless it keeps a failed run's log.
    let _ = std::fs::remove_dir(&work);
    print!("{}", conformance::table(&rows));
    Ok(if rows.iter().any(|r| matches!(r.outcome, Outcome::Fail(_))) { 1 } else { 0 })
}
