//! `ft train`: flags → configuration → the parts of a run (rank, model,
//! task, sinks) → ft_core::fit. With no arguments: the embedded demo.

use crate::args::{LoraArgs, RankArgs, Settings};
use ft_core::config::{parse_named, ModelInit, Overrides};
use anyhow::Result;
use clap::Args;
use ft_core::{Config, Registry};
use ft_core::distributed::launch;
use ft_core::env::DistEnv;
use ft_core::fit::{self, CheckpointPlan, Fit};
use ft_core::plan;
use ft_core::run_dir;
use ft_core::setup::{self, Rank};
use ft_core::task::TaskInputs;
use ft_core::lora::RunModel;
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct TrainArgs {
    /// Model directory (with its safetensors weights), hub id in the local cache, config.json (random weights), or a preset: "demo", "arithmetic" (online RL), `ft list` (model.source).
    #[arg(long)]
    model: Option<String>,
    /// What the parameters start from: pretrained (the model directory's weights, which it must hold) or random (model.init).
    #[arg(long, value_name = "pretrained|random", value_parser = parse_named::<ModelInit>)]
    init: Option<ModelInit>,
    /// What to train (task.name; `ft list`): default, the task for the model's head.
    #[arg(long)]
    task: Option<String>,
    /// A reward function of online RL (--task grpo or rloo): FILE.py:FUNCTION, called as TRL calls one, or a built-in: accuracy, format, length (task.rewards); repeatable.
    #[arg(long, value_name = "FILE.py:FUNCTION|NAME")]
    reward: Vec<String>,
    /// Training data: SQuAD .json, JSON lines or a JSON array, Parquet, Arrow (a file, a glob, a dataset directory) or text (data.train); repeated: a mixture of them (data.mixture).
    #[arg(long)]
    train_file: Vec<PathBuf>,
    /// Evaluation data (data.eval).
    #[arg(long)]
    eval_file: Option<PathBuf>,
    /// Several training examples in one row of max_seq_len tokens, each kept to itself (data.packing).
    #[arg(long)]
    packing: bool,
    #[arg(long)]
    train_samples: Option<usize>,
    #[arg(long)]
    eval_samples: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    /// Stop after N optimizer steps, instead of a number of epochs; the learning-rate schedule spans them (train.max_steps).
    #[arg(long, value_name = "N")]
    max_steps: Option<usize>,
    /// Examples per micro-batch on each rank.
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    weight_decay: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    activation_checkpointing: bool,
    /// Recompute only the first N blocks, keeping the others' activations (train.checkpoint_layers; `ft plan` finds the fewest that fit).
    #[arg(long, value_name = "N", requires = "activation_checkpointing")]
    checkpoint_layers: Option<usize>,
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// A run that does not resume may replace a previous run's outputs in
    /// the output directory (output.overwrite); otherwise it is refused there.
    #[arg(long)]
    overwrite_output_dir: bool,
    /// Where metrics go: sinks by name, comma-separated, e.g. mlflow,tensorboard (output.report_to; `ft list`).
    #[arg(long, value_delimiter = ',')]
    report_to: Option<Vec<String>>,
    /// Optimizer steps between checkpoints (train.save_every; 0: none).
    #[arg(long)]
    save_every: Option<usize>,
    /// Checkpoints kept (train.save_total_limit; 0: all).
    #[arg(long)]
    save_total_limit: Option<usize>,
    /// Continue from a checkpoint: "latest", its directory, or "auto" (latest if any) (train.resume).
    #[arg(long)]
    resume: Option<String>,
    /// Sharding strategy (train.strategy): ddp, zero1, shard_grad_op/zero2,
    /// full_shard/zero3, hybrid_shard, a plug-in's (`ft list`), or auto:
    /// `ft plan`'s fastest that fits, with its offload and activation checkpointing.
    #[arg(long)]
    strategy: Option<String>,
    /// Ranks that split a mixture of experts' experts between them (train.expert_parallel; default 1).
    #[arg(long)]
    expert_parallel: Option<usize>,
    /// Ranks per shard group (train.shard_group_size; hybrid_shard's default: one node).
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// dtype gradients are reduced in: fp32 or compute (train.reduce_dtype).
    #[arg(long)]
    reduce_dtype: Option<String>,
    /// Float8 linear layers in the blocks: off, tensorwise or rowwise, torchao's
    /// recipes (train.fp8); a GPU of compute capability 8.9+ (Ada, Hopper), or
    /// anywhere with --set train.fp8_emulate=true (fp32 emulation, for tests).
    #[arg(long, value_name = "off|tensorwise|rowwise")]
    fp8: Option<String>,
    /// Where master weights and optimizer state live: none or cpu (train.offload).
    #[arg(long)]
    offload: Option<String>,
    /// How gradients are reduced and parameters gathered: a communication
    /// plug-in (`ft list`), options as --set comm.NAME.KEY=VALUE (comm.name;
    /// default: the strategy's own collectives).
    #[arg(long)]
    comm: Option<String>,
    /// Record optimizer steps FIRST:LAST (from 1) with PyTorch's profiler on
    /// rank 0: a Chrome trace and the GPU time per kernel in OUTPUT_DIR/profile
    /// (train.profile_steps).
    #[arg(long, value_name = "FIRST:LAST", value_parser = ft_core::units::parse_step_range)]
    profile_steps: Option<[usize; 2]>,
    /// A DeepSpeed ds_config.json; its settings apply under the flags, and
    /// fields ft does not act on are reported.
    #[arg(long)]
    ds_config: Option<PathBuf>,
    /// Print the resolved configuration and the planned run, then stop.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    lora: LoraArgs,
    #[command(flatten)]
    settings: Settings,
    #[command(flatten)]
    ranks: RankArgs,
}

