//! `ft train`: wiring from the configuration to ft_core::fit — data and
//! tokenizer, model, communicator, metrics — and the summary at the end.
//! With no arguments it runs the embedded demo on two local CPU ranks.

use anyhow::{bail, Context, Result};
use clap::Args;
use figment::value::Value;
use ft_core::config::{Config, DEMO};
use ft_core::dataset::Example;
use ft_core::fit::{self, Fit, GenerationEval, Summary};
use ft_core::model::Model;
use ft_core::setup::{DType, DeviceSpec, Rank};
use ft_core::{Communicator, DistEnv, Registry};
use ft_data::{demo, metrics, prompt, squad, text};
use ft_models::{hf, init};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};
use tokenizers::Tokenizer;

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: crate::ConfigFile,
    /// Model directory, hub id in the local cache, config.json, or "demo" (model.source).
    #[arg(long)]
    model: Option<String>,
    /// Training data: SQuAD .json, .jsonl or text (data.train).
    #[arg(long)]
    train_file: Option<PathBuf>,
    /// Evaluation data (data.eval).
    #[arg(long)]
    eval_file: Option<PathBuf>,
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long)]
    max_seq_len: Option<usize>,
    #[arg(long)]
    train_samples: Option<usize>,
    #[arg(long)]
    eval_samples: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    /// Examples per micro-batch on each rank.
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    weight_decay: Option<f64>,
    /// auto, f32, bf16 or fp16 (dynamic loss scaling).
    #[arg(long)]
    dtype: Option<DType>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long)]
    device: Option<DeviceSpec>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    activation_checkpointing: bool,
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Optimizer steps between checkpoints (train.save_every; 0: none).
    #[arg(long)]
    save_every: Option<usize>,
    /// Checkpoints kept (train.save_total_limit; 0: all).
    #[arg(long)]
    save_total_limit: Option<usize>,
    /// Continue from a checkpoint: "latest" or its directory (train.resume).
    #[arg(long)]
    resume: Option<String>,
    /// Local ranks to start when no launcher started this process.
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Sharding strategy (train.strategy): ddp, zero1, shard_grad_op/zero2,
    /// full_shard/zero3, hybrid_shard, or a plug-in's (`ft list`).
    #[arg(long)]
    strategy: Option<String>,
    /// Ranks per shard group (train.shard_group_size; hybrid_shard's default: one node).
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// dtype gradients are reduced in: fp32 or compute (train.reduce_dtype).
    #[arg(long)]
    reduce_dtype: Option<String>,
    /// Where master weights and optimizer state live: none or cpu (train.offload).
    #[arg(long)]
    offload: Option<String>,
    /// Record optimizer steps FIRST:LAST (from 1) with PyTorch's profiler on
    /// rank 0: a Chrome trace and the GPU time per kernel in OUTPUT_DIR/profile
    /// (train.profile_steps).
    #[arg(long, value_name = "FIRST:LAST", value_parser = parse_step_range)]
    profile_steps: Option<[usize; 2]>,
    /// A DeepSpeed ds_config.json; its settings apply under the flags, and
    /// fields ft does not act on are reported.
    #[arg(long)]
    ds_config: Option<PathBuf>,
    /// Print the resolved configuration and the planned run, then stop.
    #[arg(long)]
    dry_run: bool,
}

/// Config overrides from flags: each given flag sets its dotted key.
#[derive(Default)]
struct Overrides(Vec<(&'static str, Value)>);

impl Overrides {
    fn set<T: Into<Value>>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        if let Some(value) = value {
            self.0.push((key, value.into()));
        }
        self
    }

    fn path(&mut self, key: &'static str, value: Option<&PathBuf>) -> &mut Self {
        self.set(key, value.map(|p| p.display().to_string()))
    }

    /// A value the configuration reads with serde (an enum such as a dtype).
    fn serialized<T: serde::Serialize>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        self.set(key, value.map(|v| Value::serialize(v).expect("plain enums serialize")))
    }
}

