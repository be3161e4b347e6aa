//! The fine-tuning loop: epochs of global batches over the task's training
//! set, one optimizer step per global batch, evaluation after each epoch.
//! What happens around a step is in components the loop calls: the run's
//! log (metrics to the sinks, the progress bar, memory and throughput counters),
//! checkpoints (periodic and the best by a monitored score), the profiler
//! window, evaluation, early stopping, and the cross-rank summary.

mod checkpointing;
mod evaluation;
mod float8_guard;
mod log;
mod monitor;
mod profiling;
mod summary;

pub use checkpointing::CheckpointPlan;
pub use evaluation::{evaluate, evaluate_on, Evaluation};
pub use summary::{EpochResult, RankMemory, ReferenceMemory, Summary};

use crate::batches::{epoch_order, BatchLayout};
use crate::config::{DataConfig, TrainConfig};
use crate::dataset::Dataset;
use crate::distributed::comm::Communicator;
use crate::distributed::comm_hook::CommHook;
use crate::distributed::parallel::DataParallel;
use crate::distributed::strategy::ShardingStrategy;
use crate::metrics::MetricsSink;
use crate::model::Model;
use crate::offload::Offload;
use crate::schedule::{lr_at, Schedule};
use crate::task::{Objective, RolloutWindow, Task};
use crate::train::{InitialParams, MicroBatch, TrainOptions, Trainer, TrainerBuilder};
use anyhow::{bail, Result};
use checkpointing::{Checkpointer, Cursor};
use log::RunLog;
use monitor::{EarlyStopping, Monitor};
use profiling::ProfileWindow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// A run stopped by a signal (SIGINT, SIGTERM, `train.save_signal`) once
/// every rank had saved `checkpoint`: what `run` fails with on every rank,
/// so the process exits with `signals::SAVED_AND_STOPPED`.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: String,
    pub step: usize,
    pub checkpoint: PathBuf,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped by {} after step {}: saved checkpoint {}", self.signal, self.step, self.checkpoint.display())
    }
}

impl std::error::Error for Interrupted {}

impl Interrupted {
    /// The exit code of a command whose run `error` (an `Interrupted`)
    /// stopped: rank 0 first says how to continue, with this process's
    /// command line and `--resume latest`.
    pub fn exit_code(error: &anyhow::Error, rank: usize) -> i32 {
        if rank == 0 {
            tracing::warn!("{error}; continue with: {}", crate::run_dir::resume_command(std::env::args()));
        }
        crate::signals::SAVED_AND_STOPPED
    }
}

/// Everything a run is made of.
pub struct Fit<'a> {
    pub model: &'a crate::lora::RunModel,
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
    /// Under float8, the block weight shapes that stay in the compute dtype
    /// (`plan::float8_kept`); None: the trainer's default.
    pub float8_kept: Option<std::collections::BTreeSet<[i64; 2]>>,
}

/// How many steps a run has, from the training set's size (or
/// `train.max_steps`), and how many its learning-rate schedule spans.
#[derive(Debug)]
struct StepPlan {
    layout: BatchLayout,
    /// Optimizer steps an epoch takes (its global batches, times the
    /// passes over each rollout window's).
    steps_per_epoch: usize,
    /// Online RL: the windows one generation serves (`Task::rollouts`).
    window: Option<RolloutWindow>,
    /// Epochs the run may start: `train.epochs`, or unbounded under
    /// `train.max_steps`, where the step count ends the run.
    epochs: usize,
    max_steps: Option<usize>,
    /// Training examples each epoch leaves out: those after its last whole global batch.
    dropped_per_epoch: usize,
    schedule_steps: usize,
    warmup_steps: usize,
}

