//! Greedy decoding with a KV cache: the prompt runs once, then one token a step.

use crate::model::{forward, lm_outputs, Inputs, KvCache, Model, StageKind};
use crate::train::loss::logits;
use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// Continues `prompt` (token ids) by up to `max_new_tokens` greedy tokens,
/// stopping after `eos`. `params[unit]` are full parameters in `dtype`.
pub fn greedy(model: &dyn Model, params: &[Vec<Tensor>], prompt: &[i64], max_new_tokens: usize, eos: Option<i64>, dtype: Kind) -> Result<Vec<i64>> {
    let mut continuations = greedy_batch(model, params, &[prompt.to_vec()], max_new_tokens, eos, 0, dtype)?;
    Ok(continuations.remove(0))
}

/// Continues every prompt at once: the prompts left-padded with `pad_id`
/// into one batch (a padding mask hides the padding, and positions count
/// real tokens only, as transformers' `generate` does), a KV cache per
/// block, one token per row a step; a row stops after `eos` or
/// `max_new_tokens` tokens, the batch when every row has.
pub fn greedy_batch(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    prompts: &[Vec<i64>],
    max_new_tokens: usize,
    eos: Option<i64>,
    pad_id: i64,
    dtype: Kind,
) -> Result<Vec<Vec<i64>>> {
    if prompts.iter().any(Vec::is_empty) {
        bail!("a prompt has no tokens");
    }
    if model.head_kind() != crate::model::head::CAUSAL_LM {
        bail!("greedy generation needs a causal LM head; this {} model has a {} head", model.model_type(), model.head_kind());
    }
    let device = params[0][0].device();
    let rows = prompts.len() as i64;
    let _no_grad = tch::no_grad_guard();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let blocks = model.stages().iter().filter(|s| s.kind == StageKind::Block).count();
    let mut caches: Vec<KvCache> = (0..blocks).map(|_| KvCache::with_capacity((longest + max_new_tokens) as i64)).collect();
    let left_padded: Vec<Vec<i64>> = prompts.iter().map(|p| [vec![pad_id; longest - p.len()], p.clone()].concat()).collect();
    // Without padding, no mask: plain causal attention, as for one prompt.
    let mut mask = prompts.iter().any(|p| p.len() != longest).then(|| {
        let rows: Vec<Vec<i64>> = prompts.iter().map(|p| [vec![0; longest - p.len()], vec![1; p.len()]].concat()).collect();
        Tensor::from_slice2(&rows).to_device(device)
    });
    let mut input = Tensor::from_slice2(&left_padded).to_device(device);
    let mut past = 0;
    let mut generated: Vec<Vec<i64>> = vec![vec![]; prompts.len()];
    let mut finished = vec![max_new_tokens == 0; prompts.len()];
    while !finished.iter().all(|&f| f) {
        let inputs = Inputs { input_ids: input.shallow_clone(), attention_mask: mask.as_ref().map(Tensor::shallow_clone), token_type_ids: None, documents: None };
        let ctx = model.context(&inputs, past, dtype, false)?;
        let (hidden, weight) = lm_outputs(forward(model, params, &inputs, &ctx, Some(&mut caches)))?;
        past += input.size()[1];
        let next = logits(&hidden.narrow(1, hidden.size()[1] - 1, 1), &weight).argmax(-1, false);
        for ((row, token), done) in generated.iter_mut().zip(Vec::<i64>::try_from(next.reshape([rows]))?).zip(&mut finished) {
            if !*done {
                row.push(token);
                *done = Some(token) == eos || row.len() == max_new_tokens;
            }
        }
        input = next;
        mask = mask.map(|m| Tensor::cat(&[m, Tensor::ones([rows, 1], (Kind::Int64, device))], 1));
    }
    Ok(generated)
}
