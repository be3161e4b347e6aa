//! An epoch's evaluation, also what `ft eval` runs: the objective's loss
//! over the task's evaluation set (each rank its share, summed over ranks)
//! plus the model's auxiliary loss where it adds one in training (a
//! mixture of experts' load balancing, as transformers' eval loss includes
//! it), and the task's own scores (EM/F1, …).

use crate::distributed::comm::Communicator;
use crate::model::{self, Model};
use crate::setup::Rank;
use crate::task::{Scores, Task};
use anyhow::{ensure, Result};
use std::path::Path;
use std::time::Instant;
use tch::{Kind, Tensor};

#[derive(Debug, Clone)]
pub struct Evaluation {
    /// Mean loss over the evaluation set (None when the task has none).
    pub loss: Option<f64>,
    pub scores: Scores,
    /// Examples evaluated, over all ranks: those the task scored (SQuAD's
    /// questions, whose windows the loss is over), else those of the loss.
    pub examples: usize,
    /// The whole evaluation, and the task's scoring alone (generation, span decoding).
    pub seconds: f64,
    pub scoring_seconds: f64,
}

/// Evaluates `params` (full, in `dtype`) on `task` in batches of
/// `batch_size` (collective: every rank calls it and gets the same result).
/// libtorch's errors (running out of memory, above all) are errors.
pub fn evaluate(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    task: &mut dyn Task,
    comm: &Communicator,
    batch_size: usize,
    dtype: Kind,
) -> Result<Evaluation> {
    ensure!(batch_size >= 1, "train.eval_batch_size (ft eval's --batch-size) must be at least 1");
    crate::panic::libtorch_errors("evaluating", || evaluation(model, params, task, comm, batch_size, dtype))?
}

/// `ft eval`'s [`evaluate`] on `rank`, which rank 0 records with PyTorch's
/// profiler into `profile` where given (the other ranks run alike, unrecorded).
pub fn evaluate_on(rank: &Rank, model: &dyn Model, params: &[Vec<Tensor>], task: &mut dyn Task, batch_size: usize, profile: Option<&Path>) -> Result<Evaluation> {
    let profile = profile.filter(|_| rank.rank() == 0);
    crate::profile::recorded(profile, "eval", rank.device.is_cuda(), || evaluate(model, params, task, &rank.comm, batch_size, rank.dtype))
}

fn evaluation(model: &dyn Model, params: &[Vec<Tensor>], task: &mut dyn Task, comm: &Communicator, batch_size: usize, dtype: Kind) -> Result<Evaluation> {
    let started = Instant::now();
    let (loss, loss_examples, auxiliary) = match task.eval_set() {
        Some(data) if !data.is_empty() => {
            let _no_grad = tch::no_grad_guard();
            let mine = crate::task::rank_share(comm, data.len());
            let (mut sum, mut weight, mut auxiliary) = (0.0, 0.0, 0.0);
            for indices in mine.chunks(batch_size) {
                let batch = data.collate(indices, comm.device())?;
                let ctx = model.context(&batch.inputs, 0, dtype, false)?;
                let (outputs, batch_auxiliary) = model::forward_with_auxiliary(model, params, &batch.inputs, &ctx, None);
                let (s, w) = task.objective().loss_sum(&outputs, &batch)?;
                sum += s;
                weight += w;
                // Each batch's, weighed by its examples (as transformers' evaluation loop averages batch losses).
                auxiliary += batch_auxiliary.map_or(0.0, |a| a.double_value(&[]) * indices.len() as f64);
            }
            let totals = comm.sum_over_ranks(&[sum, weight, mine.len() as f64, auxiliary])?;
            let examples = totals[2].max(1.0);
            let auxiliary = model.auxiliary_loss().map(|loss| (totals[3] / examples, loss.coefficient()));
            (Some(totals[0] / totals[1].max(1.0) + auxiliary.map_or(0.0, |(value, coefficient)| value * coefficient)), totals[2] as usize, auxiliary.map(|(value, _)| value))
        }
        _ => (None, 0, None),
    };
    let scoring_started = Instant::now();
    let mut scores = task.score(model, params, dtype, comm)?;
    // Logged as `eval_aux_loss`, beside the training log's `aux_loss` (both before the coefficient).
    scores.values.extend(auxiliary.map(|value| ("aux_loss".to_string(), value)));
    let examples = if scores.examples > 0 { scores.examples } else { loss_examples };
    Ok(Evaluation { loss, scores, examples, seconds: started.elapsed().as_secs_f64(), scoring_seconds: scoring_started.elapsed().as_secs_f64() })
}
