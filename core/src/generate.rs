//! Greedy decoding with a KV cache: the prompt runs once, then one token a step.

use crate::model::{forward, lm_outputs, Inputs, KvCache, Model, StageKind};
use crate::train::loss::logits;
use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// Continues `prompt` (token ids) by up to `max_new_tokens` greedy tokens,
/// stopping after `eos`. `params[unit]` are full parameters in `dtype`.
pub fn greedy(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    prompt: &[i64],
    max_new_tokens: usize,
    eos: Option<i64>,
    dtype: Kind,
) -> Result<Vec<i64>> {
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    if model.head_kind() != crate::model::head::CAUSAL_LM {
        bail!("greedy generation needs a causal LM head; this {} model has a {} head", model.model_type(), model.head_kind());
    }
    let device = params[0][0].device();
    let blocks = model.stages().iter().filter(|s| s.kind == StageKind::Block).count();
    let mut caches: Vec<KvCache> = (0..blocks).map(|_| KvCache::default()).collect();
    let _no_grad = tch::no_grad_guard();
    let mut input = Tensor::from_slice(prompt).to_device(device).unsqueeze(0);
    let mut past = 0;
    let mut generated = vec![];
    while generated.len() < max_new_tokens {
        let inputs = Inputs::ids(&input);
        let ctx = model.context(&inputs, past, dtype, false)?;
        let (hidden, weight) = lm_outputs(forward(model, params, &inputs, &ctx, Some(&mut caches)))?;
        past += input.size()[1];
        let last = hidden.narrow(1, hidden.size()[1] - 1, 1);
        let next = logits(&last, &weight).argmax(-1, false).int64_value(&[0, 0]);
        generated.push(next);
        if Some(next) == eos {
            break;
        }
        input = Tensor::from_slice(&[next]).to_device(device).unsqueeze(0);
    }
    Ok(generated)
}