impl TrainArgs {
    fn overrides(&self) -> Vec<(&'static str, Value)> {
        let mut o = Overrides::default();
        o.set("model.source", self.model.clone())
            .path("data.train", self.train_file.as_ref())
            .path("data.eval", self.eval_file.as_ref())
            .path("data.tokenizer", self.tokenizer.as_ref())
            .set("data.max_seq_len", self.max_seq_len)
            .set("data.train_samples", self.train_samples)
            .set("data.eval_samples", self.eval_samples)
            .set("train.epochs", self.epochs)
            .set("train.batch_size", self.batch_size)
            .set("train.grad_accum", self.grad_accum)
            .set("train.lr", self.lr)
            .set("train.weight_decay", self.weight_decay)
            .serialized("train.dtype", self.dtype)
            .serialized("train.device", self.device)
            .set("train.seed", self.seed)
            .set("train.activation_checkpointing", self.activation_checkpointing.then_some(true))
            .set("train.save_every", self.save_every)
            .set("train.save_total_limit", self.save_total_limit)
            .set("train.resume", self.resume.clone())
            .path("output.dir", self.output_dir.as_ref())
            .set("launch.nproc_per_node", self.nproc_per_node)
            .set("train.strategy", self.strategy.clone())
            .set("train.shard_group_size", self.shard_group_size)
            .set("train.reduce_dtype", self.reduce_dtype.clone())
            .set("train.offload", self.offload.clone())
            .set("train.profile_steps", self.profile_steps.map(|range| range.to_vec()));
        o.0
    }
}

pub fn run(args: TrainArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let deepspeed = args.ds_config.as_deref().map(|path| ft_core::ds_config::read(path, &registry)).transpose()?;
    let mut overrides = deepspeed.as_ref().map(|d| d.overrides.clone()).unwrap_or_default();
    overrides.extend(args.overrides());
    let config = Config::load(args.config.path.as_deref(), &overrides)?;
    validate(&config, &registry)?;
    let env = DistEnv::from_env()?;
    if let Some(deepspeed) = &deepspeed {
        if env.rank == 0 {
            for field in &deepspeed.ignored {
                tracing::warn!("ds_config field not used: {field}");
            }
        }
        if let Some(expected) = deepspeed.train_batch_size {
            let world = planned_world(&config, &env);
            let global = config.train.batch_size * config.train.grad_accum * world;
            if expected != global {
                bail!(
                    "ds_config train_batch_size {expected} != micro-batch {} x grad_accum {} x {world} ranks = {global}",
                    config.train.batch_size,
                    config.train.grad_accum
                );
            }
        }
    }
    if args.dry_run {
        print_plan(&config, &env);
        return Ok(0);
    }
    if env.source == ft_core::env::EnvSource::SingleProcess && config.launch.nproc_per_node > 1 {
        // Not started by a launcher: become one, with the same arguments.
        let arguments: Vec<String> = std::env::args().skip(1).collect();
        return crate::launch::spawn_local(config.launch.nproc_per_node, arguments);
    }
    worker(&config, &registry)
}

fn parse_step_range(text: &str) -> Result<[usize; 2], String> {
    let parse = |part: Option<&str>| part.and_then(|p| p.trim().parse::<usize>().ok());
    let mut parts = text.splitn(2, ':');
    match (parse(parts.next()), parse(parts.next())) {
        (Some(first), Some(last)) => Ok([first, last]),
        _ => Err(format!("{text:?} is not FIRST:LAST, e.g. 10:12")),
    }
}

fn validate(config: &Config, registry: &Registry) -> Result<()> {
    let t = &config.train;
    if t.epochs == 0 || t.batch_size == 0 || t.grad_accum == 0 {
        bail!("train.epochs, train.batch_size and train.grad_accum must be at least 1");
    }
    // Written to refuse NaN too.
    if t.lr.is_nan() || t.lr <= 0.0 {
        bail!("train.lr must be positive (got {})", t.lr);
    }
    if config.data.max_seq_len < 8 {
        bail!("data.max_seq_len must be at least 8 (got {})", config.data.max_seq_len);
    }
    if config.model.source != DEMO && config.data.train.is_none() {
        bail!("set data.train (--train-file) to train {}; only the demo model brings its own data", config.model.source);
    }
    if t.initial_loss_scale.is_nan() || t.initial_loss_scale < 1.0 {
        bail!("train.initial_loss_scale must be at least 1 (got {})", t.initial_loss_scale);
    }
    for sink in &config.output.sinks {
        registry.sink(sink)?;
    }
    let strategy = registry.strategy(&t.strategy)?;
    (strategy.create)().policy().validate(&strategy.name)?;
    registry.offload(&t.offload)?;
    if let Some([first, last]) = t.profile_steps {
        if first == 0 || first > last {
            bail!("train.profile_steps [{first}, {last}]: steps count from 1 and the first comes before or is the last, e.g. [10, 12]");
        }
    }
    Ok(())
}

