//! Decoding with a KV cache, greedy or sampled (`sampling`): the prompts
//! run once, then one token a step. Every step after the prompt has the
//! same shapes (the cache's whole capacity under a mask), so on a GPU, with
//! the parameters held whole, it is recorded once as a CUDA graph and
//! replayed: one launch a token instead of one per kernel, which is what
//! bounds decoding at small batches; the host looks at the tokens every few
//! replays rather than after each, so the GPU never waits for it. Parameters gathered a stage at a time
//! (`model::UnitSource::gathers`) are decoded eagerly, in step with the other ranks.

use crate::model::{check_token_ids, forward_from, lm_outputs, Held, Inputs, KvCache, Model, UnitSource};
use crate::panic::libtorch_errors;
use crate::train::loss::{logits, softcapped};
use anyhow::{bail, Result};
use sampling::{draw, sampling_logits};
use std::sync::atomic::{AtomicBool, Ordering};
use tch::{Device, Kind, Tensor};

pub mod sampling;
pub use sampling::Sampling;

/// How `greedy_batch` and `sample_batch` decode.
#[derive(Debug, Clone, Copy)]
pub struct Decoding {
    /// Tokens to generate per prompt at most.
    pub max_new_tokens: usize,
    /// A row stops after generating this token.
    pub eos: Option<i64>,
    /// Fills the left of shorter prompts (hidden by the padding mask).
    pub pad_id: i64,
    pub dtype: Kind,
    /// Replay the decoding step as a CUDA graph on a GPU (`task.cuda_graph`).
    pub cuda_graph: bool,
}

impl Decoding {
    /// Up to `max_new_tokens` tokens, stopping after `eos`, padding with 0, graphs on.
    pub fn greedy(max_new_tokens: usize, eos: Option<i64>, dtype: Kind) -> Decoding {
        Decoding { max_new_tokens, eos, pad_id: 0, dtype, cuda_graph: true }
    }
}

/// Continues `prompt` (token ids) by up to `max_new_tokens` greedy tokens,
/// stopping after `eos`. `params[unit]` are full parameters in `dtype`.
pub fn greedy(model: &dyn Model, params: &[Vec<Tensor>], prompt: &[i64], max_new_tokens: usize, eos: Option<i64>, dtype: Kind) -> Result<Vec<i64>> {
    let mut continuations = greedy_batch(model, params, &[prompt.to_vec()], &Decoding::greedy(max_new_tokens, eos, dtype))?;
    Ok(continuations.remove(0))
}

/// Set once a capture has failed in this process: later batches decode
/// step by step without trying (and warning) again.
static GRAPHS_FAILED: AtomicBool = AtomicBool::new(false);

/// Continues every prompt at once: the prompts left-padded into one batch
/// (a padding mask hides the padding, and positions count real tokens only,
/// as transformers' `generate` does), a KV cache per block, one token per
/// row a step; a row stops after `eos` or `max_new_tokens` tokens, the
/// batch when every row has.
pub fn greedy_batch(model: &dyn Model, params: &[Vec<Tensor>], prompts: &[Vec<i64>], decoding: &Decoding) -> Result<Vec<Vec<i64>>> {
    generate_batch(model, &mut Held(params), prompts, decoding, None)
}

/// `greedy_batch`, each token drawn as transformers' `generate` draws it
/// with `do_sample=True` and `sampling`'s options; row `i` draws with
/// `row_seeds[i]`, so its tokens depend on that seed, its prompt and the
/// model alone (not on the other rows, nor on how many there are), and the
/// same seed draws them again.
pub fn sample_batch(model: &dyn Model, params: &[Vec<Tensor>], prompts: &[Vec<i64>], row_seeds: &[u64], sampling: &Sampling, decoding: &Decoding) -> Result<Vec<Vec<i64>>> {
    sample_batch_from(model, &mut Held(params), prompts, row_seeds, sampling, decoding)
}

