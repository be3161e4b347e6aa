//! `ft bench`: a matrix of model shapes × strategies × GPU counts × batch ×
//! sequence length, each configuration in its own fresh workers (so memory
//! figures are its own) running ft_core::bench; rank 0's rows make one
//! table, JSON and a chart. Exposed communication is a configuration's step
//! time minus the same model, batch and length on one GPU.

use crate::args::LoraArgs;
use ft_core::config::Overrides;
use ft_core::lora::RunModel;
use anyhow::{Context, Result};
use clap::Args;
use ft_core::bench::{self, BenchCase, Configuration, Row};
use ft_core::{Config, Registry};
use ft_core::config::{parse_named, Fp8};
use ft_core::device::{DType, DeviceSpec};
use ft_core::distributed::strategy::ReduceDtype;
use ft_core::gpu::GpuSpec;
use ft_core::model::Model;
use ft_core::plan::{self, BenchSettings, Float8Flags};
use ft_core::setup::Rank;
use ft_models::hf;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Also each configuration's worker's own, one value each (`--worker`).
#[derive(Args, Clone, Serialize, Deserialize)]
pub struct BenchArgs {
    /// config.json, a model directory, or a hub id in the local cache; repeat for several models.
    #[arg(long = "config", required_unless_present_any = ["from_json", "worker"])]
    configs: Vec<String>,
    /// Override config keys of every model, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Strategies to compare (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "ddp")]
    strategy: Vec<String>,
    /// Communication hooks to compare under each strategy (comma-separated;
    /// default: the strategy's own collectives).
    #[arg(long, value_delimiter = ',')]
    comm: Vec<String>,
    /// A hook's option for every row, e.g. comm.powersgd.rank=4 (repeatable).
    #[arg(long = "comm-option", value_name = "comm.NAME.KEY=VALUE")]
    comm_options: Vec<String>,
    /// GPU (or, with --device cpu, process) counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    gpus: Vec<usize>,
    /// Micro-batch sizes per GPU (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    batch: Vec<i64>,
    /// Sequence lengths (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    seq: Vec<i64>,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Compute dtype (masters stay fp32).
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// cuda, cpu (Gloo), or auto (the GPU when there is one).
    #[arg(long, default_value = "cuda")]
    device: DeviceSpec,
    /// none or cpu.
    #[arg(long, default_value = "none")]
    offload: String,
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// Ranks that split a mixture of experts' experts between them (train.expert_parallel).
    #[arg(long, default_value_t = 1)]
    expert_parallel: usize,
    /// dtype gradients are reduced in: fp32 (exact sums, FSDP2's reduce_dtype=float32) or compute.
    #[arg(long, default_value = "fp32", value_parser = parse_named::<ReduceDtype>)]
    reduce_dtype: ReduceDtype,
    #[arg(long)]
    activation_checkpointing: bool,
    /// Recompute only the first N blocks (`ft train --checkpoint-layers`).
    #[arg(long, value_name = "N", requires = "activation_checkpointing")]
    checkpoint_layers: Option<usize>,
    /// Float8 linear layers in the blocks: tensorwise or rowwise (torchao's recipes; `ft train --fp8`).
    #[arg(long, value_name = "tensorwise|rowwise", value_parser = parse_named::<Fp8>)]
    fp8: Option<Fp8>,
    /// Under --fp8 tensorwise with sharding, gather float8 blocks as float8 bytes (`train.fp8_gathers`; default: on under tensorwise).
    #[arg(long, value_name = "true|false", requires = "fp8")]
    fp8_gathers: Option<bool>,
    #[arg(long, default_value_t = 1024)]
    loss_chunk_tokens: i64,
    /// On one GPU, also time the phases apart (synchronising between them):
    /// forward+backward, the LM head's loss alone, the optimizer step.
    #[arg(long)]
    breakdown: bool,
    /// Profile 3 more steps of each configuration on rank 0 with PyTorch's
    /// profiler: a Chrome trace (chrome://tracing, Perfetto) and the GPU time per
    /// kernel in this directory, and the top kernels on stderr.
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
    /// Write the rows as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The task whose random data and loss a step runs (default: the one for the model's head).
    #[arg(long)]
    task: Option<String>,
    /// Write a PNG chart of tokens/s and peak memory per configuration.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Run nothing: print the table and draw the chart of rows saved with --json (repeatable).
    #[arg(long, value_name = "ROWS_JSON")]
    from_json: Vec<PathBuf>,
    /// Print each row's peak allocated memory and step time beside `ft
    /// plan`'s prediction (with --from-json, give the rows' --config too).
    #[arg(long)]
    plan_check: bool,
    /// The GPU the rows ran on, for --plan-check (default: this machine's).
    #[arg(long)]
    gpu: Option<String>,
    /// `ft calibrate`'s file, for --plan-check: predict with its measured rates.
    #[arg(long, value_name = "JSON", requires = "plan_check")]
    calibration: Option<PathBuf>,
    /// Set on the workers `ft bench` launches: their configuration, written as JSON.
    #[arg(long, hide = true)]
    #[serde(skip)]
    worker: Option<PathBuf>,
    /// Where a worker's rank 0 writes its row.
    #[arg(skip)]
    result_file: Option<PathBuf>,
    #[command(flatten)]
    lora: LoraArgs,
}

