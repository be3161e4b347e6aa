//! `causal_lm`: fine-tuning a causal language model. SQuAD files become
//! prompts (`Question: … Context: … Answer:`) with the loss on the answer,
//! scored by exact match and F1 of the greedily generated answer; text and
//! JSONL are packed into fixed-length sequences, prompt/completion pairs and
//! conversations (`ft_data::lm`'s formats) train on their completions and
//! assistant turns (loss only).
//!
//! Task keys: `task.include_unanswerable` (train SQuAD v2's unanswerable
//! questions towards the empty answer), `task.max_new_tokens` (longest
//! generated answer), `task.train_on_prompt` (the loss on the prompt's tokens
//! in training as well, as axolotl's `train_on_inputs`; the eval loss stays
//! the answer's), `task.cuda_graph` (false: decode without replaying the
//! step as a CUDA graph, to compare or to debug).

use anyhow::{bail, Context, Result};
use ft_core::batches::to_device_async;
use ft_core::config::{DataConfig, TrainOn};
use ft_core::dataset::{Batch, Dataset};
use ft_core::distributed::comm::Communicator;
use ft_core::generate::{greedy_batch, Decoding};
use ft_core::model::{head, lm_outputs, Inputs, Model};
use ft_core::task::{self, Objective, Scores, Synthetic, Task, TaskInputs, TaskRegistration, Tokenize};
use ft_core::train::Kernels;
use ft_core::train::loss::{lm_head_loss_and_grads, lm_loss_sum, IGNORE_INDEX};
use ft_data::example::{eos_id, Example};
use ft_data::lm::{self, LoadOptions};
use ft_data::source::Split;
use ft_data::squad::QaExample;
use ft_data::{metrics, packing, prompt};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};
use tokenizers::Tokenizer;

const NAME: &str = "causal_lm";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Options {
    include_unanswerable: bool,
    max_new_tokens: usize,
    train_on_prompt: bool,
    cuda_graph: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { include_unanswerable: false, max_new_tokens: 32, train_on_prompt: false, cuda_graph: true }
    }
}

/// Token-id examples in rows — one example a row, or several packed
/// (`data.packing`) — right-padded per batch.
pub struct LmDataset {
    examples: Vec<Example>,
    /// The examples of each row, in order.
    rows: Vec<Vec<usize>>,
    pad_id: i64,
    /// Padded lengths round up to this: few shapes on a GPU, exact lengths on a CPU.
    pad_multiple: usize,
}

impl LmDataset {
    /// One example a row.
    pub fn new(examples: Vec<Example>, pad_id: i64, pad_multiple: usize) -> LmDataset {
        let rows = (0..examples.len()).map(|i| vec![i]).collect();
        LmDataset { examples, rows, pad_id, pad_multiple: pad_multiple.max(1) }
    }

    /// The examples packed into rows of at most `max_len` tokens (`ft_data::packing`).
    pub fn packed(examples: Vec<Example>, pad_id: i64, pad_multiple: usize, max_len: usize) -> LmDataset {
        let lengths: Vec<usize> = examples.iter().map(|e| e.input_ids.len()).collect();
        let rows = packing::pack(&lengths, max_len);
        let tokens: usize = lengths.iter().sum();
        tracing::info!(
            "packing: {} examples in {} rows of at most {max_len} tokens ({:.1}% of their tokens real, {:.1} examples a row)",
            examples.len(),
            rows.len(),
            100.0 * tokens as f64 / (rows.len() * max_len).max(1) as f64,
            examples.len() as f64 / rows.len().max(1) as f64
        );
        LmDataset { examples, rows, pad_id, pad_multiple: pad_multiple.max(1) }
    }

    fn row_examples(&self, row: usize) -> impl Iterator<Item = &Example> {
        self.rows[row].iter().map(|&i| &self.examples[i])
    }
}

impl Dataset for LmDataset {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn tokens(&self, index: usize) -> usize {
        self.row_examples(index).map(|e| e.input_ids.len()).sum()
    }

    fn loss_weight(&self, index: usize) -> usize {
        self.row_examples(index).map(Example::target_tokens).sum()
    }

