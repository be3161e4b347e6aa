//! `extractive_qa`: SQuAD v1.1/v2.0 question answering with an encoder's
//! span head, as transformers' run_qa.py does it: question-context windows
//! (`ft_data::qa::features`), the loss (CE(start) + CE(end)) / 2 over each
//! window's answer tokens, post-processing of the start/end logits into
//! answer texts (`ft_data::qa::postprocess`), and the official scores
//! (`ft_data::qa::squad_eval`: v1.1's exact_match/f1, or v2.0's exact, f1,
//! HasAns_*, NoAns_*, best_*, in percent).
//!
//! Task keys: `task.version_2_with_negative` (default: whether the data has
//! unanswerable questions), `task.doc_stride` (128), `task.n_best_size`
//! (20), `task.max_answer_length` (30), `task.null_score_diff_threshold`
//! (0.0). The window length is `data.max_seq_len` (run_qa.py's
//! `max_seq_length`, 384 there). A question too long to leave the context
//! room in a window is skipped, counted and logged (in scoring it predicts
//! "", the no-answer).

use anyhow::{bail, Result};
use ft_core::batches::to_device_async;
use ft_core::config::{DataFormat, DataRange};
use ft_core::dataset::{Batch, Dataset};
use ft_core::distributed::comm::Communicator;
use ft_core::model::{self, head, Inputs, Model};
use ft_core::task::{self, Objective, Scores, Synthetic, Task, TaskInputs, TaskRegistration};
use ft_data::formats::{self, Chosen};
use ft_data::qa::features::{QaFeaturizer, TrainFeature, ValidationFeature, Window, WindowConfig};
use ft_data::qa::postprocess::{postprocess_qa_predictions, PostprocessConfig};
use ft_data::qa::squad_eval;
use ft_data::squad::{self, QaExample};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tch::{Device, Kind, Tensor};

const NAME: &str = "extractive_qa";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Options {
    version_2_with_negative: Option<bool>,
    doc_stride: usize,
    n_best_size: usize,
    max_answer_length: usize,
    null_score_diff_threshold: f32,
}

impl Default for Options {
    fn default() -> Self {
        let post = PostprocessConfig::default();
        Options {
            version_2_with_negative: None,
            doc_stride: WindowConfig::default().doc_stride,
            n_best_size: post.n_best_size,
            max_answer_length: post.max_answer_length,
            null_score_diff_threshold: post.null_score_diff_threshold,
        }
    }
}

/// The model inputs of windows, each padded to the window length as run_qa.py
/// pads them (so the span logits, and the loss over them, are the same). A
/// batch without padding carries no mask, as transformers drops an all-ones
/// mask: attention then runs unmasked (the flash kernel).
fn collate_windows<'w>(windows: impl Iterator<Item = &'w Window>, device: Device) -> Inputs {
    let (mut ids, mut types, mut mask) = (vec![], vec![], vec![]);
    for w in windows {
        ids.push(w.input_ids.clone());
        types.push(w.token_type_ids.clone());
        mask.push(w.attention_mask.clone());
    }
    let padded = mask.iter().flatten().any(|&m| m == 0);
    let to_device = |rows: Vec<Vec<i64>>| to_device_async(&Tensor::from_slice2(&rows), device);
    Inputs { input_ids: to_device(ids), attention_mask: padded.then(|| to_device(mask)), token_type_ids: Some(to_device(types)), documents: None, branches: None, token_mask: None }
}

fn real_tokens(window: &Window) -> usize {
    window.attention_mask.iter().filter(|&&m| m != 0).count()
}

/// Training windows with their answer's start and end token.
pub struct SpanDataset {
    features: Vec<TrainFeature>,
}

impl Dataset for SpanDataset {
    fn len(&self) -> usize {
        self.features.len()
    }

    fn tokens(&self, index: usize) -> usize {
        real_tokens(&self.features[index].window)
    }

