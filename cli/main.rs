//! The `ft` command line: argument parsing and wiring only; the work is in ft-core.

mod bench;
mod chart;
mod comm_test;
mod launch;
mod list;
mod model_commands;
mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};
use ft_core::{Config, Registry};
use std::path::PathBuf;

// The built-in strategies and sinks register themselves with `inventory`;
// naming the crates links them in.
use ft_sinks as _;
use ft_strategy_ddp as _;
use ft_strategy_full_shard as _;
use ft_strategy_hybrid_shard as _;
use ft_strategy_shard_grad_op as _;
use ft_strategy_zero1 as _;

#[derive(Parser)]
#[command(name = "ft", version, about = "Fine-tune language models on one GPU, many GPUs and many nodes")]
struct Cli {
    /// Load a strategy plug-in (a cdylib built against this ft-core); repeatable.
    #[arg(long = "plugin", global = true, value_name = "LIB")]
    plugins: Vec<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// The run configuration file, for the subcommands that read one.
#[derive(clap::Args)]
pub struct ConfigFile {
    /// Configuration file (.toml, .yaml or .json); FT_SECTION__KEY variables and flags override it.
    #[arg(long = "config", env = "FT_CONFIG_FILE")]
    pub path: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Start local worker processes with torchrun's environment (RANK, WORLD_SIZE, …).
    Launch(launch::LaunchArgs),
    /// Fine-tune a model (with no arguments: the embedded demo on two CPU ranks).
    Train(train::TrainArgs),
    /// Evaluate a model: loss, and EM/F1 by greedy generation on SQuAD data.
    Eval(train::EvalArgs),
    /// Write a checkpoint as a Hugging Face model directory.
    Export(train::ExportArgs),
    /// Measure and check collectives (all_reduce, all_gather, reduce_scatter, broadcast).
    CommTest(comm_test::CommTestArgs),
    /// Show the registered models, strategies and metrics sinks.
    List(ConfigFile),
    /// Write a randomly initialised Hugging Face checkpoint of a config.
    InitModel(model_commands::InitModelArgs),
    /// Continue a prompt greedily (KV cache).
    Generate(model_commands::GenerateArgs),
    /// Training-step throughput and memory of a model shape, random weights.
    Bench(bench::BenchArgs),
    /// Run a forward (and backward) pass on token ids; write logits, loss and gradients.
    Forward(model_commands::ForwardArgs),
}

fn main() {
    // Variable-length batches fragment the CUDA caching allocator's fixed
    // segments; expandable segments avoid that. A user's own setting wins.
    if std::env::var_os("PYTORCH_CUDA_ALLOC_CONF").is_none() {
        std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
    }
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
        Command::CommTest(args) => comm_test::run(args),
        Command::List(config) => {
            Config::load(config.path.as_deref(), &[])?;
            list::run(&Registry::with_plugins(&cli.plugins)?);
            Ok(0)
        }
        Command::InitModel(args) => model_commands::init_model(args),
        Command::Generate(args) => model_commands::generate(args),
        Command::Forward(args) => model_commands::forward(args),
        Command::Bench(args) => bench::run(args, &cli.plugins),
        Command::Train(args) => train::run(args, &cli.plugins),
        Command::Eval(args) => train::eval(args),
        Command::Export(args) => train::export(args),
    }
}
