//! A task is what a run trains and how it is judged: its examples (through
//! [`Dataset`]s, dataset.rs), the loss of the model's head outputs ([`Objective`]), and
//! the scores an epoch ends with. The loop (`fit`) asks a task for these and
//! knows no task: causal-LM fine-tuning and extractive question answering
//! are two tasks in plugins, registered like strategies, and a third party
//! adds another (sequence classification, …) without touching core.

use crate::config::{Config, DataConfig};
use crate::dataset::{Batch, Dataset};
use crate::distributed::comm::Communicator;
use crate::model::{Held, Model, UnitSource};
use anyhow::{bail, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The loss of a head's outputs.
pub trait Objective: Send + Sync {
    /// A micro-batch's loss as its share of the global mean (its summed loss
    /// over `normalizer`, the global batch's total loss weight) and the
    /// gradient of each head output. fp16's loss scale, when given,
    /// multiplies the gradients (not the loss).
    fn loss_and_grads(&self, outputs: &[Tensor], batch: &Batch, normalizer: f64, loss_scale: Option<&Tensor>) -> Result<(Tensor, Vec<Tensor>)>;

    /// The summed loss of a batch and its total loss weight (evaluation).
    fn loss_sum(&self, outputs: &[Tensor], batch: &Batch) -> Result<(f64, f64)>;

    /// Figures of the training micro-batches since the last call, beside
    /// the loss (DPO's `rewards/chosen`, …): the loop takes them after each
    /// step and logs, at each logged step, their sums over ranks and steps
    /// divided by the examples counted. None for most objectives.
    fn take_step_metrics(&self) -> StepMetrics {
        StepMetrics::default()
    }

    /// Whether each training micro-batch also runs, without gradients and
    /// before its loss, through a reference model (a preference loss's): the
    /// model with its adapters off (LoRA's base), or, for a model without
    /// adapters, a frozen copy of the starting parameters the trainer keeps
    /// for it (`TrainerBuilder::reference_copy`).
    fn wants_reference_outputs(&self) -> bool {
        false
    }

    /// The reference model's head outputs on `batch`, given before `loss_and_grads` of the same batch.
    fn reference_outputs(&self, _outputs: &[Tensor], _batch: &Batch) -> Result<()> {
        Ok(())
    }
}

/// Sums of per-example figures, and the examples they sum over.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMetrics {
    pub sums: BTreeMap<String, f64>,
    pub count: f64,
    /// What a figure sums over where not `count` (online RL's figures of a
    /// generation, one per generation): logged only when it is above 0.
    pub counts: BTreeMap<String, f64>,
}

impl StepMetrics {
    /// Adds `other`'s sums and counts to these.
    pub fn add(&mut self, other: StepMetrics) {
        for (name, sum) in other.sums {
            *self.sums.entry(name).or_default() += sum;
        }
        for (name, count) in other.counts {
            *self.counts.entry(name).or_default() += count;
        }
        self.count += other.count;
    }
}

/// What a task may prepare before the first step (`Task::before_training`).
pub struct Start<'a> {
    /// The model training starts from, to run forward without gradients.
    pub model: &'a mut dyn StartingModel,
    pub comm: &'a Communicator,
    /// The run's output directory, where what the task keeps for a resume
    /// goes (None: `ft eval`, which keeps nothing).
    pub output: Option<&'a Path>,
    /// The run continues from a checkpoint (`train.resume`).
    pub resuming: bool,
}

/// The starting model as `Task::before_training` runs it: in the compute
/// dtype, without gradients, as it is held — the trainer's own units before
/// the first step (sharded and offloaded as the strategy placed them, so
/// the run never holds the model whole; LoRA's adapters off), or whole
/// parameters (`ft eval`'s reference, [`WholeModel`]).
pub trait StartingModel {
    /// Runs `batch` through the model and gives `head` the head's outputs
    /// (which may be views of a unit gathered for the call). Collective
    /// under sharding: every rank makes the same number of calls.
    fn forward_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()>;
}