    /// Every window weighs the same: the loss is a mean over windows, as
    /// transformers' BertForQuestionAnswering takes it.
    fn loss_weight(&self, _index: usize) -> usize {
        1
    }

    fn collate(&self, indices: &[usize], device: Device) -> Result<Batch> {
        let features: Vec<&TrainFeature> = indices.iter().map(|&i| &self.features[i]).collect();
        let positions = |pick: fn(&TrainFeature) -> i64| {
            to_device_async(&Tensor::from_slice(&features.iter().map(|f| pick(f)).collect::<Vec<i64>>()), device)
        };
        Ok(Batch {
            inputs: collate_windows(features.iter().map(|f| &f.window), device),
            targets: vec![positions(|f| f.start_position), positions(|f| f.end_position)],
        })
    }
}

/// (CE(start) + CE(end)) / 2 per window, in fp32, its gradients by autograd
/// over the two logit tensors alone.
pub struct SpanLoss;

impl SpanLoss {
    /// The summed loss of a batch, over fp32 leaves of the head's outputs.
    fn summed(outputs: &[Tensor], batch: &Batch, leaves: bool) -> Result<(Tensor, Vec<Tensor>)> {
        let ([start_logits, end_logits], [start, end]) = (outputs, batch.targets.as_slice()) else {
            bail!("a span head returns [start_logits, end_logits] and its batch has [start, end] positions");
        };
        let logits: Vec<Tensor> =
            [start_logits, end_logits].iter().map(|t| t.detach().to_kind(Kind::Float).set_requires_grad(leaves)).collect();
        let ce = |logits: &Tensor, target: &Tensor| logits.cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Sum, -100, 0.0);
        Ok(((ce(&logits[0], start) + ce(&logits[1], end)) / 2.0, logits))
    }
}

impl Objective for SpanLoss {
    fn loss_and_grads(&self, outputs: &[Tensor], batch: &Batch, normalizer: f64, loss_scale: Option<&Tensor>) -> Result<(Tensor, Vec<Tensor>)> {
        let (sum, leaves) = SpanLoss::summed(outputs, batch, true)?;
        let loss = sum / normalizer;
        let scaled = match loss_scale {
            Some(scale) => &loss * scale.squeeze(),
            None => loss.shallow_clone(),
        };
        let grads = Tensor::run_backward(&[scaled], &leaves.iter().collect::<Vec<_>>(), false, false);
        let grads = grads.iter().zip(outputs).map(|(g, output)| g.to_kind(output.kind())).collect();
        Ok((loss.detach(), grads))
    }

    fn loss_sum(&self, outputs: &[Tensor], batch: &Batch) -> Result<(f64, f64)> {
        let (sum, _) = tch::no_grad(|| SpanLoss::summed(outputs, batch, false))?;
        Ok((sum.double_value(&[]), batch.targets[0].size()[0] as f64))
    }
}

/// What scoring needs: the questions, their evaluation windows, and the
/// post-processing rules.
struct Scoring {
    examples: Vec<QaExample>,
    features: Vec<ValidationFeature>,
    postprocess: PostprocessConfig,
    batch_size: usize,
}

/// One rank's answers: text and, for v2, the null-score difference (utils_qa.py's null odds).
type Answers = Vec<(String, String, Option<f64>)>;

