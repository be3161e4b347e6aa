//! `dpo`: preference tuning of a causal LM — DPO and its family with TRL's
//! losses (trl/trainer/dpo_trainer.py, `_compute_loss`, TRL 1.16) — over
//! TRL's preference rows (`ft_data::preference`: standard, conversational,
//! implicit prompt) from any source.
//!
//! Each pair's chosen and rejected sequence go through the model in one
//! forward: as TRL's batch (every chosen sequence, then every rejected one,
//! right-padded) or, with `task.padding_free` (the default), packed into
//! rows with document boundaries (`ft_data::packing`), so no padding is
//! computed; packed, a pair's prompt runs once (`task.share_prompt`, the
//! default with padding_free): both completions branch from it
//! (`Inputs::branches`), each seeing the prompt and itself only, at the
//! positions it would have after the prompt alone. Each completion's log-probability is summed from the head's
//! logits a chunk of tokens at a time (no full-vocabulary logits), the loss
//! is taken over those sums, and its gradient goes back through the head as
//! a weight per token (`lm_head_weighted_loss_and_grads`).
//!
//! The reference model's log-probabilities are computed once, before the
//! first step, by the trainer from the starting model as it holds it
//! (TRL's `precompute_ref_log_probs`; sharded and offloaded as the policy,
//! so the model is never whole on a rank; with LoRA its adapters off): each
//! rank its share of the pairs, kept in `OUTPUT/reference_logps.json`, which
//! a resumed run reuses. With `task.precompute_ref=false` the trainer runs each
//! training micro-batch through the reference (no gradients) before its
//! loss instead, as TRL's `ref_model` does: with LoRA the base (adapters
//! off, as TRL with a peft model), else a frozen copy of the starting
//! model the trainer keeps in the compute dtype, placed as the strategy
//! places frozen units (sharded when it shards parameters, in host memory
//! under `--offload cpu`), never checkpointed (a resume builds it again
//! from the starting model). The evaluation pairs' reference is precomputed
//! in each case. The log and the summary say which reference a run uses and
//! what each rank holds for it. With `task.reference_free` the reference's
//! log-probabilities are 0 (TRL's former `reference_free`). `ft eval` (no
//! training file) gives `before_training` the reference it has: a LoRA
//! run's base, or the model `--ref-model` names.
//!
//! Task keys: `task.loss_type` (one of TRL's names or a list of them),
//! `task.loss_weights` (one per loss type; 1 each by default),
//! `task.rpo_alpha` (the `sft` loss added with that weight), `task.beta`,
//! `task.label_smoothing` (robust, exo_pair, aot, aot_unpaired),
//! `task.discopop_tau` (discopop's τ, 0.05), `task.truncation_mode`
//! (`keep_start`/`keep_end` cut sequences longer than `data.max_seq_len` as
//! TRL's `max_length`; `skip` leaves those pairs out; by default keep_start
//! with `data.truncate`, else skip), `task.padding_free`, `task.share_prompt`,
//! `task.precompute_ref`, `task.reference_free`.

use anyhow::{bail, Context as _, Result};
use ft_core::batches::to_device_async;
use ft_core::config::{Config, DataConfig, DataFormat};
use ft_core::dataset::{Batch, Dataset};
use ft_core::distributed::comm::Communicator;
use ft_core::model::{head, lm_outputs, Inputs, Model};
use ft_core::task::{self, Objective, Scores, Start, StartingModel, StepMetrics, Synthetic, Task, TaskInputs, TaskRegistration, Tokenize, WholeModel};
use ft_core::train::Kernels;
use ft_core::train::loss::{lm_head_weighted_loss_and_grads, lm_label_logps, TargetRows, IGNORE_INDEX};
use ft_data::preference::{self, Pair, Sequence, Truncation};
use ft_data::source::Split;
use ft_data::{lm, mixture, packing};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Mutex;
use tch::{Device, Kind, Tensor};
use tokenizers::Tokenizer;

const NAME: &str = "dpo";

/// Where a run keeps its reference log-probabilities.
const REFERENCE_FILE: &str = "reference_logps.json";

/// TRL's loss types ft computes (`DPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LossType {
    Sigmoid,
    Hinge,
    Ipo,
    ExoPair,
    NcaPair,
    Robust,
    BcoPair,
    SppoHard,
    ApoZero,
    ApoDown,
    /// The NLL of the chosen completions, mean over their tokens (RPO's term: TRL's `rpo_alpha` became this loss's weight).
    Sft,
    /// SimPO-style: the log-ratios' difference per completion token.
    SigmoidNorm,
    /// AOT: the micro-batch's policy log-ratio differences sorted against the reference's.
    Aot,
    /// AOT unpaired: the sorted chosen log-ratios against the sorted rejected ones.
    AotUnpaired,
    /// DiscoPOP: logistic and exponential losses blended by sigmoid(β·Δ / τ).
    Discopop,
}

/// `task.loss_type`: one of TRL's names, or a list of them.
fn one_or_many<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<LossType>, D::Error> {
    let value = match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(one) => serde_json::Value::from(vec![one]),
        many => many,
    };
    serde_json::from_value(value).map_err(serde::de::Error::custom)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Options {
    #[serde(deserialize_with = "one_or_many")]
    loss_type: Vec<LossType>,
    loss_weights: Option<Vec<f64>>,
    /// RPO (TRL before 1.0): the chosen completions' NLL added with this weight, the `sft` loss type.
    rpo_alpha: Option<f64>,
    beta: f64,
    label_smoothing: f64,
    /// DiscoPOP's τ (TRL's `discopop_tau`; None: its 0.05).
    discopop_tau: Option<f64>,
    truncation_mode: Option<Truncation>,
    padding_free: bool,
    /// None: on with padding_free.
    share_prompt: Option<bool>,
    precompute_ref: bool,
    reference_free: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            loss_type: vec![LossType::Sigmoid],
            loss_weights: None,
            rpo_alpha: None,
            beta: 0.1,
            label_smoothing: 0.0,
            discopop_tau: None,
            truncation_mode: None,
            padding_free: true,
            share_prompt: None,
            precompute_ref: true,
            reference_free: false,
        }
    }
}

