//! The `ft` command line: argument parsing and wiring only; the work is in ft-core.

mod comm_test;
mod launch;
mod list;

use anyhow::Result;
use clap::{Parser, Subcommand};
use ft_core::Config;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "ft", version, about = "Fine-tune language models on one GPU, many GPUs and many nodes")]
struct Cli {
    /// Configuration file (.toml, .yaml or .json); FT_SECTION__KEY variables and flags override it.
    #[arg(long, global = true, env = "FT_CONFIG_FILE")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start local worker processes with torchrun's environment (RANK, WORLD_SIZE, …).
    Launch(launch::LaunchArgs),
    /// Measure and check collectives (all_reduce, all_gather, reduce_scatter, broadcast).
    CommTest(comm_test::CommTestArgs),
    /// Show the registered strategies and metrics sinks.
    List,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::CommTest(args) => {
            let config = Config::load(cli.config.as_deref(), &args.config_overrides())?;
            comm_test::run(args, &config)
        }
        Command::List => {
            Config::load(cli.config.as_deref(), &[])?;
            list::run();
            Ok(0)
        }
    }
}