impl TrainArgs {
    fn set(&self, o: &mut Overrides) {
        o.set("model.source", self.model.clone())
            .serialized("model.init", self.init)
            .set("task.name", self.task.clone())
            .set("task.rewards", (!self.reward.is_empty()).then(|| self.reward.clone()))
            .train_files(&self.train_file)
            .path("data.eval", self.eval_file.as_ref())
            .set("data.packing", self.packing.then_some(true))
            .set("data.train_samples", self.train_samples)
            .set("data.eval_samples", self.eval_samples)
            .set("train.epochs", self.epochs)
            .set("train.max_steps", self.max_steps)
            .set("train.batch_size", self.batch_size)
            .set("train.grad_accum", self.grad_accum)
            .set("train.lr", self.lr)
            .set("train.weight_decay", self.weight_decay)
            .set("train.seed", self.seed)
            .set("train.activation_checkpointing", self.activation_checkpointing.then_some(true))
            .set("train.checkpoint_layers", self.checkpoint_layers)
            .set("train.save_every", self.save_every)
            .set("train.save_total_limit", self.save_total_limit)
            .set("train.resume", self.resume.clone())
            .path("output.dir", self.output_dir.as_ref())
            .set("output.overwrite", self.overwrite_output_dir.then_some(true))
            .set("output.report_to", self.report_to.clone())
            .set("train.strategy", self.strategy.clone())
            .set("train.shard_group_size", self.shard_group_size)
            .set("train.expert_parallel", self.expert_parallel)
            .set("train.reduce_dtype", self.reduce_dtype.clone())
            .set("train.fp8", self.fp8.clone())
            .set("train.offload", self.offload.clone())
            .set("comm.name", self.comm.clone())
            .set("train.profile_steps", self.profile_steps.map(|range| range.to_vec()));
        self.ranks.set(o);
        self.lora.set(o);
    }
}

pub fn run(args: TrainArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let deepspeed = args.ds_config.as_deref().map(|path| ft_core::ds_config::read(path, &registry)).transpose()?;
    let mut overrides = Overrides(deepspeed.as_ref().map(|d| d.overrides.clone()).unwrap_or_default());
    args.set(&mut overrides);
    // Every key is one of `ft train`'s.
    let config = args.settings.load(overrides, "ft train", None)?;
    let env = DistEnv::from_env()?;
    let (world, per_node) = setup::planned_ranks(&config, &env);
    setup::validate(&config, &registry, world, per_node)?;
    setup::check_float8_devices(&config, &env)?;
    hf::check_before_ranks(&config, world)?;
    if let Some(deepspeed) = &deepspeed {
        deepspeed.check(&config.train, world, env.rank == 0)?;
    }
    if args.dry_run {
        let comm = setup::check_comm_hook(&config, &registry, world, per_node)?;
        println!("resolved configuration:\n{}\n{}\n{comm}", serde_json::to_string_pretty(&config)?, config.plan(world));
        return Ok(0);
    }
    if let Some(workers) = setup::local_workers(&config, &env) {
        // Not started by a launcher: become one, with the same arguments.
        let run = || worker(config.clone(), &registry, &DistEnv::from_env()?);
        return launch::spawn_local(workers, launch::Work::Fork { run: &run, arguments: std::env::args().skip(1).collect() });
    }
    worker(config, &registry, &env)
}

