//! The run's configuration, layered with figment: defaults ← a preset
//! (when `model.source` names one, e.g. the embedded demo) ← config file
//! (TOML, YAML or JSON) ← `FT_*` environment ← command-line flags. Unknown
//! keys are errors that name the key, where it came from, and the closest
//! known key; `task.*` keys belong to the task, which checks them.

use crate::device::{DType, DeviceSpec};
use crate::distributed::comm::Backend;
use anyhow::{bail, Result};
use figment::providers::{Env, Format, Json, Serialized, Toml, Yaml};
use figment::value::Value;
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub dist: DistConfig,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub output: OutputConfig,
    pub launch: LaunchConfig,
    pub task: TaskConfig,
    pub comm: CommConfig,
    /// The dotted keys the user's layers (file, `FT_*` variables, flags,
    /// `--set`) give, sections included: what a check may call "given".
    #[serde(skip)]
    given: BTreeSet<String>,
}

/// How gradients are reduced and parameters gathered: a communication
/// plug-in by name (`--comm`, `ft list`) and each plug-in's options as
/// `comm.NAME.KEY` (`--set comm.powersgd.rank=4`), which the registry
/// checks against what the plug-in declares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct CommConfig {
    /// None: the strategy's own communication (the built-in collectives unless it brings a hook).
    pub name: Option<String>,
    #[serde(flatten)]
    pub options: serde_json::Map<String, serde_json::Value>,
}

/// The model to fine-tune.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A Hugging Face model directory, a hub id in the local cache, a
    /// config.json (random weights), or a preset's name (`ft list`); by
    /// default the default preset (the embedded demo).
    pub source: String,
    /// Where the parameters start (`--init`): a directory's weights, which
    /// it must hold, or a random initialisation, said in the log.
    pub init: ModelInit,
    /// Hold a LoRA run's frozen blocks in 4 bits (`--quantize`: QLoRA),
    /// as bitsandbytes' `bnb_4bit_quant_type`: none, nf4 or fp4.
    pub quantize: Quantize,
    /// Values per 4-bit block, each with its own absmax (bitsandbytes' blocksize).
    pub quant_blocksize: i64,
    /// Quantize the blocks' absmaxes to 8 bits too (bitsandbytes'
    /// `bnb_4bit_use_double_quant`; QLoRA's recipe).
    pub double_quant: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            source: String::new(),
            init: ModelInit::default(),
            quantize: Quantize::None,
            quant_blocksize: crate::nf4::DEFAULT_BLOCKSIZE,
            double_quant: true,
        }
    }
}

/// `model.quantize`: the 4-bit format of a LoRA run's frozen base, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Quantize {
    #[default]
    None,
    Nf4,
    Fp4,
}

impl ModelConfig {
    /// The frozen base's quantization; None when `model.quantize` is none.
    pub fn quantization(&self) -> Option<crate::nf4::Quantization> {
        let quant_type = match self.quantize {
            Quantize::None => return None,
            Quantize::Nf4 => crate::nf4::QuantType::Nf4,
            Quantize::Fp4 => crate::nf4::QuantType::Fp4,
        };
        Some(crate::nf4::Quantization { quant_type, blocksize: self.quant_blocksize, double_quant: self.double_quant })
    }
}

/// `model.init`: what the run's parameters start from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelInit {
    /// A directory's weights; random for a config.json alone or a preset.
    #[default]
    Auto,
    /// The weights of `model.source`, which must be a directory that holds them.
    Pretrained,
    /// Random from `train.seed`, whatever `model.source` holds.
    Random,
}

/// What the run trains: a task by name (`ft list`), by default the one
/// registered for the model's head, and the task's own keys, which the task
/// reads and checks (e.g. `task.max_new_tokens`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct TaskConfig {
    pub name: Option<String>,
    #[serde(flatten)]
    pub options: serde_json::Map<String, serde_json::Value>,
}

/// Settings a plug-in bundles under a model name (the embedded demos): they
/// apply between the defaults and the user's layers when `model.source` is
/// that name; the `default` preset is the model when none is set. A preset
/// brings its own files and model (`setup::prepare_preset`).
pub struct PresetRegistration {
    pub name: &'static str,
    pub summary: &'static str,
    pub default: bool,
    pub values: fn() -> serde_json::Value,
    /// Writes the preset's files (data, tokenizer) into a directory it creates, from `train.seed`.
    pub write_files: fn(&Path, u64) -> anyhow::Result<()>,
    /// Points the configuration at the files in that directory (where the
    /// user gave none of their own) and returns the model's config.json.
    pub configure: fn(&mut Config, &Path) -> anyhow::Result<serde_json::Value>,
}
inventory::collect!(PresetRegistration);

/// The preset `model.source` names (or the default preset when it is unset).
pub fn preset(source: Option<&str>) -> Option<&'static PresetRegistration> {
    inventory::iter::<PresetRegistration>.into_iter().find(|p| match source {
        Some(name) => p.name == name,
        None => p.default,
    })
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A data source: SQuAD JSON (.json), JSONL or a JSON array of rows,
    /// Parquet or Arrow (a file, a glob, or a dataset directory: the Hub's
    /// `data/train-*.parquet`, `save_to_disk`'s), or plain text. Rows hold
    /// `text`, `prompt`/`completion`, `messages`, ShareGPT's `conversations`
    /// or Alpaca's `instruction`/`output`.
    pub train: Option<std::path::PathBuf>,
    /// SQuAD JSON for eval loss and EM/F1 (or text/JSONL for eval loss only).
    pub eval: Option<std::path::PathBuf>,
    /// tokenizer.json (default: the model directory's).
    pub tokenizer: Option<std::path::PathBuf>,
    pub max_seq_len: usize,
    /// Use the first N training examples (None: all); with `range`, the first N of the range.
    pub train_samples: Option<usize>,
    /// Train on the training file's examples [start, end) in file order
    /// (`"5000:10000"`, `"5000:"` to the end): one slice of a large file,
    /// the next resumed from its checkpoint (README, "Data slices").
    pub range: Option<DataRange>,
    /// Visit the training examples in a new seeded order each epoch; false: in file order.
    pub shuffle: bool,
    pub eval_samples: Option<usize>,
    /// Round padded lengths up to a multiple of this (default: 64 on GPU, 1 on CPU).
    pub pad_to_multiple_of: Option<usize>,
    /// How the files read: by default detected from their content.
    pub format: DataFormat,
    /// Which tokens of chat and prompt/completion examples carry the loss.
    pub train_on: TrainOn,
    /// Cut a conversation or prompt/completion longer than max_seq_len to
    /// max_seq_len instead of skipping it.
    pub truncate: bool,
    /// A Jinja chat template file, instead of the tokenizer's own.
    pub chat_template: Option<std::path::PathBuf>,
    /// Several training examples in one row of max_seq_len tokens, kept
    /// apart (positions restart, attention stays inside each): causal LMs.
    pub packing: bool,
    /// Leave out each epoch's last global batch when the examples do not
    /// fill it (the run logs how many); false: train it, split among the
    /// ranks as evenly as they allow (it needs an example for each rank).
    pub drop_last: bool,
    /// The split of a dataset directory to train on (a `DatasetDict`'s, the
    /// Hub's `data/{split}-*.parquet`); default: the only one, else `train`.
    pub split: Option<String>,
    /// The split `data.eval` reads; default: the only one, else
    /// `validation`, `valid`, `dev` or `test`, whichever it has.
    pub eval_split: Option<String>,
    /// The names the formats read (`text`, `prompt`, `messages`, …) given to
    /// other columns of the file: `columns.text = "abstract"`.
    pub columns: BTreeMap<String, String>,
    /// Several training sources interleaved in a seeded order, instead of
    /// `train` (several `--train-file`s).
    pub mixture: Vec<MixtureSource>,
}

