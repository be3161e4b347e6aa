//! `ft tokenize`: what training sees of its data — one
//! `{"input_ids", "labels"}` line per example, in the file's (or the
//! mixture's seeded) order — for
//! checking a chat template's masks or feeding another trainer.

use crate::args::{ConfigFile, Overrides};
use anyhow::{bail, Context, Result};
use clap::Args;
use ft_core::Config;
use ft_data::example::IGNORE_INDEX;
use ft_data::lm::{self, LoadOptions};
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// Model directory or hub id in the local cache whose tokenizer (and chat template) to use (model.source).
    #[arg(long)]
    model: Option<String>,
    /// The data: SQuAD .json, rows (JSON lines, a JSON array, Parquet, Arrow: a file, a glob, a dataset directory) or text (data.train); repeated: a mixture of them (data.mixture).
    #[arg(long)]
    train_file: Vec<PathBuf>,
    /// tokenizer.json (data.tokenizer; default: the model directory's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// A Jinja chat template instead of the tokenizer's (data.chat_template).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Set any configuration key, e.g. --set data.format=chat (VALUE as JSON, else a string); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = ft_core::config::parse_assignment)]
    assignments: Vec<ft_core::config::Assignment>,
    /// Where the JSON lines go (written whole or not at all).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: TokenizeArgs) -> Result<i32> {
    let mut overrides = Overrides::default();
    overrides
        .set("model.source", args.model.clone())
        .train_files(&args.train_file)
        .path("data.tokenizer", args.tokenizer.as_ref())
        .set("data.max_seq_len", args.max_seq_len)
        .path("data.chat_template", args.chat_template.as_ref());
    let config = Config::load(args.config.path.as_deref(), &overrides.0, &args.assignments)?;
    let tokenizer_path = match &config.data.tokenizer {
        Some(path) => path.clone(),
        // The default preset's demo has no files until a run writes them.
        None if config.model.source.is_empty() || config.model.source == ft_data::demo::NAME => bail!("give the model whose tokenizer to use: --model DIR (or --tokenizer FILE)"),
        None => hf::resolve(&config.model.source)?.join("tokenizer.json"),
    };
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tokenizer_path.display()))?;
    let options = LoadOptions { range: config.data.range, ..LoadOptions::new(&config.data, &tokenizer_path) };
    let examples = lm::load_training(&config.data, config.train.seed, &tokenizer, &options)?.context("give the data with --train-file (data.train)")?;
    lm::write_jsonl(&examples, &args.out)?;
    let tokens: usize = examples.iter().map(|e| e.input_ids.len()).sum();
    let labelled: usize = examples.iter().map(|e| e.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()).sum();
    println!("{} examples, {tokens} tokens ({labelled} with a label) in {}", examples.len(), args.out.display());
    Ok(0)
}
