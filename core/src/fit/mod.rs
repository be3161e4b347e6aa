//! The fine-tuning loop: epochs of global batches over the task's training
//! set, one optimizer step per global batch, evaluation after each epoch.
//! What happens around a step is in components the loop calls: the run's
//! log (metrics to the sinks, the progress bar, memory and throughput counters),
//! checkpoints (periodic and the best by a monitored score), the profiler
//! window, evaluation, early stopping, and the cross-rank summary.

mod checkpointing;
mod evaluation;
mod log;
mod monitor;
mod profiling;
mod summary;

pub use checkpointing::CheckpointPlan;
pub use evaluation::{evaluate, Evaluation};
pub use summary::{EpochResult, RankMemory, Summary};

use crate::batches::{epoch_order, BatchLayout};
use crate::comm::Communicator;
use crate::comm_hook::CommHook;
use crate::config::{DataConfig, DataRange, TrainConfig};
use crate::dataset::Dataset;
use crate::metrics::MetricsSink;
use crate::model::Model;
use crate::offload::Offload;
use crate::schedule::{lr_at, Schedule};
use crate::strategy::ShardingStrategy;
use crate::task::{Objective, Task};
use crate::train::{DataParallel, TrainOptions, Trainer, TrainerBuilder};
use anyhow::{bail, Result};
use checkpointing::{Checkpointer, Cursor};
use log::RunLog;
use monitor::{EarlyStopping, Monitor};
use profiling::ProfileWindow;
use std::collections::BTreeMap;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Everything a run is made of.
pub struct Fit<'a> {
    pub model: &'a dyn Model,
    pub task: &'a mut dyn Task,
    pub comm: &'a Communicator,
    pub strategy: &'a dyn ShardingStrategy,
    /// How gradients are reduced and parameters gathered, and what checkpoints record of it.
    pub comm_hook: (Box<dyn CommHook>, crate::registry::CommRecord),
    pub offload: &'a dyn Offload,
    pub config: &'a TrainConfig,
    /// Which of the training file's examples the task's training set is
    /// (`data.range`, recorded in checkpoints) and whether epochs shuffle them.
    pub data: &'a DataConfig,
    pub dtype: Kind,
    pub sinks: Vec<Box<dyn MetricsSink>>,
    /// The run's whole configuration as dotted keys (`Config::flattened`), for the sinks.
    pub resolved_config: BTreeMap<String, String>,
    pub checkpoints: CheckpointPlan<'a>,
}

/// How many steps a run has, from the training set's size, and how many
/// its learning-rate schedule spans.
#[derive(Debug)]
struct StepPlan {
    layout: BatchLayout,
    steps_per_epoch: usize,
    schedule_steps: usize,
    warmup_steps: usize,
}

impl StepPlan {
    fn new(config: &TrainConfig, range: Option<DataRange>, world: usize, examples: usize) -> Result<StepPlan> {
        let layout = BatchLayout { micro_batch: config.batch_size, accumulation: config.grad_accum, world };
        let steps_per_epoch = layout.steps_per_epoch(examples);
        if steps_per_epoch == 0 {
            bail!(
                "{examples} training examples do not fill one global batch of {} (batch_size {} x grad_accum {} x {world} ranks)",
                layout.global_batch(),
                config.batch_size,
                config.grad_accum
            );
        }
        let run_steps = steps_per_epoch * config.epochs;
        let warmup_by_ratio = config.warmup_steps == 0 && config.warmup_ratio > 0.0;
        let schedule_steps = match (config.schedule_steps, range) {
            (Some(steps), _) => steps,
            // A slice's own steps are not the schedule's length: the slices after it continue the schedule.
            (None, Some(range)) if config.schedule != Schedule::Constant || warmup_by_ratio => {
                let what = match config.schedule {
                    Schedule::Constant => "its warm-up ratio",
                    Schedule::Linear => "its linear decay",
                    Schedule::Cosine => "its cosine decay",
                };
                bail!(
                    "data.range {range} trains one slice of the file, and the learning-rate schedule ({what}) spans all slices: \
                     set train.schedule_steps to the optimizer steps of all slices together (this slice has {run_steps}: \
                     {steps_per_epoch} per epoch x {} epoch(s)), or use train.schedule=constant with train.warmup_steps instead of train.warmup_ratio",
                    config.epochs
                )
            }
            (None, _) => run_steps,
        };
        let warmup_steps = if warmup_by_ratio { (config.warmup_ratio * schedule_steps as f64).ceil() as usize } else { config.warmup_steps };
        Ok(StepPlan { layout, steps_per_epoch, schedule_steps, warmup_steps })
    }

    /// The step a run ends at when it starts at global batch `epoch_step` of
    /// `epoch` (before `train.epochs`) after `step` steps; a cursor past the
    /// epoch's batches (a resume with a larger global batch) goes on to the next epoch.
    fn last_step(&self, config: &TrainConfig, Cursor { epoch, epoch_step, step }: Cursor) -> usize {
        step + self.steps_per_epoch.saturating_sub(epoch_step) + (config.epochs - epoch - 1) * self.steps_per_epoch
    }
}

