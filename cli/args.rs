//! What several commands' arguments share: the configuration file, and
//! flags as configuration overrides (each flag given sets its dotted key,
//! applied over the file and the environment).

use anyhow::Result;
use ft_core::config::{parse_named, Assignment, Overrides, Quantize};
use ft_core::device::{DType, DeviceSpec};
use ft_core::Config;
use ft_core::lora::RunModel;
use std::path::PathBuf;

/// The run configuration file, for the subcommands that read one.
#[derive(clap::Args)]
pub struct ConfigFile {
    /// Configuration file (.toml, .yaml or .json); FT_SECTION__KEY variables and flags override it.
    #[arg(long = "config", env = "FT_CONFIG_FILE")]
    pub path: Option<PathBuf>,
}

/// The run configuration, for the commands that read it (`ft train`, `ft
/// eval`, `ft tokenize`): the file, the flags for the text they share, and `--set`.
#[derive(clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub file: ConfigFile,
    /// tokenizer.json (data.tokenizer; default: the model directory's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A Jinja chat template for conversations instead of the tokenizer's (data.chat_template).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Tokens of an example at most (data.max_seq_len).
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Set a configuration key the command reads, e.g. --set task.beta=0.1 (VALUE as JSON, else a string); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = ft_core::config::parse_assignment)]
    assignments: Vec<Assignment>,
}

impl Settings {
    /// The configuration: the file, `FT_*` variables, these flags over
    /// `flags`, then `--set`, each of whose keys must be one `command`
    /// reads (`reads`; None: it reads every key).
    pub fn load(&self, mut flags: Overrides, command: &str, reads: Option<&[&str]>) -> Result<Config> {
        flags.path("data.tokenizer", self.tokenizer.as_ref()).path("data.chat_template", self.chat_template.as_ref()).set("data.max_seq_len", self.max_seq_len);
        if let Some(reads) = reads {
            ft_core::config::check_reads(&self.assignments, command, reads)?;
        }
        Config::load(self.file.path.as_deref(), &flags.0, &self.assignments)
    }
}

/// Where and how a command's ranks compute (`ft train`, `ft eval`).
#[derive(clap::Args)]
pub struct RankArgs {
    /// auto, f32, bf16 or fp16 (dynamic loss scaling) (train.dtype).
    #[arg(long)]
    dtype: Option<DType>,
    /// auto, cpu, cuda or cuda:N (train.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// Local ranks to start when no launcher started this process (launch.nproc_per_node).
    #[arg(long)]
    nproc_per_node: Option<usize>,
}

impl RankArgs {
    pub fn set(&self, overrides: &mut Overrides) {
        overrides.serialized("train.dtype", self.dtype).serialized("train.device", self.device).set("launch.nproc_per_node", self.nproc_per_node);
    }
}

/// The step `ft plan` predicts and `ft calibrate` times: the model's
/// config.json keys changed, micro-batches of `batch` examples of `seq`
/// tokens in the compute dtype, the LM head's logits a chunk at a time.
#[derive(clap::Args)]
pub struct StepShape {
    /// Change keys of the model's config.json, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Examples per GPU per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub batch: i64,
    /// Tokens per example.
    #[arg(long, default_value_t = 512)]
    pub seq: i64,
    /// Compute dtype (masters stay fp32): bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// Tokens per chunk of the LM head's logits.
    #[arg(long, default_value_t = 1024)]
    pub loss_chunk_tokens: i64,
}

/// LoRA's flags (`train.lora.*`, `model.quantize`), shared by `ft train`, `ft bench` and `ft plan`.
#[derive(clap::Args, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LoraArgs {
    /// Train rank-R low-rank adapters on the frozen model instead of every parameter (train.lora.r).
    #[arg(long, value_name = "R")]
    pub lora_r: Option<usize>,
    /// The adapters' update is scaled by alpha / r (train.lora.alpha; default 2·r).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Dropout on the adapters' input while training (train.lora.dropout).
    #[arg(long)]
    pub lora_dropout: Option<f64>,
    /// The linear layers to adapt: q,k,v,o,gate,up,down, module names as
    /// peft's target_modules, all-linear, or experts (a mixture of experts'
    /// fused experts) (train.lora.targets; default q,v).
    #[arg(long, value_delimiter = ',')]
    pub lora_targets: Option<Vec<String>>,
    /// Hold the frozen base's blocks in 4 bits, nf4 or fp4, as bitsandbytes
    /// does (model.quantize: QLoRA; with --lora-r).
    #[arg(long, value_name = "nf4|fp4", value_parser = parse_named::<Quantize>)]
    pub quantize: Option<Quantize>,
}

impl LoraArgs {
    pub fn set(&self, overrides: &mut Overrides) {
        overrides
            .set("train.lora.r", self.lora_r)
            .set("train.lora.alpha", self.lora_alpha)
            .set("train.lora.dropout", self.lora_dropout)
            .set("train.lora.targets", self.lora_targets.clone())
            .serialized("model.quantize", self.quantize);
    }

    /// `base` as these flags make it: adapters on it, its blocks in 4 bits
    /// (what `ft plan` and `ft bench --plan-check` predict for).
    pub fn run_model(&self, base: Box<dyn ft_core::Model>) -> Result<RunModel> {
        let mut overrides = Overrides::default();
        self.set(&mut overrides);
        ft_core::setup::run_model(base, &overrides)
    }
}