/// One source of `data.mixture`: its own path, format, split and columns
/// (by default `data.*`'s) and its share: `weight` (of the examples the
/// weighted sources hold together) or `samples` (examples); neither: each
/// of its examples once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixtureSource {
    pub path: std::path::PathBuf,
    #[serde(default)]
    pub format: DataFormat,
    pub weight: Option<f64>,
    pub samples: Option<usize>,
    pub split: Option<String>,
    #[serde(default)]
    pub columns: BTreeMap<String, String>,
}

/// `data.range`: the training file's examples [start, end) in the order
/// the file holds them. What an example is depends on the format: a SQuAD
/// question, a JSONL line, a packed text sequence (README, "Data slices").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataRange {
    pub start: usize,
    /// None: to the end of the file.
    pub end: Option<usize>,
}

impl DataRange {
    /// Whether the example at `position` in the file is in the range.
    pub fn contains(&self, position: usize) -> bool {
        position >= self.start && self.end.is_none_or(|end| position < end)
    }

    /// The positions the range takes of a file of `len` examples; a range
    /// that leaves the file, or takes nothing of it, is an error saying how
    /// many `examples` (e.g. "questions") `file` has.
    pub fn positions(&self, len: usize, file: &Path, examples: &str) -> Result<std::ops::Range<usize>> {
        let end = self.end.unwrap_or(len);
        if self.start >= len || end > len {
            bail!(
                "data.range {self} is not within {}: it has {len} {examples} (data.range takes START:END of them, counted from 0)",
                file.display()
            );
        }
        Ok(self.start..end)
    }

    /// What the range takes of `file`'s `total` `examples`, for the log.
    pub fn describe(&self, total: usize, file: &Path, examples: &str) -> String {
        let last = self.end.unwrap_or(total).saturating_sub(1);
        format!("{}: data.range {self} takes {examples} {} to {last} of its {total}", file.display(), self.start)
    }

    /// The items of `all` (a file's examples in order) in the range; an
    /// error as [`DataRange::positions`] says.
    pub fn select<T>(&self, mut all: Vec<T>, file: &Path, examples: &str) -> Result<Vec<T>> {
        let positions = self.positions(all.len(), file, examples)?;
        all.truncate(positions.end);
        all.drain(..positions.start);
        Ok(all)
    }
}

impl std::str::FromStr for DataRange {
    type Err = String;
    fn from_str(text: &str) -> std::result::Result<DataRange, String> {
        let malformed = || format!("{text:?} is not START:END: {RANGE_FORM}");
        let (start, end) = text.split_once(':').ok_or_else(malformed)?;
        let number = |part: &str| part.trim().parse::<usize>().map_err(|_| malformed());
        let start = if start.trim().is_empty() { 0 } else { number(start)? };
        let end = if end.trim().is_empty() { None } else { Some(number(end)?) };
        if let Some(end) = end.filter(|&end| end <= start) {
            return Err(format!("{text:?} takes no example: END ({end}) must be greater than START ({start})"));
        }
        Ok(DataRange { start, end })
    }
}

/// How `data.range` is written, for its error messages.
const RANGE_FORM: &str = "the training file's examples START to END (END not included, counted from 0), e.g. \"5000:10000\", or \"5000:\" to the end of the file";

impl std::fmt::Display for DataRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.end {
            Some(end) => write!(f, "{}:{end}", self.start),
            None => write!(f, "{}:", self.start),
        }
    }
}

impl Serialize for DataRange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DataRange {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<DataRange, D::Error> {
        struct RangeText;
        impl serde::de::Visitor<'_> for RangeText {
            type Value = DataRange;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "START:END, {RANGE_FORM}")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> std::result::Result<DataRange, E> {
                text.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(RangeText)
    }
}

/// What a data file's rows (or text) hold (`data.format`); where they come
/// from (JSONL, Parquet, Arrow, …) is read from the file itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// SQuAD for a SQuAD .json file; for rows, the keys of the first; else plain text.
    #[default]
    Auto,
    Squad,
    /// Plain text or rows `{"text": …}`, packed.
    Text,
    /// Rows `{"prompt": …, "completion": …}`: strings (the loss on the
    /// completion), or message lists as TRL's conversational
    /// prompt/completion (rendered with the chat template).
    PromptCompletion,
    /// Rows `{"messages": [{"role", "content"}, …], "tools": […]}`, rendered with the chat template.
    Chat,
    /// ShareGPT's `{"conversations": [{"from", "value"}, …]}`, roles mapped as axolotl maps them.
    Sharegpt,
    /// Alpaca's `{"instruction", "input", "output"}` in the Stanford Alpaca prompt, the loss on the output.
    Alpaca,
    /// TRL's preference rows `{"prompt", "chosen", "rejected"}` (strings or
    /// message lists; without `prompt`, the one `chosen` and `rejected`
    /// share): what the `dpo` task trains on.
    Preference,
}

/// Which tokens carry the loss in chat and prompt/completion examples (`data.train_on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TrainOn {
    /// The assistant's turns (chat) or the completion.
    #[default]
    Assistant,
    /// Every token.
    All,
}