impl Scoring {
    /// The examples `mine` (indices, this rank's share) answered.
    fn answer_share(&self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, mine: &[usize], device: Device) -> Result<Answers> {
        let _no_grad = tch::no_grad_guard();
        let local_of: HashMap<usize, usize> = mine.iter().enumerate().map(|(local, &global)| (global, local)).collect();
        let features: Vec<ValidationFeature> = self
            .features
            .iter()
            .filter_map(|f| local_of.get(&f.example_index).map(|&local| ValidationFeature { example_index: local, ..f.clone() }))
            .collect();
        let (mut starts, mut ends): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (vec![], vec![]);
        for chunk in features.chunks(self.batch_size.max(1)) {
            let inputs = collate_windows(chunk.iter().map(|f| &f.window), device);
            let ctx = model.context(&inputs, 0, dtype, false)?;
            let outputs = model::forward(model, params, &inputs, &ctx, None);
            for (all, logits) in [(&mut starts, &outputs[0]), (&mut ends, &outputs[1])] {
                all.extend(Vec::<Vec<f32>>::try_from(logits.to_kind(Kind::Float).to_device(Device::Cpu))?);
            }
        }
        // Examples without windows (their question left no room) answer "" below.
        let windowed: Vec<usize> = (0..mine.len()).filter(|local| features.iter().any(|f| f.example_index == *local)).collect();
        let compact: HashMap<usize, usize> = windowed.iter().enumerate().map(|(i, &local)| (local, i)).collect();
        let features: Vec<ValidationFeature> =
            features.into_iter().map(|f| ValidationFeature { example_index: compact[&f.example_index], ..f }).collect();
        let examples: Vec<QaExample> = windowed.iter().map(|&local| self.examples[mine[local]].clone()).collect();
        let (starts, ends): (Vec<&[f32]>, Vec<&[f32]>) = (starts.iter().map(Vec::as_slice).collect(), ends.iter().map(Vec::as_slice).collect());
        let predictions = postprocess_qa_predictions(&examples, &features, &starts, &ends, &self.postprocess)?;
        let mut answers: BTreeMap<String, (String, Option<f64>)> =
            mine.iter().map(|&g| (self.examples[g].id.clone(), (String::new(), self.postprocess.version_2_with_negative.then_some(0.0)))).collect();
        for p in predictions {
            answers.insert(p.id, (p.text, p.null_score_diff));
        }
        Ok(answers.into_iter().map(|(id, (text, odds))| (id, text, odds)).collect())
    }
}

pub struct ExtractiveQa {
    train: SpanDataset,
    eval: Option<SpanDataset>,
    scoring: Option<Scoring>,
    /// The last scoring's answers and (v2) null odds, by question id.
    predictions: BTreeMap<String, String>,
    null_odds: BTreeMap<String, f64>,
}

impl Task for ExtractiveQa {
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
        &SpanLoss
    }

    /// Each rank answers its share of the questions; every rank scores all
    /// of them with the official rules.
    fn score(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, comm: &Communicator) -> Result<Scores> {
        let Some(scoring) = &self.scoring else { return Ok(Scores::default()) };
        let mine = scoring.answer_share(model, params, dtype, &task::rank_share(comm, scoring.examples.len()), comm.device())?;
        let all: Answers = task::all_gather_json(comm, &mine)?.into_iter().flatten().collect();
        self.predictions = all.iter().map(|(id, text, _)| (id.clone(), text.clone())).collect();
        self.null_odds = all.iter().filter_map(|(id, _, odds)| Some((id.clone(), (*odds)?))).collect();
        let predictions: HashMap<String, String> = self.predictions.clone().into_iter().collect();
        let values: BTreeMap<String, f64> = if scoring.postprocess.version_2_with_negative {
            let na_probs: Vec<(String, f64)> = self.null_odds.clone().into_iter().collect();
            let scores = squad_eval::evaluate_v2(&scoring.examples, &predictions, Some(&na_probs), squad_eval::DEFAULT_NA_PROB_THRESH)?;
            serde_json::from_value(scores.to_json())?
        } else {
            let scores = squad_eval::evaluate_v1(&scoring.examples, &predictions)?;
            BTreeMap::from([("exact_match".into(), scores.exact_match), ("f1".into(), scores.f1)])
        };
        Ok(Scores { values, examples: scoring.examples.len() })
    }

    fn write_predictions(&self, dir: &Path) -> Result<Vec<String>> {
        if self.scoring.is_none() {
            return Ok(vec![]);
        }
        std::fs::write(dir.join("predictions.json"), serde_json::to_string_pretty(&self.predictions)?)?;
        let mut written = vec!["predictions.json".to_string()];
        if !self.null_odds.is_empty() {
            std::fs::write(dir.join("null_odds.json"), serde_json::to_string_pretty(&self.null_odds)?)?;
            written.push("null_odds.json".into());
        }
        Ok(written)
    }
}