fn worker(mut config: Config, registry: &Registry, env: &DistEnv) -> Result<i32> {
    let (_output_lock, resumed_step) = run_dir::claim_for_run(&config, env.rank)?;
    let configured_offload = (registry.offload(&config.train.offload)?.create)();
    let rank = Rank::start(&config, configured_offload.as_ref())?;
    // Rank 0's lock made the directory.
    let output = config.output.dir.clone();
    let source = hf::ModelSource::of_run(&mut config, &rank.comm)?;
    let tokenizer = source.tokenizer(config.data.tokenizer.as_deref())?;
    let run_model = RunModel::new(source.model()?, &config.train.lora, config.model.quantization())?;
    let model = run_model.model();
    setup::check_expert_parallel(config.train.expert_parallel, rank.world_size(), model)?;
    let mut task = registry.build_task(config.task.name.as_deref(), &TaskInputs { config: &config, tokenizer: &tokenizer, model, device: rank.device })?;
    // `--strategy auto` takes the plan's choice; on a GPU, running out of memory is explained with it.
    let rollout = task.rollouts().map(|rollouts| plan::RolloutShape::of_run(&config, rollouts));
    let prediction = plan::for_run(&rank.comm, model, &mut config, rank.dtype, registry, task.reference().as_ref(), rollout)?;
    let strategy = (registry.strategy(&config.train.strategy)?.create)();
    let comm_hook = registry.comm_hook(&config.comm, strategy.as_ref())?;
    let offload = (registry.offload(&config.train.offload)?.create)();
    rank.share_cores_with(offload.as_ref(), configured_offload.as_ref())?;
    let seed = config.train.seed as i64;
    let start = source.start(config.model.init)?;
    if let (hf::Start::Random(why), 0) = (&start, rank.rank()) {
        tracing::info!("random initialisation (train.seed {seed}): {why}");
    }
    let base_dir = hf::base_weights_dir(&run_model, &start, seed, rank.device, &output, rank.dtype, &rank.comm)?;
    let params = hf::StartingParams::new(&run_model, &start, seed, rank.device)?;
    let sinks = if rank.rank() == 0 { registry.create_sinks(config.output.sinks()?, &output, resumed_step)? } else { vec![] };
    rank.log_run(task.as_ref(), &run_model, config.train.expert_parallel);
    let model_files = ft_models::trained::model_files(&tokenizer, config.data.chat_template.as_deref(), source.files_dir().as_deref());
    let fit = Fit {
        model: &run_model,
        task: task.as_mut(),
        comm: &rank.comm,
        strategy: strategy.as_ref(),
        comm_hook,
        offload: offload.as_ref(),
        config: &config.train,
        data: &config.data,
        dtype: rank.dtype,
        sinks,
        resolved_config: config.flattened()?,
        checkpoints: CheckpointPlan { output: &output, model_config: &source.config, model_files: &model_files, base_model: base_dir.as_deref() },
        float8_kept: plan::float8_kept(model, &config)?,
    };
    let trained = match fit::run(fit, params) {
        Err(error) if error.is::<fit::Interrupted>() => return Ok(fit::Interrupted::exit_code(&error, rank.rank())),
        trained => trained.map_err(|error| match &prediction {
            Some(prediction) => plan::explain_out_of_memory(error, prediction, strategy.name(), offload.name(), &config.train),
            None => error,
        })?,
    };
    let Some((summary, final_params)) = trained else { return Ok(0) };
    if rank.rank() == 0 {
        let mut written = vec![ft_models::trained::write_final(&output, &run_model, &final_params, base_dir.as_deref(), &model_files, &source.config)?];
        written.extend(task.write_predictions(&output)?);
        run_dir::finish(&output, &summary, written, config.output.sinks()?)?;
    }
    Ok(0)
}