/// A model with its parameters whole, in the compute dtype.
pub struct WholeModel<'a> {
    pub model: &'a dyn Model,
    pub params: &'a [Vec<Tensor>],
    pub dtype: Kind,
}

impl StartingModel for WholeModel<'_> {
    fn forward_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        SourcedModel { model: self.model, source: &mut Held(self.params), dtype: self.dtype }.forward_head(batch, head)
    }
}

/// A model whose parameters `source` gives stage by stage, in the compute dtype.
pub struct SourcedModel<'a> {
    pub model: &'a dyn Model,
    pub source: &'a mut dyn UnitSource,
    pub dtype: Kind,
}

impl StartingModel for SourcedModel<'_> {
    fn forward_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let ctx = self.model.context(&batch.inputs, 0, self.dtype, false)?;
        let (outputs, _) = crate::panic::libtorch_errors("a forward without gradients", || crate::model::forward_from(self.model, self.source, &batch.inputs, &ctx, None))??;
        head(&outputs)
    }
}

/// The reference model a task compares with while training (`Task::reference`).
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// What it is, as the log and the summary name it (DPO: a frozen copy,
    /// LoRA's base, precomputed log-probabilities).
    pub kind: String,
    /// Host memory the task holds for it on each rank (precomputed
    /// log-probabilities); what the trainer holds (a frozen copy,
    /// `Trainer::reference_memory`) the summary adds.
    pub host_bytes: f64,
    /// It runs with each step (a frozen copy, LoRA's base) rather than once
    /// before training: how `ft train --strategy auto` plans it.
    pub each_step: bool,
}

/// What a task's scoring found: named scores, the same on every rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scores {
    /// e.g. {"em": 41.0, "f1": 55.2}, in the units the task's field uses (percent for SQuAD).
    pub values: BTreeMap<String, f64>,
    /// Examples scored over all ranks.
    pub examples: usize,
}

pub trait Task {
    fn name(&self) -> &str;

    fn train_set(&self) -> &dyn Dataset;

    /// Examples the evaluation loss is taken over (None: no evaluation loss).
    fn eval_set(&self) -> Option<&dyn Dataset>;

    fn objective(&self) -> &dyn Objective;

    /// Scores the model with `params` (full, in the compute dtype) on the
    /// task's evaluation data; empty when it has nothing to score.
    /// Collective: every rank calls it and gets the same scores.
    fn score(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, comm: &Communicator) -> Result<Scores>;

    /// Writes the last scoring's predictions under `dir` (rank 0 calls it),
    /// in the field's usual files (e.g. SQuAD's `predictions.json`); returns
    /// the names of the files written.
    fn write_predictions(&self, dir: &Path) -> Result<Vec<String>>;

    /// Called once on every rank before training starts (collective): what
    /// a task computes from the starting model (DPO's reference
    /// log-probabilities). Nothing by default.
    fn before_training(&mut self, _start: &mut Start) -> Result<()> {
        Ok(())
    }

    /// Whether the evaluation compares the model with a reference: the
    /// model its training started from, which `before_training` is given
    /// (DPO's reference model, unless reference-free). `ft eval` then gives
    /// it one: a LoRA run's base, or `--ref-model`. False by default.
    fn compares_with_reference(&self) -> bool {
        false
    }

    /// The reference model training compares with, once `before_training`
    /// has run (None: none, the default). The log says which it is and the
    /// summary what each rank holds for it.
    fn reference(&self) -> Option<Reference> {
        None
    }

    /// Online RL (GRPO, RLOO): the task's training examples are
    /// completions sampled from the model being trained, made by
    /// [`Rollouts::generate`] before the steps that train on them. None (the
    /// default): the examples are fixed.
    fn rollouts(&mut self) -> Option<&mut dyn Rollouts> {
        None
    }
}