/// SQuAD examples of `path` (unanswerable ones kept: whether they count is
/// the version's): the questions in `range` of the file's, then the first `limit`.
fn read_examples(path: &Path, range: Option<DataRange>, limit: Option<usize>) -> Result<Vec<QaExample>> {
    let (mut examples, stats) = squad::read(path, true, range)?;
    if let Some(limit) = limit {
        examples.truncate(limit);
    }
    let (rows, gave) = (format!("{} questions in {} articles", stats.questions, stats.articles), format!("{} questions ({} with bad offsets skipped)", examples.len(), stats.bad_offsets_skipped));
    formats::log_source(&path.display().to_string(), DataFormat::Squad, Chosen::ByTask, &rows, &gave);
    Ok(examples)
}

fn log_skipped(what: &str, skipped: usize, max_seq_len: usize) {
    if skipped > 0 {
        tracing::warn!("{skipped} {what} question(s) skipped: too long to leave room for the context in a {max_seq_len}-token window");
    }
}

fn build(inputs: &TaskInputs) -> Result<Box<dyn Task>> {
    task::check_head(NAME, head::QUESTION_ANSWERING, inputs.model)?;
    task::check_sequence_length(&inputs.config.data, inputs.model)?;
    let options: Options = task::options(NAME, &serde_json::Value::Object(inputs.config.task.options.clone()))?;
    let data = &inputs.config.data;
    if data.packing {
        bail!("data.packing is for causal language models: extractive_qa reads each window of a question and its context whole");
    }
    if !data.mixture.is_empty() || data.split.is_some() || data.eval_split.is_some() || !data.columns.is_empty() {
        bail!("data.mixture, data.split, data.eval_split and data.columns are for causal language models' rows: extractive_qa reads SQuAD JSON files");
    }
    let tokenizer = ft_data::tokenizer::load(inputs.tokenizer, inputs.model.dims().vocab)?;
    let windows = WindowConfig { max_seq_length: data.max_seq_len, doc_stride: options.doc_stride };
    let featurizer = QaFeaturizer::new(tokenizer, &inputs.tokenizer.display().to_string(), windows)?;
    let train_examples = match &data.train {
        Some(path) => read_examples(path, data.range, data.train_samples)?,
        None => vec![],
    };
    let eval_examples = match &data.eval {
        Some(path) => read_examples(path, None, data.eval_samples)?,
        None => vec![],
    };
    let has_unanswerable = train_examples.iter().chain(&eval_examples).any(|e| e.answers.is_empty());
    let version_2 = options.version_2_with_negative.unwrap_or(has_unanswerable);
    if has_unanswerable && !version_2 {
        bail!("the data has unanswerable questions but task.version_2_with_negative is false: SQuAD v1.1 data has none");
    }
    let mut train = featurizer.prepare_train_features(&train_examples);
    log_skipped("training", train.skipped.len(), data.max_seq_len);
    // As run_qa.py's max_train_samples: the examples, then their windows.
    if let Some(limit) = data.train_samples {
        train.features.truncate(limit);
    }
    let (eval, scoring) = if eval_examples.is_empty() {
        (None, None)
    } else {
        let loss_windows = featurizer.prepare_train_features(&eval_examples);
        let windows = featurizer.prepare_validation_features(&eval_examples);
        log_skipped("evaluation", windows.skipped.len(), data.max_seq_len);
        let postprocess = PostprocessConfig {
            version_2_with_negative: version_2,
            n_best_size: options.n_best_size,
            max_answer_length: options.max_answer_length,
            null_score_diff_threshold: options.null_score_diff_threshold,
        };
        let scoring = Scoring { examples: eval_examples, features: windows.features, postprocess, batch_size: inputs.config.train.eval_batch_size };
        (Some(SpanDataset { features: loss_windows.features }), Some(scoring))
    };
    Ok(Box::new(ExtractiveQa {
        train: SpanDataset { features: train.features },
        eval,
        scoring,
        predictions: BTreeMap::new(),
        null_odds: BTreeMap::new(),
    }))
}