/// What one optimizer step did.
pub(crate) struct StepOutcome {
    /// This rank's share of the global batch's mean loss, on the device.
    pub loss: Tensor,
    pub grad_norm: Tensor,
    /// Examples and non-padding tokens this rank computed, and their model FLOPs.
    pub examples: usize,
    pub tokens: usize,
    pub flops: f64,
}

/// One optimizer step over global batch `epoch_step` of `order`: this rank's
/// micro-batches forward and backward, then AdamW at `lr`.
#[allow(clippy::too_many_arguments)]
fn train_step(
    trainer: &mut Trainer,
    data: &dyn Dataset,
    objective: &dyn Objective,
    layout: &BatchLayout,
    order: &[usize],
    epoch_step: usize,
    rank: usize,
    lr: f64,
    device: Device,
) -> Result<StepOutcome> {
    // Every rank knows the whole global batch, so the exact normaliser needs no communication.
    let normalizer = layout.global(order, epoch_step).iter().map(|&i| data.loss_weight(i)).sum::<usize>().max(1) as f64;
    let mut outcome = StepOutcome { loss: Tensor::zeros([], (Kind::Float, device)), grad_norm: Tensor::new(), examples: 0, tokens: 0, flops: 0.0 };
    for micro in 0..layout.accumulation {
        let indices = layout.micro(order, epoch_step, rank, micro);
        let batch = data.collate(indices, device)?;
        outcome.examples += indices.len();
        for &i in indices {
            let tokens = data.tokens(i);
            outcome.tokens += tokens;
            outcome.flops += tokens as f64 * trainer.model().train_flops_per_token(tokens as i64);
        }
        outcome.loss += trainer.forward_backward(&batch, objective, normalizer, micro + 1 == layout.accumulation)?;
    }
    outcome.grad_norm = trainer.step(lr)?;
    Ok(outcome)
}