impl StepPlan {
    /// `rollouts`: the task's group size and window (`Task::rollouts`).
    fn new(config: &TrainConfig, data: &DataConfig, world: usize, examples: usize, rollouts: Option<(usize, RolloutWindow)>) -> Result<StepPlan> {
        let range = data.range;
        let window = rollouts.map(|(_, window)| window);
        // A rollout's window trains whole global batches only.
        let layout = BatchLayout { micro_batch: config.batch_size, accumulation: config.grad_accum, world, keep_last: !data.drop_last && window.is_none() };
        if let Some((group, window)) = rollouts {
            // A generation samples whole groups: a prompt's completions are compared with each other.
            let generation = layout.global_batch() * window.steps;
            if generation % group != 0 {
                bail!(
                    "a generation of {generation} completions (batch_size {} x grad_accum {} x {world} ranks x {} optimizer step(s) a generation serves) \
                     is not a whole number of groups of {group} completions a prompt (task.num_generations): make one a multiple of the other",
                    config.batch_size,
                    config.grad_accum,
                    window.steps
                );
            }
        }
        let batches = layout.steps_per_epoch(examples);
        let steps_per_epoch = match window {
            Some(window) => batches / window.steps * window.steps * window.passes,
            None => batches,
        };
        if steps_per_epoch == 0 {
            let window = window.map_or(String::new(), |w| format!(" x {} steps a rollout serves", w.steps));
            bail!(
                "{examples} training examples do not fill one global batch of {}{window} (batch_size {} x grad_accum {} x {world} ranks)",
                layout.global_batch(),
                config.batch_size,
                config.grad_accum
            );
        }
        let run_steps = config.max_steps.unwrap_or(steps_per_epoch * config.epochs);
        let epochs = if config.max_steps.is_some() { usize::MAX } else { config.epochs };
        let trained_batches = window.map_or(batches, |w| batches / w.steps * w.steps);
        let dropped_per_epoch = examples - (trained_batches * layout.global_batch()).min(examples);
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
        Ok(StepPlan { layout, steps_per_epoch, window, epochs, max_steps: config.max_steps, dropped_per_epoch, schedule_steps, warmup_steps })
    }

    /// The step a run ends at when it starts at global batch `epoch_step` of
    /// `epoch` (before `epochs`) after `step` steps: `train.max_steps` when
    /// set; a cursor past the epoch's batches (a resume with a larger global
    /// batch) goes on to the next epoch.
    fn last_step(&self, Cursor { epoch, epoch_step, step }: Cursor) -> usize {
        match self.max_steps {
            Some(max) => max.max(step),
            None => step + self.steps_per_epoch.saturating_sub(epoch_step) + (self.epochs - epoch - 1) * self.steps_per_epoch,
        }
    }

    /// The global batch epoch `epoch_step`'s loop stops before, after `step`
    /// steps: the epoch's end, or where `train.max_steps` ends the run.
    fn epoch_stop(&self, epoch_step: usize, step: usize) -> usize {
        self.max_steps.map_or(self.steps_per_epoch, |max| self.steps_per_epoch.min(epoch_step + max.saturating_sub(step)))
    }

    /// The global batch of the epoch's order that step `epoch_step` of the
    /// epoch trains: itself, or under rollouts its window's batch of the pass.
    fn global_batch(&self, epoch_step: usize) -> usize {
        match self.window {
            Some(RolloutWindow { steps, passes }) => epoch_step / (steps * passes) * steps + epoch_step % steps,
            None => epoch_step,
        }
    }

    /// Whether step `epoch_step` of an epoch starts a rollout window.
    fn starts_window(&self, epoch_step: usize) -> bool {
        self.window.is_some() && self.steps_into_window(epoch_step) == 0
    }

    /// The steps of its rollout window before step `epoch_step` of an epoch (0 without rollouts).
    fn steps_into_window(&self, epoch_step: usize) -> usize {
        self.window.map_or(0, |w| epoch_step % (w.steps * w.passes))
    }

