//! `ft init-model`, `ft generate`, `ft forward`: models from Hugging Face files.

use anyhow::{Context, Result};
use clap::Args;
use ft_core::device::{DType, DeviceSpec};
use ft_models::hf;
use ft_models::trained::{self, Prompt, SamplingRequest};
use std::path::PathBuf;

#[derive(Args)]
pub struct InitModelArgs {
    /// config.json, a model directory, or a hub id in the local Hugging Face cache.
    #[arg(long)]
    config: String,
    /// Output directory (config.json + model.safetensors).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Weight dtype on disk: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Override config keys, e.g. --set num_hidden_layers=2 (values are JSON).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Copy this tokenizer.json next to the weights.
    #[arg(long, conflicts_with = "train_tokenizer")]
    tokenizer: Option<PathBuf>,
    /// Train a BERT WordPiece vocabulary on this SQuAD or text file, write
    /// it as tokenizer.json and size the model's vocab_size to it.
    #[arg(long, value_name = "FILE")]
    train_tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 8000, requires = "train_tokenizer")]
    vocab_size: usize,
}

pub fn init_model(args: InitModelArgs) -> Result<i32> {
    let source = hf::ModelSource::resolve(&args.config)?.set_keys(&args.overrides)?;
    let vocabulary = args.train_tokenizer.as_deref().map(|file| ft_data::qa::wordpiece::train_on_file(file, args.vocab_size)).transpose()?;
    let model = hf::write_random(source, args.seed, &args.out, args.dtype.storage_kind(), vocabulary)?;
    if let Some(tokenizer) = &args.tokenizer {
        ft_data::tokenizer::load(tokenizer, model.dims().vocab)?;
        std::fs::copy(tokenizer, args.out.join("tokenizer.json"))
            .with_context(|| format!("cannot copy {}", tokenizer.display()))?;
    }
    println!(
        "wrote a random {} model ({:.1}M parameters, seed {}) to {}",
        model.model_type(),
        model.numel() as f64 / 1e6,
        args.seed,
        args.out.display()
    );
    Ok(0)
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (or hub id in the local cache), or a peft adapter directory (a LoRA run's final/) on the base it names.
    #[arg(long)]
    model: String,
    /// Text to continue (needs the model's tokenizer.json).
    #[arg(long, conflicts_with = "ids")]
    prompt: Option<String>,
    /// Token ids to continue, comma-separated.
    #[arg(long, value_delimiter = ',')]
    ids: Vec<i64>,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[arg(long, default_value = "f32")]
    dtype: DType,
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Stop at this token id (default: config.json's eos_token_id).
    #[arg(long)]
    eos: Option<i64>,
    /// Sample (transformers' do_sample) at this temperature (default 1). Any
    /// of the five sampling options samples; without them decoding is greedy.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f64>,
    /// Sample from the K most likely tokens (0: all).
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<i64>,
    /// Sample from the most likely tokens that add up to P (1: all).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f64>,
    /// Sample from the tokens at least P times as likely as the most likely one.
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f64>,
    /// Sample with the tokens of the prompt and completion so far penalised (1: none).
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f64>,
    /// Sampling's seed: sample i draws with seed SEED + i [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Sample N continuations, one a line, each as JSON (a string for text).
    #[arg(long, value_name = "N")]
    num_samples: Option<usize>,
}

pub fn generate(args: GenerateArgs) -> Result<i32> {
    let device = args.device.device(0)?;
    let prompt = match &args.prompt {
        Some(text) => Prompt::Text(text),
        None => Prompt::Ids(&args.ids),
    };
    let request = SamplingRequest { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, min_p: args.min_p, repetition_penalty: args.repetition_penalty, seed: args.seed, num_samples: args.num_samples };
    let sampled = request.sampled(|name| format!("--{}", name.replace('_', "-")))?;
    let continuations = trained::generate(&hf::resolve(&args.model)?, prompt, args.max_new_tokens, args.eos, sampled.as_ref(), args.dtype.kind(device), device)?;
    for continuation in continuations {
        match (&args.num_samples, &args.prompt) {
            // Text on one line, however many lines it holds.
            (Some(_), Some(_)) => println!("{}", serde_json::to_string(&continuation)?),
            _ => println!("{continuation}"),
        }
    }
    Ok(0)
}

#[derive(Args)]
pub struct ForwardArgs {
    /// Model directory (or hub id in the local cache), or a peft adapter directory (a LoRA run's final/) on the base it names.
    #[arg(long)]
    model: String,
    /// JSON file with token ids, [[...], ...] (one row per sequence).
    #[arg(long)]
    ids: PathBuf,
    #[arg(long, default_value = "f32")]
    dtype: DType,
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Also backpropagate the LM loss (labels = ids) and write every parameter's gradient.
    #[arg(long)]
    grads: bool,
    /// Output safetensors: `logits`, `loss`, and `grad.<hf name>` with --grads.
    #[arg(long)]
    out: PathBuf,
}

pub fn forward(args: ForwardArgs) -> Result<i32> {
    let device = args.device.device(0)?;
    let loss = trained::forward(&hf::resolve(&args.model)?, &args.ids, &args.out, args.grads, args.dtype.kind(device), device)?;
    println!("loss {loss:.6}");
    Ok(0)
}