/// A task whose training examples the policy samples. Its training set's
/// examples come in groups ([`Rollouts::group_size`]: the completions of
/// one prompt), which an epoch's order keeps together; the loop calls
/// `generate` at the first step of each window of [`RolloutWindow::steps`]
/// optimizer steps, which then train on what it made.
pub trait Rollouts {
    /// Completions per prompt: examples `g·k .. g·(k+1)` are prompt k's.
    fn group_size(&self) -> usize;

    fn window(&self) -> RolloutWindow;

    /// Tokens a completion generates at most (what `ft plan` counts the rollout by).
    fn max_new_tokens(&self) -> usize;

    /// Whether `generate` compares with the reference model (a KL term):
    /// the trainer then keeps one (LoRA's base, or a frozen copy) and
    /// passes it in [`Rollout::reference`].
    fn wants_reference(&self) -> bool {
        false
    }

    /// Samples and scores the completions of `rollout.micro_batches` (this
    /// rank's examples of the window) from the policy. Collective: every
    /// rank calls it at the same step.
    fn generate(&mut self, rollout: Rollout) -> Result<()>;
}

/// How long one generation serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutWindow {
    /// Optimizer steps over different examples (TRL's
    /// `steps_per_generation` over `gradient_accumulation_steps`).
    pub steps: usize,
    /// Passes over the window's examples (TRL's `num_iterations`).
    pub passes: usize,
}

/// What [`Rollouts::generate`] samples with.
pub struct Rollout<'a> {
    pub model: &'a dyn Model,
    /// The policy: the trainer's current parameters in `dtype`, held whole
    /// (`model::Held`) or gathered a stage at a time (`train::GatheredPolicy`:
    /// collective, `train.rollout_gather`).
    pub policy: &'a mut dyn UnitSource,
    /// What sampling decodes with, where it differs from `model` over
    /// `policy`: LoRA's base model over the policy's weights with the
    /// adapters folded in (`lora::LoraModel::merged_base`), the same function
    /// to rounding at fewer GEMMs a step. Scoring (log-probabilities) stays
    /// on `model` and `policy`, as training computes them.
    pub sampler: Option<(&'a dyn Model, &'a mut dyn UnitSource)>,
    pub dtype: Kind,
    /// This rank's examples of the window, a list per micro-batch in the
    /// order they train.
    pub micro_batches: Vec<Vec<usize>>,
    /// Every rank's examples of the window, in the epoch's order.
    pub examples: Vec<usize>,
    /// Optimizer steps done before the window (where its log and its
    /// samples' seeds start), the step the run ends at, and the epochs done
    /// (fractional): what reward functions may shape by.
    pub step: usize,
    /// A resumed run starts inside the window, at this step: its earlier
    /// steps trained before the resume on the samples the task made then,
    /// which it may have kept in `output` to train on again; else it samples
    /// the window again from the resumed weights, and says so.
    pub resumed_at: Option<usize>,
    pub last_step: usize,
    pub epoch: f64,
    /// The run's seed (`train.seed`).
    pub seed: u64,
    pub comm: &'a Communicator,
    /// The run's output directory (None: nothing is written).
    pub output: Option<&'a Path>,
    /// The reference model, when the task wants one (`Rollouts::wants_reference`).
    pub reference: Option<&'a mut dyn StartingModel>,
}

/// What a task is built from.
pub struct TaskInputs<'a> {
    /// `data.*` (files, lengths, samples) and `task.*` (the task's own keys).
    pub config: &'a Config,
    /// The tokenizer.json the task encodes text with.
    pub tokenizer: &'a Path,
    pub model: &'a dyn Model,
    /// Where batches are collated to.
    pub device: Device,
}

