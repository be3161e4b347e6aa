//! Data for ft's tasks: SQuAD v1.1/v2.0 files, question answering as
//! prompts with the loss on the answer, plain text and JSONL packed for
//! causal-LM fine-tuning, the official SQuAD metrics, tokenizer loading, and
//! the embedded demo (its data, tokenizer, model and settings).

pub mod demo;
pub mod lm;
pub mod metrics;
pub mod prompt;
pub mod qa;
pub mod squad;
pub mod text;
pub mod tokenizer;