impl Options {
    fn read(value: &serde_json::Value) -> Result<Options> {
        let options: Options = task::options(NAME, value)?;
        options.losses()?;
        if options.beta <= 0.0 || options.beta.is_nan() {
            bail!("task.beta must be positive, not {}", options.beta);
        }
        let types = &options.loss_type;
        if let Some(tau) = options.discopop_tau {
            if !types.contains(&LossType::Discopop) {
                bail!("task.discopop_tau is discopop's τ, and task.loss_type has no discopop");
            }
            if tau <= 0.0 || tau.is_nan() {
                bail!("task.discopop_tau must be positive, not {tau}");
            }
        }
        let smoothed = [LossType::Robust, LossType::ExoPair, LossType::Aot, LossType::AotUnpaired];
        if options.label_smoothing != 0.0 && !types.iter().any(|loss_type| smoothed.contains(loss_type)) {
            bail!("task.label_smoothing applies to the robust, exo_pair, aot and aot_unpaired losses, and task.loss_type has none of them");
        }
        if options.share_prompt == Some(true) && !options.padding_free {
            bail!("task.share_prompt=true runs a pair's prompt once in a packed row, which task.padding_free=false leaves out: give one of them");
        }
        if options.reference_free && !options.precompute_ref {
            bail!("task.precompute_ref=false runs a reference model, which task.reference_free=true leaves out: give one of them");
        }
        if types.contains(&LossType::Robust) && !(0.0..0.5).contains(&options.label_smoothing) {
            bail!("task.label_smoothing must be in [0, 0.5) for the robust loss, not {}", options.label_smoothing);
        }
        if types.contains(&LossType::ExoPair) && !(options.label_smoothing > 0.0 && options.label_smoothing < 1.0) {
            bail!("the exo_pair loss needs task.label_smoothing in (0, 1) (its ε; the EXO paper suggests 1e-3), not {}", options.label_smoothing);
        }
        Ok(options)
    }

    /// Each loss type with its weight.
    fn losses(&self) -> Result<Vec<(LossType, f64)>> {
        let types = self.loss_type.clone();
        if types.is_empty() {
            bail!("task.loss_type is an empty list: name at least one of TRL's loss types (sigmoid, ipo, …)");
        }
        let weights = self.loss_weights.clone().unwrap_or_else(|| vec![1.0; types.len()]);
        if weights.len() != types.len() {
            bail!("task.loss_weights has {} weights for the {} loss types of task.loss_type", weights.len(), types.len());
        }
        let mut losses: Vec<(LossType, f64)> = types.into_iter().zip(weights).collect();
        if let Some(alpha) = self.rpo_alpha {
            if losses.iter().any(|(loss_type, _)| *loss_type == LossType::Sft) {
                bail!("task.rpo_alpha adds the sft loss, which task.loss_type already lists: give its weight in task.loss_weights alone");
            }
            losses.push((LossType::Sft, alpha));
        }
        Ok(losses)
    }
}

/// A pair's two sequences as rows: which sequence each token is of, its
/// label (the token where it is a completion's, else ignored).
fn sequence_labels(sequence: &Sequence) -> Vec<i64> {
    sequence.ids.iter().enumerate().map(|(i, &id)| if i >= sequence.completion_start { id } else { IGNORE_INDEX }).collect()
}

/// Preference pairs, each weighed 1 in the loss (TRL's loss is a mean over pairs).
pub struct PairDataset {
    pairs: Vec<Pair>,
    /// The reference's log-probabilities of each pair's chosen and rejected completion, once computed.
    reference: Option<Vec<[f64; 2]>>,
    pad_id: i64,
    pad_multiple: usize,
    /// Pack each batch's pairs into rows of at most this many tokens with
    /// document boundaries, instead of TRL's padded rows (None).
    packed_rows: Option<usize>,
    /// Packed, a pair's prompt runs once, both completions branching from it.
    share_prompt: bool,
}

/// A batch's targets, in order: labels [rows, seq]; each token's sequence
/// [rows, seq] (chosen of pair k: k, rejected: pairs + k); each sequence's
/// completion tokens [2 · pairs]; with a reference, its log-probabilities [2 · pairs].
const LABELS: usize = 0;
const SEQUENCE_OF_TOKEN: usize = 1;
const COMPLETION_TOKENS: usize = 2;
const REFERENCE: usize = 3;

impl PairDataset {
    /// The sequences of `indices`' pairs, chosen ones first (TRL's order).
    fn sequences<'p>(&'p self, indices: &[usize]) -> Vec<&'p Sequence> {
        let chosen = indices.iter().map(|&i| &self.pairs[i].chosen);
        chosen.chain(indices.iter().map(|&i| &self.pairs[i].rejected)).collect()
    }

    /// How many leading tokens of `pair`'s two sequences a packed row holds
    /// once: all they share before either completion but the last, which
    /// each branch repeats so that its hidden state predicts the
    /// completion's first token. 0 when the prompt is not shared.
    fn shared_prefix(&self, pair: &Pair) -> usize {
        if !(self.share_prompt && self.packed_rows.is_some()) {
            return 0;
        }
        let (chosen, rejected) = (&pair.chosen, &pair.rejected);
        let prompts = chosen.ids[..chosen.completion_start].iter().zip(&rejected.ids[..rejected.completion_start]);
        prompts.take_while(|(a, b)| a == b).count().saturating_sub(1)
    }

    /// Rows of sequences: TRL's padded batch (each sequence a row, chosen
    /// ones first), or each row a packing of whole pairs, one example each.
    fn rows(&self, indices: &[usize]) -> Vec<Row> {
        let Some(capacity) = self.packed_rows else {
            return self.sequences(indices).into_iter().enumerate().map(|(s, sequence)| Row::default().with(sequence, 0, s, 0, 0)).collect();
        };
        let pairs = indices.len();
        let lengths: Vec<usize> = indices.iter().map(|&i| self.tokens(i)).collect();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let packed = packing::pack(&lengths, capacity.max(longest));
        let row = |row_pairs: Vec<usize>| {
            row_pairs.into_iter().enumerate().fold(Row::default(), |row, (document, k)| {
                let pair = &self.pairs[indices[k]];
                match self.shared_prefix(pair) {
                    0 => row.with(&pair.chosen, 0, k, 2 * document, 0).with(&pair.rejected, 0, pairs + k, 2 * document + 1, 0),
                    // One example (numbered as an unshared pair's first, so numbers never repeat in a row).
                    shared => row.with_prefix(&pair.chosen.ids[..shared], k, 2 * document).with(&pair.chosen, shared, k, 2 * document, 1).with(&pair.rejected, shared, pairs + k, 2 * document, 2),
                }
            })
        };
        packed.into_iter().map(row).collect()
    }
}