/// Random windows (two segments, no padding) with random answer spans:
/// what `ft bench` times a step with.
fn synthetic(spec: &Synthetic) -> Result<Box<dyn Task>> {
    tch::manual_seed(spec.seed);
    let (examples, seq) = (spec.examples as i64, spec.seq);
    let ids: Vec<Vec<i64>> = Vec::try_from(Tensor::randint(spec.model.dims().vocab, [examples, seq], (Kind::Int64, Device::Cpu)))?;
    let starts: Vec<i64> = Vec::try_from(Tensor::randint(seq, [examples], (Kind::Int64, Device::Cpu)))?;
    let features = ids
        .into_iter()
        .zip(starts)
        .enumerate()
        .map(|(i, (input_ids, start))| TrainFeature {
            window: Window {
                token_type_ids: (0..seq).map(|t| i64::from(t >= seq / 4)).collect(),
                attention_mask: vec![1; seq as usize],
                input_ids,
            },
            example_index: i,
            start_position: start,
            end_position: (start + 8).min(seq - 1),
        })
        .collect();
    Ok(Box::new(ExtractiveQa { train: SpanDataset { features }, eval: None, scoring: None, predictions: BTreeMap::new(), null_odds: BTreeMap::new() }))
}

inventory::submit! {
    TaskRegistration {
        name: NAME,
        summary: "extractive QA on SQuAD v1.1/v2.0 with a span head: run_qa.py's windows, loss and post-processing, the official scores",
        head_kind: head::QUESTION_ANSWERING,
        build,
        synthetic,
        check_options: |value, _, _| task::options::<Options>(NAME, value).map(drop),
        tokenize: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_loss_and_gradients_equal_autograd_cross_entropy() {
        tch::manual_seed(0);
        let start = Tensor::randn([3, 7], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let end = Tensor::randn([3, 7], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let targets = vec![Tensor::from_slice(&[0i64, 3, 6]), Tensor::from_slice(&[0i64, 4, 6])];
        let batch = Batch { inputs: Inputs::ids(&Tensor::zeros([3, 7], (Kind::Int64, Device::Cpu))), targets };
        // transformers: (CrossEntropy(start) + CrossEntropy(end)) / 2, means over the batch.
        let reference = (start.cross_entropy_for_logits(&batch.targets[0]) + end.cross_entropy_for_logits(&batch.targets[1])) / 2.0;
        reference.backward();
        let outputs = [start.detach(), end.detach()];
        let (loss, grads) = SpanLoss.loss_and_grads(&outputs, &batch, 3.0, None).unwrap();
        assert!((loss.double_value(&[]) - reference.double_value(&[])).abs() < 1e-6);
        assert!(grads[0].allclose(&start.grad(), 1e-6, 1e-7, false) && grads[1].allclose(&end.grad(), 1e-6, 1e-7, false));
        let (sum, weight) = SpanLoss.loss_sum(&outputs, &batch).unwrap();
        assert!((sum / weight - reference.double_value(&[])).abs() < 1e-6);
        // fp16's scale multiplies the gradients, not the loss.
        let scale = Tensor::from_slice(&[8f32]);
        let (scaled_loss, scaled) = SpanLoss.loss_and_grads(&outputs, &batch, 3.0, Some(&scale)).unwrap();
        assert!(scaled_loss.allclose(&loss, 1e-6, 1e-7, false) && scaled[0].allclose(&(&grads[0] * 8.0), 1e-5, 1e-6, false));
    }

    #[test]
    fn unknown_task_keys_are_named() {
        let err = task::options::<Options>(NAME, &serde_json::json!({"doc_strid": 64})).unwrap_err().to_string();
        assert!(err.contains("unknown field `doc_strid`"), "{err}");
    }
}