/// The ranks the run will have: the launcher's world, or the local workers
/// `ft train` is about to start itself.
fn planned_world(config: &Config, env: &DistEnv) -> usize {
    if env.source == ft_core::env::EnvSource::SingleProcess {
        config.launch.nproc_per_node
    } else {
        env.world_size
    }
}

fn print_plan(config: &Config, env: &DistEnv) {
    println!("resolved configuration:\n{}", serde_json::to_string_pretty(config).unwrap_or_default());
    let world = planned_world(config, env);
    let t = &config.train;
    println!(
        "plan: {world} rank(s), strategy {}; micro-batch {} x grad_accum {} x {world} = global batch {}; {} epoch(s); outputs in {}",
        t.strategy,
        t.batch_size,
        t.grad_accum,
        t.batch_size * t.grad_accum * world,
        t.epochs,
        config.output.dir.display()
    );
}

/// Padded lengths round up to this: few shapes on a GPU, exact lengths on a CPU.
fn pad_multiple(config: &Config, device: Device) -> usize {
    config.data.pad_to_multiple_of.unwrap_or(if device == Device::Cpu { 1 } else { 64 })
}

/// Where the model, tokenizer and data come from.
struct Sources {
    model_config: serde_json::Value,
    /// Directory with weights to start from (None: random initialisation).
    weights: Option<PathBuf>,
    tokenizer: PathBuf,
    train: PathBuf,
    eval: Option<PathBuf>,
}

/// The demo's model: a small BLOOM sized to the demo tokenizer.
fn demo_model_config(vocab: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom",
        "hidden_size": 128, "n_layer": 4, "n_head": 4, "vocab_size": vocab,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        "apply_residual_connection_post_layernorm": false, "hidden_dropout": 0.0, "attention_dropout": 0.0
    })
}

fn sources(config: &Config, comm: &Communicator) -> Result<Sources> {
    if config.model.source == DEMO {
        let dir = config.output.dir.join("demo-data");
        if comm.env().rank == 0 {
            demo::write(&dir, 400, 40, config.train.seed)?;
        }
        comm.world().barrier()?.wait()?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
        return Ok(Sources {
            model_config: demo_model_config(tokenizer.get_vocab_size(true)),
            weights: None,
            tokenizer: config.data.tokenizer.clone().unwrap_or(dir.join("tokenizer.json")),
            train: config.data.train.clone().unwrap_or(dir.join("demo-train.json")),
            eval: config.data.eval.clone().or(Some(dir.join("demo-eval.json"))),
        });
    }
    let source = Path::new(&config.model.source);
    let (model_config, dir) = if source.is_file() {
        let text = std::fs::read_to_string(source).with_context(|| format!("cannot read {}", source.display()))?;
        (serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", source.display()))?, None)
    } else {
        let dir = hf::resolve(&config.model.source)?;
        (hf::read_config(&dir)?, Some(dir))
    };
    let tokenizer = match (&config.data.tokenizer, &dir) {
        (Some(path), _) => path.clone(),
        (None, Some(dir)) => dir.join("tokenizer.json"),
        (None, None) => bail!("set data.tokenizer (--tokenizer): {} has no directory to find tokenizer.json in", source.display()),
    };
    Ok(Sources {
        model_config,
        weights: dir,
        tokenizer,
        train: config.data.train.clone().expect("validated"),
        eval: config.data.eval.clone(),
    })
}

fn is_squad(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()) == Some("json")
}