/// One row of a batch being built: its tokens, their labels, and each
/// token's sequence number (chosen of pair k: k, rejected: pairs + k),
/// example and branch.
#[derive(Default)]
struct Row {
    ids: Vec<i64>,
    labels: Vec<i64>,
    owners: Vec<i64>,
    documents: Vec<i64>,
    branches: Vec<i64>,
}

impl Row {
    /// With `sequence`'s tokens from `from` on, as sequence number `owner`.
    fn with(mut self, sequence: &Sequence, from: usize, owner: usize, document: usize, branch: i64) -> Row {
        let mut labels = sequence_labels(sequence);
        // Nothing of this part precedes its first token: no label there (a
        // seam, when packed; a prompt token, in a branch).
        labels[from] = IGNORE_INDEX;
        self.ids.extend(&sequence.ids[from..]);
        self.labels.extend(&labels[from..]);
        self.fill(owner as i64, document as i64, branch);
        self
    }

    /// With a pair's shared prompt `prefix` (branch 0, counted as sequence `owner`'s).
    fn with_prefix(mut self, prefix: &[i64], owner: usize, document: usize) -> Row {
        self.ids.extend(prefix);
        self.labels.resize(self.ids.len(), IGNORE_INDEX);
        self.fill(owner as i64, document as i64, 0);
        self
    }

    /// Padded to `width` tokens of `pad_id`, an example of their own.
    fn padded(mut self, width: usize, pad_id: i64) -> Row {
        let document = self.documents.last().map_or(0, |&d| d + 1);
        self.ids.resize(width, pad_id);
        self.labels.resize(width, IGNORE_INDEX);
        self.fill(0, document, 0);
        self
    }

    /// The new tokens' sequence number, example and branch.
    fn fill(&mut self, owner: i64, document: i64, branch: i64) {
        self.owners.resize(self.ids.len(), owner);
        self.documents.resize(self.ids.len(), document);
        self.branches.resize(self.ids.len(), branch);
    }
}

impl Dataset for PairDataset {
    fn len(&self) -> usize {
        self.pairs.len()
    }

    /// The tokens a pair computes (packed with its prompt shared: that once).
    fn tokens(&self, index: usize) -> usize {
        let pair = &self.pairs[index];
        pair.chosen.ids.len() + pair.rejected.ids.len() - self.shared_prefix(pair)
    }

    fn loss_weight(&self, _index: usize) -> usize {
        1
    }

    fn collate(&self, indices: &[usize], device: Device) -> Result<Batch> {
        let rows = self.rows(indices);
        let longest = rows.iter().map(|row| row.ids.len()).max().unwrap_or(0).div_ceil(self.pad_multiple) * self.pad_multiple;
        // Right padding needs no attention mask; what counts tokens (a router's load) skips it.
        let real: Vec<Vec<i64>> = rows.iter().map(|row| [vec![1; row.ids.len()], vec![0; longest - row.ids.len()]].concat()).collect();
        let rows: Vec<Row> = rows.into_iter().map(|row| row.padded(longest, self.pad_id)).collect();
        let column = |field: fn(&Row) -> &Vec<i64>| to_device_async(&Tensor::from_slice2(&rows.iter().map(field).collect::<Vec<_>>()), device);
        let mut inputs = Inputs::ids(&column(|row| &row.ids));
        inputs.token_mask = real.iter().flatten().any(|&token| token == 0).then(|| to_device_async(&Tensor::from_slice2(&real), device));
        if self.packed_rows.is_some() {
            inputs.documents = Some(column(|row| &row.documents));
            inputs.branches = self.share_prompt.then(|| column(|row| &row.branches));
        }
        let sequences = self.sequences(indices);
        let completion_tokens: Vec<f32> = sequences.iter().map(|s| s.completion_tokens() as f32).collect();
        let mut targets = vec![
            column(|row| &row.labels),
            column(|row| &row.owners),
            to_device_async(&Tensor::from_slice(&completion_tokens), device),
        ];
        if let Some(reference) = &self.reference {
            let logps: Vec<f32> = (0..2).flat_map(|side| indices.iter().map(move |&i| reference[i][side] as f32)).collect();
            targets.push(to_device_async(&Tensor::from_slice(&logps), device));
        }
        Ok(Batch { inputs, targets })
    }
}

/// What one micro-batch's sequences came to.
struct SequenceLogps {
    /// The head's rows that predict a completion token (the gradient pass reads them again).
    rows: TargetRows,
    /// Each token's log-probability [rows, seq] (0 off the completions).
    tokens: Tensor,
    /// Each sequence's sum [2 · pairs]: chosen, then rejected.
    sums: Tensor,
}

/// TRL's DPO losses over summed completion log-probabilities.
pub struct DpoLoss {
    losses: Vec<(LossType, f64)>,
    beta: f64,
    label_smoothing: f64,
    discopop_tau: f64,
    chunk_tokens: i64,
    kernels: Kernels,
    softcap: Option<f64>,
    /// The training micro-batches' figures since the last step's end.
    metrics: Mutex<StepMetrics>,
    /// The reference runs with every training micro-batch
    /// (`task.precompute_ref=false`: LoRA's base, or the trainer's frozen
    /// copy); its log-probabilities of the batch about to be trained, once
    /// the trainer gave them.
    step_reference: Option<Mutex<Option<Tensor>>>,
}

/// Per-pair values: the loss (weighted sum over the loss types) and TRL's six figures.
struct PairValues {
    loss: Tensor,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
}

impl DpoLoss {
    fn sequence_logps(&self, hidden: &Tensor, weight: &Tensor, batch: &Batch) -> Result<SequenceLogps> {
        let rows = TargetRows::of(hidden, &batch.targets[LABELS])?;
        let tokens = lm_label_logps(&rows, weight, self.chunk_tokens, self.softcap, self.kernels)?;
        let sequences = batch.targets[COMPLETION_TOKENS].size()[0];
        let sums = Tensor::zeros([sequences], (Kind::Float, tokens.device())).index_add(0, &batch.targets[SEQUENCE_OF_TOKEN].reshape([-1]), &tokens.reshape([-1]));
        Ok(SequenceLogps { rows, tokens, sums })
    }

