//! `grpo` and `rloo`: online RL of a causal LM with TRL's losses
//! (trl/trainer/grpo_trainer.py and rloo_trainer.py, TRL 1.16) — GRPO and
//! its family by `task.loss_type` (`grpo`, `bnpo`, `dr_grpo`, `dapo`) and
//! `task.importance_sampling_level` (`sequence`: GSPO), and RLOO's
//! leave-one-out baseline — over completions ft's own generator samples
//! from the weights being trained, in the trainer's process: nothing is
//! copied to a second engine, nothing synchronised.
//!
//! The training set is the prompts (TRL's prompt-only rows, text or
//! conversational) each repeated `task.num_generations` times; the batch
//! size counts completions, as TRL's does. At the start of each window of
//! steps (`steps_per_generation / grad_accum` optimizer steps, trained
//! `num_iterations` times) the loop gives [`Rollouts::generate`] the policy's
//! whole parameters: each rank samples its examples' completions (seeded
//! by the run's seed, the window's step and the example, so a row's
//! completion depends on nothing else), scores them with the reward
//! functions (`rewards`), gathers every rank's rewards, and computes the
//! advantages over each prompt's group as TRL does. The loss takes the
//! completions' log-probabilities (logits over `task.temperature`) a chunk
//! of tokens at a time and backpropagates through the head as a weight per
//! token, as DPO's does.
//!
//! Each window's rollouts go to `OUTPUT/rollouts.jsonl`, one row per
//! completion grouped by prompt; TRL's figures (`reward`, `reward_std`,
//! `rewards/NAME/mean`, `kl`, `entropy`, `clip_ratio/…`, …) are logged each step.
//!
//! A resume continues exactly: at a window's start the seeds make the same
//! completions; a window of more than one step is kept by each rank in
//! `OUTPUT/rollout_window/` (its samples, log-probabilities and advantages),
//! which a run resumed inside it trains on again (without them, it samples
//! again from the resumed weights and warns). A run's first generation
//! drops the rows rollouts.jsonl has of the windows it trains (again).

use crate::rewards::{RewardBatch, RewardOptions, RewardSpec, Rewards, TrainerState};
use anyhow::{bail, Context as _, Result};
use ft_core::batches::to_device_async;
use ft_core::config::{Config, TrainConfig};
use ft_core::dataset::{Batch, Dataset};
use ft_core::distributed::comm::Communicator;
use ft_core::generate::{sample_batch_from, Decoding, Sampling};
use ft_core::model::{head, lm_outputs, Inputs, Model};
use ft_core::task::{self, Objective, Rollout, RolloutWindow, Rollouts, Scores, StartingModel, StepMetrics, Synthetic, Task, TaskInputs, TaskRegistration, SourcedModel};
use ft_core::train::loss::{lm_head_weighted_loss_and_grads, lm_label_logps_and_entropies, TargetRows, IGNORE_INDEX};
use ft_core::train::Kernels;
use ft_data::chat::{ChatTemplate, Conversation};
use ft_data::example::{eos_id, ids, Positions};
use ft_data::source::{Source, Split};
use ft_data::lm;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;
use tch::{Device, Kind, Tensor};
use tokenizers::Tokenizer;

/// Where a run writes its rollouts.
pub const ROLLOUTS_FILE: &str = "rollouts.jsonl";

/// Where each rank keeps the samples of the window being trained when it
/// spans more than one step: a run resumed inside the window trains on them again.
const KEPT_WINDOW_DIR: &str = "rollout_window";

/// TRL's GRPO loss types (`GRPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LossType {
    /// Each sequence's mean over its tokens, then the mean over sequences.
    Grpo,
    /// The mean over the micro-batch's tokens.
    Bnpo,
    /// The sum over tokens divided by sequences x `max_completion_length`.
    DrGrpo,
    /// The sum over tokens divided by the tokens of the step (of the generation batch, per step).
    Dapo,
}

/// How rewards are scaled into advantages (`scale_rewards`; TRL's `true`/`false` are `group`/`none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScaleRewards {
    Group,
    Batch,
    None,
}

impl<'de> Deserialize<'de> for ScaleRewards {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Json::deserialize(deserializer)? {
            Json::Bool(true) => Ok(ScaleRewards::Group),
            Json::Bool(false) => Ok(ScaleRewards::None),
            Json::String(s) if s == "group" => Ok(ScaleRewards::Group),
            Json::String(s) if s == "batch" => Ok(ScaleRewards::Batch),
            Json::String(s) if s == "none" => Ok(ScaleRewards::None),
            other => Err(serde::de::Error::custom(format!("scale_rewards {other}: expected group, batch or none (or true/false)"))),
        }
    }
}

/// Where importance weights are taken (`importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Level {
    Token,
    /// GSPO: one weight per sequence, from its tokens' mean log-ratio.
    Sequence,
}

/// Which trainer's algorithm: GRPO's group-normalised advantages and
/// clipped per-token loss, or RLOO's leave-one-out baseline and clipped
/// per-sequence loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Algorithm {
    Grpo,
    Rloo,
}

impl Algorithm {
    fn name(self) -> &'static str {
        match self {
            Algorithm::Grpo => "grpo",
            Algorithm::Rloo => "rloo",
        }
    }
}

/// `task.*` keys, named as TRL's GRPOConfig / RLOOConfig names them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Options {
    num_generations: usize,
    max_completion_length: usize,
    temperature: f64,
    top_p: f64,
    top_k: i64,
    min_p: Option<f64>,
    repetition_penalty: f64,
    /// None: TRL's default (GRPO 0, RLOO 0.05).
    beta: Option<f64>,
    epsilon: f64,
    epsilon_high: Option<f64>,
    /// The KL term times the importance weight (GRPO; TRL's default).
    use_bias_correction_kl: bool,
    /// GRPO only (None: dapo).
    loss_type: Option<LossType>,
    /// GRPO only (None: group).
    scale_rewards: Option<ScaleRewards>,
    /// GRPO only (None: token).
    importance_sampling_level: Option<Level>,
    /// RLOO only: advantages normalised over the batch.
    normalize_advantages: Option<bool>,
    num_iterations: usize,
    /// None: `train.grad_accum`.
    steps_per_generation: Option<usize>,
    mask_truncated_completions: bool,
    reward_weights: Option<Vec<f64>>,
    /// `--reward`: `FILE.py:FUNCTION` or a built-in's name.
    rewards: Vec<String>,
    /// The built-in rewards' settings (`rewards::RewardOptions`).
    format_pattern: Option<String>,
    max_completion_len: Option<usize>,
    soft_punish_cache: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            num_generations: 8,
            max_completion_length: 512,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            beta: None,
            epsilon: 0.2,
            epsilon_high: None,
            use_bias_correction_kl: true,
            loss_type: None,
            scale_rewards: None,
            importance_sampling_level: None,
            normalize_advantages: None,
            num_iterations: 1,
            steps_per_generation: None,
            mask_truncated_completions: false,
            reward_weights: None,
            rewards: vec![],
            format_pattern: None,
            max_completion_len: None,
            soft_punish_cache: None,
        }
    }
}