    /// Whether a run at `cursor` has nothing left to train: the one answer
    /// to "is the run over", for the loop, a resume and the stop on a signal.
    fn finished(&self, cursor: Cursor) -> bool {
        cursor.epoch >= self.epochs || self.max_steps.is_some_and(|max| cursor.step >= max)
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
    /// The objective's own figures of this step (`Objective::take_step_metrics`).
    pub metrics: crate::task::StepMetrics,
    /// This rank's share of the model's auxiliary loss, before its
    /// coefficient, and the figures of its statistics (over every rank)
    /// for the log (`Trainer::take_auxiliary`); None where it adds none.
    pub auxiliary: Option<(Tensor, Vec<(String, Tensor)>)>,
    /// Seconds the step spent sampling its rollouts (None: it sampled none).
    pub rollout_seconds: Option<f64>,
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
    let mut outcome = StepOutcome { loss: Tensor::zeros([], (Kind::Float, device)), grad_norm: Tensor::new(), examples: 0, tokens: 0, flops: 0.0, metrics: Default::default(), auxiliary: None, rollout_seconds: None };
    let micro_steps = layout.micro_steps(order, epoch_step);
    for micro in 0..micro_steps {
        let indices = layout.micro(order, epoch_step, rank, micro);
        let batch = data.collate(indices, device)?;
        outcome.examples += indices.len();
        for &i in indices {
            let tokens = data.tokens(i);
            outcome.tokens += tokens;
            outcome.flops += tokens as f64 * trainer.model().train_flops_per_token(tokens as i64);
        }
        outcome.loss += trainer.forward_backward(&batch, objective, normalizer, MicroBatch { index: micro, count: micro_steps })?;
    }
    outcome.grad_norm = trainer.step(lr)?;
    outcome.metrics = objective.take_step_metrics();
    outcome.auxiliary = trainer.take_auxiliary();
    Ok(outcome)
}

/// Samples the rollouts of the window of global batch `batch` (of
/// `order`), which starts after `step` steps (`resumed_at`: a resumed run
/// starts inside it, at that step): the policy gathered whole, or a unit
/// at a time (`per_unit`), this rank's micro-batches of the window's
/// steps given to the task (collective).
#[allow(clippy::too_many_arguments)]
fn generate_rollouts(
    trainer: &mut Trainer,
    run_model: &crate::lora::RunModel,
    task: &mut dyn Task,
    plan: &StepPlan,
    order: &[usize],
    batch: usize,
    (step, last_step, epoch, resumed_at): (usize, usize, f64, Option<usize>),
    per_unit: bool,
    rank: usize,
    output: &std::path::Path,
    config: &TrainConfig,
    dtype: Kind,
    comm: &Communicator,
) -> Result<()> {
    let model = run_model.model();
    let window = plan.window.expect("rollouts have a window");
    let first = batch - batch % window.steps;
    let micro_batches = (first..first + window.steps)
        .flat_map(|b| (0..plan.layout.micro_steps(order, b)).map(move |micro| plan.layout.micro(order, b, rank, micro).to_vec()))
        .collect();
    let examples = (first..first + window.steps).flat_map(|b| plan.layout.global(order, b).to_vec()).collect();
    let whole = if per_unit { vec![] } else { trainer.compute_params()? };
    // LoRA samples from its base with the adapters folded in, where `lora::samples_folded`.
    let folded = run_model.lora().filter(|&lora| crate::lora::samples_folded(lora, per_unit)).map(|lora| (lora.base(), lora.merged_base(&whole)));
    let mut folded_source = folded.as_ref().map(|(base, merged)| (*base, crate::model::Held(merged)));
    let sampler = folded_source.as_mut().map(|(base, source)| (*base, source as &mut dyn crate::model::UnitSource));
    let trainer = std::cell::RefCell::new(trainer);
    let (mut held, mut gathered) = (crate::model::Held(&whole), crate::train::GatheredPolicy::new(&trainer));
    let policy: &mut dyn crate::model::UnitSource = if per_unit { &mut gathered } else { &mut held };
    let rollouts = task.rollouts().expect("a task with a rollout window has rollouts");
    let mut reference = crate::train::ReferenceModel(&trainer);
    let reference = rollouts.wants_reference().then_some(&mut reference as &mut dyn crate::task::StartingModel);
    rollouts.generate(crate::task::Rollout { model, policy, sampler, dtype, micro_batches, examples, step, resumed_at, last_step, epoch, seed: config.seed, comm, output: Some(output), reference })
}

/// Whether online RL's rollouts gather the policy a unit at a time
/// (`train.rollout_gather`, which `plan::for_run` settles and logs; `auto`
/// left unsettled: whole). Where every unit is already held whole, per
/// unit would gather nothing and only lose the CUDA graphs: whole then, said on rank 0.
fn rollouts_per_unit(config: &TrainConfig, trainer: &Trainer, rank: usize) -> bool {
    let asked = config.rollout_gather == crate::config::RolloutGather::PerUnit;
    if asked && trainer.holds_compute_whole() && rank == 0 {
        tracing::warn!("train.rollout_gather=per_unit: {} holds every unit whole already, so the rollouts decode from the units as held (as `whole` does, with CUDA graphs)", config.strategy);
    }
    asked && !trainer.holds_compute_whole()
}

/// Evaluates the trainer's current parameters (collective).
fn evaluate_now(trainer: &Trainer, model: &dyn Model, task: &mut dyn Task, comm: &Communicator, config: &TrainConfig, dtype: Kind) -> Result<Evaluation> {
    let params = trainer.compute_params()?;
    evaluate(model, &params, task, comm, config.eval_batch_size, dtype)
}

/// Trains `params` (every rank passes the same) as `fit` says; returns the
/// summary and the final fp32 parameters, or None (having said so) when the
/// checkpoint it resumed from had already trained every epoch. libtorch's
/// errors in the models' math (running out of memory, above all) end it as
/// errors, which `ft train` explains with the plan.
pub fn run(fit: Fit, params: impl InitialParams) -> Result<Option<(Summary, Vec<Vec<Tensor>>)>> {
    crate::panic::libtorch_errors("training", || train(fit, params))?
}

fn train(fit: Fit, params: impl InitialParams) -> Result<Option<(Summary, Vec<Vec<Tensor>>)>> {
    let Fit { model: run_model, task, comm, strategy, comm_hook: (hook, comm_record), offload, config, data, dtype, sinks, mut resolved_config, checkpoints, float8_kept } = fit;
    let model = run_model.model();
    let (rank, world, device) = (comm.env().rank, comm.env().world_size, comm.device());
    let rollout_shape = task.rollouts().map(|r| (r.group_size(), r.window()));
    let plan = StepPlan::new(config, data, world, task.train_set().len(), rollout_shape)?;
    let parallel = DataParallel::new(comm, strategy, config.shard_group_size, config.reduce_dtype, dtype, config.expert_parallel)?;
    crate::distributed::comm_hook::check_serves(hook.as_ref(), &parallel.policy.comm_plan(strategy.name(), world, parallel.shard_size, offload.to_host()))?;
    if let (Some(groups), Some(experts), 0) = (&parallel.experts, model.experts(), rank) {
        let (degree, copies) = (groups.group.size(), groups.replicas.as_ref().map_or(1, |r| r.size()));
        tracing::info!("expert parallel {degree}: each rank holds {} of the {} experts of each sparse layer, each expert held by {copies} rank(s)", experts.count / degree as i64, experts.count);
    }
    let resuming = config.resume.as_deref().map(|spec| crate::checkpoint::resume_from(spec, checkpoints.output)).transpose()?.flatten().is_some();
    let options = TrainOptions { float8_kept, ..TrainOptions::from_config(config, dtype) };
    let builder = TrainerBuilder::new(model, options).data_parallel(&parallel).comm(hook).offload(offload);
    let wants_reference = task.objective().wants_reference_outputs() || task.rollouts().is_some_and(|r| r.wants_reference());
    let builder = builder.reference_copy(wants_reference);
    let mut trainer = builder.build(params)?;
    // Before the checkpoint is restored: the trainer holds the starting model.
    task.before_training(&mut crate::task::Start { model: &mut trainer, comm, output: Some(checkpoints.output), resuming })?;
    let per_unit_rollouts = task.rollouts().is_some() && rollouts_per_unit(config, &trainer, rank);
    let reference = task.reference();
    if let (Some(reference), 0) = (&reference, rank) {
        let held = summary::reference_held(summary::ReferenceMemory::of_this_rank(reference, &trainer));
        tracing::info!("reference model: {}; rank 0 holds {held} for it", reference.kind);
    }

    let monitor = Monitor::from_config(config);
    let mut early_stopping = EarlyStopping::from_config(config, monitor.as_ref())?;
    let mut checkpointer = Checkpointer::new(checkpoints, config, data.range, strategy.name(), world, comm_record, monitor)?;
    let resumed = checkpointer.resume(&mut trainer, comm)?;
    let Cursor { epoch: first_epoch, epoch_step: first_epoch_step, mut step } = resumed;
    if plan.finished(resumed) {
        if rank == 0 {
            let limit = match config.max_steps {
                Some(max) => format!("{step} step(s) and train.max_steps is {max}"),
                None => format!("{first_epoch} epoch(s) and train.epochs is {}", config.epochs),
            };
            tracing::info!("nothing left to train: checkpoint {} already completed {limit}", crate::checkpoint::name_of(step));
        }
        return Ok(None);
    }
    if plan.dropped_per_epoch > 0 && rank == 0 {
        let why = match data.drop_last {
            true => "they do not fill a global batch (data.drop_last=false trains them as a short last batch)",
            false => "too few for a short last batch that gives each rank one",
        };
        tracing::info!(
            "each epoch leaves out {} of its {} training examples, after its last global batch of {}: {why}; which ones changes with each epoch's order",
            plan.dropped_per_epoch,
            task.train_set().len(),
            plan.layout.global_batch()
        );
    }
    let last_step = plan.last_step(resumed);
    if last_step > plan.schedule_steps && config.schedule != Schedule::Constant && rank == 0 {
        tracing::warn!(
            "this run ends at step {last_step}, past the {} steps of its learning-rate schedule (train.schedule_steps): steps after {} train at learning rate 0",
            plan.schedule_steps,
            plan.schedule_steps
        );
    }
    let mut profiler = ProfileWindow::new(config.profile_steps, checkpoints.output.join("profile"), device, rank);
    let mut log = RunLog::new(sinks, comm, offload.to_host(), last_step, config);
    if let Some(float8) = config.float8() {
        log.guard_float8(float8_guard::Float8Guard::start(float8));
    }
    resolved_config.insert("run_id".into(), checkpointer.run_id().into());
    log.params(&resolved_config)?;
    let sampler = match device {
        Device::Cuda(index) => crate::gpu::UtilizationSampler::start(index),
        _ => None,
    };
    let (mut epochs, mut stopped_early, mut end) = (vec![], None, resumed);
    for epoch in first_epoch..plan.epochs {
        let group = rollout_shape.map_or(1, |(group, _)| group);
        let order = epoch_order(task.train_set().len(), group, epoch as u64, config.seed, data.shuffle);
        let start = if epoch == first_epoch { first_epoch_step } else { 0 };
        let stop_at = plan.epoch_stop(start, step);
        for epoch_step in start..stop_at {
            profiler.before_step(step + 1)?;
            log.before_step();
            let started = Instant::now();
            // Dropout's masks follow from (seed, step), so a resumed run repeats them.
            tch::manual_seed((config.seed as i64).wrapping_mul(1_000_003).wrapping_add(step as i64));
            let lr = lr_at(config.schedule, config.lr, step, plan.schedule_steps, plan.warmup_steps);
            let offloaded_before = trainer.offload_stats();
            let sent_before = comm.bytes_sent();
            let batch = plan.global_batch(epoch_step);
            let mut rollout_seconds = None;
            if plan.starts_window(epoch_step) || (plan.window.is_some() && epoch == first_epoch && epoch_step == first_epoch_step) {
                // A resumed run may start inside a window, this many steps after its first.
                let into = plan.steps_into_window(epoch_step);
                let rollout = Instant::now();
                let epoch_done = epoch as f64 + (epoch_step - into) as f64 / plan.steps_per_epoch as f64;
                let window = (step - into, last_step, epoch_done, (into > 0).then_some(step));
                generate_rollouts(&mut trainer, run_model, task, &plan, &order, batch, window, per_unit_rollouts, rank, checkpoints.output, config, dtype, comm)?;
                rollout_seconds = Some(rollout.elapsed().as_secs_f64());
            }
            let mut outcome =
                train_step(&mut trainer, task.train_set(), task.objective(), &plan.layout, &order, batch, rank, lr, device)?;
            outcome.rollout_seconds = rollout_seconds;
            log.count_sent(sent_before, comm.bytes_sent());
            step += 1;
            profiler.after_step(step)?;
            let epoch_progress = epoch as f64 + (epoch_step + 1) as f64 / plan.steps_per_epoch as f64;
            let last_of_epoch = epoch_step + 1 == plan.steps_per_epoch;
            if let Err(error) = log.after_step(step, epoch_progress, epoch_step + 1 == stop_at, lr, &outcome, started, offloaded_before, trainer.offload_stats()) {
                if error.is::<float8_guard::Diverged>() {
                    // Every rank stops here together: the save in flight is the last good state.
                    checkpointer.finish(comm)?;
                }
                return Err(error);
            }
            let next = if last_of_epoch { Cursor { epoch: epoch + 1, epoch_step: 0, step } } else { Cursor { epoch, epoch_step: epoch_step + 1, step } };
            if let Some(stop) = checkpointer.after_step(&trainer, next, plan.finished(next), comm)? {
                let signal = crate::signals::name(stop.signal);
                return Err(Interrupted { signal, step, checkpoint: stop.checkpoint }.into());
            }
            crate::checkpoint::fault_point("after-step", step);
            // `train.eval_every`, besides the evaluation that ends the epoch (or the run) below.
            if config.eval_every > 0 && step % config.eval_every == 0 && epoch_step + 1 != stop_at {
                let evaluation = evaluate_now(&trainer, model, task, comm, config, dtype)?;
                log.after_eval(epoch_progress, step, &evaluation)?;
            }
        }
        // The epoch ended inside the profiled steps: stop before evaluation.
        profiler.stop(step)?;
        let evaluation = evaluate_now(&trainer, model, task, comm, config, dtype)?;
        let result = log.after_epoch(epoch + 1, epoch as f64 + stop_at as f64 / plan.steps_per_epoch as f64, step, &evaluation)?;
        end = match stop_at == plan.steps_per_epoch {
            true => Cursor { epoch: epoch + 1, epoch_step: 0, step },
            // train.max_steps ended the run inside the epoch: a resume continues it there.
            false => Cursor { epoch, epoch_step: stop_at, step },
        };
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
        if plan.finished(end) {
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
        reference,
    )?;
    summary.stopped_early_after_epoch = stopped_early;
    summary.best_checkpoint = checkpointer.best().cloned();
    summary.run_id = checkpointer.run_id().into();
    summary.last_checkpoint = checkpointer.latest().map(PathBuf::from);
    log.finish(&summary)?;
    Ok(Some((summary, trainer.params()?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DataRange;

    fn data(range: Option<DataRange>) -> DataConfig {
        DataConfig { range, ..DataConfig::default() }
    }

    #[test]
    fn a_slice_of_the_file_needs_the_schedules_length_unless_nothing_depends_on_it() {
        let slice = Some("0:96".parse().unwrap());
        let linear = TrainConfig { batch_size: 4, epochs: 1, warmup_ratio: 0.25, ..TrainConfig::default() };
        let err = StepPlan::new(&linear, &data(slice), 2, 96, None).unwrap_err().to_string();
        assert!(err.contains("data.range 0:96 trains one slice of the file, and the learning-rate schedule (its linear decay)"), "{err}");
        assert!(err.contains("set train.schedule_steps") && err.contains("this slice has 12: 12 per epoch x 1 epoch(s)"), "{err}");
        let spanning = TrainConfig { schedule_steps: Some(120), ..linear.clone() };
        let plan = StepPlan::new(&spanning, &data(slice), 2, 96, None).unwrap();
        assert_eq!((plan.steps_per_epoch, plan.schedule_steps, plan.warmup_steps), (12, 120, 30), "the warm-up ratio is of the schedule's steps");
        // One run over the whole file: its own steps.
        let plan = StepPlan::new(&linear, &data(None), 2, 96, None).unwrap();
        assert_eq!((plan.schedule_steps, plan.warmup_steps), (12, 3));
        assert_eq!(plan.last_step(Cursor { epoch: 0, epoch_step: 5, step: 40 }), 47);
        assert_eq!(plan.last_step(Cursor { epoch: 0, epoch_step: 20, step: 40 }), 40);
        // A constant rate after a warm-up of fixed steps does not depend on the length; a ratio does.
        let constant = TrainConfig { schedule: Schedule::Constant, warmup_ratio: 0.0, warmup_steps: 3, ..linear };
        assert_eq!(StepPlan::new(&constant, &data(slice), 2, 96, None).unwrap().warmup_steps, 3);
        let err = StepPlan::new(&TrainConfig { warmup_steps: 0, warmup_ratio: 0.25, ..constant }, &data(slice), 2, 96, None).unwrap_err().to_string();
        assert!(err.contains("(its warm-up ratio)"), "{err}");
    }

    #[test]
    fn max_steps_ends_the_run_inside_an_epoch_and_is_the_schedules_length() {
        let config = TrainConfig { batch_size: 4, max_steps: Some(30), ..TrainConfig::default() };
        // 100 examples: 12 global batches of 8 an epoch, 4 examples left out of each.
        let plan = StepPlan::new(&config, &data(None), 2, 100, None).unwrap();
        assert_eq!((plan.steps_per_epoch, plan.schedule_steps, plan.dropped_per_epoch), (12, 30, 4));
        assert_eq!(plan.last_step(Cursor::default()), 30);
        assert_eq!((plan.epoch_stop(0, 0), plan.epoch_stop(0, 24), plan.epoch_stop(3, 27)), (12, 6, 6));
        assert!(!plan.finished(Cursor { epoch: 2, epoch_step: 5, step: 29 }) && plan.finished(Cursor { epoch: 2, epoch_step: 6, step: 30 }));
        let by_epochs = StepPlan::new(&TrainConfig { max_steps: None, ..config }, &data(None), 2, 100, None).unwrap();
        assert_eq!((by_epochs.last_step(Cursor::default()), by_epochs.epoch_stop(0, 0)), (36, 12));
        assert!(by_epochs.finished(Cursor { epoch: 3, epoch_step: 0, step: 36 }));
    }

    #[test]
    fn a_rollout_window_trains_its_batches_pass_after_pass() {
        let config = TrainConfig { batch_size: 4, epochs: 1, ..TrainConfig::default() };
        // 100 examples: 12 global batches of 8, so 4 windows of 3, each trained twice.
        let plan = StepPlan::new(&config, &data(None), 2, 100, Some((2, RolloutWindow { steps: 3, passes: 2 }))).unwrap();
        assert_eq!((plan.steps_per_epoch, plan.dropped_per_epoch), (24, 4));
        let batches: Vec<usize> = (0..9).map(|s| plan.global_batch(s)).collect();
        assert_eq!(batches, [0, 1, 2, 0, 1, 2, 3, 4, 5]);
        let starts: Vec<usize> = (0..24).filter(|&s| plan.starts_window(s)).collect();
        assert_eq!(starts, [0, 6, 12, 18]);
        // 10 global batches: the last window's lone batch is left out, and a window never takes a short batch.
        let plan = StepPlan::new(&config, &data(None), 2, 87, Some((1, RolloutWindow { steps: 2, passes: 1 }))).unwrap();
        assert_eq!((plan.steps_per_epoch, plan.dropped_per_epoch), (10, 7));
        let err = StepPlan::new(&config, &data(None), 2, 12, Some((4, RolloutWindow { steps: 2, passes: 1 }))).unwrap_err().to_string();
        assert!(err.contains("do not fill one global batch of 8 x 2 steps a rollout serves"), "{err}");
        // A generation of 3 x 2 ranks x 1 step: not whole groups of 4.
        let config = TrainConfig { batch_size: 3, ..config };
        let err = StepPlan::new(&config, &data(None), 2, 96, Some((4, RolloutWindow { steps: 1, passes: 1 }))).unwrap_err().to_string();
        assert!(err.contains("a generation of 6 completions (batch_size 3 x grad_accum 1 x 2 ranks x 1 optimizer step(s) a generation serves) is not a whole number of groups of 4"), "{err}");
    }
}