    /// TRL's `_compute_loss` from the sequences' summed log-probabilities
    /// `logps` (chosen, then rejected), per pair; the `sft` term is the
    /// batch's mean NLL over the chosen completions' tokens, counted per pair.
    fn pair_values(&self, logps: &Tensor, token_logps: &Tensor, reference: &Tensor, batch: &Batch) -> Result<PairValues> {
        let pairs = logps.size()[0] / 2;
        let (chosen_logps, rejected_logps) = (logps.narrow(0, 0, pairs), logps.narrow(0, pairs, pairs));
        let chosen_ratio = &chosen_logps - reference.narrow(0, 0, pairs);
        let rejected_ratio = &rejected_logps - reference.narrow(0, pairs, pairs);
        let delta = &chosen_ratio - &rejected_ratio;
        let (beta, smoothing) = (self.beta, self.label_smoothing);
        // -logsigmoid(β·d)·(1 − ε) − logsigmoid(−β·d)·ε: the smoothed logistic loss AOT's two forms take.
        let smoothed = |d: &Tensor| (d * beta).log_sigmoid() * -(1.0 - smoothing) - (-(d * beta)).log_sigmoid() * smoothing;
        let sorted = |t: &Tensor| t.sort(0, false).0;
        let counts = batch.targets[COMPLETION_TOKENS].clamp_min(1.0);
        let per_token_delta = || &chosen_ratio / counts.narrow(0, 0, pairs) - &rejected_ratio / counts.narrow(0, pairs, pairs);
        let mut loss = Tensor::zeros([pairs], (Kind::Float, logps.device()));
        for &(loss_type, weight) in &self.losses {
            let per_pair: Tensor = match loss_type {
                LossType::Sigmoid => -(&delta * beta).log_sigmoid(),
                LossType::Hinge => (-(&delta * beta) + 1.0).relu(),
                LossType::Ipo => (per_token_delta() - 1.0 / (2.0 * beta)).square(),
                LossType::ExoPair => {
                    let (log_qw, log_ql) = ((&delta * beta).log_sigmoid(), (-(&delta * beta)).log_sigmoid());
                    log_qw.exp() * (&log_qw - (-smoothing).ln_1p()) + log_ql.exp() * (&log_ql - smoothing.ln())
                }
                LossType::NcaPair => {
                    let (chosen, rejected) = (&chosen_ratio * beta, &rejected_ratio * beta);
                    -chosen.log_sigmoid() - (-&chosen).log_sigmoid() * 0.5 - (-rejected).log_sigmoid() * 0.5
                }
                LossType::Robust => {
                    let clean = (&delta * beta).log_sigmoid() * -(1.0 - smoothing);
                    let flipped = (-(&delta * beta)).log_sigmoid() * -smoothing;
                    (clean - flipped) / (1.0 - 2.0 * smoothing)
                }
                LossType::BcoPair => -(&chosen_ratio * beta).log_sigmoid() - (-(&rejected_ratio * beta)).log_sigmoid(),
                LossType::SppoHard => (&chosen_ratio - 0.5 / beta).square() + (&rejected_ratio + 0.5 / beta).square(),
                LossType::ApoZero => -(&chosen_ratio * beta).sigmoid() + 1.0 + (&rejected_ratio * beta).sigmoid(),
                LossType::ApoDown => (&chosen_ratio * beta).sigmoid() - (&delta * beta).sigmoid() + 1.0,
                LossType::Sft => {
                    // The chosen completions' tokens: those of sequences 0..pairs.
                    let chosen_tokens = batch.targets[SEQUENCE_OF_TOKEN].lt(pairs).logical_and(&batch.targets[LABELS].ne(IGNORE_INDEX));
                    let chosen_tokens = chosen_tokens.narrow(1, 1, chosen_tokens.size()[1] - 1).to_kind(Kind::Float);
                    let shifted = token_logps.narrow(1, 1, token_logps.size()[1] - 1);
                    let mean = -(shifted * &chosen_tokens).sum(Kind::Float) / chosen_tokens.sum(Kind::Float).clamp_min(1.0);
                    mean.expand([pairs], false)
                }
                LossType::SigmoidNorm => -(per_token_delta() * beta).log_sigmoid(),
                // Sorted over the micro-batch's pairs, as TRL sorts its batch: a pair's loss is no longer its own.
                LossType::Aot => {
                    let reference_ratios = reference.narrow(0, 0, pairs) - reference.narrow(0, pairs, pairs);
                    smoothed(&(sorted(&(&chosen_logps - &rejected_logps)) - sorted(&reference_ratios)))
                }
                LossType::AotUnpaired => smoothed(&(sorted(&chosen_ratio) - sorted(&rejected_ratio))),
                LossType::Discopop => {
                    let logits = &delta * beta;
                    let modulation = (&logits / self.discopop_tau).sigmoid();
                    -logits.log_sigmoid() * (-&modulation + 1.0) + (-&logits).exp() * modulation
                }
            };
            loss += per_pair * weight;
        }
        Ok(PairValues { loss, chosen_rewards: chosen_ratio.detach() * beta, rejected_rewards: rejected_ratio.detach() * beta, chosen_logps: chosen_logps.detach(), rejected_logps: rejected_logps.detach() })
    }
}

/// The reference log-probabilities precomputed for `batch`.
fn precomputed(batch: &Batch) -> Result<&Tensor> {
    batch.targets.get(REFERENCE).context("the dpo task's batch has no precomputed reference log-probabilities")
}

/// TRL's six figures of `values`, summed over its pairs.
fn metric_sums(values: &PairValues) -> StepMetrics {
    let sum = |t: &Tensor| t.sum(Kind::Double).double_value(&[]);
    let (chosen, rejected) = (&values.chosen_rewards, &values.rejected_rewards);
    StepMetrics {
        sums: BTreeMap::from([
            ("rewards/chosen".to_string(), sum(chosen)),
            ("rewards/rejected".to_string(), sum(rejected)),
            ("rewards/accuracies".to_string(), sum(&chosen.gt_tensor(rejected))),
            ("rewards/margins".to_string(), sum(&(chosen - rejected))),
            ("logps/chosen".to_string(), sum(&values.chosen_logps)),
            ("logps/rejected".to_string(), sum(&values.rejected_logps)),
        ]),
        count: chosen.size()[0] as f64,
        counts: BTreeMap::new(),
    }
}

