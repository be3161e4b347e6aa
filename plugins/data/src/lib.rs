//! Datasets for ft: SQuAD v1.1/v2.0 question answering as prompts with the
//! loss on the answer, plain text and JSONL packed for causal-LM
//! fine-tuning, the official SQuAD metrics, and the embedded demo set.

pub mod demo;
pub mod metrics;
pub mod prompt;
pub mod qa;
pub mod squad;
pub mod text;