    /// Each row's examples one after another, right-padded to the longest
    /// row rounded up to the multiple: padding is invisible to a causal
    /// model's earlier positions and has no loss. Where a row holds several
    /// examples, `documents` tells them apart and the label at each seam
    /// (the next example's first token, which nothing of it precedes) is
    /// ignored.
    fn collate(&self, indices: &[usize], device: Device) -> Result<Batch> {
        let longest = indices.iter().map(|&i| self.tokens(i)).max().unwrap_or(0).div_ceil(self.pad_multiple) * self.pad_multiple;
        let (mut ids, mut labels, mut documents, mut real) = (vec![], vec![], vec![], vec![]);
        for &row in indices {
            let (mut row_ids, mut row_labels, mut row_documents) = (vec![], vec![], vec![]);
            for (document, example) in self.row_examples(row).enumerate() {
                row_ids.extend(&example.input_ids);
                row_labels.extend(&example.labels);
                if document > 0 {
                    row_labels[row_documents.len()] = IGNORE_INDEX;
                }
                row_documents.resize(row_ids.len(), document as i64);
            }
            // Padding is an example of its own.
            let padding = self.rows[row].len() as i64;
            real.push([vec![1i64; row_ids.len()], vec![0; longest - row_ids.len()]].concat());
            row_ids.resize(longest, self.pad_id);
            row_labels.resize(longest, IGNORE_INDEX);
            row_documents.resize(longest, padding);
            ids.push(row_ids);
            labels.push(row_labels);
            documents.push(row_documents);
        }
        let packed = indices.iter().any(|&i| self.rows[i].len() > 1);
        let mut inputs = Inputs::ids(&to_device_async(&Tensor::from_slice2(&ids), device));
        inputs.documents = packed.then(|| to_device_async(&Tensor::from_slice2(&documents), device));
        // Right padding needs no attention mask under a causal one; what counts tokens still skips it.
        let padded = real.iter().flatten().any(|&token| token == 0);
        inputs.token_mask = padded.then(|| to_device_async(&Tensor::from_slice2(&real), device));
        Ok(Batch { inputs, targets: vec![to_device_async(&Tensor::from_slice2(&labels), device)] })
    }
}

/// Next-token cross-entropy on the labels, the logits formed chunk by chunk.
pub struct CausalLmLoss {
    pub chunk_tokens: i64,
    pub kernels: Kernels,
    /// The model's cap of its logits (`Model::logit_softcap`).
    pub softcap: Option<f64>,
}

fn labels(batch: &Batch) -> Result<&Tensor> {
    match batch.targets.as_slice() {
        [labels] => Ok(labels),
        other => bail!("a causal LM batch has one target (labels), this one has {}", other.len()),
    }
}

impl Objective for CausalLmLoss {
    fn loss_and_grads(&self, outputs: &[Tensor], batch: &Batch, normalizer: f64, loss_scale: Option<&Tensor>) -> Result<(Tensor, Vec<Tensor>)> {
        let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
        // A frozen LM weight (LoRA) needs no gradient.
        let weight_grad = weight.requires_grad();
        let (loss, grad_hidden, grad_weight) =
            lm_head_loss_and_grads(&hidden, &weight, labels(batch)?, normalizer, self.chunk_tokens, loss_scale, self.kernels, weight_grad, self.softcap)?;
        Ok((loss, vec![grad_hidden, grad_weight]))
    }

    fn loss_sum(&self, outputs: &[Tensor], batch: &Batch) -> Result<(f64, f64)> {
        let (hidden, weight) = lm_outputs(outputs.iter().map(Tensor::shallow_clone).collect())?;
        let (sum, count) = lm_loss_sum(&hidden, &weight, labels(batch)?, self.chunk_tokens, self.softcap)?;
        Ok((sum.double_value(&[]), count.double_value(&[])))
    }
}

/// EM/F1 of greedily generated answers.
struct Generation {
    tokenizer: Tokenizer,
    questions: Vec<QaExample>,
    max_seq_len: usize,
    max_new_tokens: usize,
    eos: Option<i64>,
    pad_id: i64,
    batch_size: usize,
    cuda_graph: bool,
}