impl DataConfig {
    /// Refuses a `max_seq_len` too short for any example: every command
    /// that builds examples would otherwise drop them all.
    pub fn check_max_seq_len(&self) -> Result<()> {
        if self.max_seq_len < 8 {
            bail!("data.max_seq_len (--max-seq-len) must be at least 8 (got {})", self.max_seq_len);
        }
        Ok(())
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train: None,
            eval: None,
            tokenizer: None,
            max_seq_len: 512,
            train_samples: None,
            range: None,
            shuffle: true,
            eval_samples: None,
            pad_to_multiple_of: None,
            format: DataFormat::Auto,
            train_on: TrainOn::Assistant,
            truncate: false,
            chat_template: None,
            packing: false,
            drop_last: true,
            split: None,
            eval_split: None,
            columns: BTreeMap::new(),
            mixture: vec![],
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub epochs: usize,
    /// Stop after this many optimizer steps, counted from the first across
    /// resumes; it sets the run's length instead of `epochs` (as Hugging
    /// Face Trainer's `max_steps`), and the schedule's unless `schedule_steps` is set.
    pub max_steps: Option<usize>,
    /// Also evaluate every this many optimizer steps, besides each epoch's end (0: epoch ends only).
    pub eval_every: usize,
    /// Examples per micro-batch on each rank.
    pub batch_size: usize,
    /// Examples per batch on each rank in evaluation (loss, generation, span scoring).
    pub eval_batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub warmup_steps: usize,
    /// Warm-up as a fraction of all steps (used when warmup_steps is 0).
    pub warmup_ratio: f64,
    pub schedule: crate::schedule::Schedule,
    /// Optimizer steps the schedule spans (its warm-up ratio and its decay),
    /// counted from the first step across resumes; default: this run's
    /// epochs × steps per epoch. Slices of a file (`data.range`) set it to
    /// all slices' steps together.
    pub schedule_steps: Option<usize>,
    /// 0 disables clipping.
    pub max_grad_norm: f64,
    /// Compute dtype: auto (bf16 on GPU, f32 on CPU), f32, bf16, or fp16
    /// (with dynamic loss scaling).
    pub dtype: DType,
    /// fp16's first loss scale.
    pub initial_loss_scale: f64,
    /// auto (the rank's GPU when there is one), cpu, cuda or cuda:N.
    pub device: DeviceSpec,
    pub seed: u64,
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, recompute only the first N blocks
    /// and keep the others' activations (all blocks when unset): the
    /// fewest that fit memory cost the least recomputation (`ft plan` picks N).
    pub checkpoint_layers: Option<usize>,
    pub loss_chunk_tokens: i64,
    /// Optimizer steps between metrics records (the sinks' files).
    pub log_every: usize,
    /// Without a terminal, the least seconds between two progress lines in
    /// the log, besides the first step's, each epoch's end and the last step's.
    pub log_seconds: f64,
    /// Optimizer steps between checkpoints (0: none).
    pub save_every: usize,
    /// Save a checkpoint at the end of every epoch, so a run always has one
    /// to resume from (with the periodic and timed saves; none of the three: no checkpoints).
    pub save_each_epoch: bool,
    /// Save when this many minutes passed since the last save (rank 0's
    /// clock decides for every rank); None: no timed saves.
    pub save_minutes: Option<f64>,
    /// The signal that makes a run save a checkpoint and stop, besides
    /// SIGINT and SIGTERM: SIGUSR1 (what Slurm's `--signal` sends), SIGUSR2 or SIGHUP.
    pub save_signal: String,
    /// Under Slurm (SLURM_JOB_ID set), rank 0 requeues the job
    /// (`scontrol requeue`) after saving on `save_signal`; the requeued job
    /// continues with `--resume auto`.
    pub requeue: bool,
    /// Checkpoints kept, newest first (0: all).
    pub save_total_limit: usize,
    /// Continue from a checkpoint: "latest" (in output.dir), its directory,
    /// or "auto" (the latest when there is one, else start afresh).
    pub resume: Option<String>,
    /// Sharding strategy by name or alias (`ft list` shows them).
    pub strategy: String,
    /// Ranks per shard group for sharded strategies (default: the
    /// strategy's — the world, or one node for hybrid_shard).
    pub shard_group_size: Option<usize>,
    /// Ranks of one expert-parallel group, which split a mixture of
    /// experts' experts between them (1: every rank holds every expert).
    pub expert_parallel: usize,
    /// dtype gradients are reduced in: fp32, or compute (bf16 halves the bytes).
    pub reduce_dtype: crate::distributed::strategy::ReduceDtype,
    /// Where optimizer state and master shards live: none (the device) or cpu.
    pub offload: String,
    /// Optimizer steps [first, last] (counted from 1, as in the metrics) that
    /// rank 0 records with PyTorch's profiler into `<output.dir>/profile/`.
    pub profile_steps: Option<[usize; 2]>,
    /// The GPU's dense peak TFLOP/s in the compute dtype, for MFU (default:
    /// ft's table by GPU name; MFU is n/a for a GPU not in it).
    pub peak_tflops: Option<f64>,
    /// The evaluation score early stopping and `save_best` judge epochs by,
    /// as the metrics name it: `eval_loss`, `eval_f1`, `eval_exact`, …
    pub monitor: Option<String>,
    /// Whether higher or lower `monitor` is better (auto: lower for a loss).
    pub monitor_mode: MonitorMode,
    /// Stop after this many evaluations without improvement (0: never).
    pub early_stopping_patience: usize,
    /// The least change of `monitor` that counts as an improvement.
    pub early_stopping_min_delta: f64,
    /// Keep the checkpoints of the best N epochs by `monitor` (saved after
    /// their evaluation), besides the newest `save_total_limit` (0: none).
    pub save_best: usize,
    /// Low-rank adapters on a frozen base (`r` 0: full fine-tuning).
    pub lora: LoraConfig,
    /// Float8 linear layers: off, tensorwise or rowwise (torchao's recipes
    /// of those names; `ft_sys::float8`).
    pub fp8: Fp8,
    /// Emulate the float8 GEMMs: cast to float8 and back, multiply in fp32
    /// (torchao's `Float8LinearConfig(emulate=True)`), on any device — for
    /// CPU and tests, slower than bf16.
    pub fp8_emulate: bool,
    /// Which block linear layers run in float8: `auto`, those float8
    /// speeds up (measured by `fp8_calibration`, or by ft's size rule
    /// without one), or `all` (every one whose widths are multiples of 16).
    pub fp8_layers: Fp8Layers,
    /// An `ft calibrate --fp8` file: under `fp8_layers=auto`, the block
    /// layers whose float8 GEMMs it measured no faster than the compute
    /// dtype's stay in the compute dtype.
    pub fp8_calibration: Option<std::path::PathBuf>,
    /// Under `fp8=tensorwise` with a strategy that gathers sharded
    /// parameters, gather the blocks whose weights all run in float8 as
    /// float8 bytes (half a bf16 gather), each weight cast with its whole
    /// tensor's scale as the layer would cast it. Unset: on under
    /// `fp8=tensorwise` ([`TrainConfig::float8_gathers`]).
    pub fp8_gathers: Option<bool>,
    /// How online RL's rollouts hold the policy while decoding: `whole`,
    /// `per_unit`, or `auto` (whole where `ft plan` predicts the policy
    /// whole and its KV cache fit the GPU, else per unit; whole without a plan).
    pub rollout_gather: RolloutGather,
}

/// `train.rollout_gather`: how online RL's rollouts hold the policy while decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RolloutGather {
    #[default]
    Auto,
    /// Gathered whole in the compute dtype once a generation, decoded with CUDA graphs.
    Whole,
    /// Each unit gathered for the stage that uses it and freed after, at
    /// every decoding step (collective: the ranks step together), without CUDA graphs.
    PerUnit,
}

