//! Data for ft's tasks: SQuAD v1.1/v2.0 files, question answering as
//! prompts with the loss on the answer, plain text and rows (JSON lines, a
//! JSON array, Parquet, Arrow; several sources mixed) packed for
//! causal-LM fine-tuning, row formats (prompt/completion pairs, chat
//! conversations with tools rendered with the model's chat template,
//! ShareGPT, Alpaca), preference pairs (TRL's format, for DPO), the official SQuAD metrics, tokenizer loading, and
//! the embedded demos (their data, tokenizers, models and settings: the QA
//! demo, and `arithmetic` for online RL).
//!
//! The modules depend one way: `example` (the example type, tokenizing,
//! which examples `data.range` takes), `source` (rows from JSON lines, JSON
//! arrays, Parquet and Arrow: where the data comes from) and `tokenizer`
//! under the readers `prompt`, `text` and `chat`; `formats` (a row to an
//! example, by its format: what a row means) and `preference` (a row to a
//! chosen/rejected pair) over `chat`; under them all
//! `lm`, which picks one by the data's format and mixes sources
//! (`mixture`); `packing` (which examples share a row) stands alone.

pub mod arithmetic;
pub mod chat;
pub mod demo;
pub mod example;
pub mod formats;
pub mod lm;
pub mod metrics;
pub mod mixture;
pub mod packing;
pub mod preference;
pub mod prompt;
pub mod qa;
pub mod source;
pub mod squad;
pub mod text;
pub mod tokenizer;

/// Whether this process logs what it read: every rank reads the data, rank
/// 0 (or a process no launcher started) says so.
pub(crate) fn logs_data() -> bool {
    ft_core::env::DistEnv::from_env().map_or(true, |env| env.rank == 0)
}