impl Generation {
    /// The answers to `questions`, generated in batches of prompts of
    /// similar length (so little padding is computed); "" where even an
    /// empty context leaves no room for the question.
    fn answers(&self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, questions: &[&QaExample]) -> Result<Vec<String>> {
        let budget = self.max_seq_len.saturating_sub(self.max_new_tokens);
        let prompts = questions.iter().map(|q| prompt::prompt_ids(&self.tokenizer, q, budget)).collect::<Result<Vec<_>>>()?;
        let mut by_length: Vec<usize> = (0..prompts.len()).filter(|&i| prompts[i].is_some()).collect();
        by_length.sort_by_key(|&i| prompts[i].as_ref().map_or(0, Vec::len));
        let mut answers = vec![String::new(); questions.len()];
        let decoding = Decoding { max_new_tokens: self.max_new_tokens, eos: self.eos, pad_id: self.pad_id, dtype, cuda_graph: self.cuda_graph };
        for chunk in by_length.chunks(self.batch_size.max(1)) {
            let batch: Vec<Vec<i64>> = chunk.iter().filter_map(|&i| prompts[i].clone()).collect();
            let generated = greedy_batch(model, params, &batch, &decoding)?;
            for (&i, tokens) in chunk.iter().zip(generated) {
                let answer_ids: Vec<u32> = tokens.iter().filter(|&&t| Some(t) != self.eos).map(|&t| t as u32).collect();
                let text = self.tokenizer.decode(&answer_ids, true).map_err(anyhow::Error::msg)?;
                answers[i] = text.lines().next().unwrap_or("").trim().to_string();
            }
        }
        Ok(answers)
    }
}

pub struct CausalLm {
    train: LmDataset,
    eval: Option<LmDataset>,
    objective: CausalLmLoss,
    generation: Option<Generation>,
    /// The last scoring's answers, by question id.
    predictions: BTreeMap<String, String>,
}

impl Task for CausalLm {
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

    /// Each rank generates answers for its share of the questions; every
    /// rank scores all of them.
    fn score(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, comm: &Communicator) -> Result<Scores> {
        let Some(generation) = &self.generation else { return Ok(Scores::default()) };
        let questions: Vec<&QaExample> = task::rank_share(comm, generation.questions.len()).into_iter().map(|i| &generation.questions[i]).collect();
        let answers = generation.answers(model, params, dtype, &questions)?;
        let mine: Vec<(String, String)> = questions.iter().map(|q| q.id.clone()).zip(answers).collect();
        self.predictions = task::all_gather_json(comm, &mine)?.into_iter().flatten().collect();
        let (mut em, mut f1) = (0.0, 0.0);
        for question in &generation.questions {
            let (e, f) = metrics::score(self.predictions.get(&question.id).map_or("", String::as_str), &question.answers);
            em += e;
            f1 += f;
        }
        let count = generation.questions.len().max(1) as f64;
        Ok(Scores {
            values: BTreeMap::from([("em".into(), 100.0 * em / count), ("f1".into(), 100.0 * f1 / count)]),
            examples: generation.questions.len(),
        })
    }

    fn write_predictions(&self, dir: &Path) -> Result<Vec<String>> {
        if self.generation.is_none() {
            return Ok(vec![]);
        }
        std::fs::write(dir.join("predictions.json"), serde_json::to_string_pretty(&self.predictions)?)?;
        Ok(vec!["predictions.json".into()])
    }
}

/// How the training file is read, or (`eval`: the split of the evaluation
/// data, `ft_data::source::eval_data`'s) the evaluation file. The prompt's
/// tokens count in training only: the eval loss stays the answer's. Only
/// training takes `data.range` of its file.
fn load_options<'a>(data: &'a DataConfig, options: &Options, tokenizer: &'a Path, eval: Option<Option<&'a str>>) -> LoadOptions<'a> {
    let training = eval.is_none();
    LoadOptions {
        range: if training { data.range } else { None },
        limit: if training { data.train_samples } else { data.eval_samples },
        include_unanswerable: options.include_unanswerable,
        train_on_prompt: training && options.train_on_prompt,
        train_on: if training { data.train_on } else { TrainOn::Assistant },
        packing: training && data.packing,
        split: match eval {
            None => Split::train(data.split.as_deref()),
            Some(split) => Split::eval(split),
        },
        ..LoadOptions::new(data, tokenizer)
    }
}

