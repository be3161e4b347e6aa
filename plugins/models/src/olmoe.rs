//! OLMoE (allenai/OLMoE-1B-7B-*): Llama's block with an RMSNorm over the
//! whole query and key projections before they are split into heads
//! (`q_norm`, `k_norm` of heads × head_dim and kv_heads × head_dim), and
//! `moe.rs`'s experts in every layer — softmax over `num_experts`, the top
//! `num_experts_per_tok`, not renormalised unless `norm_topk_prob`, each
//! expert `intermediate_size` wide. Biases on the four attention projections
//! when `attention_bias`. `clip_qkv` (clamping q, k and v) is refused: the
//! released models leave it null. Keys config.json leaves out take
//! OlmoeConfig's defaults where they differ from Llama's.

use crate::check;
use crate::llama::{Llama, QkNorm, Variant};
use crate::moe::{self, Moe, RouterKeys};
use anyhow::{bail, Result};
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' OlmoeConfig values for keys config.json leaves out.
fn defaults() -> [(&'static str, serde_json::Value); 4] {
    [("rms_norm_eps", 1e-5.into()), ("num_experts_per_tok", 8.into()), ("router_aux_loss_coef", 0.01.into()), ("norm_topk_prob", false.into())]
}

/// OLMoE's own keys.
#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    clip_qkv: Option<f64>,
    hidden_size: i64,
    num_attention_heads: i64,
    #[serde(default)]
    head_dim: Option<i64>,
    num_hidden_layers: i64,
    intermediate_size: i64,
    norm_topk_prob: bool,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    let mut moe = None;
    let llama = Llama::build(hf_config, &defaults(), |config| {
        let keys: Keys = check::parse(config)?;
        if let Some(clip) = keys.clip_qkv {
            bail!("clip_qkv {clip} is not supported: ft does not clamp OLMoE's query, key and value (set it to null)");
        }
        check::sizes(&[("hidden_size", keys.hidden_size), ("num_attention_heads", keys.num_attention_heads)])?;
        // transformers sizes q_norm by hidden_size: a head_dim apart from hidden_size / heads would not fit it.
        if let Some(head_dim) = keys.head_dim.filter(|&head_dim| head_dim * keys.num_attention_heads != keys.hidden_size) {
            bail!("head_dim ({head_dim}) must be hidden_size / num_attention_heads ({}) for OLMoE, whose q_norm spans hidden_size", keys.hidden_size / keys.num_attention_heads);
        }
        let (experts_key, experts) = check::parse::<moe::ExpertCount>(config)?.read("num_experts", 64)?;
        check::layers("num_hidden_layers", keys.num_hidden_layers)?;
        let (top_k, aux_loss_coef) = check::parse::<RouterKeys>(config)?.validate((experts_key, experts))?;
        let sparse = vec![true; keys.num_hidden_layers as usize];
        moe = Some(Moe { experts, top_k, inner: keys.intermediate_size, norm_topk_prob: keys.norm_topk_prob, sparse, aux_loss_coef, shared_expert: None, hub_module: "mlp" });
        Ok(Variant { qkv_bias: keys.attention_bias, o_bias: keys.attention_bias, qk_norm: QkNorm::Projection, ..Variant::plain("OLMoE") })
    })?;
    llama.with_experts(moe.expect("read with the variant"))
}

inventory::submit! {
    ModelRegistration {
        model_type: "olmoe",
        summary: "OLMoE (Llama's block with q/k RMSNorm over the projections and top-k routed SwiGLU experts in every layer)",
        build: |c| Ok(Box::new(new(c)?)),
    }
}