impl std::fmt::Display for RolloutGather {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            RolloutGather::Auto => "auto",
            RolloutGather::Whole => "whole",
            RolloutGather::PerUnit => "per_unit",
        })
    }
}

/// `train.fp8_layers`: which block linear layers a float8 run casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Layers {
    #[default]
    Auto,
    All,
}

/// `train.fp8`: which float8 recipe a run's linear layers follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Fp8 {
    #[default]
    Off,
    Tensorwise,
    Rowwise,
}

/// LoRA as Hugging Face peft configures it (`r`, `lora_alpha`,
/// `lora_dropout`, `target_modules`); `lora.rs` builds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// The adapters' rank; 0 trains every parameter instead.
    pub r: usize,
    /// The update is scaled by alpha / r (default 2·r, scale 2).
    pub alpha: Option<f64>,
    /// Dropout on each adapter's input while training.
    pub dropout: f64,
    /// Linear layers to adapt: short names (q, k, v, o, gate, up, down, as
    /// the architecture maps them), module names as peft's
    /// `target_modules` (q_proj, query_key_value, …), `all-linear`
    /// (every linear layer of the blocks, as peft's `all-linear`), or
    /// `experts` (a mixture of experts' fused experts, as peft's
    /// `target_parameters`).
    pub targets: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig { r: 0, alpha: None, dropout: 0.0, targets: vec!["q".into(), "v".into()] }
    }
}

impl TrainConfig {
    /// The run's float8 linear layers; None when `train.fp8` is off.
    pub fn float8(&self) -> Option<ft_sys::float8::Float8> {
        let recipe = match self.fp8 {
            Fp8::Off => return None,
            Fp8::Tensorwise => ft_sys::float8::Recipe::Tensorwise,
            Fp8::Rowwise => ft_sys::float8::Recipe::Rowwise,
        };
        Some(ft_sys::float8::Float8 { recipe, emulate: self.fp8_emulate })
    }

    /// Whether sharded float8 blocks are gathered as float8 bytes:
    /// `fp8_gathers` where given, else under `fp8=tensorwise` (the recipe
    /// whose one scale a weight's gathered bytes can carry).
    pub fn float8_gathers(&self) -> bool {
        self.fp8_gathers.unwrap_or(self.fp8 == Fp8::Tensorwise)
    }
}

impl LoraConfig {
    pub fn enabled(&self) -> bool {
        self.r > 0
    }

    pub fn alpha(&self) -> f64 {
        self.alpha.unwrap_or(2.0 * self.r as f64)
    }

    /// Refuses settings LoRA cannot train with, naming the key.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            bail!("train.lora.r (--lora-r) is 0: LoRA's rank must be at least 1 (leave it out to train every parameter)");
        }
        let alpha = self.alpha();
        if alpha.is_nan() || alpha <= 0.0 {
            bail!("train.lora.alpha must be positive (got {alpha})");
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("train.lora.dropout must be in [0, 1) (got {})", self.dropout);
        }
        if self.targets.is_empty() {
            bail!("train.lora.targets is empty: name the linear layers to adapt, e.g. q,v or q,k,v,o,gate,up,down");
        }
        Ok(())
    }
}

/// Which way a monitored score improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MonitorMode {
    #[default]
    Auto,
    Min,
    Max,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 3,
            max_steps: None,
            eval_every: 0,
            batch_size: 8,
            eval_batch_size: 32,
            grad_accum: 1,
            lr: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            schedule: crate::schedule::Schedule::Linear,
            schedule_steps: None,
            max_grad_norm: 1.0,
            dtype: DType::Auto,
            initial_loss_scale: 65536.0,
            device: DeviceSpec::Auto,
            seed: 42,
            activation_checkpointing: false,
            checkpoint_layers: None,
            loss_chunk_tokens: 1024,
            log_every: 1,
            log_seconds: 30.0,
            save_every: 0,
            save_each_epoch: true,
            save_minutes: None,
            save_signal: "SIGUSR1".into(),
            requeue: false,
            save_total_limit: 2,
            resume: None,
            strategy: "ddp".into(),
            shard_group_size: None,
            expert_parallel: 1,
            reduce_dtype: crate::distributed::strategy::ReduceDtype::Fp32,
            offload: "none".into(),
            profile_steps: None,
            peak_tflops: None,
            monitor: None,
            monitor_mode: MonitorMode::Auto,
            early_stopping_patience: 0,
            early_stopping_min_delta: 0.0,
            save_best: 0,
            lora: LoraConfig::default(),
            fp8: Fp8::Off,
            fp8_emulate: false,
            fp8_gathers: None,
            fp8_layers: Fp8Layers::Auto,
            fp8_calibration: None,
            rollout_gather: RolloutGather::Auto,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    pub dir: std::path::PathBuf,
    /// The metrics sinks the run reports to, by name (`ft list` shows them),
    /// as Hugging Face Trainer's `report_to`.
    pub report_to: Vec<String>,
    /// The experiment the `mlflow` sink records the run in.
    pub mlflow_experiment: String,
    /// A run that does not resume may replace the outputs of a previous run
    /// in `dir` (`--overwrite-output-dir`, as Hugging Face Trainer's);
    /// otherwise it is refused there.
    pub overwrite: bool,
}