/// `ft tokenize`: the training examples as training reads them, one
/// `{"input_ids", "labels"}` line each (-100 where no loss is taken).
fn tokenize(given: &Tokenize) -> Result<String> {
    let options: Options = task::options(NAME, &serde_json::Value::Object(given.config.task.options.clone()))?;
    let data = &given.config.data;
    let tokenizer = ft_data::tokenizer::open(given.tokenizer)?;
    let examples = lm::load_training(data, given.config.train.seed, &tokenizer, &load_options(data, &options, given.tokenizer, None))?
        .context("give the data with --train-file (data.train)")?;
    lm::write_jsonl(&examples, given.out)?;
    let tokens: usize = examples.iter().map(|e| e.input_ids.len()).sum();
    let labelled: usize = examples.iter().map(|e| e.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()).sum();
    Ok(format!("{} examples, {tokens} tokens ({labelled} with a label) in {}", examples.len(), given.out.display()))
}

fn build(inputs: &TaskInputs) -> Result<Box<dyn Task>> {
    task::check_head(NAME, head::CAUSAL_LM, inputs.model)?;
    task::check_sequence_length(&inputs.config.data, inputs.model)?;
    let options: Options = task::options(NAME, &serde_json::Value::Object(inputs.config.task.options.clone()))?;
    let data = &inputs.config.data;
    let tokenizer = ft_data::tokenizer::load(inputs.tokenizer, inputs.model.dims().vocab)?;
    let pad_id = lm::pad_id(&tokenizer);
    let pad_multiple = data.pad_to_multiple_of.unwrap_or(if inputs.device == Device::Cpu { 1 } else { 64 });
    let eval_data = ft_data::source::eval_data(data)?;
    let eval_split = eval_data.as_ref().map(|(_, split)| split.as_deref());
    let train = lm::load_training(data, inputs.config.train.seed, &tokenizer, &load_options(data, &options, inputs.tokenizer, None))?.unwrap_or_default();
    let (eval, questions) = match &eval_data {
        Some((path, _)) => {
            let (examples, questions) = lm::load(path, &tokenizer, &load_options(data, &options, inputs.tokenizer, eval_split))?;
            (Some(LmDataset::new(examples, pad_id, pad_multiple)), questions)
        }
        None => (None, vec![]),
    };
    let generation = (!questions.is_empty()).then(|| Generation {
        eos: eos_id(&tokenizer),
        tokenizer: tokenizer.clone(),
        questions,
        max_seq_len: data.max_seq_len,
        max_new_tokens: options.max_new_tokens,
        pad_id,
        batch_size: inputs.config.train.eval_batch_size,
        cuda_graph: options.cuda_graph,
    });
    // Evaluation stays one example a row: its loss and scores are per example anyway.
    let train = match data.packing {
        true => LmDataset::packed(train, pad_id, pad_multiple, data.max_seq_len),
        false => LmDataset::new(train, pad_id, pad_multiple),
    };
    Ok(Box::new(CausalLm {
        train,
        eval,
        objective: CausalLmLoss {
            chunk_tokens: inputs.config.train.loss_chunk_tokens,
            kernels: Kernels::select(inputs.device),
            softcap: inputs.model.logit_softcap(),
        },
        generation,
        predictions: BTreeMap::new(),
    }))
}

/// Random tokens, every one a target: what `ft bench` times a step with.
fn synthetic(spec: &Synthetic) -> Result<Box<dyn Task>> {
    tch::manual_seed(spec.seed);
    let ids = Tensor::randint(spec.model.dims().vocab, [spec.examples as i64, spec.seq], (Kind::Int64, Device::Cpu));
    let rows: Vec<Vec<i64>> = Vec::try_from(ids)?;
    let examples = rows.into_iter().map(|row| Example { labels: row.clone(), input_ids: row }).collect();
    Ok(Box::new(CausalLm {
        train: LmDataset::new(examples, 0, 1),
        eval: None,
        objective: CausalLmLoss { chunk_tokens: spec.loss_chunk_tokens, kernels: Kernels::select(spec.device), softcap: spec.model.logit_softcap() },
        generation: None,
        predictions: BTreeMap::new(),
    }))
}