impl Options {
    fn read(algorithm: Algorithm, value: &Json) -> Result<Options> {
        let options: Options = task::options(algorithm.name(), value)?;
        let other = match algorithm {
            Algorithm::Grpo => [("normalize_advantages", options.normalize_advantages.is_some())].to_vec(),
            Algorithm::Rloo => [
                ("loss_type", options.loss_type.is_some()),
                ("scale_rewards", options.scale_rewards.is_some()),
                ("importance_sampling_level", options.importance_sampling_level.is_some()),
            ]
            .to_vec(),
        };
        if let Some((key, _)) = other.iter().find(|(_, given)| *given) {
            let owner = if algorithm == Algorithm::Grpo { "rloo" } else { "grpo" };
            bail!("task.{key} is a key of task `{owner}`, not of `{}`", algorithm.name());
        }
        if options.num_generations < 2 {
            bail!("task.num_generations is {}: a group needs at least 2 completions to compare", options.num_generations);
        }
        if options.max_completion_length == 0 {
            bail!("task.max_completion_length must be at least 1");
        }
        if options.num_iterations == 0 || options.steps_per_generation == Some(0) {
            bail!("task.num_iterations and task.steps_per_generation must be at least 1");
        }
        if !(options.epsilon >= 0.0 && options.epsilon_high.is_none_or(|e| e >= 0.0)) {
            bail!("task.epsilon and task.epsilon_high must be at least 0");
        }
        if options.beta.is_some_and(|b| !(b >= 0.0 && b.is_finite())) {
            bail!("task.beta must be a finite number ≥ 0");
        }
        options.sampling()?;
        if options.rewards.is_empty() {
            bail!("task `{}` needs at least one reward function: --reward FILE.py:FUNCTION or a built-in (accuracy, format, length), or task.rewards", algorithm.name());
        }
        if let Some(weights) = &options.reward_weights {
            if weights.len() != options.rewards.len() {
                bail!("task.reward_weights has {} weights for {} reward functions", weights.len(), options.rewards.len());
            }
        }
        Ok(options)
    }

    /// Whether a generation (TRL's `generation_batch_size`: the completions
    /// of `steps_per_generation` micro-batches on every one of `world` ranks)
    /// serves whole optimizer steps and samples whole groups of `num_generations`.
    fn check_batches(&self, train: &TrainConfig, world: usize) -> Result<()> {
        let per_generation = self.window(train)?.steps * train.grad_accum;
        let generation = train.batch_size * world * per_generation;
        if generation % self.num_generations != 0 {
            bail!(
                "a generation of {generation} completions (batch_size {} x {world} ranks x task.steps_per_generation {per_generation}) is not a whole number of groups of task.num_generations {}: make one a multiple of the other",
                train.batch_size,
                self.num_generations
            );
        }
        Ok(())
    }

    /// The steps a generation serves, and their passes.
    fn window(&self, train: &TrainConfig) -> Result<RolloutWindow> {
        let per_generation = self.steps_per_generation.unwrap_or(train.grad_accum);
        if per_generation % train.grad_accum != 0 {
            bail!("task.steps_per_generation {per_generation} is not a multiple of train.grad_accum {}: a generation serves whole optimizer steps", train.grad_accum);
        }
        Ok(RolloutWindow { steps: per_generation / train.grad_accum, passes: self.num_iterations })
    }

    fn sampling(&self) -> Result<Sampling> {
        let sampling = Sampling { temperature: self.temperature, top_k: self.top_k, top_p: self.top_p, min_p: self.min_p, repetition_penalty: self.repetition_penalty };
        sampling.check(|name| format!("task.{name}"))?;
        Ok(sampling)
    }

    fn reward_options(&self) -> RewardOptions {
        RewardOptions { format_pattern: self.format_pattern.clone(), max_completion_len: self.max_completion_len, soft_punish_cache: self.soft_punish_cache }
    }

    fn beta(&self, algorithm: Algorithm) -> f64 {
        self.beta.unwrap_or(if algorithm == Algorithm::Rloo { 0.05 } else { 0.0 })
    }
}

/// A prompt-only row: the prompt as given (text or messages), its tokens,
/// and the row's other columns (what reward functions read).
#[derive(Debug, Clone)]
struct Prompt {
    prompt: Json,
    ids: Vec<i64>,
    columns: serde_json::Map<String, Json>,
}

/// A completion sampled for one example, and what the loss reads of it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Sample {
    completion: Vec<i64>,
    /// Its tokens that count in the loss: all of them, or none when
    /// `mask_truncated_completions` masks a completion that did not end.
    counted: bool,
    advantage: f64,
    /// Each completion token's log-probability under the policy that
    /// sampled it (kept when a window trains more than one step on it, and
    /// by RLOO), and under the reference model (β > 0).
    old_logps: Option<Vec<f32>>,
    ref_logps: Option<Vec<f32>>,
}

impl Sample {
    /// The sum of `logps` over the tokens the loss counts (TRL's masked sum).
    fn counted_sum(&self, logps: &Option<Vec<f32>>) -> f64 {
        match (self.counted, logps) {
            (true, Some(logps)) => logps.iter().map(|&v| v as f64).sum(),
            _ => 0.0,
        }
    }
}

/// The prompts, each `group` times: example `i` is prompt `i / group`'s
/// completion `i % group`, filled in by each rollout.
pub struct RolloutSet {
    prompts: Vec<Prompt>,
    group: usize,
    samples: BTreeMap<usize, Sample>,
    pad_id: i64,
    pad_multiple: usize,
    /// DAPO's normaliser for the window's steps: the window's counted completion tokens over its steps.
    tokens_per_step: f64,
}

/// The targets of a collated batch, by position.
const LABELS: usize = 0;
const ADVANTAGES: usize = 1;
const OLD_LOGPS: usize = 2;
const REF_LOGPS: usize = 3;
const TOKENS_PER_STEP: usize = 4;

impl RolloutSet {
    fn sample(&self, index: usize) -> Result<&Sample> {
        self.samples.get(&index).with_context(|| format!("example {index} has no rollout: the loop trains an example before generating its completion"))
    }
}

impl Dataset for RolloutSet {
    fn len(&self) -> usize {
        self.prompts.len() * self.group
    }

    fn tokens(&self, index: usize) -> usize {
        self.prompts[index / self.group].ids.len() + self.samples.get(&index).map_or(0, |s| s.completion.len())
    }

    /// A completion each: the normaliser of GRPO's and RLOO's means over sequences.
    fn loss_weight(&self, _index: usize) -> usize {
        1
    }