impl Objective for DpoLoss {
    fn loss_and_grads(&self, outputs: &[Tensor], batch: &Batch, normalizer: f64, loss_scale: Option<&Tensor>) -> Result<(Tensor, Vec<Tensor>)> {
        let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
        let logps = self.sequence_logps(&hidden, &weight, batch)?;
        // The loss of the summed log-probabilities and its gradient by autograd (a few numbers a pair) ...
        let (sums, token_logps) = (logps.sums.detach().set_requires_grad(true), logps.tokens.detach().set_requires_grad(true));
        let reference = match &self.step_reference {
            Some(step) => step.lock().expect("reference lock").take().context("the trainer gave no reference outputs before the loss")?,
            None => precomputed(batch)?.shallow_clone(),
        };
        let values = tch::with_grad(|| self.pair_values(&sums, &token_logps, &reference, batch))?;
        let loss = tch::with_grad(|| values.loss.sum(Kind::Float) / normalizer);
        loss.backward();
        // ... then through the head: each token's cross-entropy (its negated log-probability) weighed by that gradient, negated.
        // A gradient is undefined where no loss type reads it (the sums under `sft` alone, the tokens without `sft`).
        let owners = &batch.targets[SEQUENCE_OF_TOKEN];
        let mut token_weights = owners.zeros_like().to_kind(Kind::Float);
        if sums.grad().defined() {
            token_weights -= sums.grad().index_select(0, &owners.reshape([-1])).view_as(owners);
        }
        if token_logps.grad().defined() {
            token_weights -= token_logps.grad();
        }
        let weight_grad = weight.requires_grad();
        let (_, grad_hidden, grad_weight) =
            lm_head_weighted_loss_and_grads(&hidden, &weight, &logps.rows, &token_weights, self.chunk_tokens, loss_scale, self.kernels, weight_grad, self.softcap)?;
        self.metrics.lock().expect("metrics lock").add(metric_sums(&values));
        Ok((loss.detach(), vec![grad_hidden, grad_weight]))
    }

    fn loss_sum(&self, outputs: &[Tensor], batch: &Batch) -> Result<(f64, f64)> {
        let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
        let logps = self.sequence_logps(&hidden, &weight, batch)?;
        let values = self.pair_values(&logps.sums, &logps.tokens, precomputed(batch)?, batch)?;
        Ok((values.loss.sum(Kind::Double).double_value(&[]), values.loss.size()[0] as f64))
    }

    fn take_step_metrics(&self) -> StepMetrics {
        std::mem::take(&mut *self.metrics.lock().expect("metrics lock"))
    }

    fn wants_reference_outputs(&self) -> bool {
        self.step_reference.is_some()
    }

    fn reference_outputs(&self, outputs: &[Tensor], batch: &Batch) -> Result<()> {
        if let Some(step) = &self.step_reference {
            let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
            *step.lock().expect("reference lock") = Some(self.sequence_logps(&hidden, &weight, batch)?.sums);
        }
        Ok(())
    }
}

/// The reference log-probabilities a run keeps, and what they are of.
#[derive(Serialize, Deserialize)]
struct ReferenceFile {
    /// A hash of the pairs' tokens: a resume reuses the file only for the same pairs.
    fingerprint: String,
    train: Vec<[f64; 2]>,
    eval: Vec<[f64; 2]>,
}

pub struct Dpo {
    train: PairDataset,
    eval: Option<PairDataset>,
    objective: DpoLoss,
    batch_size: usize,
    /// The reference's log-probabilities are 0: nothing to compute before training.
    reference_free: bool,
    /// The model trains LoRA adapters (whose base is the reference run with each step).
    adapters: bool,
}

impl Dpo {
    /// Runs this rank's share of `data`'s pairs through `model` in batches,
    /// giving `each` a batch's pair indices, the batch and its sequences'
    /// log-probabilities. Every rank runs as many batches, since a sharded
    /// model's forward gathers with the other ranks: a shorter share ends
    /// with a batch of pair 0, whose result is dropped.
    fn for_each_batch(&self, data: &PairDataset, model: &mut dyn StartingModel, comm: &Communicator, each: &mut dyn FnMut(&[usize], &Batch, SequenceLogps) -> Result<()>) -> Result<()> {
        let batch_size = self.batch_size.max(1);
        let mine = task::rank_share(comm, data.len());
        let rounds = data.len().div_ceil(comm.env().world_size).div_ceil(batch_size);
        let mut batches = mine.chunks(batch_size);
        for _ in 0..rounds {
            let (indices, kept) = match batches.next() {
                Some(indices) => (indices, true),
                None => (&[0][..], false),
            };
            let batch = data.collate(indices, comm.device())?;
            let mut logps = None;
            model.forward_head(&batch, &mut |outputs| {
                let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
                logps = Some(self.objective.sequence_logps(&hidden, &weight, &batch)?);
                Ok(())
            })?;
            if kept {
                each(indices, &batch, logps.context("the model's forward gave its head's outputs to no one")?)?;
            }
        }
        Ok(())
    }

    /// Each pair's summed chosen and rejected log-probabilities under
    /// `model` (each rank its share, gathered on every rank).
    fn logps(&self, data: &PairDataset, model: &mut dyn StartingModel, comm: &Communicator) -> Result<Vec<[f64; 2]>> {
        let mut logps = vec![];
        self.for_each_batch(data, model, comm, &mut |indices, _, batch_logps| {
            let sums: Vec<f64> = Vec::try_from(batch_logps.sums.to_kind(Kind::Double))?;
            let pairs = indices.len();
            logps.extend(indices.iter().enumerate().map(|(k, &i)| (i, [sums[k], sums[pairs + k]])));
            Ok(())
        })?;
        let mut all = vec![[0.0; 2]; data.len()];
        for (i, pair) in task::all_gather_json(comm, &logps)?.into_iter().flatten() {
            all[i] = pair;
        }
        Ok(all)
    }

    fn fingerprint(&self) -> String {
        let mut hasher = fnv::FnvHasher::default();
        for pair in self.train.pairs.iter().chain(self.eval.iter().flat_map(|e| &e.pairs)) {
            for sequence in [&pair.chosen, &pair.rejected] {
                (&sequence.ids, sequence.completion_start).hash(&mut hasher);
            }
        }
        format!("{:016x}", hasher.finish())
    }

    /// The file a resumed run reuses, if it holds these pairs' log-probabilities.
    fn kept_reference(&self, path: &Path, fingerprint: &str) -> Option<ReferenceFile> {
        let kept: ReferenceFile = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        let train = if self.objective.step_reference.is_some() { 0 } else { self.train.len() };
        (kept.fingerprint == fingerprint && kept.train.len() == train && kept.eval.len() == self.eval.as_ref().map_or(0, |e| e.len())).then_some(kept)
    }

    /// Whether there are reference log-probabilities to compute before
    /// training: not reference-free, and not (the reference run with every
    /// step serving the training pairs) without evaluation pairs.
    fn computes_reference(&self) -> bool {
        !self.reference_free && (self.objective.step_reference.is_none() || self.eval.is_some())
    }
}

impl Task for Dpo {
    fn name(&self) -> &str {
        NAME
    }

    fn train_set(&self) -> &dyn Dataset {
        &self.train
    }