/// [`sample_batch`] over the parameters `source` fetches stage by stage
/// (online RL's rollouts from the policy gathered a unit at a time:
/// collective then, every rank stepping until every rank is done). The
/// same parameters draw the same tokens.
pub fn sample_batch_from(model: &dyn Model, source: &mut dyn UnitSource, prompts: &[Vec<i64>], row_seeds: &[u64], sampling: &Sampling, decoding: &Decoding) -> Result<Vec<Vec<i64>>> {
    sampling.check(str::to_string)?;
    if row_seeds.len() != prompts.len() {
        bail!("sampling takes one seed per prompt: {} seeds for {} prompts", row_seeds.len(), prompts.len());
    }
    generate_batch(model, source, prompts, decoding, Some((sampling, row_seeds)))
}

/// `greedy_batch`, or `sample_batch` given its options and seeds.
fn generate_batch(model: &dyn Model, source: &mut dyn UnitSource, prompts: &[Vec<i64>], decoding: &Decoding, sampled: Option<(&Sampling, &[u64])>) -> Result<Vec<Vec<i64>>> {
    if model.head_kind() != crate::model::head::CAUSAL_LM {
        bail!("generation needs a causal LM head; this {} model has a {} head", model.model_type(), model.head_kind());
    }
    check_token_ids(model, prompts, decoding.max_new_tokens)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if longest.checked_add(decoding.max_new_tokens).is_none_or(|positions| i64::try_from(positions).is_err()) {
        bail!("{} new tokens after a prompt of {longest} tokens take more positions than a model can have", decoding.max_new_tokens);
    }
    if prompts.is_empty() && source.gathers() {
        // It would leave the other ranks' gathers waiting; online RL gives every rank whole batches.
        bail!("decoding from parameters gathered a stage at a time needs prompts on every rank, and this rank has none");
    }
    if decoding.max_new_tokens == 0 || prompts.is_empty() {
        return Ok(vec![vec![]; prompts.len()]);
    }
    libtorch_errors("generating", || decode(model, source, prompts, decoding, sampled))?
}

/// Steps replayed between two looks at the tokens drawn: a look waits for
/// the GPU, and the graphs launched ahead of it keep the GPU busy while the
/// host launches the next. A batch that ends between looks runs at most
/// this many steps more than it needed.
const REPLAYS_PER_LOOK: usize = 8;

/// `generate_batch` on checked prompts.
fn decode(model: &dyn Model, source: &mut dyn UnitSource, prompts: &[Vec<i64>], decoding: &Decoding, sampled: Option<(&Sampling, &[u64])>) -> Result<Vec<Vec<i64>>> {
    let _no_grad = tch::no_grad_guard();
    let mut step = Step::after_prompts(model, source, prompts, decoding, sampled)?;
    let mut graph: Option<ft_sys::CudaGraph> = None;
    // Tokens every row has drawn (each step draws one a row, after a row's end too: dropped below).
    let mut drawn = 1;
    loop {
        let generated = step.generated(drawn, decoding.eos)?;
        let done = drawn == decoding.max_new_tokens || generated.iter().all(|row| row.last().copied() == decoding.eos);
        // Fetching collectively, every rank steps until all are done (one
        // small reduction a look, against a gather of every unit), rather
        // than always `max_new_tokens` steps: early stops save whole steps.
        if step.source.all_done(done)? {
            return Ok(generated);
        }
        match &graph {
            Some(graph) => {
                let steps = REPLAYS_PER_LOOK.min(decoding.max_new_tokens - drawn);
                for _ in 0..steps {
                    graph.replay()?;
                }
                drawn += steps;
            }
            None => {
                step.run()?;
                drawn += 1;
                // After one eager step (lazy initialisations done), when at least two steps follow.
                let replayable = decoding.cuda_graph && !step.source.gathers() && model.graph_capturable(step.tokens.device(), step.dtype);
                if replayable && decoding.max_new_tokens - drawn >= 2 && !GRAPHS_FAILED.load(Ordering::Relaxed) {
                    graph = step.capture();
                }
            }
        }
    }
}

