//! `ft eval` and `ft export`: a trained model on evaluation data (loss and
//! the task's scores), and a checkpoint as a Hugging Face model directory.

use crate::args::{RankArgs, Settings};
use ft_core::config::Overrides;
use anyhow::Result;
use clap::Args;
use ft_core::device::DType;
use ft_core::env::DistEnv;
use ft_core::distributed::launch;
use ft_core::{Config, Registry};
use ft_core::setup::Rank;
use ft_core::task::TaskInputs;
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct EvalArgs {
    /// Model directory (weights and tokenizer.json), e.g. a run's final/
    /// (a LoRA run's: its adapter, on the base model it names).
    #[arg(long)]
    model: String,
    /// What to score (task.name); default: the task for the model's head.
    #[arg(long)]
    task: Option<String>,
    /// The task's evaluation data, e.g. SQuAD JSON (loss and EM/F1) or text/JSONL (loss).
    #[arg(long)]
    eval_file: PathBuf,
    /// The reference model of a task that compares with one (`--task dpo`):
    /// the model training started from, e.g. the SFT model. Default for a
    /// LoRA run's output: its base, the adapters off, as training takes it.
    #[arg(long, value_name = "DIR")]
    ref_model: Option<String>,
    #[arg(long)]
    eval_samples: Option<usize>,
    /// Examples per batch on each rank (train.eval_batch_size).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Where the predictions go.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Record the evaluation on rank 0 with PyTorch's profiler: a Chrome
    /// trace and the time per kernel in this directory.
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
    #[command(flatten)]
    settings: Settings,
    #[command(flatten)]
    ranks: RankArgs,
}

/// The configuration keys `ft eval` reads: the model, the task, the evaluation data, its ranks.
const READS: &[&str] = &[
    "model.source", "task", "data.eval", "data.tokenizer", "data.chat_template", "data.eval_samples", "data.max_seq_len", "data.format",
    "data.columns", "data.eval_split", "data.truncate", "data.pad_to_multiple_of", "train.eval_batch_size", "train.dtype", "train.device",
    "train.loss_chunk_tokens", "output.dir", "launch", "dist",
];

pub fn eval(args: EvalArgs, plugins: &[PathBuf]) -> Result<i32> {
    let mut overrides = Overrides::default();
    overrides
        .set("model.source", Some(args.model.clone()))
        .set("task.name", args.task.clone())
        .path("data.eval", Some(&args.eval_file))
        .set("data.eval_samples", args.eval_samples)
        .set("train.eval_batch_size", args.batch_size)
        .path("output.dir", args.output_dir.as_ref());
    args.ranks.set(&mut overrides);
    let config = args.settings.load(overrides, "ft eval", Some(READS))?;
    config.launch.validate()?;
    let registry = Registry::with_plugins(plugins)?;
    if let Some(workers) = ft_core::setup::local_workers(&config, &DistEnv::from_env()?) {
        let run = || evaluate(&args, &config, &registry);
        return launch::spawn_local(workers, launch::Work::Fork { run: &run, arguments: std::env::args().skip(1).collect() });
    }
    evaluate(&args, &config, &registry)
}

/// One rank's evaluation.
fn evaluate(args: &EvalArgs, config: &Config, registry: &Registry) -> Result<i32> {
    let rank = Rank::start(config, &ft_core::offload::NoOffload)?;
    let dir = hf::resolve(&config.model.source)?;
    let tokenizer = config.data.tokenizer.clone().unwrap_or(dir.join("tokenizer.json"));
    let (model, params) = ft_models::trained::load_trained(&dir, rank.dtype, rank.device)?;
    let mut task = registry.build_task(config.task.name.as_deref(), &TaskInputs { config, tokenizer: &tokenizer, model: model.model(), device: rank.device })?;
    ft_models::trained::give_reference(task.as_mut(), args.ref_model.as_deref(), &args.model, &model, &params, &tokenizer, &rank)?;
    let evaluation = ft_core::fit::evaluate_on(&rank, model.model(), &params, task.as_mut(), config.train.eval_batch_size, args.profile.as_deref())?;
    if rank.rank() == 0 {
        ft_core::run_dir::finish_eval(&config.output.dir, &args.eval_file, &evaluation, task.as_ref())?;
    }
    Ok(0)
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint directory, "latest" in --output-dir, or a trained model
    /// directory (a run's final/).
    #[arg(long)]
    checkpoint: String,
    /// The run's output directory (where "latest" is looked for).
    #[arg(long, default_value = "ft-output")]
    output_dir: PathBuf,
    /// The Hugging Face directory to write (config.json, model.safetensors, the tokenizer with
    /// tokenizer_config.json and the chat template, generation_config.json).
    #[arg(long)]
    out: PathBuf,
    /// Weight dtype on disk: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Largest weights file, e.g. 5GB: more make model-0000k-of-0000n.safetensors and an index (export holds one file in memory).
    #[arg(long, value_parser = ft_core::units::parse_size)]
    max_shard_size: Option<f64>,
    /// A LoRA checkpoint or final/: write the base model with the adapters folded in,
    /// instead of the adapter files (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    merge: bool,
    /// The base weights to merge into (default: the model directory the run read).
    #[arg(long, requires = "merge")]
    base_model: Option<PathBuf>,
}

pub fn export(args: ExportArgs) -> Result<i32> {
    let source = ft_models::trained::export_source(&args.checkpoint, &args.output_dir)?;
    let export = ft_models::trained::Export {
        dtype: args.dtype.storage_kind(),
        max_shard_bytes: args.max_shard_size.map_or(hf::DEFAULT_MAX_SHARD_BYTES, |bytes| bytes as u64),
        merge: args.merge,
        base_model: args.base_model.as_deref(),
    };
    let exported = ft_models::trained::export(&source, &args.out, &export)?;
    println!("exported {exported} to {}", args.out.display());
    Ok(0)
}