    /// Prompt then completion, right-padded; labels on the counted
    /// completion tokens; the advantages [batch]; the sampling policy's and
    /// the reference's log-probabilities [batch, seq] aligned with the
    /// labels (0 where none are kept); DAPO's tokens per step [1].
    fn collate(&self, indices: &[usize], device: Device) -> Result<Batch> {
        let rows: Vec<(&Prompt, &Sample)> = indices.iter().map(|&i| Ok((&self.prompts[i / self.group], self.sample(i)?))).collect::<Result<_>>()?;
        let longest = rows.iter().map(|(p, s)| p.ids.len() + s.completion.len()).max().unwrap_or(0).div_ceil(self.pad_multiple) * self.pad_multiple;
        let (mut input_ids, mut labels, mut real, mut old, mut reference) = (vec![], vec![], vec![], vec![], vec![]);
        // Per-token values beside the labels: 0 over the prompt and the padding.
        let aligned = |prompt: &Prompt, sample: &Sample, values: &Option<Vec<f32>>| {
            let mut row = vec![0f32; prompt.ids.len()];
            row.extend(values.clone().unwrap_or_else(|| vec![0.0; sample.completion.len()]));
            row.resize(longest, 0.0);
            row
        };
        for (prompt, sample) in &rows {
            let used = prompt.ids.len() + sample.completion.len();
            let mut row_ids = [prompt.ids.as_slice(), &sample.completion].concat();
            let mut row_labels = vec![IGNORE_INDEX; prompt.ids.len()];
            row_labels.extend(sample.completion.iter().map(|&id| if sample.counted { id } else { IGNORE_INDEX }));
            real.push([vec![1i64; used], vec![0; longest - used]].concat());
            row_ids.resize(longest, self.pad_id);
            row_labels.resize(longest, IGNORE_INDEX);
            input_ids.push(row_ids);
            labels.push(row_labels);
            old.push(aligned(prompt, sample, &sample.old_logps));
            reference.push(aligned(prompt, sample, &sample.ref_logps));
        }
        let mut inputs = Inputs::ids(&to_device_async(&Tensor::from_slice2(&input_ids), device));
        let padded = real.iter().flatten().any(|&token| token == 0);
        inputs.token_mask = padded.then(|| to_device_async(&Tensor::from_slice2(&real), device));
        let advantages: Vec<f32> = rows.iter().map(|(_, s)| s.advantage as f32).collect();
        let targets = vec![
            to_device_async(&Tensor::from_slice2(&labels), device),
            to_device_async(&Tensor::from_slice(&advantages), device),
            to_device_async(&Tensor::from_slice2(&old), device),
            to_device_async(&Tensor::from_slice2(&reference), device),
            to_device_async(&Tensor::from_slice(&[self.tokens_per_step as f32]), device),
        ];
        Ok(Batch { inputs, targets })
    }
}

/// The policy loss over a batch's completions.
pub struct PolicyLoss {
    algorithm: Algorithm,
    loss_type: LossType,
    level: Level,
    beta: f64,
    epsilon_low: f64,
    epsilon_high: f64,
    temperature: f64,
    max_completion_length: usize,
    /// TRL's `use_bias_correction_kl`.
    bias_correction_kl: bool,
    /// Whether batches carry the sampling policy's log-probabilities (a
    /// window trained more than once, and RLOO); else GRPO takes the
    /// current ones, detached (TRL's shortcut).
    old_logps_kept: bool,
    chunk_tokens: i64,
    kernels: Kernels,
    softcap: Option<f64>,
    metrics: Mutex<StepMetrics>,
    /// The last generation's figures (rewards, lengths), until a step logs them.
    window_figures: Mutex<Option<BTreeMap<String, f64>>>,
}

/// A batch's per-token values, [batch, seq] aligned with the labels.
struct TokenValues {
    rows: TargetRows,
    logps: Tensor,
    entropies: Tensor,
    mask: Tensor,
}

impl PolicyLoss {
    /// The LM head's weight over the temperature: logits / T, as TRL divides them.
    fn tempered(&self, weight: &Tensor) -> Tensor {
        if self.temperature == 1.0 {
            weight.shallow_clone()
        } else {
            weight / self.temperature
        }
    }

    fn token_values(&self, hidden: &Tensor, weight: &Tensor, batch: &Batch) -> Result<TokenValues> {
        let labels = &batch.targets[LABELS];
        let rows = TargetRows::of(hidden, labels)?;
        let (logps, entropies) = lm_label_logps_and_entropies(&rows, &self.tempered(weight), self.chunk_tokens, self.softcap)?;
        Ok(TokenValues { rows, logps, entropies, mask: labels.ne(IGNORE_INDEX).to_kind(Kind::Float) })
    }

    /// TRL's `_compute_loss` over the per-token log-probabilities `logps`
    /// (a leaf the gradient is taken of): the micro-batch's share of the
    /// step's loss (`completions`: the global batch's), and its figures.
    fn loss(&self, logps: &Tensor, values: &TokenValues, batch: &Batch, completions: f64) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
        let mask = &values.mask;
        let advantages = batch.targets[ADVANTAGES].unsqueeze(1);
        let sequences = mask.size()[0] as f64;
        let seq_mean = |x: &Tensor| (x * mask).sum_dim_intlist(-1, false, Kind::Float) / mask.sum_dim_intlist(-1, false, Kind::Float).clamp_min(1.0);
        let token_mean = |x: &Tensor| (x * mask).sum(Kind::Float) / mask.sum(Kind::Float).clamp_min(1.0);
        let mut figures = BTreeMap::from([("entropy".to_string(), token_mean(&values.entropies))]);
        let clip = |coef: &Tensor, advantages: &Tensor| {
            let coef_2 = coef.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high);
            let low = coef.lt(1.0 - self.epsilon_low).logical_and(&advantages.lt(0.0)).to_kind(Kind::Float);
            let high = coef.gt(1.0 + self.epsilon_high).logical_and(&advantages.gt(0.0)).to_kind(Kind::Float);
            let loss = -(coef * advantages).minimum(&(coef_2 * advantages));
            (loss, low, high)
        };
        if self.algorithm == Algorithm::Rloo {
            let sums = (logps * mask).sum_dim_intlist(-1, false, Kind::Float);
            let old_sums = (&batch.targets[OLD_LOGPS] * mask).sum_dim_intlist(-1, false, Kind::Float);
            let coef = (&sums - old_sums).exp();
            let (loss, low, high) = clip(&coef, &batch.targets[ADVANTAGES]);
            let mean = |x: &Tensor| x.mean(Kind::Float);
            figures.insert("clip_ratio/low_mean".into(), mean(&low));
            figures.insert("clip_ratio/high_mean".into(), mean(&high));
            figures.insert("clip_ratio/region_mean".into(), mean(&(&low + &high)));
            return Ok((loss.sum(Kind::Float) / completions, figures));
        }
        let old = if self.old_logps_kept { batch.targets[OLD_LOGPS].shallow_clone() } else { logps.detach() };
        let log_ratio = logps - old;
        let log_weights = match self.level {
            Level::Token => log_ratio,
            Level::Sequence => seq_mean(&log_ratio).unsqueeze(-1),
        };
        let coef = log_weights.exp();
        let (mut per_token, low, high) = clip(&coef, &advantages);
        // Seen per token or per sequence, as TRL's figures see them.
        let clipped_mean = |x: &Tensor| match self.level {
            Level::Token => token_mean(x),
            Level::Sequence => x.mean(Kind::Float),
        };
        figures.insert("clip_ratio/low_mean".into(), clipped_mean(&low));
        figures.insert("clip_ratio/high_mean".into(), clipped_mean(&high));
        figures.insert("clip_ratio/region_mean".into(), clipped_mean(&(&low + &high)));
        if self.beta != 0.0 {
            let delta = &batch.targets[REF_LOGPS] - logps;
            let mut kl = delta.exp() - &delta - 1.0;
            if self.bias_correction_kl {
                // The unbiased reverse-KL gradient (TRL's default): the term times the importance weight.
                kl = kl * &coef;
            }
            figures.insert("kl".into(), token_mean(&kl));
            per_token = per_token + kl * self.beta;
        }
        // TRL's loss of a micro-batch, over the micro-batches of the global batch (accumulation x ranks).
        let micro_batches = completions / sequences;
        let loss = match self.loss_type {
            LossType::Grpo => seq_mean(&per_token).sum(Kind::Float) / completions,
            LossType::Bnpo => token_mean(&per_token) / micro_batches,
            LossType::DrGrpo => (&per_token * mask).sum(Kind::Float) / (completions * self.max_completion_length as f64),
            LossType::Dapo => (&per_token * mask).sum(Kind::Float) / batch.targets[TOKENS_PER_STEP].squeeze().clamp_min(1.0),
        };
        Ok((loss, figures))
    }
}