/// Tokenised examples of a file, and its questions when it is SQuAD.
fn load_examples(
    path: &Path,
    tokenizer: &Tokenizer,
    config: &Config,
    limit: Option<usize>,
) -> Result<(Vec<Example>, Vec<squad::QaExample>)> {
    let max_len = config.data.max_seq_len;
    if is_squad(path) {
        let (mut questions, stats) = squad::read(path, config.data.include_unanswerable)?;
        if let Some(limit) = limit {
            questions.truncate(limit);
        }
        let mut examples = vec![];
        let mut too_long = 0;
        for question in &questions {
            match prompt::encode(tokenizer, question, max_len)? {
                Some(example) => examples.push(example),
                None => too_long += 1,
            }
        }
        tracing::info!(
            "{}: {} questions from {} articles ({} unanswerable and {} with bad offsets skipped, {} too long for max_seq_len {max_len})",
            path.display(),
            examples.len(),
            stats.articles,
            stats.unanswerable_skipped,
            stats.bad_offsets_skipped,
            too_long
        );
        Ok((examples, questions))
    } else {
        let documents = text::read_documents(path)?;
        let mut examples = text::pack(tokenizer, &documents, max_len, prompt::eos_id(tokenizer))?;
        if let Some(limit) = limit {
            examples.truncate(limit);
        }
        tracing::info!("{}: {} documents packed into {} sequences of {max_len} tokens", path.display(), documents.len(), examples.len());
        Ok((examples, vec![]))
    }
}

/// EM/F1 by greedy generation on this rank's share of the questions.
struct QaEval<'a> {
    tokenizer: &'a Tokenizer,
    questions: Vec<&'a squad::QaExample>,
    max_seq_len: usize,
    max_new_tokens: usize,
    eos: Option<i64>,
    predictions: BTreeMap<String, String>,
}

impl<'a> QaEval<'a> {
    /// The evaluator of this rank's share of `questions`.
    fn new(tokenizer: &'a Tokenizer, questions: &'a [squad::QaExample], config: &Config, comm: &Communicator) -> QaEval<'a> {
        let (rank, world) = (comm.env().rank, comm.env().world_size);
        QaEval {
            tokenizer,
            questions: questions.iter().skip(rank).step_by(world).collect(),
            max_seq_len: config.data.max_seq_len,
            max_new_tokens: config.train.eval_max_new_tokens,
            eos: prompt::eos_id(tokenizer),
            predictions: BTreeMap::new(),
        }
    }
}

/// Padding uses the tokenizer's pad token, else its end token (never read: no loss, causal).
fn pad_id(tokenizer: &Tokenizer) -> i64 {
    tokenizer.get_padding().map(|p| p.pad_id as i64).or(prompt::eos_id(tokenizer)).unwrap_or(0)
}

impl GenerationEval for QaEval<'_> {
    fn evaluate(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, _epoch: usize) -> Result<(BTreeMap<String, f64>, usize)> {
        let (mut em, mut f1) = (0.0, 0.0);
        let budget = self.max_seq_len.saturating_sub(self.max_new_tokens);
        self.predictions.clear();
        for question in &self.questions {
            let Some(ids) = prompt::prompt_ids(self.tokenizer, question, budget)? else { continue };
            let generated = ft_core::generate::greedy(model, params, &ids, self.max_new_tokens, self.eos, dtype)?;
            let answer_ids: Vec<u32> = generated.iter().filter(|&&t| Some(t) != self.eos).map(|&t| t as u32).collect();
            let text = self.tokenizer.decode(&answer_ids, true).map_err(anyhow::Error::msg)?;
            let answer = text.lines().next().unwrap_or("").trim().to_string();
            let (e, f) = metrics::score(&answer, &question.answers);
            em += e;
            f1 += f;
            self.predictions.insert(question.id.clone(), answer);
        }
        Ok((BTreeMap::from([("em".into(), 100.0 * em), ("f1".into(), 100.0 * f1)]), self.questions.len()))
    }
}

