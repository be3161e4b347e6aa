//! Training examples as token ids, ready for a causal language model.

use anyhow::Result;

/// One tokenised example. `labels[i]` is the target for position i, or
/// `IGNORE_INDEX` where no loss is taken (prompt tokens, padding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
}

/// The label that cross-entropy skips (PyTorch's and Hugging Face's convention).
pub const IGNORE_INDEX: i64 = -100;

pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, index: usize) -> Result<Example>;
}