impl Objective for PolicyLoss {
    fn loss_and_grads(&self, outputs: &[Tensor], batch: &Batch, normalizer: f64, loss_scale: Option<&Tensor>) -> Result<(Tensor, Vec<Tensor>)> {
        let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
        let values = self.token_values(&hidden, &weight, batch)?;
        let logps = values.logps.detach().set_requires_grad(true);
        let (loss, figures) = tch::with_grad(|| self.loss(&logps, &values, batch, normalizer))?;
        tch::with_grad(|| loss.backward());
        // Each token's cross-entropy (its negated log-probability) weighed by the loss's gradient, negated.
        let token_weights = match logps.grad().defined() {
            true => -logps.grad(),
            false => logps.zeros_like(),
        };
        let tempered = self.tempered(&weight);
        let (_, grad_hidden, mut grad_weight) =
            lm_head_weighted_loss_and_grads(&hidden, &tempered, &values.rows, &token_weights, self.chunk_tokens, loss_scale, self.kernels, weight.requires_grad(), self.softcap)?;
        if self.temperature != 1.0 && grad_weight.defined() {
            // The logits are hidden · (W / T): W's gradient is (W / T)'s over T.
            grad_weight = grad_weight / self.temperature;
        }
        let sequences = values.mask.size()[0] as f64;
        let mut metrics = self.metrics.lock().expect("metrics lock");
        // Each figure as its micro-batch's mean, weighed by the micro-batch's completions.
        let mut step = StepMetrics { sums: figures.iter().map(|(name, value)| (name.clone(), value.double_value(&[]) * sequences)).collect(), count: sequences, counts: BTreeMap::new() };
        // A generation's figures join the first micro-batch trained on it (TRL logs them once per
        // generation), the same on every rank: each counts once a rank.
        for (name, value) in self.window_figures.lock().expect("figures lock").take().unwrap_or_default() {
            step.sums.insert(name.clone(), value);
            step.counts.insert(name, 1.0);
        }
        metrics.add(step);
        Ok((loss.detach(), vec![grad_hidden, grad_weight]))
    }

    /// No evaluation set: the rollouts' rewards are what a run is judged by.
    fn loss_sum(&self, _outputs: &[Tensor], _batch: &Batch) -> Result<(f64, f64)> {
        bail!("the {} task has no evaluation loss", self.algorithm.name())
    }

    fn take_step_metrics(&self) -> StepMetrics {
        std::mem::take(&mut *self.metrics.lock().expect("metrics lock"))
    }
}

/// One completion's scores, as every rank gathers them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Scored {
    index: usize,
    /// One per reward function; None: it does not apply (NaN in TRL).
    rewards: Vec<Option<f64>>,
    length: usize,
    truncated: bool,
    counted_tokens: usize,
    /// The summed log-ratio of the sampling policy to the reference over the counted tokens (RLOO's KL).
    log_ratio: f64,
    /// Columns the reward functions added (`log_extra`), shown in rollouts.jsonl.
    extra: serde_json::Map<String, Json>,
    /// What rollouts.jsonl shows (rank 0 writes it).
    prompt: Json,
    completion: Json,
    prompt_ids: Vec<i64>,
    completion_ids: Vec<i64>,
}

/// What one rank's generation gives the others: its completions' scores,
/// what its reward functions logged (each name's sum and count), and its
/// sampling's seconds.
#[derive(Serialize, Deserialize)]
struct RankRollout {
    scored: Vec<Scored>,
    logged: BTreeMap<String, (f64, f64)>,
    sampled_seconds: f64,
}

/// TRL's `nanstd`: the standard deviation of the values that are not NaN, with Bessel's correction (NaN for fewer than 2).
fn nanstd(values: &[f64]) -> f64 {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if kept.len() < 2 {
        return f64::NAN;
    }
    let mean = kept.iter().sum::<f64>() / kept.len() as f64;
    (kept.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (kept.len() - 1) as f64).sqrt()
}