    fn eval_set(&self) -> Option<&dyn Dataset> {
        self.eval.as_ref().map(|d| d as &dyn Dataset)
    }

    fn objective(&self) -> &dyn Objective {
        &self.objective
    }

    /// TRL's six figures over the evaluation pairs (the loss is the loop's).
    fn score(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, comm: &Communicator) -> Result<Scores> {
        let Some(data) = &self.eval else { return Ok(Scores::default()) };
        let mut mine = StepMetrics::default();
        let objective = &self.objective;
        self.for_each_batch(data, &mut WholeModel { model, params, dtype }, comm, &mut |_, batch, logps| {
            mine.add(metric_sums(&objective.pair_values(&logps.sums, &logps.tokens, precomputed(batch)?, batch)?));
            Ok(())
        })?;
        let mut local = vec![mine.count];
        local.extend(mine.sums.values());
        let summed = comm.sum_over_ranks(&local)?;
        let values = mine.sums.keys().zip(&summed[1..]).map(|(name, sum)| (name.clone(), sum / summed[0].max(1.0))).collect();
        Ok(Scores { values, examples: summed[0] as usize })
    }

    fn write_predictions(&self, _dir: &Path) -> Result<Vec<String>> {
        Ok(vec![])
    }

    /// The reference log-probabilities (of the evaluation pairs alone when
    /// the reference runs with every step): those the run kept when it
    /// resumes with the same pairs, else computed from the starting model
    /// (`ft eval`: the reference model) and kept in the run's output.
    fn before_training(&mut self, start: &mut Start) -> Result<()> {
        if !self.computes_reference() {
            return Ok(());
        }
        let path = start.output.map(|output| output.join(REFERENCE_FILE));
        let fingerprint = self.fingerprint();
        let kept = path.as_deref().filter(|_| start.resuming).and_then(|path| self.kept_reference(path, &fingerprint));
        // Every rank must take the same branch: rank 0's view of the file decides.
        let reuse = start.comm.sum_over_ranks(&[if start.comm.env().rank == 0 && kept.is_some() { 1.0 } else { 0.0 }])?[0] > 0.0;
        let reference = match (reuse, kept) {
            (true, Some(kept)) => kept,
            (true, None) => {
                let path = path.as_deref().unwrap_or(Path::new(REFERENCE_FILE));
                bail!("{}: rank 0 reuses it but this rank cannot read it (is the output directory shared by every node?)", path.display())
            }
            (false, _) => {
                let started = std::time::Instant::now();
                // With the reference run at every step, only the evaluation pairs need theirs now.
                let train = match self.objective.step_reference {
                    None => self.logps(&self.train, start.model, start.comm)?,
                    Some(_) => vec![],
                };
                let eval = match &self.eval {
                    Some(eval) => self.logps(eval, start.model, start.comm)?,
                    None => vec![],
                };
                let computed = ReferenceFile { fingerprint, train, eval };
                if start.comm.env().rank == 0 {
                    let kept_in = match (start.output, &path) {
                        (Some(output), Some(path)) => {
                            std::fs::create_dir_all(output)?;
                            std::fs::write(path, serde_json::to_vec(&computed)?).with_context(|| format!("cannot write {}", path.display()))?;
                            format!(", kept in {}", path.display())
                        }
                        _ => String::new(),
                    };
                    tracing::info!(
                        "reference log-probabilities of {} training and {} evaluation pairs computed in {:.1} s{kept_in}",
                        computed.train.len(),
                        computed.eval.len(),
                        started.elapsed().as_secs_f64(),
                    );
                }
                computed
            }
        };
        if let (true, 0, Some(path)) = (reuse, start.comm.env().rank, &path) {
            tracing::info!("reference log-probabilities reused from {}", path.display());
        }
        if self.objective.step_reference.is_none() {
            self.train.reference = Some(reference.train);
        }
        if let Some(eval) = &mut self.eval {
            eval.reference = Some(reference.eval);
        }
        Ok(())
    }

    fn compares_with_reference(&self) -> bool {
        !self.reference_free
    }

    /// Which of TRL's reference options the run uses; the host memory it
    /// costs here is the precomputed log-probabilities (a frozen copy is the
    /// trainer's to count).
    fn reference(&self) -> Option<task::Reference> {
        if self.reference_free {
            return None;
        }
        let kind = match (&self.objective.step_reference, self.adapters) {
            (None, _) => "log-probabilities precomputed from the starting model (task.precompute_ref=true)",
            (Some(_), true) => "LoRA's base (the model's own frozen units, its adapters off), run with each step (task.precompute_ref=false)",
            (Some(_), false) => "a frozen copy of the starting model, run with each step (task.precompute_ref=false)",
        };
        let datasets = std::iter::once(&self.train).chain(&self.eval);
        let logps: usize = datasets.filter_map(|data| data.reference.as_ref()).map(Vec::len).sum();
        let host_bytes = (logps * std::mem::size_of::<[f64; 2]>()) as f64;
        Some(task::Reference { kind: kind.into(), host_bytes, each_step: self.objective.step_reference.is_some() })
    }
}

fn objective(options: &Options, chunk_tokens: i64, device: Device, model: &dyn Model) -> Result<DpoLoss> {
    Ok(DpoLoss {
        losses: options.losses()?,
        beta: options.beta,
        label_smoothing: options.label_smoothing,
        discopop_tau: options.discopop_tau.unwrap_or(0.05),
        chunk_tokens,
        kernels: Kernels::select(device),
        softcap: model.logit_softcap(),
        metrics: Mutex::new(StepMetrics::default()),
        step_reference: (!options.precompute_ref).then(|| Mutex::new(None)),
    })
}

/// How the training pairs are read, or (`eval`: the split of the
/// evaluation data, `ft_data::source::eval_data`'s) the evaluation pairs.
fn load_options<'a>(data: &'a DataConfig, options: &Options, tokenizer: &'a Path, eval: Option<Option<&'a str>>) -> preference::LoadOptions<'a> {
    let training = eval.is_none();
    preference::LoadOptions {
        max_length: data.max_seq_len,
        truncation: options.truncation_mode.unwrap_or(if data.truncate { Truncation::KeepStart } else { Truncation::Skip }),
        range: if training { data.range } else { None },
        limit: if training { data.train_samples } else { data.eval_samples },
        tokenizer_dir: tokenizer.parent().unwrap_or(Path::new(".")),
        chat_template: data.chat_template.as_deref(),
        split: match eval {
            None => Split::train(data.split.as_deref()),
            Some(split) => Split::eval(split),
        },
        columns: &data.columns,
    }
}