/// What a task over random data is made for.
pub struct Synthetic<'a> {
    pub model: &'a dyn Model,
    /// Examples of `seq` tokens each, drawn with `seed`, collated to `device`.
    pub examples: usize,
    pub seq: i64,
    pub seed: i64,
    pub device: Device,
    /// Tokens per chunk of an LM head's logits (`train.loss_chunk_tokens`).
    pub loss_chunk_tokens: i64,
}

/// A task's registration (`--task NAME`), beside its implementation.
pub struct TaskRegistration {
    pub name: &'static str,
    pub summary: &'static str,
    /// The head kind of the models it trains (`Model::head_kind`); the
    /// first task registered for a model's head is the default.
    pub head_kind: &'static str,
    pub build: fn(&TaskInputs) -> Result<Box<dyn Task>>,
    /// A task over random examples: what `ft bench` times a step with.
    pub synthetic: fn(&Synthetic) -> Result<Box<dyn Task>>,
    /// Checks the task's `task.*` keys, and how they fit the run's batches
    /// (`train.*` over the run's ranks), before any worker starts.
    pub check_options: fn(&serde_json::Value, &crate::config::TrainConfig, usize) -> Result<()>,
    /// `ft tokenize`: writes the rows the task trains on, as JSON lines,
    /// and says what it wrote (None: the task has no such rows to give).
    pub tokenize: Option<fn(&Tokenize) -> Result<String>>,
}

/// What `ft tokenize` gives a task: `data.*` and `task.*`, the
/// tokenizer.json, and the file the JSON lines go to.
pub struct Tokenize<'a> {
    pub config: &'a Config,
    pub tokenizer: &'a Path,
    pub out: &'a Path,
}
inventory::collect!(TaskRegistration);

/// Reads a task's own `task.*` keys into its options struct, naming any
/// unknown key (the options struct should deny unknown fields).
pub fn options<T: DeserializeOwned>(task: &str, value: &serde_json::Value) -> Result<T> {
    serde_json::from_value(value.clone()).map_err(|e| anyhow::anyhow!("task.* keys of task `{task}`: {e}"))
}

/// The indices of `len` items this rank takes: every `world`-th from its
/// rank, so shares differ by at most one item.
pub fn rank_share(comm: &Communicator, len: usize) -> Vec<usize> {
    let env = comm.env();
    (env.rank..len).step_by(env.world_size).collect()
}

/// Every rank's `mine`, in rank order, on every rank (e.g. each rank's
/// share of the predictions, gathered for scoring).
pub fn all_gather_json<T: Serialize + DeserializeOwned>(comm: &Communicator, mine: &T) -> Result<Vec<T>> {
    let parts = comm.all_gather_bytes(&serde_json::to_vec(mine)?)?;
    parts.iter().map(|bytes| Ok(serde_json::from_slice(bytes)?)).collect()
}

/// Refuses a model whose head the task cannot train, naming both.
pub fn check_head(task: &str, expected: &str, model: &dyn Model) -> Result<()> {
    if model.head_kind() != expected {
        bail!(
            "task `{task}` trains a {expected} head, but this {} model has a {} head (choose the task with --task, or a model with that head)",
            model.model_type(),
            model.head_kind()
        );
    }
    Ok(())
}

/// Refuses sequences too short for any example ([`DataConfig::check_max_seq_len`])
/// or longer than the model's learned positions (`Model::max_positions`)
/// before any data is read, naming both keys: `data.max_seq_len` is the
/// longest sequence (or window) a task builds.
pub fn check_sequence_length(data: &DataConfig, model: &dyn Model) -> Result<()> {
    data.check_max_seq_len()?;
    let max_seq_len = data.max_seq_len;
    if let Some(positions) = model.max_positions().filter(|&positions| max_seq_len as i64 > positions) {
        bail!(
            "data.max_seq_len ({max_seq_len}) is longer than this {} model's max_position_embeddings ({positions}, in its config.json): \
             set --max-seq-len (data.max_seq_len) to at most {positions}",
            model.model_type()
        );
    }
    Ok(())
}
