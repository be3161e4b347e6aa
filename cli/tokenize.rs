//! `ft tokenize`: flags → configuration → the task's own rows of the data
//! (`TaskRegistration::tokenize`: causal_lm's `{"input_ids", "labels"}`,
//! dpo's chosen and rejected rows) as JSON lines.

use crate::args::Settings;
use ft_core::config::Overrides;
use anyhow::Result;
use clap::Args;
use ft_core::task::Tokenize;
use ft_core::Registry;
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct TokenizeArgs {
    /// Model directory, its config.json, or hub id in the local cache whose tokenizer (and chat template) to use (model.source).
    #[arg(long)]
    model: Option<String>,
    /// Whose training rows to write (task.name; default causal_lm): causal_lm or dpo (`ft list`).
    #[arg(long)]
    task: Option<String>,
    /// The data: SQuAD .json, rows (JSON lines, a JSON array, Parquet, Arrow: a file, a glob, a dataset directory) or text (data.train); repeated: a mixture of them (data.mixture).
    #[arg(long)]
    train_file: Vec<PathBuf>,
    /// Where the JSON lines go (written whole or not at all).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    settings: Settings,
}

/// The configuration keys `ft tokenize` reads: the training data as the task reads it.
const READS: &[&str] = &[
    "model.source", "task", "train.seed", "data.train", "data.mixture", "data.tokenizer", "data.max_seq_len", "data.train_samples", "data.range",
    "data.format", "data.train_on", "data.truncate", "data.chat_template", "data.packing", "data.split", "data.columns",
];

pub fn run(args: TokenizeArgs, plugins: &[PathBuf]) -> Result<i32> {
    let mut overrides = Overrides::default();
    overrides.set("model.source", args.model.clone()).set("task.name", args.task.clone()).train_files(&args.train_file);
    let config = args.settings.load(overrides, "ft tokenize", Some(READS))?;
    let tokenize = Registry::with_plugins(plugins)?.tokenize(config.task.name.as_deref())?;
    let tokenizer = hf::tokenizer_of(&config)?;
    println!("{}", tokenize(&Tokenize { config: &config, tokenizer: &tokenizer, out: &args.out })?);
    Ok(0)
}