fn nanmean(values: &[f64]) -> f64 {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// Each completion's weighted reward (NaN where no function applies) and
/// its advantage, over groups of `group` in order, as TRL computes them;
/// with whether each completion's group (or batch) had a zero reward spread.
/// `penalties` are subtracted from the weighted rewards before the
/// advantages (RLOO's KL term; 0 for GRPO), not from the rewards returned (what TRL logs).
fn advantages(algorithm: Algorithm, per_function: &[Vec<f64>], weights: &[f64], penalties: &[f64], group: usize, scale: ScaleRewards, normalize: bool) -> (Vec<f64>, Vec<f64>, Vec<bool>) {
    let logged: Vec<f64> = per_function
        .iter()
        .map(|values| match values.iter().all(|v| v.is_nan()) {
            true => f64::NAN,
            false => values.iter().zip(weights).filter(|(v, _)| !v.is_nan()).map(|(v, w)| v * w).sum::<f64>(),
        })
        .collect();
    let rewards: Vec<f64> = logged.iter().zip(penalties).map(|(reward, penalty)| reward - penalty).collect();
    let batch_std = nanstd(&rewards);
    let mut advantages = Vec::with_capacity(rewards.len());
    let mut zero_std = Vec::with_capacity(rewards.len());
    for members in rewards.chunks(group) {
        let (mean, std) = (nanmean(members), nanstd(members));
        let scorable = members.iter().filter(|v| !v.is_nan()).count() as f64;
        let sum: f64 = members.iter().filter(|v| !v.is_nan()).sum();
        for &reward in members {
            let advantage = match algorithm {
                Algorithm::Grpo => match scale {
                    ScaleRewards::Group => (reward - mean) / (std + 1e-4),
                    ScaleRewards::Batch => (reward - mean) / (batch_std + 1e-4),
                    ScaleRewards::None => reward - mean,
                },
                // The leave-one-out baseline: the mean of the others that could be scored.
                Algorithm::Rloo => reward - (sum - reward) / (scorable - 1.0),
            };
            advantages.push(advantage);
            let spread = if algorithm == Algorithm::Grpo && scale == ScaleRewards::Batch { batch_std } else { std };
            zero_std.push(spread.abs() <= 1e-8);
        }
    }
    if algorithm == Algorithm::Rloo && normalize {
        let (mean, std) = (nanmean(&advantages), nanstd(&advantages));
        advantages.iter_mut().for_each(|a| *a = (*a - mean) / (std + 1e-4));
    }
    let advantages = advantages.into_iter().map(|a| if a.is_nan() { 0.0 } else { a }).collect();
    (logged, advantages, zero_std)
}

pub struct OnlineRl {
    algorithm: Algorithm,
    options: Options,
    train: RolloutSet,
    objective: PolicyLoss,
    rewards: Rewards,
    tokenizer: Tokenizer,
    eos: Option<i64>,
    window: RolloutWindow,
    /// Whether this process has generated yet: its first generation drops
    /// the rows rollouts.jsonl has of windows a resumed run trains again.
    generated: bool,
}

/// A window's samples as one rank kept them, with what they are the
/// samples of: the steps before the window, the ranks, and this rank's micro-batches.
#[derive(Serialize, Deserialize)]
struct KeptWindow {
    step: usize,
    world: usize,
    micro_batches: Vec<Vec<usize>>,
    samples: Vec<(usize, Sample)>,
    tokens_per_step: f64,
}

impl KeptWindow {
    fn path(output: &Path, rank: usize) -> std::path::PathBuf {
        output.join(KEPT_WINDOW_DIR).join(format!("rank-{rank:05}.json"))
    }
}

impl OnlineRl {
    /// As TRL: a completion is clipped unless it ends with the EOS or the padding token.
    fn clipped(&self, completion: &[i64]) -> bool {
        completion.last().is_none_or(|&last| Some(last) != self.eos && last != self.train.pad_id)
    }

    /// A completion as reward functions see it: its text, or for a
    /// conversational prompt the assistant's message, as TRL passes it.
    fn completion_value(&self, prompt: &Json, ids: &[i64]) -> Result<Json> {
        let tokens: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
        let text = self.tokenizer.decode(&tokens, true).map_err(anyhow::Error::msg).context("decoding a completion")?;
        Ok(match prompt {
            Json::Array(_) => json!([{"role": "assistant", "content": text}]),
            _ => Json::String(text),
        })
    }

    /// Each of this rank's samples' completion log-probabilities under
    /// `model` (the sampling policy, or the reference), micro-batch by micro-batch.
    fn completion_logps(&self, model: &mut dyn StartingModel, micro_batches: &[Vec<usize>], device: Device) -> Result<Vec<(usize, Vec<f32>)>> {
        let mut kept = vec![];
        for indices in micro_batches {
            let batch = self.train.collate(indices, device)?;
            let mut logps = None;
            model.forward_head(&batch, &mut |outputs| {
                let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
                logps = Some(self.objective.token_values(&hidden, &weight, &batch)?.logps);
                Ok(())
            })?;
            let rows: Vec<Vec<f32>> = Vec::try_from(&logps.context("the model's forward gave its head's outputs to no one")?.to_device(Device::Cpu))?;
            for (row, &index) in rows.iter().zip(indices) {
                let prompt_len = self.train.prompts[index / self.train.group].ids.len();
                let completion_len = self.train.samples[&index].completion.len();
                kept.push((index, row[prompt_len..prompt_len + completion_len].to_vec()));
            }
        }
        Ok(kept)
    }
}

/// A row's sampling seed: the run's seed, the window's step and the example, mixed (splitmix64).
fn row_seed(seed: u64, step: usize, example: usize) -> u64 {
    let mut z = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (example as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rollouts for OnlineRl {
    fn group_size(&self) -> usize {
        self.train.group
    }

    fn window(&self) -> RolloutWindow {
        self.window
    }

    fn max_new_tokens(&self) -> usize {
        self.options.max_completion_length
    }

    fn wants_reference(&self) -> bool {
        self.objective.beta != 0.0
    }

    fn generate(&mut self, mut rollout: Rollout) -> Result<()> {
        let started = Instant::now();
        let group = self.train.group;
        let rank = rollout.comm.env().rank;
        let restored = rollout.resumed_at.is_some() && self.restore_window(&rollout)?;
        if let (Some(at), false, 0) = (rollout.resumed_at, restored, rank) {
            tracing::warn!(
                "resuming at step {at}, inside the rollout window that starts at step {}, with no samples kept for it ({KEPT_WINDOW_DIR}/): its completions are sampled again from the weights at the resume",
                rollout.step + 1
            );
        }
        if let (false, 0, Some(output)) = (self.generated, rank, rollout.output) {
            // Rows of this window (unless restored) and of any after it are of steps this run trains again.
            keep_rollouts_before(&output.join(ROLLOUTS_FILE), rollout.step + 1 + usize::from(restored))?;
        }
        self.generated = true;
        if restored {
            return Ok(());
        }
        // A window trains its own examples only.
        self.train.samples.clear();
        let mine: Vec<usize> = rollout.micro_batches.concat();
        let device = rollout.comm.device();
        let prompt_ids: Vec<Vec<i64>> = mine.iter().map(|&i| self.train.prompts[i / group].ids.clone()).collect();
        let seeds: Vec<u64> = mine.iter().map(|&i| row_seed(rollout.seed, rollout.step, i)).collect();
        let decoding = Decoding { pad_id: self.train.pad_id, ..Decoding::greedy(self.options.max_completion_length, self.eos, rollout.dtype) };
        let (model, source) = match rollout.sampler.as_mut() {
            Some((model, source)) => (*model, &mut **source),
            None => (rollout.model, &mut *rollout.policy),
        };
        let completions = sample_batch_from(model, source, &prompt_ids, &seeds, &self.options.sampling()?, &decoding)?;
        let sampled_seconds = started.elapsed().as_secs_f64();
        for (&index, completion) in mine.iter().zip(completions) {
            let counted = !(self.options.mask_truncated_completions && self.clipped(&completion));
            self.train.samples.insert(index, Sample { completion, counted, ..Sample::default() });
        }
        if self.objective.old_logps_kept {
            let policy = self.completion_logps(&mut SourcedModel { model: rollout.model, source: &mut *rollout.policy, dtype: rollout.dtype }, &rollout.micro_batches, device)?;
            for (index, logps) in policy {
                self.train.samples.get_mut(&index).expect("sampled above").old_logps = Some(logps);
            }
        }
        if let Some(reference) = rollout.reference.as_deref_mut() {
            for (index, logps) in self.completion_logps(reference, &rollout.micro_batches, device)? {
                self.train.samples.get_mut(&index).expect("sampled above").ref_logps = Some(logps);
            }
        }
        let state = TrainerState { global_step: rollout.step as u64, max_steps: rollout.last_step as u64, epoch: rollout.epoch };
        let (scored, logged) = self.score(&mine, state)?;

        // Every rank's, in one gather: the scores in the window's order of examples (grouped by prompt).
        let gathered = task::all_gather_json(rollout.comm, &RankRollout { scored, logged, sampled_seconds })?;
        // Sampling speed: every rank's tokens over the slowest rank's time.
        let slowest = gathered.iter().map(|r| r.sampled_seconds).fold(0.0, f64::max);
        // What the reward functions logged (`log_metric`): each name's mean over every rank's calls.
        let mut logged_totals: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for (name, (sum, count)) in gathered.iter().flat_map(|r| &r.logged) {
            let total = logged_totals.entry(name.clone()).or_default();
            (total.0, total.1) = (total.0 + sum, total.1 + count);
        }
        let order: BTreeMap<usize, usize> = rollout.examples.iter().enumerate().map(|(k, &index)| (index, k)).collect();
        let mut all: Vec<Scored> = gathered.into_iter().flat_map(|r| r.scored).collect();
        all.sort_by_key(|s| order.get(&s.index).copied().unwrap_or(usize::MAX));
        let per_function: Vec<Vec<f64>> = all.iter().map(|s| s.rewards.iter().map(|r| r.unwrap_or(f64::NAN)).collect()).collect();
        let weights = self.options.reward_weights.clone().unwrap_or_else(|| vec![1.0; self.rewards.names().len()]);
        let scale = self.options.scale_rewards.unwrap_or(ScaleRewards::Group);
        // RLOO's KL penalty is in the reward: β times each completion's summed log-ratio to the reference.
        let penalties: Vec<f64> = all.iter().map(|s| if self.algorithm == Algorithm::Rloo { self.objective.beta * s.log_ratio } else { 0.0 }).collect();
        let (rewards, advantages, zero_std) = advantages(self.algorithm, &per_function, &weights, &penalties, group, scale, self.options.normalize_advantages.unwrap_or(false));
        // The samples held are this rank's own.
        for (k, scored) in all.iter().enumerate() {
            if let Some(sample) = self.train.samples.get_mut(&scored.index) {
                sample.advantage = advantages[k];
            }
        }
        let window_tokens: usize = all.iter().map(|s| s.counted_tokens).sum();
        self.train.tokens_per_step = window_tokens as f64 / self.window.steps as f64;
        if let (true, Some(output)) = (self.window.steps * self.window.passes > 1, rollout.output) {
            self.keep_window(&rollout, output)?;
        }

        let mut figures = self.figures(&all, &per_function, &rewards, &zero_std);
        figures.extend(logged_totals.into_iter().map(|(name, (sum, count))| (name, sum / count.max(1.0))));
        figures.insert("rollout/tokens_per_second".to_string(), all.iter().map(|s| s.length).sum::<usize>() as f64 / slowest.max(1e-9));
        *self.objective.window_figures.lock().expect("figures lock") = Some(figures);
        if let (0, Some(output)) = (rank, rollout.output) {
            self.write_rollouts(&output.join(ROLLOUTS_FILE), rollout.step + 1, &all, &rewards, &advantages)?;
        }
        Ok(())
    }
}

impl OnlineRl {
    /// Writes this rank's samples of the window for a resume inside it
    /// (whole or not at all: written aside, then renamed).
    fn keep_window(&self, rollout: &Rollout, output: &Path) -> Result<()> {
        let env = rollout.comm.env();
        let kept = KeptWindow {
            step: rollout.step,
            world: env.world_size,
            micro_batches: rollout.micro_batches.clone(),
            samples: self.train.samples.iter().map(|(&index, sample)| (index, sample.clone())).collect(),
            tokens_per_step: self.train.tokens_per_step,
        };
        let (path, bytes) = (KeptWindow::path(output, env.rank), serde_json::to_vec(&kept)?);
        let partial = path.with_extension("json.partial");
        let written = std::fs::create_dir_all(path.parent().expect("a file in a directory")).and_then(|()| std::fs::write(&partial, bytes));
        written.and_then(|()| std::fs::rename(&partial, &path)).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Takes back the samples kept for the window a run resumed inside,
    /// when every rank kept them (else every rank samples again: sampling
    /// is collective). Collective.
    fn restore_window(&mut self, rollout: &Rollout) -> Result<bool> {
        let env = rollout.comm.env();
        let kept = rollout.output.and_then(|output| {
            let path = KeptWindow::path(output, env.rank);
            let kept: KeptWindow = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
            (kept.step == rollout.step && kept.world == env.world_size && kept.micro_batches == rollout.micro_batches).then_some(kept)
        });
        let everywhere = rollout.comm.all_gather_bytes(&[u8::from(kept.is_some())])?.iter().all(|kept| kept == &[1]);
        let Some(kept) = kept.filter(|_| everywhere) else { return Ok(false) };
        self.train.samples = kept.samples.into_iter().collect();
        self.train.tokens_per_step = kept.tokens_per_step;
        if env.rank == 0 {
            tracing::info!("resuming inside the rollout window that starts at step {}: its samples kept in {KEPT_WINDOW_DIR}/ are trained on again", rollout.step + 1);
        }
        Ok(true)
    }

    /// The reward functions' scores of this rank's samples `mine`, with
    /// what every rank gathers of them, and what the functions logged
    /// (`log_metric`: each name's sum and count).
    fn score(&mut self, mine: &[usize], trainer_state: TrainerState) -> Result<(Vec<Scored>, BTreeMap<String, (f64, f64)>)> {
        let group = self.train.group;
        let prompts: Vec<&Prompt> = mine.iter().map(|&i| &self.train.prompts[i / group]).collect();
        let samples: Vec<&Sample> = mine.iter().map(|i| &self.train.samples[i]).collect();
        let completions: Vec<Vec<i64>> = samples.iter().map(|s| s.completion.clone()).collect();
        let values: Vec<Json> = prompts.iter().zip(&completions).map(|(p, c)| self.completion_value(&p.prompt, c)).collect::<Result<_>>()?;
        let mut columns: BTreeMap<String, Vec<Json>> = BTreeMap::new();
        for prompt in &prompts {
            for (name, value) in &prompt.columns {
                columns.entry(name.clone()).or_default().push(value.clone());
            }
        }
        let prompt_values: Vec<Json> = prompts.iter().map(|p| p.prompt.clone()).collect();
        let scores = self.rewards.score(&RewardBatch { prompts: &prompt_values, completions: &values, completion_ids: &completions, columns: &columns, trainer_state })?;
        let mut scored = vec![];
        for (k, (&index, sample)) in mine.iter().zip(&samples).enumerate() {
            scored.push(Scored {
                index,
                rewards: scores.rewards.iter().map(|per_function| per_function[k]).collect(),
                extra: scores.extra_columns.iter().map(|(column, values)| (column.clone(), values.get(k).cloned().unwrap_or(Json::Null))).collect(),
                length: sample.completion.len(),
                truncated: self.clipped(&sample.completion),
                counted_tokens: if sample.counted { sample.completion.len() } else { 0 },
                log_ratio: sample.counted_sum(&sample.old_logps) - sample.counted_sum(&sample.ref_logps),
                prompt: prompt_values[k].clone(),
                completion: values[k].clone(),
                prompt_ids: prompts[k].ids.clone(),
                completion_ids: sample.completion.clone(),
            });
        }
        let logged = scores.metrics.iter().map(|(name, values)| (name.clone(), (values.iter().sum(), values.len() as f64))).collect();
        Ok((scored, logged))
    }

    /// TRL's figures of a generation, the same on every rank.
    fn figures(&self, all: &[Scored], per_function: &[Vec<f64>], rewards: &[f64], zero_std: &[bool]) -> BTreeMap<String, f64> {
        let n = all.len() as f64;
        let mut figures = BTreeMap::from([
            ("reward".to_string(), nanmean(rewards)),
            ("reward_std".to_string(), nanstd(rewards)),
            ("frac_reward_zero_std".to_string(), zero_std.iter().filter(|&&z| z).count() as f64 / n),
            ("completions/mean_length".to_string(), all.iter().map(|s| s.length).sum::<usize>() as f64 / n),
            ("completions/clipped_ratio".to_string(), all.iter().filter(|s| s.truncated).count() as f64 / n),
        ]);
        for (f, name) in self.rewards.names().iter().enumerate() {
            let values: Vec<f64> = per_function.iter().map(|r| r[f]).collect();
            figures.insert(format!("rewards/{name}/mean"), nanmean(&values));
            figures.insert(format!("rewards/{name}/std"), nanstd(&values));
        }
        if self.algorithm == Algorithm::Rloo && self.objective.beta != 0.0 {
            // RLOO's `kl`: the mean per-token log-ratio to the reference over the counted tokens.
            let tokens = all.iter().map(|s| s.counted_tokens).sum::<usize>().max(1) as f64;
            figures.insert("kl".to_string(), all.iter().map(|s| s.log_ratio).sum::<f64>() / tokens);
        }
        figures
    }

    /// Appends a generation's rows to `path`: one per completion, grouped by prompt, in the order generated.
    fn write_rollouts(&self, path: &Path, step: usize, all: &[Scored], rewards: &[f64], advantages: &[f64]) -> Result<()> {
        let names = self.rewards.names();
        let mut text = String::new();
        for (k, s) in all.iter().enumerate() {
            let per: serde_json::Map<String, Json> = names.iter().zip(&s.rewards).map(|(name, r)| (name.clone(), json!(r))).collect();
            let reward = if rewards[k].is_nan() { Json::Null } else { json!(rewards[k]) };
            let mut row = json!({"step": step, "prompt": s.prompt, "completion": s.completion, "prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids, "rewards": per, "reward": reward, "advantage": advantages[k]});
            if !s.extra.is_empty() {
                row["extra"] = Json::Object(s.extra.clone());
            }
            text.push_str(&row.to_string());
            text.push('\n');
        }
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("cannot write {}", path.display()))?;
        file.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
    }
}

impl Task for OnlineRl {
    fn name(&self) -> &str {
        self.algorithm.name()
    }

    fn train_set(&self) -> &dyn Dataset {
        &self.train
    }

    fn eval_set(&self) -> Option<&dyn Dataset> {
        None
    }

    fn objective(&self) -> &dyn Objective {
        &self.objective
    }

    fn score(&mut self, _model: &dyn Model, _params: &[Vec<Tensor>], _dtype: Kind, _comm: &Communicator) -> Result<Scores> {
        Ok(Scores::default())
    }

    fn write_predictions(&self, _dir: &Path) -> Result<Vec<String>> {
        Ok(vec![])
    }

    fn rollouts(&mut self) -> Option<&mut dyn Rollouts> {
        Some(self)
    }
}

/// Drops the rows of `path` (rollouts.jsonl) from step `step` on, if any.
fn keep_rollouts_before(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let row_step = |line: &str| serde_json::from_str::<Json>(line).ok().and_then(|row| row["step"].as_u64()).unwrap_or(u64::MAX);
    let kept: String = text.lines().filter(|line| row_step(line) < step as u64).map(|line| format!("{line}\n")).collect();
    if kept.len() < text.len() {
        let partial = path.with_extension("jsonl.partial");
        std::fs::write(&partial, kept).and_then(|()| std::fs::rename(&partial, path)).with_context(|| format!("cannot rewrite {}", path.display()))?;
    }
    Ok(())
}

/// The prompt-only rows of `path` (TRL's format: a `prompt` string or
/// message list, any other columns kept for the rewards), tokenised as TRL
/// does: text with the tokenizer's special tokens, messages through the
/// chat template with the generation prompt.
fn load_prompts(path: &Path, config: &Config, tokenizer_path: &Path, tokenizer: &Tokenizer, budget: usize) -> Result<Vec<Prompt>> {
    let data = &config.data;
    let source = Source::open(path, Split::train(data.split.as_deref()))?;
    let mut template: Option<ChatTemplate> = None;
    let (mut prompts, mut positions, mut too_long) = (vec![], Positions::new(data.range), 0usize);
    for row in source.rows(&data.columns) {
        let row = row?;
        if !positions.take() || data.train_samples.is_some_and(|limit| prompts.len() >= limit) {
            continue;
        }
        let at = row.to_string();
        let Json::Object(mut columns) = row.parse::<Json>()? else { bail!("{at}: a row must be a JSON object") };
        let prompt = columns.remove("prompt").with_context(|| format!("{at}: no \"prompt\" (online RL trains on prompt-only rows: {{\"prompt\": text or messages, …}})"))?;
        let ids = match &prompt {
            Json::String(text) => ids(tokenizer, text, true).with_context(|| at.clone())?,
            Json::Array(messages) => {
                if template.is_none() {
                    template = Some(ChatTemplate::load(tokenizer_path.parent().unwrap_or(Path::new(".")), data.chat_template.as_deref())?);
                }
                let conversation = Conversation::from_row(messages, &Json::Object(columns.clone()), &at)?;
                template.as_ref().expect("loaded above").render_ids(tokenizer, &conversation, true)?.map_err(|reason| anyhow::anyhow!("{at}: the chat template cannot render the prompt: {reason}"))?
            }
            _ => bail!("{at}: \"prompt\" is neither a string nor a list of messages"),
        };
        if ids.len() > budget {
            too_long += 1;
            continue;
        }
        prompts.push(Prompt { prompt, ids, columns });
    }
    positions.finish(Path::new(&source.name), "prompts (rows)")?;
    if prompts.is_empty() {
        bail!("{}: no prompt left ({too_long} longer than data.max_seq_len minus task.max_completion_length = {budget} tokens)", source.name);
    }
    let format = if prompts[0].prompt.is_array() { "conversational prompts" } else { "text prompts" };
    let skipped = if too_long > 0 { format!(" ({too_long} skipped: longer than {budget} tokens, data.max_seq_len minus task.max_completion_length)") } else { String::new() };
    tracing::info!("{}: {} {format} of {} rows{skipped}", source.name, prompts.len(), positions.seen());
    Ok(prompts)
}

fn objective(algorithm: Algorithm, options: &Options, steps: usize, chunk_tokens: i64, device: Device, model: &dyn Model) -> Result<PolicyLoss> {
    let beta = options.beta(algorithm);
    if model.logit_softcap().is_some() && options.temperature != 1.0 {
        bail!("task.temperature {} with a model that soft-caps its logits ({}): ft divides the head's weight by the temperature, which a soft cap does not commute with; use temperature 1", options.temperature, model.model_type());
    }
    Ok(PolicyLoss {
        algorithm,
        loss_type: options.loss_type.unwrap_or(LossType::Dapo),
        level: options.importance_sampling_level.unwrap_or(Level::Token),
        beta,
        epsilon_low: options.epsilon,
        epsilon_high: options.epsilon_high.unwrap_or(options.epsilon),
        temperature: options.temperature,
        max_completion_length: options.max_completion_length,
        bias_correction_kl: options.use_bias_correction_kl,
        old_logps_kept: algorithm == Algorithm::Rloo || steps * options.num_iterations > 1,
        chunk_tokens,
        kernels: Kernels::select(device),
        softcap: model.logit_softcap(),
        metrics: Mutex::new(StepMetrics::default()),
        window_figures: Mutex::new(None),
    })
}

fn build(algorithm: Algorithm, inputs: &TaskInputs) -> Result<Box<dyn Task>> {
    let name = algorithm.name();
    task::check_head(name, head::CAUSAL_LM, inputs.model)?;
    task::check_sequence_length(&inputs.config.data, inputs.model)?;
    let options = Options::read(algorithm, &Json::Object(inputs.config.task.options.clone()))?;
    let (data, train) = (&inputs.config.data, &inputs.config.train);
    if data.packing {
        bail!("data.packing does not apply to the {name} task: each completion is its own row");
    }
    if options.importance_sampling_level == Some(Level::Sequence) && matches!(options.loss_type, Some(LossType::Bnpo | LossType::DrGrpo | LossType::Dapo) | None) {
        tracing::warn!("task.importance_sampling_level=sequence with loss_type {:?}: TRL warns that these sum per-token losses; GSPO's paper uses loss_type=grpo", options.loss_type.unwrap_or(LossType::Dapo));
    }
    let window = options.window(train)?;
    let Some(path) = &data.train else { bail!("task `{name}` needs prompts: give them with --train-file (data.train)") };
    if !data.mixture.is_empty() {
        bail!("data.mixture is not read by task `{name}` yet: give one prompt file with --train-file");
    }
    let budget = data.max_seq_len.checked_sub(options.max_completion_length).filter(|&b| b > 0).with_context(|| {
        format!("task.max_completion_length {} leaves no room for a prompt in data.max_seq_len {}", options.max_completion_length, data.max_seq_len)
    })?;
    let tokenizer = ft_data::tokenizer::load(inputs.tokenizer, inputs.model.dims().vocab)?;
    let prompts = load_prompts(path, inputs.config, inputs.tokenizer, &tokenizer, budget)?;
    let specs: Vec<RewardSpec> = options.rewards.iter().map(|spec| spec.parse()).collect::<Result<_>>()?;
    let rewards = Rewards::start(&specs, &options.reward_options())?;
    let objective = objective(algorithm, &options, window.steps, train.loss_chunk_tokens, inputs.device, inputs.model)?;
    let pad_multiple = data.pad_to_multiple_of.unwrap_or(if inputs.device == Device::Cpu { 1 } else { 64 }).max(1);
    let train_set = RolloutSet { prompts, group: options.num_generations, samples: BTreeMap::new(), pad_id: lm::pad_id(&tokenizer), pad_multiple, tokens_per_step: 0.0 };
    Ok(Box::new(OnlineRl { algorithm, eos: eos_id(&tokenizer), options, train: train_set, objective, rewards, tokenizer, window, generated: false }))
}

fn synthetic(_spec: &Synthetic) -> Result<Box<dyn Task>> {
    bail!("ft bench does not time online RL yet: its step samples completions first")
}

inventory::submit! {
    TaskRegistration {
        name: "grpo",
        summary: "online RL of a causal LM: GRPO and its family (DAPO, Dr. GRPO, BNPO, GSPO) with TRL's losses, completions sampled by ft's generator from the weights being trained, rewards from Python functions or built-ins",
        head_kind: head::CAUSAL_LM,
        build: |inputs| build(Algorithm::Grpo, inputs),
        synthetic,
        check_options: |value, train, world| Options::read(Algorithm::Grpo, value)?.check_batches(train, world),
        tokenize: None,
    }
}

inventory::submit! {
    TaskRegistration {
        name: "rloo",
        summary: "online RL of a causal LM: RLOO (REINFORCE leave-one-out) with TRL's loss, completions sampled by ft's generator from the weights being trained",
        head_kind: head::CAUSAL_LM,
        build: |inputs| build(Algorithm::Rloo, inputs),
        synthetic,
        check_options: |value, train, world| Options::read(Algorithm::Rloo, value)?.check_batches(train, world),
        tokenize: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(algorithm: Algorithm, value: Json) -> Result<Options> {
        Options::read(algorithm, &value)
    }

    #[test]
    fn bad_options_are_named() {
        let reward = json!(["accuracy"]);
        let error = |algorithm, mut value: Json| {
            value.as_object_mut().unwrap().entry("rewards").or_insert(reward.clone());
            read(algorithm, value).unwrap_err().to_string()
        };
        assert!(error(Algorithm::Grpo, json!({"normalize_advantages": true})).contains("task.normalize_advantages is a key of task `rloo`, not of `grpo`"));
        assert!(error(Algorithm::Rloo, json!({"loss_type": "dapo"})).contains("task.loss_type is a key of task `grpo`, not of `rloo`"));
        assert!(error(Algorithm::Grpo, json!({"num_generations": 1})).contains("at least 2 completions"));
        assert!(error(Algorithm::Grpo, json!({"top_p": 1.5})).contains("task.top_p must be in (0, 1]"));
        assert!(error(Algorithm::Grpo, json!({"loss_type": "sapo"})).contains("unknown variant `sapo`"));
        assert!(error(Algorithm::Grpo, json!({"scale_rewards": "rank"})).contains("expected group, batch or none"));
        assert!(error(Algorithm::Grpo, json!({"reward_weights": [1.0, 2.0]})).contains("2 weights for 1 reward functions"));
        assert!(error(Algorithm::Grpo, json!({"num_generation": 4})).contains("unknown field `num_generation`"));
        let none = read(Algorithm::Grpo, json!({})).unwrap_err().to_string();
        assert!(none.contains("needs at least one reward function: --reward FILE.py:FUNCTION"), "{none}");
        // TRL's defaults, and its booleans for scale_rewards.
        let options = read(Algorithm::Rloo, json!({"rewards": reward})).unwrap();
        assert_eq!((options.beta(Algorithm::Rloo), options.num_generations, options.max_completion_length), (0.05, 8, 512));
        let options = read(Algorithm::Grpo, json!({"rewards": reward, "scale_rewards": false})).unwrap();
        assert_eq!((options.beta(Algorithm::Grpo), options.scale_rewards), (0.0, Some(ScaleRewards::None)));
    }

    #[test]
    fn advantages_skip_what_no_function_scores() {
        let nan = f64::NAN;
        // Two groups of three: the second's middle completion is scored by no function.
        let per_function = vec![vec![1.0, nan], vec![0.0, nan], vec![2.0, 1.0], vec![1.0, 0.0], vec![nan, nan], vec![3.0, nan]];
        let (rewards, advantages, zero_std) = advantages(Algorithm::Grpo, &per_function, &[1.0, 0.5], &[0.0; 6], 3, ScaleRewards::None, false);
        assert_eq!(rewards[..4], [1.0, 0.0, 2.5, 1.0]);
        assert!(rewards[4].is_nan());
        assert_eq!(advantages, [1.0 - 3.5 / 3.0, -3.5 / 3.0, 2.5 - 3.5 / 3.0, -1.0, 0.0, 1.0]);
        assert_eq!(zero_std, [false; 6]);
        // RLOO: each against the mean of the others scored.
        let (_, leave_one_out, _) = super::advantages(Algorithm::Rloo, &per_function, &[1.0, 0.5], &[0.0; 6], 3, ScaleRewards::Group, false);
        assert_eq!(leave_one_out, [1.0 - 1.25, 0.0 - 1.75, 2.5 - 0.5, 1.0 - 3.0, 0.0, 3.0 - 1.0]);
    }
}
