//! A task's examples as the loop sees them: indexable (so the loop can
//! shuffle, split over ranks and cut micro-batches without knowing what an
//! example is), each weighed in the loss and counted in tokens, collated
//! into device batches. Tasks implement it (task.rs).

use crate::model::Inputs;
use anyhow::Result;
use tch::{Device, Tensor};

/// One collated micro-batch, on the device.
pub struct Batch {
    pub inputs: Inputs,
    /// What the objective compares the head's outputs with, as the task
    /// defines it (a causal LM's labels [batch, seq]; QA's start and end
    /// positions [batch]).
    pub targets: Vec<Tensor>,
}

pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Non-padding input tokens of example `index`: what throughput and MFU count.
    fn tokens(&self, index: usize) -> usize;

    /// Example `index`'s share of its global batch's loss: the loss is a
    /// mean over the global batch's total weight, whatever the micro-batches
    /// and ranks (a causal LM weighs an example by its target tokens, span
    /// prediction by 1).
    fn loss_weight(&self, index: usize) -> usize;

    /// Examples `indices` as one padded batch on `device`.
    fn collate(&self, indices: &[usize], device: Device) -> Result<Batch>;
}