pub fn run(args: BenchArgs, plugins: &[PathBuf]) -> Result<i32> {
    if let Some(path) = &args.worker {
        return worker(&bench::worker_arguments(path)?, plugins);
    }
    if !args.from_json.is_empty() {
        return report(&args, bench::read_rows(&args.from_json)?, plugins);
    }
    let matrix = bench::matrix(&args.configs, &args.batch, &args.seq, &args.gpus, &args.strategy, &args.comm);
    let rows = bench::run_matrix(&matrix, &args.offload, |one| case(&args, one.batch, one.seq), |one, result| launch_one(&args, plugins, one, result))?;
    report(&args, rows, plugins)
}

/// The table, and the JSON, chart and plan check when asked for; fails when a configuration did.
fn report(args: &BenchArgs, mut rows: Vec<Row>, plugins: &[PathBuf]) -> Result<i32> {
    bench::fill_exposed_comm(&mut rows);
    print!("{}", bench::table(&rows));
    if args.plan_check {
        plan_check(args, &rows, plugins)?;
    }
    bench::save(&rows, args.json.as_deref(), args.chart.as_deref())?;
    Ok(if rows.iter().any(|r| r.error.is_some()) { 1 } else { 0 })
}

/// Each row beside `ft plan`'s prediction.
fn plan_check(args: &BenchArgs, rows: &[Row], plugins: &[PathBuf]) -> Result<()> {
    let registry = Registry::with_plugins(plugins)?;
    let models = args.configs.iter().map(|config| args.lora.run_model(hf::ModelSource::resolve(config)?.set_keys(&args.overrides)?.model()?)).collect::<Result<Vec<_>>>()?;
    let models: Vec<&dyn Model> = models.iter().map(|m| m.model()).collect();
    let calibration = args.calibration.as_deref().map(plan::Calibration::load).transpose()?;
    let (float8, float8_gathers) = Float8Flags { fp8: args.fp8, gathers: args.fp8_gathers, ..Default::default() }.recipe();
    let settings = BenchSettings {
        calibration: calibration.as_ref(),
        gpu: GpuSpec::of_rows(args.gpu.as_deref())?,
        dtype: args.dtype.kind(tch::Device::Cuda(0)),
        loss_chunk_tokens: args.loss_chunk_tokens,
        shard_group_size: args.shard_group_size,
        float8,
        float8_gathers,
    };
    print!("{}", plan::check_report(rows, &models, &registry, &settings, args.calibration.as_deref())?);
    Ok(())
}

/// Runs one configuration in fresh workers, which get this command's own arguments with one value each.
fn launch_one(args: &BenchArgs, plugins: &[PathBuf], one: &Configuration, result: &Path) -> Result<Row> {
    let one = BenchArgs {
        configs: vec![one.model.clone()],
        strategy: vec![one.strategy.clone()],
        comm: one.comm.iter().cloned().collect(),
        gpus: vec![one.gpus],
        batch: vec![one.batch],
        seq: vec![one.seq],
        result_file: Some(result.into()),
        ..args.clone()
    };
    bench::run_in_workers(&one, one.gpus[0], plugins, result)
}

/// One configuration, run by each of its workers.
fn worker(args: &BenchArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let strategy = (registry.strategy(&args.strategy[0])?.create)();
    let offload = (registry.offload(&args.offload)?.create)();
    // dist.* from FT_DIST__* variables, like every other command.
    let mut overrides = Overrides(vec![("train.device", args.device.to_string().into()), ("train.dtype", args.dtype.to_string().into())]);
    args.lora.set(&mut overrides);
    overrides.set("comm.name", args.comm.first().cloned());
    let options = args.comm_options.iter().map(|o| ft_core::config::parse_comm_option(o).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    let config = Config::load(None, &overrides.0, &options)?;
    let (hook, _) = registry.comm_hook(&config.comm, strategy.as_ref())?;
    let rank = Rank::start(&config, offload.as_ref())?;
    let model = RunModel::new(hf::ModelSource::resolve(&args.configs[0])?.set_keys(&args.overrides)?.model()?, &config.train.lora, config.model.quantization())?;
    let task = registry.task(args.task.as_deref(), model.model().head_kind())?;
    let case = case(args, args.batch[0], args.seq[0]);
    if let Some(row) = bench::run_case(&rank, model.model(), task, strategy.as_ref(), hook, offload.as_ref(), &case)? {
        std::fs::write(args.result_file.as_ref().context("a bench worker is given its result file")?, serde_json::to_string(&row)?)?;
    }
    Ok(0)
}

/// The settings of one configuration of `batch` examples of `seq` tokens.
fn case(args: &BenchArgs, batch: i64, seq: i64) -> BenchCase {
    BenchCase {
        batch,
        seq,
        warmup: args.warmup,
        steps: args.steps,
        shard_group_size: args.shard_group_size,
        reduce_dtype: args.reduce_dtype,
        expert_parallel: args.expert_parallel,
        activation_checkpointing: args.activation_checkpointing,
        checkpoint_layers: args.checkpoint_layers,
        loss_chunk_tokens: args.loss_chunk_tokens,
        breakdown: args.breakdown,
        profile: args.profile.clone(),
        float8: Float8Flags { fp8: args.fp8, ..Default::default() }.recipe().0,
        float8_gathers: args.fp8_gathers,
    }
}