inventory::submit! {
    TaskRegistration {
        name: NAME,
        summary: "causal-LM fine-tuning: SQuAD as prompts with the loss on the answer (EM/F1 by greedy generation), or packed text/JSONL",
        head_kind: head::CAUSAL_LM,
        build,
        synthetic,
        check_options: |value, _, _| task::options::<Options>(NAME, value).map(drop),
        tokenize: Some(tokenize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collate_pads_inputs_and_ignores_padded_labels() {
        let a = Example { input_ids: vec![1, 2, 3], labels: vec![-100, 2, 3] };
        let b = Example { input_ids: vec![4], labels: vec![4] };
        let data = LmDataset::new(vec![a, b], 0, 1);
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        assert_eq!(Vec::<Vec<i64>>::try_from(&batch.inputs.input_ids).unwrap(), vec![vec![1, 2, 3], vec![4, 0, 0]]);
        assert_eq!(Vec::<Vec<i64>>::try_from(&batch.targets[0]).unwrap(), vec![vec![-100, 2, 3], vec![4, -100, -100]]);
        assert_eq!((data.loss_weight(0), data.loss_weight(1), data.tokens(0)), (2, 0, 3));
        // Right padding needs no attention mask; what counts tokens is told which are padding.
        assert!(batch.inputs.attention_mask.is_none());
        assert_eq!(Vec::<Vec<i64>>::try_from(batch.inputs.token_mask.as_ref().unwrap()).unwrap(), vec![vec![1, 1, 1], vec![1, 0, 0]]);
        assert!(data.collate(&[0], Device::Cpu).unwrap().inputs.token_mask.is_none(), "nothing padded");
        let padded = LmDataset::new(data.examples.clone(), 0, 4);
        assert_eq!(padded.collate(&[0, 1], Device::Cpu).unwrap().inputs.input_ids.size(), [2, 4]);
    }

    #[test]
    fn packed_rows_keep_examples_apart_and_ignore_the_label_at_each_seam() {
        let a = Example { input_ids: vec![1, 2, 3], labels: vec![-100, 2, 3] };
        let b = Example { input_ids: vec![4, 5], labels: vec![4, 5] };
        let c = Example { input_ids: vec![6, 7, 8, 9], labels: vec![6, 7, 8, 9] };
        let data = LmDataset::packed(vec![a, b, c], 0, 1, 6);
        // Best fit decreasing: c (4) with b (2); a (3) alone.
        assert_eq!(data.len(), 2);
        let batch = data.collate(&[0, 1], Device::Cpu).unwrap();
        assert_eq!(Vec::<Vec<i64>>::try_from(&batch.inputs.input_ids).unwrap(), vec![vec![6, 7, 8, 9, 4, 5], vec![1, 2, 3, 0, 0, 0]]);
        assert_eq!(Vec::<Vec<i64>>::try_from(&batch.targets[0]).unwrap(), vec![vec![6, 7, 8, 9, -100, 5], vec![-100, 2, 3, -100, -100, -100]]);
        let documents = batch.inputs.documents.as_ref().expect("a row holds two examples");
        assert_eq!(Vec::<Vec<i64>>::try_from(documents).unwrap(), vec![vec![0, 0, 0, 0, 1, 1], vec![0, 0, 0, 1, 1, 1]]);
        // The loss counts what each example counts alone.
        assert_eq!((data.loss_weight(0), data.loss_weight(1), data.tokens(0)), (3 + 1, 2, 6));
        // A batch of single-example rows needs no documents.
        assert!(data.collate(&[1], Device::Cpu).unwrap().inputs.documents.is_none());
    }

    #[test]
    fn unknown_task_keys_are_named() {
        let err = task::options::<Options>(NAME, &serde_json::json!({"max_new_token": 4})).unwrap_err().to_string();
        assert!(err.contains("unknown field `max_new_token`"), "{err}");
    }
}