/// The training pairs of `data.train` or `data.mixture` (None: neither is set).
fn training_pairs(config: &Config, options: &Options, tokenizer_path: &Path, tokenizer: &Tokenizer) -> Result<Option<Vec<Pair>>> {
    let data = &config.data;
    mixture::training_set(data, config.train.seed, data.range, data.train_samples, "preference pairs", |path, source| {
        let Some(source) = source else { return preference::load(path, tokenizer, &load_options(data, options, tokenizer_path, None)) };
        if source.format != DataFormat::Auto {
            bail!("data.mixture: {} has a format, which preference pairs do not take (their rows are TRL's preference format whatever the file)", path.display());
        }
        let options = preference::LoadOptions {
            range: None,
            limit: None,
            split: Split::train(source.split.as_deref().or(data.split.as_deref())),
            columns: if source.columns.is_empty() { &data.columns } else { &source.columns },
            ..load_options(data, options, tokenizer_path, None)
        };
        preference::load(path, tokenizer, &options)
    })
}

/// `ft tokenize --task dpo`: the training pairs as the task reads them, one
/// line each: `{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
/// "rejected_labels"}`, each sequence the prompt then its completion, its
/// labels -100 over the prompt (where no loss is taken).
fn tokenize(given: &Tokenize) -> Result<String> {
    let options = Options::read(&serde_json::Value::Object(given.config.task.options.clone()))?;
    let tokenizer = ft_data::tokenizer::open(given.tokenizer)?;
    let pairs = training_pairs(given.config, &options, given.tokenizer, &tokenizer)?.context("give the data with --train-file (data.train)")?;
    let labels = |sequence: &Sequence| -> Vec<i64> { sequence.ids.iter().enumerate().map(|(i, &id)| if i < sequence.completion_start { IGNORE_INDEX } else { id }).collect() };
    let rows: Vec<serde_json::Value> = pairs
        .iter()
        .map(|pair| {
            serde_json::json!({
                "chosen_input_ids": pair.chosen.ids, "chosen_labels": labels(&pair.chosen),
                "rejected_input_ids": pair.rejected.ids, "rejected_labels": labels(&pair.rejected),
            })
        })
        .collect();
    lm::write_jsonl(&rows, given.out)?;
    let tokens: usize = pairs.iter().map(|pair| pair.chosen.ids.len() + pair.rejected.ids.len()).sum();
    let completions: usize = pairs.iter().map(|pair| pair.chosen.completion_tokens() + pair.rejected.completion_tokens()).sum();
    Ok(format!("{} preference pairs, {tokens} tokens ({completions} in completions) in {}", pairs.len(), given.out.display()))
}

fn build(inputs: &TaskInputs) -> Result<Box<dyn Task>> {
    task::check_head(NAME, head::CAUSAL_LM, inputs.model)?;
    task::check_sequence_length(&inputs.config.data, inputs.model)?;
    let options = Options::read(&serde_json::Value::Object(inputs.config.task.options.clone()))?;
    let data = &inputs.config.data;
    if data.packing {
        bail!("data.packing does not apply to the dpo task: its pairs are packed with task.padding_free (the default)");
    }
    let tokenizer = ft_data::tokenizer::load(inputs.tokenizer, inputs.model.dims().vocab)?;
    let pad_id = lm::pad_id(&tokenizer);
    let pad_multiple = data.pad_to_multiple_of.unwrap_or(if inputs.device == Device::Cpu { 1 } else { 64 }).max(1);
    let pairs_dataset = |pairs: Vec<Pair>| {
        // Reference-free: the reference's log-probabilities are 0.
        let reference = options.reference_free.then(|| vec![[0.0; 2]; pairs.len()]);
        // A packed row holds a pair's two sequences of at most max_seq_len each.
        let packed_rows = options.padding_free.then_some(2 * data.max_seq_len);
        PairDataset { pairs, reference, pad_id, pad_multiple, packed_rows, share_prompt: options.share_prompt.unwrap_or(options.padding_free) }
    };
    // `ft eval` reads no training file.
    let train = pairs_dataset(training_pairs(inputs.config, &options, inputs.tokenizer, &tokenizer)?.unwrap_or_default());
    let eval_data = ft_data::source::eval_data(data)?;
    let eval_options = load_options(data, &options, inputs.tokenizer, Some(eval_data.as_ref().and_then(|(_, split)| split.as_deref())));
    let eval = eval_data.as_ref().map(|(path, _)| preference::load(path, &tokenizer, &eval_options).map(pairs_dataset)).transpose()?;
    Ok(Box::new(Dpo {
        train,
        eval,
        objective: objective(&options, inputs.config.train.loss_chunk_tokens, inputs.device, inputs.model)?,
        batch_size: inputs.config.train.eval_batch_size,
        reference_free: options.reference_free,
        adapters: inputs.model.adapter_scaling().is_some(),
    }))
}

/// Random pairs (a shared prompt, then two completions, of `seq` tokens
/// each), the reference at 0: what `ft bench` times a step with.
fn synthetic(spec: &Synthetic) -> Result<Box<dyn Task>> {
    tch::manual_seed(spec.seed);
    let ids = Tensor::randint(spec.model.dims().vocab, [2 * spec.examples as i64, spec.seq], (Kind::Int64, Device::Cpu));
    let rows: Vec<Vec<i64>> = Vec::try_from(ids)?;
    let prompt = (spec.seq / 2) as usize;
    let pairs = rows
        .chunks(2)
        .map(|two| {
            let rejected: Vec<i64> = two[0][..prompt].iter().chain(&two[1][prompt..]).copied().collect();
            Pair { chosen: Sequence { ids: two[0].clone(), completion_start: prompt }, rejected: Sequence { ids: rejected, completion_start: prompt } }
        })
        .collect::<Vec<_>>();
    let reference = Some(vec![[0.0; 2]; pairs.len()]);
    Ok(Box::new(Dpo {
        train: PairDataset { pairs, reference, pad_id: 0, pad_multiple: 1, packed_rows: Some(2 * spec.seq as usize), share_prompt: true },
        eval: None,
        objective: objective(&Options::default(), spec.loss_chunk_tokens, spec.device, spec.model)?,
        batch_size: 1,
        reference_free: false,
        adapters: spec.model.adapter_scaling().is_some(),
    }))
}