/// A decoding step of fixed shapes over its buffers: the last token of each
/// row, every token drawn so far, the attention mask over the cache's
/// capacity (1 where a slot holds a real token), and the slot the next
/// token goes to, all on the device.
struct Step<'a> {
    model: &'a dyn Model,
    source: &'a mut dyn UnitSource,
    caches: Vec<KvCache>,
    tokens: Tensor,
    /// `[rows, max_new_tokens]`: column i holds the completions' i-th tokens once drawn.
    drawn: Tensor,
    mask: Tensor,
    slot: Tensor,
    /// The longest prompt's length: the slot of a row's first generated token.
    longest: i64,
    dtype: Kind,
    draws: Option<Draws>,
}

/// What sampling keeps on the device between steps.
struct Draws {
    sampling: Sampling,
    /// `[rows, 1]`: each row's seed, as int64.
    row_seeds: Tensor,
    /// `[rows, vocab]`: the tokens of each row's prompt and completion so far (the repetition penalty's).
    seen: Tensor,
}

impl<'a> Step<'a> {
    /// Runs the prompts (without padding, with no mask: plain causal
    /// attention) and fixes the caches' shapes for the steps after.
    fn after_prompts(model: &'a dyn Model, source: &'a mut dyn UnitSource, prompts: &[Vec<i64>], decoding: &Decoding, sampled: Option<(&Sampling, &[u64])>) -> Result<Step<'a>> {
        let device = source.device();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        // The prompt's positions and one per step after the first token.
        let capacity = (longest + decoding.max_new_tokens - 1) as i64;
        let blocks = crate::model::block_count(model);
        let mut caches: Vec<KvCache> = (0..blocks).map(|_| KvCache::with_capacity(capacity)).collect();
        let left_padded: Vec<Vec<i64>> = prompts.iter().map(|p| [vec![decoding.pad_id; longest - p.len()], p.clone()].concat()).collect();
        let real: Vec<Vec<i64>> = prompts.iter().map(|p| [vec![0; longest - p.len()], vec![1; p.len()]].concat()).collect();
        let mask = Tensor::from_slice2(&real).to_device(device);
        let padded = prompts.iter().any(|p| p.len() != longest);
        let input_ids = Tensor::from_slice2(&left_padded).to_device(device);
        let inputs = Inputs { input_ids: input_ids.shallow_clone(), attention_mask: padded.then(|| mask.shallow_clone()), token_type_ids: None, documents: None, branches: None, token_mask: None };
        let ctx = model.context(&inputs, 0, decoding.dtype, false)?;
        let (hidden, weight) = lm_outputs(forward_from(model, source, &inputs, &ctx, Some(&mut caches))?.0)?;
        let last_logits = logits(&hidden.narrow(1, longest as i64 - 1, 1), &weight);
        let mut draws = sampled.map(|(sampling, row_seeds)| {
            let seeds: Vec<i64> = row_seeds.iter().map(|&seed| seed as i64).collect();
            // Counts, so that a pad id that is also a real token of a row stays seen.
            let seen = Tensor::zeros([prompts.len() as i64, last_logits.size()[2]], (Kind::Int64, device)).scatter_add(1, &input_ids, &mask).gt(0);
            Draws { sampling: *sampling, row_seeds: Tensor::from_slice(&seeds).to_device(device).unsqueeze(1), seen }
        });
        let slot = Tensor::from_slice(&[longest as i64]).to_device(device);
        for cache in &mut caches {
            cache.fix_shapes(&slot)?;
        }
        let unwritten = Tensor::zeros([prompts.len() as i64, capacity - longest as i64], (Kind::Int64, device));
        let tokens = next_tokens(model, &last_logits, draws.as_mut(), &Tensor::zeros([1], (Kind::Int64, device)));
        let drawn = Tensor::zeros([prompts.len() as i64, decoding.max_new_tokens as i64], (Kind::Int64, device));
        let _ = drawn.narrow(1, 0, 1).copy_(&tokens);
        Ok(Step { model, source, caches, tokens, drawn, mask: Tensor::cat(&[mask, unwritten], 1), slot, longest: longest as i64, dtype: decoding.dtype, draws })
    }

    /// One token per row: marks the slot real, runs the model on the last
    /// tokens as the cache's last position (so positions and masks come out
    /// as for a growing cache), writes the next tokens, advances the slot.
    /// Nothing here reads the device from the host, so it can be recorded.
    fn run(&mut self) -> Result<()> {
        let _ = self.mask.index_fill_(1, &self.slot, 1);
        let inputs = Inputs { input_ids: self.tokens.shallow_clone(), attention_mask: Some(self.mask.shallow_clone()), token_type_ids: None, documents: None, branches: None, token_mask: None };
        let capacity = self.mask.size()[1];
        let ctx = self.model.context(&inputs, capacity - 1, self.dtype, false)?;
        let (hidden, weight) = lm_outputs(forward_from(self.model, self.source, &inputs, &ctx, Some(&mut self.caches))?.0)?;
        // The token at slot `longest` is the completion's second (index 1).
        let index = self.slot.g_sub_scalar(self.longest - 1);
        self.tokens.copy_(&next_tokens(self.model, &logits(&hidden, &weight), self.draws.as_mut(), &index));
        let _ = self.drawn.index_copy_(1, &index, &self.tokens);
        let _ = self.slot.g_add_scalar_(1);
        Ok(())
    }

    /// The first `count` tokens each row drew, each row cut after its first `eos`.
    fn generated(&self, count: usize, eos: Option<i64>) -> Result<Vec<Vec<i64>>> {
        // One copy to the host (converting a device tensor copies row by row).
        let drawn = Vec::<Vec<i64>>::try_from(self.drawn.narrow(1, 0, count as i64).to_device(Device::Cpu))?;
        Ok(drawn
            .into_iter()
            .map(|mut row| {
                if let Some(end) = row.iter().position(|&token| Some(token) == eos) {
                    row.truncate(end + 1);
                }
                row
            })
            .collect())
    }

    /// Records `run` as a CUDA graph; None on the CPU, or (with a warning,
    /// and no further tries in this process) when the recording fails.
    fn capture(&mut self) -> Option<ft_sys::CudaGraph> {
        let Device::Cuda(index) = self.tokens.device() else { return None };
        let recorded = ft_sys::CudaGraph::capture(index, || self.run()).map_err(anyhow::Error::from).and_then(|(graph, ran)| ran.map(|()| graph));
        match recorded {
            Ok(graph) => Some(graph),
            Err(error) => {
                GRAPHS_FAILED.store(true, Ordering::Relaxed);
                tracing::warn!("cannot record the decoding step as a CUDA graph ({error:#}); decoding step by step");
                None
            }
        }
    }
}

/// Each row's next token (`[rows, 1]`) from its logits (`[rows, 1, vocab]`):
/// the most likely, or with `draws` drawn as the `index`-th token of the
/// completion (a one-element tensor on the device), and marked seen.
fn next_tokens(model: &dyn Model, logits: &Tensor, draws: Option<&mut Draws>, index: &Tensor) -> Tensor {
    let logits = softcapped(logits.squeeze_dim(1), model.logit_softcap());
    match draws {
        None => logits.argmax(-1, true),
        Some(draws) => {
            let tokens = draw(&sampling_logits(&logits, &draws.seen, &draws.sampling), &draws.row_seeds, index);
            let _ = draws.seen.scatter_value_(1, &tokens, 1);
            tokens
        }
    }
}
