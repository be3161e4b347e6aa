//! The `ft` command line: argument parsing and wiring only; the work is in ft-core.

mod args;
mod bench;
mod comm_test;
mod eval;
mod launch;
mod model_commands;
mod plan;
mod plugin;
mod tokenize;
mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};
use ft_core::{Config, Registry};
use std::ffi::OsString;
use std::path::PathBuf;

// The built-in strategies and sinks register themselves with `inventory`;
// naming the crates links them in.
use ft_sinks as _;
use ft_tasks as _;
use ft_strategy_cpu_offload as _;
use ft_strategy_ddp as _;
use ft_strategy_full_shard as _;
use ft_strategy_hybrid_shard as _;
use ft_strategy_shard_grad_op as _;
use ft_strategy_zero1 as _;

/// What `ft` alone prints first: where to start.
const START_HERE: &str = "Start here: `ft train` fine-tunes the embedded demo (a small BLOOM learning to answer \
questions about invented countries, with its own data and tokenizer, on two CPU ranks, about a minute on 2 cores). \
`ft train --model arithmetic`: online RL (GRPO) learning additions from rewards alone. \
Flags without a command are `ft train`'s: `ft --strategy hybrid_shard --offload cpu --model DIR --train-file F`.";

#[derive(Parser)]
#[command(
    name = "ft",
    version,
    about = "Fine-tune language models on one GPU, many GPUs and many nodes",
    before_help = START_HERE,
    arg_required_else_help = true
)]
struct Cli {
    /// Load a plug-in: a cdylib built against this ft-core that adds strategies
    /// (--strategy) and communication hooks (--comm); repeatable.
    #[arg(long = "plugin", global = true, value_name = "LIB")]
    plugins: Vec<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// `ft --strategy x …` is `ft train --strategy x …`: when the first
/// argument after the global `--plugin LIB` pairs is a flag other than help
/// or version, the command is `train`.
fn with_default_command(mut args: Vec<OsString>) -> Vec<OsString> {
    let mut first = 1;
    while args.get(first).is_some_and(|a| a == "--plugin") {
        first += 2;
    }
    let is_train_flag = args.get(first).and_then(|a| a.to_str()).is_some_and(|a| {
        a.starts_with('-') && !matches!(a, "-h" | "--help" | "-V" | "--version") && !a.starts_with("--plugin=")
    });
    if is_train_flag {
        args.insert(first, "train".into());
    }
    args
}

#[derive(Subcommand)]
enum Command {
    /// Start local worker processes with torchrun's environment (RANK, WORLD_SIZE, …).
    Launch(launch::LaunchArgs),
    /// Fine-tune a model (with no arguments: the embedded demo on two CPU ranks).
    /// A flag given twice takes its last value (a script's defaults, then the user's).
    #[command(args_override_self = true)]
    Train(train::TrainArgs),
    /// Evaluate a model on its task: loss and scores (e.g. EM/F1 on SQuAD data).
    Eval(eval::EvalArgs),
    /// Write a checkpoint as a Hugging Face model directory.
    Export(eval::ExportArgs),
    /// Measure and check collectives (all_reduce, all_gather, reduce_scatter, broadcast).
    CommTest(comm_test::CommTestArgs),
    /// Show what the registry holds: models, tasks, strategies, offloads, sinks, presets.
    List(args::ConfigFile),
    /// Write what training sees of a data file as JSON lines: {"input_ids", "labels"} per example (--task dpo: its chosen and rejected rows).
    Tokenize(tokenize::TokenizeArgs),
    /// Write a randomly initialised Hugging Face checkpoint of a config.
    InitModel(model_commands::InitModelArgs),
    /// Continue a prompt greedily (KV cache).
    Generate(model_commands::GenerateArgs),
    /// Training-step throughput and memory of a model shape, random weights.
    Bench(bench::BenchArgs),
    /// Predict each rank's memory and step time for every strategy, offload and
    /// activation checkpointing, and pick the fastest that fits.
    Plan(plan::PlanArgs),
    /// Measure this machine's rates for `ft plan --calibration`: GEMMs of a
    /// model's shapes, the host optimizer, the host link.
    Calibrate(plan::CalibrateArgs),
    /// Run a forward (and backward) pass on token ids; write logits, loss and gradients.
    Forward(model_commands::ForwardArgs),
    /// Work with plug-ins: `ft plugin check libX.so` runs the conformance kit.
    Plugin(plugin::PluginArgs),
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
    ft_core::setup::prepare_cuda();
    let args = with_default_command(std::env::args_os().collect());
    let cli = parse(args.iter().cloned());
    let code = ft_core::panic::run_command(&args, || run(cli));
    // Everything of the run is dropped by now (files written and closed, sinks and ranks finished).
    ft_core::setup::exit_without_teardown(code)
}

/// An `ft` command line run in this process: what `ft launch` forks its
/// workers to. A bad one ends the worker as it would end `ft` (clap's
/// message and exit code).
fn run_arguments(arguments: &[String]) -> Result<i32> {
    let args = std::iter::once(OsString::from("ft")).chain(arguments.iter().map(OsString::from)).collect();
    run(parse(with_default_command(args)))
}

/// The command line, or clap's help, version or error printed and the
/// process ended with clap's exit code — without libtorch's teardown, as
/// `main` ends (`ft plan --help` took 0.36 s of CPU with it, 0.26 s without).
fn parse(args: impl IntoIterator<Item = OsString>) -> Cli {
    Cli::try_parse_from(args).unwrap_or_else(|error| {
        let _ = error.print();
        ft_core::setup::exit_without_teardown(error.exit_code())
    })
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Launch(args) => launch::run(args, &run_arguments),
        Command::CommTest(args) => comm_test::run(args, &cli.plugins),
        Command::List(config) => {
            Config::load(config.path.as_deref(), &[], &[])?;
            print!("{}", Registry::with_plugins(&cli.plugins)?.describe());
            Ok(0)
        }
        Command::Tokenize(args) => tokenize::run(args, &cli.plugins),
        Command::InitModel(args) => model_commands::init_model(args),
        Command::Generate(args) => model_commands::generate(args),
        Command::Forward(args) => model_commands::forward(args),
        Command::Bench(args) => bench::run(args, &cli.plugins),
        Command::Plan(args) => plan::run(args, &cli.plugins),
        Command::Calibrate(args) => plan::calibrate(args, &cli.plugins),
        Command::Train(args) => train::run(args, &cli.plugins),
        Command::Eval(args) => eval::eval(args, &cli.plugins),
        Command::Export(args) => eval::export(args),
        Command::Plugin(args) => plugin::run(args, &cli.plugins),
    }
}