/// What `output.report_to` (`--report-to`) says for no sink at all, as Hugging Face Trainer's `report_to="none"`.
pub const NO_SINK: &str = "none";

impl OutputConfig {
    /// The sinks the run reports to: none for `["none"]` (or `[]`); `none`
    /// beside a sink is refused.
    pub fn sinks(&self) -> Result<&[String]> {
        match self.report_to.iter().any(|name| name == NO_SINK) {
            false => Ok(&self.report_to),
            true if self.report_to.len() == 1 => Ok(&[]),
            true => bail!("output.report_to (--report-to) lists {}: `{NO_SINK}` means no sink and stands alone", self.report_to.join(", ")),
        }
    }
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig {
            dir: "ft-output".into(),
            report_to: vec!["jsonl".into(), "csv".into(), "tensorboard".into()],
            mlflow_experiment: "ft".into(),
            overwrite: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaunchConfig {
    /// Local workers `ft train` starts itself when no launcher started it.
    pub nproc_per_node: usize,
}

impl LaunchConfig {
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            bail!("launch.nproc_per_node (--nproc-per-node) must be at least 1: the local ranks to start");
        }
        Ok(())
    }
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig { nproc_per_node: 1 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// auto (NCCL when a GPU is visible, else Gloo), gloo or nccl.
    pub backend: Backend,
    /// Seconds that rendezvous and each collective may take before the run fails.
    pub timeout_secs: u64,
    /// Before each collective, every rank of its group exchanges what it is
    /// about to issue (kind, elements, dtype), and a difference is an error
    /// naming both sides instead of a hang or a corrupt result: for
    /// debugging a communication plug-in (`ft plugin check` turns it on).
    /// Doubles the collectives.
    pub verify_collectives: bool,
    /// On the CPU, the collectives of a group whose ranks all run on this
    /// host go through shared memory instead of Gloo's TCP sockets (across
    /// hosts, and for the all-to-all of rows, Gloo carries them).
    pub shared_memory: bool,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig { backend: Backend::Auto, timeout_secs: 300, verify_collectives: false, shared_memory: true }
    }
}

/// Environment variables `FT_SECTION__KEY` set `section.key`.
pub const ENV_PREFIX: &str = "FT_";

/// The configuration's sections: `FT_<SECTION>__<KEY>` sets `section.key`.
pub const SECTIONS: [&str; 8] = ["dist", "model", "data", "train", "output", "launch", "task", "comm"];

/// Whether an `FT_`-less variable name is a configuration key: a known
/// section, `__`, a key. Any other `FT_*` variable (`FT_CONFIG_FILE`,
/// `FT_KERNELS`, `FT_CHART_FONT`, a tool's own) is left alone, with a debug
/// line; a misspelt key inside a known section is still an error.
fn is_config_variable(name: &str) -> bool {
    let is_key = name.split_once("__").is_some_and(|(section, _)| SECTIONS.iter().any(|s| section.eq_ignore_ascii_case(s)));
    if !is_key {
        tracing::debug!("environment variable {ENV_PREFIX}{} is not a configuration key (FT_SECTION__KEY): ignored", name.to_uppercase());
    }
    is_key
}

impl Config {
    /// Resolves the configuration. `flags` are dotted keys from a command's
    /// own flags (e.g. `("dist.timeout_secs", 30.into())`), `assignments`
    /// its `--set KEY=VALUE`s, applied last.
    pub fn load(file: Option<&Path>, flags: &[(&str, Value)], assignments: &[Assignment]) -> Result<Config> {
        let env = Env::prefixed(ENV_PREFIX).filter(|key| is_config_variable(key.as_str()));
        Config::load_with_env(file, flags, assignments, env.split("__"))
    }

    fn load_with_env(file: Option<&Path>, flags: &[(&str, Value)], assignments: &[Assignment], env: Env) -> Result<Config> {
        let user = Config::layers(Figment::new(), file, flags, assignments, env.clone())?;
        let mut base = Figment::from(Serialized::defaults(Config::default()));
        let source = user.extract_inner::<String>("model.source").ok();
        if let Some(preset) = preset(source.as_deref()) {
            base = base.merge(Serialized::defaults(serde_json::json!({"model": {"source": preset.name}})));
            base = base.merge(Serialized::defaults((preset.values)()));
        }
        let figment = Config::layers(base, file, flags, assignments, env)?;
        let mut config: Config = figment.extract().map_err(|e| anyhow::anyhow!(describe(e)))?;
        for dict in figment::Provider::data(&user).map_err(|e| anyhow::anyhow!(describe(e)))?.values() {
            dotted_keys(&mut config.given, "", dict);
        }
        Ok(config)
    }

    /// Whether the user's layers give `key` (dotted, e.g. `train.lora.alpha`),
    /// whatever its value: an option written out at its default is given.
    pub fn given(&self, key: &str) -> bool {
        self.given.contains(key)
    }

    /// One line saying what a run of `world` ranks will do (`ft train --dry-run`).
    pub fn plan(&self, world: usize) -> String {
        let t = &self.train;
        format!(
            "plan: {world} rank(s), strategy {}; micro-batch {} x grad_accum {} x {world} = global batch {}; {}; outputs in {}",
            t.strategy,
            t.batch_size,
            t.grad_accum,
            t.batch_size * t.grad_accum * world,
            t.max_steps.map_or(format!("{} epoch(s)", t.epochs), |steps| format!("{steps} optimizer step(s)")),
            self.output.dir.display()
        )
    }

    /// The resolved configuration as dotted keys and their values as text
    /// (`train.lr` → "0.00005", lists as JSON), unset keys left out: the run's
    /// parameters as the sinks record them.
    pub fn flattened(&self) -> Result<BTreeMap<String, String>> {
        let mut entries = BTreeMap::new();
        flatten_into(&mut entries, "", &serde_json::to_value(self)?);
        Ok(entries)
    }

    /// Whether `model.source` is a preset (which brings its own model and data).
    pub fn uses_preset(&self) -> bool {
        preset(Some(&self.model.source)).is_some()
    }