/// Trains `params` (every rank passes the same) as `fit` says; returns the
/// summary and the final fp32 parameters, or None (having said so) when the
/// checkpoint it resumed from had already trained every epoch.
pub fn run(fit: Fit, params: Vec<Vec<Tensor>>) -> Result<Option<(Summary, Vec<Vec<Tensor>>)>> {
    let Fit { model, task, comm, strategy, comm_hook: (hook, comm_record), offload, config, data, dtype, sinks, resolved_config, checkpoints } = fit;
    let (rank, world, device) = (comm.env().rank, comm.env().world_size, comm.device());
    let plan = StepPlan::new(config, data.range, world, task.train_set().len())?;
    let parallel = DataParallel::new(comm, strategy, config.shard_group_size, config.reduce_dtype, dtype)?;
    crate::comm_hook::check_serves(hook.as_ref(), &parallel.policy.comm_plan(strategy.name(), world, parallel.shard_size, offload.to_host()))?;
    let options = TrainOptions::from_config(config, dtype);
    let mut trainer = TrainerBuilder::new(model, options).data_parallel(&parallel).comm(hook).offload(offload).build(&params)?;
    drop(params);

    let monitor = Monitor::from_config(config);
    let mut early_stopping = EarlyStopping::from_config(config, monitor.as_ref())?;
    let mut checkpointer = Checkpointer::new(checkpoints, config, data.range, strategy.name(), world, comm_record, monitor)?;
    let resumed = checkpointer.resume(&mut trainer, rank)?;
    let Cursor { epoch: first_epoch, epoch_step: first_epoch_step, mut step } = resumed;
    if first_epoch >= config.epochs {
        if rank == 0 {
            tracing::info!(
                "nothing left to train: checkpoint {} already completed {first_epoch} epoch(s) and train.epochs is {}",
                crate::checkpoint::name_of(step),
                config.epochs
            );
        }
        return Ok(None);
    }
    let last_step = plan.last_step(config, resumed);
    if last_step > plan.schedule_steps && config.schedule != Schedule::Constant && rank == 0 {
        tracing::warn!(
            "this run ends at step {last_step}, past the {} steps of its learning-rate schedule (train.schedule_steps): steps after {} train at learning rate 0",
            plan.schedule_steps,
            plan.schedule_steps
        );
    }
    let mut profiler = ProfileWindow::new(config.profile_steps, checkpoints.output.join("profile"), device, rank);
    let mut log = RunLog::new(sinks, comm, offload.to_host(), last_step, config.log_every);
    log.params(&resolved_config)?;
    let sampler = match device {
        Device::Cuda(index) => crate::gpu::UtilizationSampler::start(index),
        _ => None,
    };
    let (mut epochs, mut stopped_early, mut end) = (vec![], None, resumed);
    for epoch in first_epoch..config.epochs {
        let order = epoch_order(task.train_set().len(), epoch as u64, config.seed, data.shuffle);
        let start = if epoch == first_epoch { first_epoch_step } else { 0 };
        for epoch_step in start..plan.steps_per_epoch {
            profiler.before_step(step + 1)?;
            let started = Instant::now();
            // Dropout's masks follow from (seed, step), so a resumed run repeats them.
            tch::manual_seed((config.seed as i64).wrapping_mul(1_000_003).wrapping_add(step as i64));
            let lr = lr_at(config.schedule, config.lr, step, plan.schedule_steps, plan.warmup_steps);
            let offloaded_before = trainer.offload_stats();
            let sent_before = comm.bytes_sent();
            let outcome =
                train_step(&mut trainer, task.train_set(), task.objective(), &plan.layout, &order, epoch_step, rank, lr, device)?;
            log.count_sent(sent_before, comm.bytes_sent());
            step += 1;
            profiler.after_step(step)?;
            let epoch_progress = epoch as f64 + (epoch_step + 1) as f64 / plan.steps_per_epoch as f64;
            let last_of_epoch = epoch_step + 1 == plan.steps_per_epoch;
            log.after_step(step, epoch_progress, last_of_epoch, lr, &outcome, started, offloaded_before, trainer.offload_stats())?;
            let next = if last_of_epoch { Cursor { epoch: epoch + 1, epoch_step: 0, step } } else { Cursor { epoch, epoch_step: epoch_step + 1, step } };
            checkpointer.after_step(&trainer, next, comm)?;
            crate::checkpoint::fault_point("after-step", step);
        }
        // The epoch ended inside the profiled steps: stop before evaluation.
        profiler.stop(step)?;
        let params = trainer.compute_params()?;
        let evaluation = evaluate(model, &params, task, comm, config.eval_batch_size, dtype)?;
        drop(params);
        let result = log.after_epoch(epoch + 1, step, &evaluation)?;
        end = Cursor { epoch: epoch + 1, epoch_step: 0, step };
        checkpointer.after_epoch(&trainer, end, &result, comm)?;
        let stop = early_stopping.as_mut().map(|e| e.should_stop(&result)).transpose()?.unwrap_or(false);
        epochs.push(result);
        if stop {
            stopped_early = Some(epoch + 1);
            if rank == 0 {
                tracing::info!("early stopping after epoch {}: no improvement of {} in {} evaluations", epoch + 1, config.monitor.as_deref().unwrap_or_default(), config.early_stopping_patience);
            }
            break;
        }
    }
    checkpointer.after_run(&trainer, end, comm)?;
    let utilisation = sampler.and_then(|s| s.finish());
    let peak_flops = config.peak_tflops.map(|tflops| tflops * 1e12);
    let mut summary = Summary::gather(
        comm,
        &trainer,
        log.totals(),
        utilisation,
        epochs,
        plan.steps_per_epoch,
        step,
        strategy.name(),
        parallel.shard_size,
        offload.to_host(),
        peak_flops,
    )?;
    summary.stopped_early_after_epoch = stopped_early;
    summary.best_checkpoint = checkpointer.best().cloned();
    log.finish(&summary)?;
    Ok(Some((summary, trainer.params()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_of_the_file_needs_the_schedules_length_unless_nothing_depends_on_it() {
        let slice = Some("0:96".parse().unwrap());
        let linear = TrainConfig { batch_size: 4, epochs: 1, warmup_ratio: 0.25, ..TrainConfig::default() };
        let err = StepPlan::new(&linear, slice, 2, 96).unwrap_err().to_string();
        assert!(err.contains("data.range 0:96 trains one slice of the file, and the learning-rate schedule (its linear decay)"), "{err}");
        assert!(err.contains("set train.schedule_steps") && err.contains("this slice has 12: 12 per epoch x 1 epoch(s)"), "{err}");
        let spanning = TrainConfig { schedule_steps: Some(120), ..linear.clone() };
        let plan = StepPlan::new(&spanning, slice, 2, 96).unwrap();
        assert_eq!((plan.steps_per_epoch, plan.schedule_steps, plan.warmup_steps), (12, 120, 30), "the warm-up ratio is of the schedule's steps");
        // One run over the whole file: its own steps.
        let plan = StepPlan::new(&linear, None, 2, 96).unwrap();
        assert_eq!((plan.schedule_steps, plan.warmup_steps), (12, 3));
        assert_eq!(plan.last_step(&linear, Cursor { epoch: 0, epoch_step: 5, step: 40 }), 47);
        assert_eq!(plan.last_step(&linear, Cursor { epoch: 0, epoch_step: 20, step: 40 }), 40);
        // A constant rate after a warm-up of fixed steps does not depend on the length; a ratio does.
        let constant = TrainConfig { schedule: Schedule::Constant, warmup_ratio: 0.0, warmup_steps: 3, ..linear };
        assert_eq!(StepPlan::new(&constant, slice, 2, 96).unwrap().warmup_steps, 3);
        let err = StepPlan::new(&TrainConfig { warmup_steps: 0, warmup_ratio: 0.25, ..constant }, slice, 2, 96).unwrap_err().to_string();
        assert!(err.contains("(its warm-up ratio)"), "{err}");
    }
}
