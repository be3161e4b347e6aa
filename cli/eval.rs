//! `ft eval` and `ft export`: a trained model on evaluation data (loss and
//! the task's scores), and a checkpoint as a Hugging Face model directory.

use crate::args::{ConfigFile, Overrides};
use anyhow::{bail, Context, Result};
use clap::Args;
use ft_core::env::{DistEnv, EnvSource};
use ft_core::device::{DType, DeviceSpec};
use ft_core::setup::Rank;
use ft_core::task::{Start, Task, TaskInputs, WholeModel};
use ft_core::{Config, Registry};
use ft_models::hf;
use ft_core::lora::RunModel;
use std::path::{Path, PathBuf};
use tch::Tensor;

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub config: ConfigFile,
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
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The reference model of a task that compares with one (`--task dpo`):
    /// the model training started from, e.g. the SFT model. Default for a
    /// LoRA run's output: its base, the adapters off, as training takes it.
    #[arg(long, value_name = "DIR")]
    ref_model: Option<String>,
    /// A Jinja chat template for conversations instead of the tokenizer's (data.chat_template).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    #[arg(long)]
    eval_samples: Option<usize>,
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Examples per batch on each rank (train.eval_batch_size).
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    dtype: Option<DType>,
    /// Set any configuration key, e.g. --set task.beta=0.1 (VALUE as JSON, else a string); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = ft_core::config::parse_assignment)]
    assignments: Vec<ft_core::config::Assignment>,
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// Where the predictions go.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Record the evaluation on rank 0 with PyTorch's profiler: a Chrome
    /// trace and the time per kernel in this directory.
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
}

pub fn eval(args: EvalArgs, plugins: &[PathBuf]) -> Result<i32> {
    let mut overrides = Overrides::default();
    overrides
        .set("model.source", Some(args.model.clone()))
        .set("task.name", args.task.clone())
        .path("data.eval", Some(&args.eval_file))
        .path("data.tokenizer", args.tokenizer.as_ref())
        .path("data.chat_template", args.chat_template.as_ref())
        .set("data.eval_samples", args.eval_samples)
        .set("data.max_seq_len", args.max_seq_len)
        .set("train.eval_batch_size", args.batch_size)
        .serialized("train.dtype", args.dtype)
        .serialized("train.device", args.device)
        .path("output.dir", args.output_dir.as_ref())
        .set("launch.nproc_per_node", args.nproc_per_node);
    let config = Config::load(args.config.path.as_deref(), &overrides.0, &args.assignments)?;
    config.launch.validate()?;
    let registry = Registry::with_plugins(plugins)?;
    if DistEnv::from_env()?.source == EnvSource::SingleProcess && config.launch.nproc_per_node > 1 {
        return ft_core::launch::spawn_local(config.launch.nproc_per_node, std::env::args().skip(1).collect());
    }
    let rank = Rank::start(&config, &ft_core::offload::NoOffload)?;
    let dir = hf::resolve(&config.model.source)?;
    let tokenizer = config.data.tokenizer.clone().unwrap_or(dir.join("tokenizer.json"));
    let (model, params) = ft_models::trained::load_trained(&dir, rank.dtype, rank.device)?;
    let inputs = TaskInputs { config: &config, tokenizer: &tokenizer, model: model.model(), device: rank.device };
    let mut task = (registry.task(config.task.name.as_deref(), model.model().head_kind())?.build)(&inputs)?;
    give_reference(task.as_mut(), &args, &model, &params, &tokenizer, &rank)?;
    let model = model.model();
    let profiling = args.profile.as_ref().filter(|_| rank.rank() == 0);
    if profiling.is_some() {
        ft_core::profile::start(rank.device.is_cuda())?;
    }
    let evaluation = ft_core::fit::evaluate(model, &params, task.as_mut(), &rank.comm, config.train.eval_batch_size, rank.dtype)?;
    if let Some(dir) = profiling {
        let report = ft_core::profile::stop(dir, "eval", rank.device.is_cuda(), 1)?;
        tracing::info!("profile of the evaluation: {}", report.top(25));
    }
    if rank.rank() == 0 {
        std::fs::create_dir_all(&config.output.dir).with_context(|| format!("cannot create {}", config.output.dir.display()))?;
        task.write_predictions(&config.output.dir)?;
        let loss = evaluation.loss.map_or("n/a".into(), |l| format!("{l:.4}"));
        let scores: String = evaluation.scores.values.iter().map(|(k, v)| format!(", {k} {v:.4}")).collect();
        let examples = evaluation.examples;
        println!("{}: eval loss {loss} over {examples} examples{scores}", args.eval_file.display());
        let per_second = examples as f64 / evaluation.seconds.max(f64::MIN_POSITIVE);
        // Every figure at full precision, named as a training run's evaluation records them (and Hugging Face's eval_results.json).
        let mut results = serde_json::Map::new();
        if let Some(loss) = evaluation.loss {
            results.insert("eval_loss".into(), loss.into());
        }
        results.extend(evaluation.scores.values.iter().map(|(k, v)| (format!("eval_{k}"), (*v).into())));
        results.insert("eval_samples".into(), examples.into());
        results.insert("eval_samples_per_second".into(), per_second.into());
        let path = config.output.dir.join("eval_results.json");
        std::fs::write(&path, serde_json::to_string_pretty(&results)?).with_context(|| format!("cannot write {}", path.display()))?;
        // The task's own scoring (generation, span decoding), where it has one.
        let scoring = match evaluation.scores.examples {
            0 => String::new(),
            _ => format!("; its scoring {:.2} s", evaluation.scoring_seconds),
        };
        println!("evaluated {examples} examples in {:.2} s ({per_second:.1} examples/s{scoring})", evaluation.seconds);
    }
    Ok(0)
}

/// Gives a task that compares the model with a reference (DPO) its
/// reference, as training's `Task::before_training` takes it: the model
/// `--ref-model` names, else a LoRA run's base (the adapters off).
fn give_reference(task: &mut dyn Task, args: &EvalArgs, model: &RunModel, params: &[Vec<Tensor>], tokenizer: &Path, rank: &Rank) -> Result<()> {
    if !task.compares_with_reference() {
        if let Some(dir) = &args.ref_model {
            bail!("--ref-model {dir}: this evaluation of task `{}` compares with no reference model (leave --ref-model out)", task.name());
        }
        return Ok(());
    }
    let given = match &args.ref_model {
        Some(spec) => Some(ft_models::trained::load_reference(&hf::resolve(spec)?, model.base(), tokenizer, rank.dtype, rank.device)?),
        None => None,
    };
    let (reference, reference_params) = match (&given, model.lora()) {
        (Some((reference, reference_params)), _) => (reference.model(), &reference_params[..]),
        (None, Some(lora)) => (lora.base(), &params[..lora.base_units()]),
        (None, None) => bail!(
            "task `{}` compares {} with its reference model, and it has no LoRA adapters whose base would be one: \
             name the model its training started from with --ref-model DIR, or evaluate reference-free (task.reference_free=true)",
            task.name(),
            args.model
        ),
    };
    let mut reference = WholeModel { model: reference, params: reference_params, dtype: rank.dtype };
    task.before_training(&mut Start { model: &mut reference, comm: &rank.comm, output: None, resuming: false })
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
    #[arg(long, value_parser = crate::args::parse_size)]
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