inventory::submit! {
    TaskRegistration {
        name: NAME,
        summary: "preference tuning of a causal LM: DPO and TRL's other pairwise losses over chosen/rejected pairs, the reference precomputed or run with each step (LoRA's base, or a frozen copy)",
        head_kind: head::CAUSAL_LM,
        build,
        synthetic,
        check_options: |value, _, _| Options::read(value).map(drop),
        tokenize: Some(tokenize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(prompt: &[i64], chosen: &[i64], rejected: &[i64]) -> Pair {
        let sequence = |completion: &[i64]| Sequence { ids: [prompt, completion].concat(), completion_start: prompt.len() };
        Pair { chosen: sequence(chosen), rejected: sequence(rejected) }
    }

    #[test]
    fn padded_rows_are_trls_batch_and_packed_rows_keep_each_pair_together() {
        let pairs = vec![pair(&[1, 2], &[3], &[4, 5]), pair(&[6], &[7, 8], &[9])];
        let mut data = PairDataset { pairs, reference: Some(vec![[-1.0, -2.0], [-3.0, -4.0]]), pad_id: 0, pad_multiple: 1, packed_rows: None, share_prompt: false };
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        let rows = |t: &Tensor| Vec::<Vec<i64>>::try_from(t).unwrap();
        assert_eq!(rows(&batch.inputs.input_ids), vec![vec![1, 2, 3, 0], vec![6, 7, 8, 0], vec![1, 2, 4, 5], vec![6, 9, 0, 0]]);
        assert_eq!(rows(&batch.targets[LABELS]), vec![vec![-100, -100, 3, -100], vec![-100, 7, 8, -100], vec![-100, -100, 4, 5], vec![-100, 9, -100, -100]]);
        assert_eq!(Vec::<f32>::try_from(&batch.targets[REFERENCE]).unwrap(), vec![-1.0, -3.0, -2.0, -4.0]);
        assert_eq!(rows(batch.inputs.token_mask.as_ref().unwrap()), vec![vec![1, 1, 1, 0], vec![1, 1, 1, 0], vec![1, 1, 1, 1], vec![1, 1, 0, 0]]);
        data.packed_rows = Some(6);
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        assert_eq!(rows(&batch.inputs.input_ids), vec![vec![1, 2, 3, 1, 2, 4, 5], vec![6, 7, 8, 6, 9, 0, 0]]);
        assert_eq!(rows(&batch.targets[SEQUENCE_OF_TOKEN]), vec![vec![0, 0, 0, 2, 2, 2, 2], vec![1, 1, 1, 3, 3, 0, 0]]);
        assert_eq!(rows(batch.inputs.documents.as_ref().unwrap()), vec![vec![0, 0, 0, 1, 1, 1, 1], vec![0, 0, 0, 1, 1, 2, 2]]);
        assert!(batch.inputs.branches.is_none());
        // Sharing the prompt: the first pair's prompt but its last token once, then each
        // completion after that token; the second's one-token prompt leaves nothing to share.
        data.share_prompt = true;
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        assert_eq!(rows(&batch.inputs.input_ids), vec![vec![1, 2, 3, 2, 4, 5], vec![6, 7, 8, 6, 9, 0]]);
        assert_eq!(rows(&batch.targets[LABELS]), vec![vec![-100, -100, 3, -100, 4, 5], vec![-100, 7, 8, -100, 9, -100]]);
        assert_eq!(rows(&batch.targets[SEQUENCE_OF_TOKEN]), vec![vec![0, 0, 0, 2, 2, 2], vec![1, 1, 1, 3, 3, 0]]);
        assert_eq!(rows(batch.inputs.documents.as_ref().unwrap()), vec![vec![0, 0, 0, 0, 0, 0], vec![0, 0, 0, 1, 1, 2]]);
        assert_eq!(rows(batch.inputs.branches.as_ref().unwrap()), vec![vec![0, 1, 1, 2, 2, 2], vec![0, 0, 0, 0, 0, 0]]);
        // Each token at the position it has in its own sequence.
        assert_eq!(rows(&ft_core::model::decoder_positions(&batch.inputs, 0)), vec![vec![0, 1, 2, 1, 2, 3], vec![0, 1, 2, 0, 1, 0]]);
        // In one row, an unshared pair's two examples and then a shared pair's one are three.
        data.pairs = vec![pair(&[6], &[7, 8, 10, 11], &[9]), pair(&[1, 2], &[3], &[4, 5])];
        data.packed_rows = Some(13);
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        assert_eq!(rows(&batch.inputs.input_ids), vec![vec![6, 7, 8, 10, 11, 6, 9, 1, 2, 3, 2, 4, 5]]);
        assert_eq!(rows(batch.inputs.documents.as_ref().unwrap()), vec![vec![0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2]]);
        assert_eq!(rows(batch.inputs.branches.as_ref().unwrap()), vec![vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2]]);
        assert_eq!(rows(&ft_core::model::decoder_positions(&batch.inputs, 0)), vec![vec![0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 1, 2, 3]]);
    }

    #[test]
    fn rpo_alpha_is_the_sft_loss_with_that_weight() {
        let options = Options::read(&serde_json::json!({"rpo_alpha": 0.5})).unwrap();
        assert_eq!(options.losses().unwrap(), vec![(LossType::Sigmoid, 1.0), (LossType::Sft, 0.5)]);
    }

    #[test]
    fn bad_options_are_named() {
        for (options, expected) in [
            (serde_json::json!({"loss_type": "simpo"}), "unknown variant `simpo`, expected one of `sigmoid`"),
            (serde_json::json!({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}), "1 weights for the 2 loss types"),
            (serde_json::json!({"loss_type": "robust", "label_smoothing": 0.5}), "task.label_smoothing must be in [0, 0.5)"),
            (serde_json::json!({"bet": 0.1}), "unknown field `bet`"),
            (serde_json::json!({"reference_free": true, "precompute_ref": false}), "which task.reference_free=true leaves out"),
            (serde_json::json!({"share_prompt": true, "padding_free": false}), "which task.padding_free=false leaves out"),
            (serde_json::json!({"loss_type": ["sigmoid", "sft"], "rpo_alpha": 0.5}), "which task.loss_type already lists"),
            (serde_json::json!({"loss_type": "discopop", "discopop_tau": 0.0}), "task.discopop_tau must be positive"),
            (serde_json::json!({"loss_type": "sigmoid", "discopop_tau": 0.1}), "task.loss_type has no discopop"),
            (serde_json::json!({"loss_type": "ipo", "label_smoothing": 0.1}), "task.loss_type has none of them"),
        ] {
            let err = Options::read(&options).unwrap_err().to_string();
            assert!(err.contains(expected), "{options}: {err}");
        }
    }
}
