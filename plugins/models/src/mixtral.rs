//! Mixtral (mistralai/Mixtral-8x7B-*, 8x22B): Mistral's block (`mistral.rs`:
//! Llama's, sliding-window attention where `sliding_window` is set) whose MLP
//! in every layer is `moe.rs`'s experts — the top `num_experts_per_tok` of
//! `num_local_experts` by router logit, softmaxed over those k (transformers
//! 5 computes it as softmax, top k, renormalised: the same), each expert
//! `intermediate_size` wide. Its Hub files name the block `block_sparse_moe`
//! and each expert's matrices `w1` (gate), `w3` (up), `w2` (down).
//! `router_jitter_noise` (random scaling of the router's input in training)
//! is refused: the released models leave it at 0. Keys config.json leaves
//! out take MixtralConfig's defaults where they differ from Llama's.

use crate::check;
use crate::llama::{Llama, Variant};
use crate::moe::{self, Moe, RouterKeys};
use anyhow::{bail, Result};
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' MixtralConfig values for keys config.json leaves out
/// (an explicit `null` stays null: as many key-value heads as heads).
fn defaults() -> [(&'static str, serde_json::Value); 4] {
    [("num_key_value_heads", 8.into()), ("rms_norm_eps", 1e-5.into()), ("num_experts_per_tok", 2.into()), ("router_aux_loss_coef", 0.001.into())]
}

/// Mixtral's own keys.
#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    sliding_window: Option<i64>,
    #[serde(default)]
    router_jitter_noise: f64,
    num_hidden_layers: i64,
    intermediate_size: i64,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    let mut moe = None;
    let llama = Llama::build(hf_config, &defaults(), |config| {
        let keys: Keys = check::parse(config)?;
        if let Some(window) = keys.sliding_window {
            check::sizes(&[("sliding_window", window)])?;
        }
        if keys.router_jitter_noise != 0.0 {
            bail!("router_jitter_noise {} is not supported: ft's router reads its input as it is (set it to 0.0)", keys.router_jitter_noise);
        }
        let (experts_key, experts) = check::parse::<moe::ExpertCount>(config)?.read("num_local_experts", 8)?;
        check::layers("num_hidden_layers", keys.num_hidden_layers)?;
        let (top_k, aux_loss_coef) = check::parse::<RouterKeys>(config)?.validate((experts_key, experts))?;
        let sparse = vec![true; keys.num_hidden_layers as usize];
        moe = Some(Moe { experts, top_k, inner: keys.intermediate_size, norm_topk_prob: true, sparse, aux_loss_coef, shared_expert: None, hub_module: "block_sparse_moe" });
        Ok(Variant { sliding_window: keys.sliding_window, ..Variant::plain("Mixtral") })
    })?;
    llama.with_experts(moe.expect("read with the variant"))
}

inventory::submit! {
    ModelRegistration {
        model_type: "mixtral",
        summary: "Mixtral (Mistral's block with top-k routed SwiGLU experts in every layer)",
        build: |c| Ok(Box::new(new(c)?)),
    }
}