    /// The user's layers over `figment`: file, environment, flags, then
    /// `--set`; each named as the user gave it, for error messages.
    fn layers(mut figment: Figment, file: Option<&Path>, flags: &[(&str, Value)], assignments: &[Assignment], env: Env) -> Result<Figment> {
        if let Some(path) = file {
            if !path.is_file() {
                bail!("config file {} does not exist", path.display());
            }
            let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            figment = match extension {
                "toml" => figment.merge(Toml::file(path)),
                "yaml" | "yml" => figment.merge(Yaml::file(path)),
                "json" => figment.merge(Json::file(path)),
                _ => bail!("config file {} must end in .toml, .yaml, .yml or .json", path.display()),
            };
        }
        figment = figment.merge(Named { name: ENV_SOURCE.into(), provider: env });
        for (key, value) in flags {
            figment = figment.merge(Named { name: FLAG_SOURCE.into(), provider: Serialized::default(key, value.clone()) });
        }
        for assignment in assignments {
            figment = figment.merge(Named { name: assignment.to_string(), provider: Serialized::default(&assignment.key, assignment.value.clone()) });
        }
        Ok(figment)
    }
}

/// What the error messages call the `FT_*` variables' layer and the flags'.
const ENV_SOURCE: &str = "environment variable";
const FLAG_SOURCE: &str = "command-line flag";

/// A layer under the name a message should give it (figment names a
/// serialized value by its Rust type and the line that added it).
struct Named<P> {
    name: String,
    provider: P,
}

impl<P: figment::Provider> figment::Provider for Named<P> {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.name.clone())
    }

    fn data(&self) -> std::result::Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        self.provider.data()
    }
}

/// One `KEY=VALUE` the user gave with `flag` (`--set`, `--comm-option`).
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    pub key: String,
    pub value: Value,
    /// As the user wrote it: `train.batch_size=abc`.
    pub text: String,
    pub flag: &'static str,
}

impl Assignment {
    /// `KEY=VALUE` given with `flag`: the value as JSON when it parses as
    /// JSON (numbers, booleans, quoted strings, lists), else as the plain string.
    pub fn parse(text: &str, flag: &'static str) -> Result<Assignment, String> {
        let (key, value) = text.split_once('=').ok_or_else(|| format!("{flag} {text:?} is not KEY=VALUE"))?;
        let value: serde_json::Value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
        let value = Value::serialize(value).map_err(|e| e.to_string())?;
        Ok(Assignment { key: key.to_string(), value, text: text.to_string(), flag })
    }
}

impl std::fmt::Display for Assignment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.flag, self.text)
    }
}

/// `--set KEY=VALUE` (see [`Assignment::parse`]).
pub fn parse_assignment(text: &str) -> Result<Assignment, String> {
    Assignment::parse(text, "--set")
}

/// `--comm-option comm.NAME.KEY=VALUE`: a hook's option (`ft plan`, `ft bench`).
pub fn parse_comm_option(text: &str) -> Result<Assignment, String> {
    Assignment::parse(text, "--comm-option")
}

/// A plain enum the configuration reads with serde, by its name (`--fp8
/// rowwise`), as a flag's value: another name is refused with the names
/// there are, as the configuration refuses it.
pub fn parse_named<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::from(text)).map_err(|e| format!("{text:?}: {}", e.to_string().replace('`', "")))
}