fn worker(config: &Config, registry: &Registry) -> Result<i32> {
    let strategy = (registry.strategy(&config.train.strategy)?.create)();
    let offload = (registry.offload(&config.train.offload)?.create)();
    let Rank { comm, device, dtype } = Rank::start(config, offload.to_host())?;
    let rank = comm.env().rank;
    if rank == 0 {
        std::fs::create_dir_all(&config.output.dir).with_context(|| format!("cannot create {}", config.output.dir.display()))?;
    }
    let sources = sources(config, &comm)?;
    let tokenizer = Tokenizer::from_file(&sources.tokenizer)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", sources.tokenizer.display()))?;
    let model = hf::model_from_config(sources.model_config.clone())?;
    let tokens = tokenizer.get_vocab_size(true);
    if tokens as i64 > model.dims().vocab {
        // Token ids past the embedding would fail deep inside a GPU kernel.
        bail!(
            "tokenizer {} has {tokens} tokens but the model's vocab_size is {}: use the model's own tokenizer",
            sources.tokenizer.display(),
            model.dims().vocab
        );
    }
    let params = match &sources.weights {
        Some(dir) if dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists() => {
            hf::load_params(model.as_ref(), dir, Kind::Float, device)?
        }
        _ => init::init_params(model.as_ref(), config.train.seed as i64, Kind::Float, device),
    };
    let (train, _) = load_examples(&sources.train, &tokenizer, config, config.data.train_samples)?;
    let (eval, questions) = match &sources.eval {
        Some(path) => load_examples(path, &tokenizer, config, config.data.eval_samples)?,
        None => (vec![], vec![]),
    };
    let pad_id = pad_id(&tokenizer);
    let world = comm.env().world_size;
    let mut qa_eval = QaEval::new(&tokenizer, &questions, config, &comm);
    let sinks = if rank == 0 {
        let append = config.train.resume.is_some();
        config.output.sinks.iter().map(|name| (registry.sink(name)?.create)(&config.output.dir, append)).collect::<Result<Vec<_>>>()?
    } else {
        vec![]
    };
    let progress = indicatif::ProgressBar::new(0);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} [{elapsed} < {eta}]").expect("template"),
    );
    if rank != 0 {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut on_step = |step: usize, total: usize, record: &ft_core::metrics::Record| {
        progress.set_length(total as u64);
        progress.set_position(step as u64);
        progress.set_message(format!("loss {:.4} lr {:.2e}", record.values["loss"], record.values["lr"]));
    };
    if rank == 0 {
        tracing::info!(
            "training a {}M-parameter {} on {} examples, {world} rank(s), {:?}, {:?}",
            model.numel() as f64 / 1e6,
            model.model_type(),
            train.len(),
            device,
            dtype
        );
    }
    let fit = Fit {
        model: model.as_ref(),
        comm: &comm,
        strategy: strategy.as_ref(),
        offload: offload.as_ref(),
        train: &train,
        eval: &eval,
        config: &config.train,
        dtype,
        pad_id,
        pad_to_multiple_of: pad_multiple(config, device),
        sinks,
        generation_eval: if questions.is_empty() { None } else { Some(&mut qa_eval) },
        on_step: Some(&mut on_step),
        checkpoints: fit::CheckpointPlan {
            output: &config.output.dir,
            model_config: &sources.model_config,
            tokenizer: Some(&sources.tokenizer),
        },
    };
    let (summary, final_params) = fit::run(fit, params)?;
    progress.finish_and_clear();
    write_predictions(config, &comm, &qa_eval.predictions)?;
    if rank == 0 {
        let final_dir = config.output.dir.join("final");
        hf::save(model.as_ref(), &final_params, &final_dir, Kind::Float)?;
        std::fs::copy(&sources.tokenizer, final_dir.join("tokenizer.json"))?;
        std::fs::write(config.output.dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
        print!("{}", summary_table(&summary));
        println!(
            "outputs in {}: final/ (Hugging Face model + tokenizer), summary.json, predictions.json, {}",
            config.output.dir.display(),
            config.output.sinks.iter().map(|s| format!("metrics.{s}")).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(0)
}

/// Each rank writes its predictions; rank 0 merges them into the official `{id: answer}` file.
fn write_predictions(config: &Config, comm: &Communicator, mine: &BTreeMap<String, String>) -> Result<()> {
    let dir = &config.output.dir;
    let rank = comm.env().rank;
    std::fs::write(dir.join(format!("predictions.rank{rank}.json")), serde_json::to_string(mine)?)?;
    comm.world().barrier()?.wait()?;
    if rank == 0 {
        let mut all: BTreeMap<String, String> = BTreeMap::new();
        for r in 0..comm.env().world_size {
            let part = dir.join(format!("predictions.rank{r}.json"));
            all.extend(serde_json::from_str::<BTreeMap<String, String>>(&std::fs::read_to_string(&part)?)?);
            std::fs::remove_file(part)?;
        }
        std::fs::write(dir.join("predictions.json"), serde_json::to_string_pretty(&all)?)?;
    }
    Ok(())
}

pub fn summary_table(s: &Summary) -> String {
    let mut out = String::from("\n== ft train summary ==\n");
    let row = |name: &str, value: String| format!("{name:<28} {value}\n");
    out += &row("ranks / device", format!("{} / {}", s.world_size, s.device));
    out += &row("strategy", format!("{} (shard group of {})", s.strategy, s.shard_group_size));
    out += &row("final train loss", format!("{:.4}", s.final_train_loss));
    for e in &s.epochs {
        let scores: Vec<String> = e.scores.iter().map(|(k, v)| format!("{} {v:.1}", k.to_uppercase())).collect();
        out += &row(
            &format!("epoch {}", e.epoch),
            format!(
                "train loss {:.4}, eval loss {}{}",
                e.train_loss,
                e.eval_loss.map_or("n/a".into(), |l| format!("{l:.4}")),
                if scores.is_empty() { String::new() } else { format!(", {}", scores.join(", ")) }
            ),
        );
    }
    out += &row("steps per epoch", s.steps_per_epoch.to_string());
    out += &row("train samples/s", format!("{:.1}", s.train_samples_per_s));
    out += &row("train tokens/s", format!("{:.0}", s.train_tokens_per_s));
    out += &row("eval samples/s", s.eval_samples_per_s.map_or("n/a".into(), |v| format!("{v:.1}")));
    out += &row("MFU", s.mfu.map_or("n/a (CPU)".into(), |m| format!("{:.1}%", m * 100.0)));
    out += &row(
        "GPU utilisation",
        s.gpu_utilisation_per_rank.as_ref().map_or("n/a (no NVML or no GPU)".into(), |u| {
            u.iter().enumerate().map(|(r, u)| format!("rank {r} {u:.0}%")).collect::<Vec<_>>().join(", ")
        }),
    );
    for (rank, m) in s.memory_per_rank.iter().enumerate() {
        out += &row(
            &format!("memory rank {rank} ({})", s.memory_kind),
            format!("peak {:.2} GB, mean {:.2} GB, min {:.2} GB", m.peak / 1e9, m.mean / 1e9, m.min / 1e9),
        );
    }
    if let Some(o) = &s.offload {
        out += &row(
            "offload (rank 0)",
            format!(
                "waited {:.2} s for the device, host optimizer {:.2} s, moved {:.2} GB to host and {:.2} GB to device",
                o.wait_seconds,
                o.cpu_step_seconds,
                o.device_to_host_bytes / 1e9,
                o.host_to_device_bytes / 1e9
            ),
        );
    }
    for (rank, m) in s.state_per_rank.iter().enumerate() {
        out += &row(
            &format!("state held rank {rank}"),
            format!(
                "params {:.1} MB, grads {:.1} MB, optimizer {:.1} MB, gathered peak {:.1} MB, of which in host memory {:.1} MB",
                m.params / 1e6,
                m.grads / 1e6,
                m.optimizer_state / 1e6,
                m.gathered_peak / 1e6,
                m.host / 1e6
            ),
        );
    }
    out
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint directory, or "latest" in --output-dir.
    #[arg(long)]
    checkpoint: String,
    /// The run's output directory (where "latest" is looked for).
    #[arg(long, default_value = "ft-output")]
    output_dir: PathBuf,
    /// The Hugging Face directory to write (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    out: PathBuf,
    /// Weight dtype on disk: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
}

pub fn export(args: ExportArgs) -> Result<i32> {
    let dir = ft_core::checkpoint::resolve(&args.checkpoint, &args.output_dir)?;
    let manifest = ft_core::checkpoint::read_manifest(&dir)?;
    let model = hf::model_from_config(manifest.model_config.clone())?;
    let params = ft_core::checkpoint::load_params(&dir, model.as_ref())?;
    hf::save(model.as_ref(), &params, &args.out, args.dtype.storage_kind())?;
    if dir.join("tokenizer.json").exists() {
        std::fs::copy(dir.join("tokenizer.json"), args.out.join("tokenizer.json"))?;
    }
    println!("exported step {} of {} to {}", manifest.step, dir.display(), args.out.display());
    Ok(0)
}

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub config: crate::ConfigFile,
    /// Model directory (weights and tokenizer.json), e.g. a run's final/.
    #[arg(long)]
    model: String,
    /// SQuAD JSON (loss, EM and F1) or text/JSONL (loss).
    #[arg(long)]
    eval_file: PathBuf,
    #[arg(long)]
    eval_samples: Option<usize>,
    #[arg(long)]
    max_seq_len: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    dtype: Option<DType>,
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// Where predictions.json goes.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    #[arg(long)]
    nproc_per_node: Option<usize>,
}

pub fn eval(args: EvalArgs) -> Result<i32> {
    let mut overrides = Overrides::default();
    overrides
        .set("model.source", Some(args.model.clone()))
        .path("data.eval", Some(&args.eval_file))
        .set("data.eval_samples", args.eval_samples)
        .set("data.max_seq_len", args.max_seq_len)
        .set("train.batch_size", args.batch_size)
        .serialized("train.dtype", args.dtype)
        .serialized("train.device", args.device)
        .path("output.dir", args.output_dir.as_ref())
        .set("launch.nproc_per_node", args.nproc_per_node);
    let overrides = overrides.0;
    let config = Config::load(args.config.path.as_deref(), &overrides)?;
    let env = DistEnv::from_env()?;
    if env.source == ft_core::env::EnvSource::SingleProcess && config.launch.nproc_per_node > 1 {
        return crate::launch::spawn_local(config.launch.nproc_per_node, std::env::args().skip(1).collect());
    }
    let Rank { comm, device, dtype } = Rank::start(&config, false)?;
    let dir = hf::resolve(&config.model.source)?;
    let tokenizer_path = config.data.tokenizer.clone().unwrap_or(dir.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tokenizer_path.display()))?;
    let model = hf::load_model(&dir)?;
    let params = hf::load_params(model.as_ref(), &dir, dtype, device)?;
    let (examples, questions) = load_examples(&args.eval_file, &tokenizer, &config, config.data.eval_samples)?;
    let set = fit::EvalSet {
        examples: &examples,
        batch_size: config.train.batch_size,
        pad_id: pad_id(&tokenizer),
        pad_to_multiple_of: pad_multiple(&config, device),
        dtype,
        loss_chunk_tokens: config.train.loss_chunk_tokens,
    };
    let loss = fit::eval_loss(model.as_ref(), &params, &set, &comm)?;
    let rank = comm.env().rank;
    let mut qa_eval = QaEval::new(&tokenizer, &questions, &config, &comm);
    let scores = if questions.is_empty() {
        BTreeMap::new()
    } else {
        fit::generation_scores(&mut qa_eval, model.as_ref(), &params, dtype, 0, &comm)?.0
    };
    if rank == 0 {
        std::fs::create_dir_all(&config.output.dir)?;
    }
    comm.world().barrier()?.wait()?;
    write_predictions(&config, &comm, &qa_eval.predictions)?;
    if rank == 0 {
        let scores: Vec<String> = scores.iter().map(|(k, v)| format!("{} {v:.2}", k.to_uppercase())).collect();
        println!("{}: eval loss {loss:.4} over {} examples{}", args.eval_file.display(), examples.len(),
            if scores.is_empty() { String::new() } else { format!(", {}", scores.join(", ")) });
    }
    Ok(0)
}