/// A command's flags as configuration overrides: each flag given sets its
/// dotted key (`Config::load`'s `flags`), applied over the file and the environment.
#[derive(Default)]
pub struct Overrides(pub Vec<(&'static str, Value)>);

impl Overrides {
    pub fn set<T: Into<Value>>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        if let Some(value) = value {
            self.0.push((key, value.into()));
        }
        self
    }

    pub fn path(&mut self, key: &'static str, value: Option<&std::path::PathBuf>) -> &mut Self {
        self.set(key, value.map(|p| p.display().to_string()))
    }

    /// `--train-file`s: one is `data.train`; several are a `data.mixture`
    /// of them, each of their examples once.
    pub fn train_files(&mut self, files: &[std::path::PathBuf]) -> &mut Self {
        match files {
            [] => self,
            [one] => self.path("data.train", Some(one)),
            several => {
                let sources: Vec<serde_json::Value> = several.iter().map(|file| serde_json::json!({"path": file.display().to_string()})).collect();
                self.serialized("data.mixture", Some(sources))
            }
        }
    }

    /// A value the configuration reads with serde (an enum such as a dtype).
    pub fn serialized<T: serde::Serialize>(&mut self, key: &'static str, value: Option<T>) -> &mut Self {
        self.set(key, value.map(|v| Value::serialize(v).expect("plain enums and JSON serialize")))
    }
}

/// Refuses each `--set` key that `command` does not read: it would do
/// nothing in silence. `reads` holds dotted keys, a section's name standing
/// for all of its keys. Only `--set` is checked: a config file and `FT_*`
/// variables may hold other commands' keys too (one file serves a run's
/// `ft train` and `ft eval`).
pub fn check_reads(assignments: &[Assignment], command: &str, reads: &[&str]) -> Result<()> {
    for assignment in assignments {
        let mut keys = BTreeSet::from([assignment.key.clone()]);
        if let Value::Dict(_, dict) = &assignment.value {
            dotted_keys(&mut keys, &assignment.key, dict);
        }
        let read = |key: &String| reads.iter().any(|r| key == r || key.starts_with(&format!("{r}.")) || r.starts_with(&format!("{key}.")));
        if let Some(key) = keys.iter().find(|key| !read(key)) {
            bail!("{assignment}: `{command}` does not read `{key}` (the keys it reads: {})", reads.join(", "));
        }
    }
    Ok(())
}

/// Every dotted key of `dict` under `prefix`, sections included.
fn dotted_keys(keys: &mut BTreeSet<String>, prefix: &str, dict: &figment::value::Dict) {
    for (name, value) in dict {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        if let Value::Dict(_, inner) = value {
            dotted_keys(keys, &key, inner);
        }
        keys.insert(key);
    }
}

fn flatten_into(entries: &mut BTreeMap<String, String>, key: &str, value: &serde_json::Value) {
    match value {
        serde_json::Value::Object(fields) => {
            for (name, field) in fields {
                let dotted = if key.is_empty() { name.clone() } else { format!("{key}.{name}") };
                flatten_into(entries, &dotted, field);
            }
        }
        serde_json::Value::Null => {}
        serde_json::Value::String(text) => {
            entries.insert(key.to_string(), text.clone());
        }
        other => {
            entries.insert(key.to_string(), other.to_string());
        }
    }
}

/// One line per problem: where the value came from as the user gave it
/// (the file, the variable, the flag), the key, and a suggestion for a misspelling.
fn describe(error: figment::Error) -> String {
    let mut lines = vec![];
    for e in error {
        let path = e.path.join(".");
        let origin = e.metadata.as_ref().map(|m| match &m.source {
            Some(figment::Source::File(file)) => format!("config file {}", file.display()),
            _ if m.name == ENV_SOURCE => format!("{ENV_SOURCE} {ENV_PREFIX}{}", e.path.join("__").to_uppercase()),
            _ => m.name.to_string(),
        });
        let line = match &e.kind {
            figment::error::Kind::UnknownField(field, expected) => {
                // figment's path already ends with the unknown field.
                let suggestion = crate::names::did_you_mean(field, expected);
                let origin = origin.map(|o| format!(" ({o})")).unwrap_or_default();
                format!("unknown config key `{path}`{origin}{suggestion} (known keys here: {})", expected.join(", "))
            }
            kind => {
                let problem = match kind {
                    figment::error::Kind::InvalidType(actual, expected) => format!("expected {}, found {actual}", in_words(expected)),
                    // A file kind where a row format belongs: say where the kind is read from.
                    figment::error::Kind::UnknownVariant(actual, _) if path == "data.format" && SOURCE_KINDS.contains(&actual.as_str()) => {
                        format!("{kind}; `{actual}` is a kind of file, which ft reads from the file itself: data.format says what its rows hold")
                    }
                    other => other.to_string(),
                };
                match origin {
                    Some(origin) => format!("{origin}: config key `{path}`: {problem}"),
                    None => format!("config key `{path}`: {problem}"),
                }
            }
        };
        lines.push(line);
    }
    lines.join("\n")
}

/// Kinds of data file a user may take for a `data.format`.
const SOURCE_KINDS: [&str; 4] = ["parquet", "arrow", "json", "jsonl"];

/// What serde calls a Rust type, as a user would say it.
fn in_words(expected: &str) -> String {
    match expected {
        "u8" | "u16" | "u32" | "u64" | "usize" => "a whole number (0 or more)".into(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "an integer".into(),
        "f32" | "f64" => "a number".into(),
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(name: &str, body: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::File::create(&path).unwrap().write_all(body.as_bytes()).unwrap();
        (dir, path)
    }

    fn no_env() -> Env {
        Env::prefixed("FT_TEST_NOTHING_")
    }

    #[test]
    fn layers_apply_in_order() {
        let (_dir, path) = file("ft.toml", "[dist]\nbackend = 'gloo'\ntimeout_secs = 10\n");
        let config = Config::load_with_env(Some(&path), &[], &[], no_env()).unwrap();
        assert_eq!(config.dist, DistConfig { backend: Backend::Gloo, timeout_secs: 10, verify_collectives: false, shared_memory: true });
        let config = Config::load_with_env(Some(&path), &[("dist.timeout_secs", 42.into())], &[], no_env()).unwrap();
        assert_eq!(config.dist.timeout_secs, 42);
        // A prefix of its own keeps this test off other tests' environment.
        std::env::set_var("FT_CFGTEST_DIST__TIMEOUT_SECS", "7");
        let env = Env::prefixed("FT_CFGTEST_").split("__");
        assert_eq!(Config::load_with_env(Some(&path), &[], &[], env).unwrap().dist.timeout_secs, 7);
    }

    inventory::submit! {
        PresetRegistration {
            name: "config-test-preset",
            summary: "",
            default: false,
            values: || serde_json::json!({"train": {"epochs": 6, "lr": 2e-3}, "launch": {"nproc_per_node": 2}, "task": {"max_new_tokens": 8}}),
            write_files: |_, _| Ok(()),
            configure: |_, _| Ok(serde_json::json!({})),
        }
    }

    #[test]
    fn a_preset_sits_under_the_user_layers() {
        let named = |more: &[(&str, Value)]| {
            let mut overrides = vec![("model.source", Value::from("config-test-preset"))];
            overrides.extend(more.iter().cloned());
            Config::load_with_env(None, &overrides, &[], no_env()).unwrap()
        };
        let config = named(&[]);
        assert_eq!((config.launch.nproc_per_node, config.train.lr), (2, 2e-3));
        assert_eq!(config.task.options["max_new_tokens"], 8);
        assert!(config.uses_preset());
        let config = named(&[("train.lr", 0.5.into())]);
        assert_eq!((config.train.lr, config.train.epochs), (0.5, 6));
        // A real model gets the ordinary defaults, not the preset's.
        let config = Config::load_with_env(None, &[("model.source", "some/model".into())], &[], no_env()).unwrap();
        assert_eq!((config.train.lr, config.launch.nproc_per_node, config.data.max_seq_len), (5e-5, 1, 512));
        assert!(!config.uses_preset());
    }

    #[test]
    fn set_keys_a_command_does_not_read_are_refused_naming_the_key_and_the_command() {
        let set = |texts: &[&str]| texts.iter().map(|text| parse_assignment(text).unwrap()).collect::<Vec<_>>();
        let reads = ["data", "train.dtype"];
        check_reads(&set(&["data.max_seq_len=64", "train.dtype=bf16", r#"train={"dtype": "f32"}"#]), "ft eval", &reads).unwrap();
        let refused = check_reads(&set(&["data.format=chat", "train.lr=1"]), "ft eval", &reads).unwrap_err().to_string();
        assert!(refused.starts_with("--set train.lr=1: `ft eval` does not read `train.lr` (the keys it reads: data, train.dtype)"), "{refused}");
        let refused = check_reads(&set(&[r#"train={"lr": 1}"#]), "ft eval", &reads).unwrap_err().to_string();
        assert!(refused.contains("does not read `train.lr`"), "{refused}");
    }

    #[test]
    fn only_section_keys_are_read_from_the_environment() {
        assert!(is_config_variable("dist__timeout_secs") && is_config_variable("TRAIN__LR") && is_config_variable("dist__bakend"));
        for stray in ["chart_font", "config_file", "kernels", "fault_inject", "chart__font", "reference_wheels"] {
            assert!(!is_config_variable(stray), "{stray}");
        }
    }

    #[test]
    fn the_configuration_flattens_to_dotted_keys() {
        let mut config = Config::default();
        config.train.profile_steps = Some([2, 3]);
        config.task.options.insert("doc_stride".into(), 64.into());
        let entries = config.flattened().unwrap();
        assert_eq!(entries["train.lr"], "0.00005");
        assert_eq!(entries["train.strategy"], "ddp");
        assert_eq!(entries["train.profile_steps"], "[2,3]");
        assert_eq!(entries["output.report_to"], r#"["jsonl","csv","tensorboard"]"#);
        assert_eq!(entries["task.doc_stride"], "64");
        assert!(!entries.contains_key("train.resume") && !entries.contains_key("task.name"), "unset keys are left out");
    }

    #[test]
    fn yaml_and_json_files() {
        let (_d1, yaml) = file("ft.yaml", "dist:\n  timeout_secs: 5\n");
        assert_eq!(Config::load_with_env(Some(&yaml), &[], &[], no_env()).unwrap().dist.timeout_secs, 5);
        let (_d2, json) = file("ft.json", r#"{"dist": {"backend": "nccl"}}"#);
        assert_eq!(Config::load_with_env(Some(&json), &[], &[], no_env()).unwrap().dist.backend, Backend::Nccl);
    }

    #[test]
    fn unknown_keys_are_named_with_a_suggestion() {
        let (_dir, path) = file("ft.toml", "[dist]\ntimout_secs = 10\n");
        let err = Config::load_with_env(Some(&path), &[], &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("unknown config key `dist.timout_secs` (config file "), "{err}");
        assert!(err.contains("did you mean `timeout_secs`?"), "{err}");
        assert!(err.contains("ft.toml"), "{err}");
    }

    #[test]
    fn a_file_kind_given_as_data_format_says_where_the_kind_is_read_from() {
        let err = Config::load_with_env(None, &[("data.format", "parquet".into())], &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("config key `data.format`") && err.contains("`parquet` is a kind of file, which ft reads from the file itself"), "{err}");
        let err = Config::load_with_env(None, &[("data.format", "chatml".into())], &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("`sharegpt`") && !err.contains("kind of file"), "{err}");
    }

    #[test]
    fn a_data_range_is_start_colon_end_or_open_ended() {
        let range = |text: &str| Config::load_with_env(None, &[("data.range", text.into())], &[], no_env()).map(|c| c.data.range.unwrap());
        assert_eq!(range("5000:10000").unwrap(), DataRange { start: 5000, end: Some(10000) });
        assert_eq!(range("5000:").unwrap(), DataRange { start: 5000, end: None });
        assert_eq!(range(":300").unwrap(), DataRange { start: 0, end: Some(300) });
        for (text, expected) in [
            ("5000-10000", "is not START:END"),
            ("a:b", "is not START:END"),
            ("-5:10", "is not START:END"),
            ("10:5", "takes no example: END (5) must be greater than START (10)"),
            ("7:7", "takes no example"),
        ] {
            let err = range(text).unwrap_err().to_string();
            assert!(err.contains("config key `data.range`") && err.contains(expected), "{text}: {err}");
        }
        let err = Config::load_with_env(None, &[("data.range", 5000.into())], &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("config key `data.range`") && err.contains("expected START:END"), "{err}");
        // What a checkpoint's manifest records reads back the same.
        for text in ["5000:10000", "5000:"] {
            let parsed: DataRange = serde_json::from_value(serde_json::Value::from(text)).unwrap();
            assert_eq!(serde_json::to_value(parsed).unwrap(), text);
        }
    }

    #[test]
    fn a_data_range_selects_in_file_order_or_says_how_many_examples_the_file_has() {
        let file = Path::new("train.jsonl");
        let slice = |text: &str| text.parse::<DataRange>().unwrap().select((0..10).collect(), file, "lines");
        assert_eq!(slice("2:5").unwrap(), vec![2, 3, 4]);
        assert_eq!(slice("8:").unwrap(), vec![8, 9]);
        assert_eq!(slice("0:10").unwrap(), (0..10).collect::<Vec<_>>());
        for outside in ["5:11", "10:", "12:20"] {
            let err = slice(outside).unwrap_err().to_string();
            assert!(err.contains(&format!("data.range {outside} is not within train.jsonl: it has 10 lines")), "{err}");
        }
        let range: DataRange = "3:5".parse().unwrap();
        assert_eq!((0..7).filter(|&p| range.contains(p)).collect::<Vec<_>>(), vec![3, 4]);
    }

    #[test]
    fn bad_values_and_files_are_rejected() {
        let (_dir, path) = file("ft.toml", "[dist]\nbackend = 'mpi'\n");
        let err = Config::load_with_env(Some(&path), &[], &[], no_env()).unwrap_err().to_string();
        assert!(err.contains("dist.backend"), "{err}");
        let err = Config::load_with_env(Some(Path::new("/nonexistent/ft.toml")), &[], &[], no_env()).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        let (_d, ini) = file("ft.ini", "");
        let err = Config::load_with_env(Some(&ini), &[], &[], no_env()).unwrap_err();
        assert!(err.to_string().contains("must end in .toml"), "{err}");
    }

    #[test]
    fn a_bad_value_names_its_source_as_the_user_gave_it() {
        let set = |text: &str| Config::load_with_env(None, &[], &[parse_assignment(text).unwrap()], no_env()).unwrap_err().to_string();
        let err = set("train.batch_size=abc");
        assert!(err.starts_with("--set train.batch_size=abc: config key `train.batch_size`: expected a whole number"), "{err}");
        assert!(!err.contains("figment") && !err.contains("config.rs"), "{err}");
        assert!(set("train.lora.alhpa=4").contains("unknown config key `train.lora.alhpa` (--set train.lora.alhpa=4); did you mean `alpha`?"));
        let (_dir, path) = file("ft.toml", "[train]\nepochs = 'many'\n");
        let err = Config::load_with_env(Some(&path), &[], &[], no_env()).unwrap_err().to_string();
        assert!(err.starts_with(&format!("config file {}: config key `train.epochs`", path.display())), "{err}");
        std::env::set_var("FT_SRCTEST_TRAIN__LR", "fast");
        let env = Env::prefixed("FT_SRCTEST_").split("__");
        let err = Config::load_with_env(None, &[], &[], env).unwrap_err().to_string();
        assert!(err.starts_with("environment variable FT_TRAIN__LR: config key `train.lr`: expected a number"), "{err}");
    }

    #[test]
    fn given_keys_are_those_the_user_wrote_even_at_their_default() {
        let config = Config::load_with_env(None, &[("train.lora.dropout", 0.0.into())], &[parse_assignment("data.shuffle=true").unwrap()], no_env()).unwrap();
        assert!(config.given("train.lora.dropout") && config.given("train.lora") && config.given("data.shuffle"));
        assert!(!config.given("train.lora.r") && !config.given("train.epochs"));
    }
}
