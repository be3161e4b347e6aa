//! Qwen3-MoE (Qwen/Qwen3-30B-A3B, 235B-A22B): Qwen3's block (`qwen3.rs`:
//! Llama's with per-head q/k RMSNorm) whose MLP is `moe.rs`'s experts —
//! softmax over `num_experts`, the top `num_experts_per_tok`, renormalised
//! when `norm_topk_prob` — in every `decoder_sparse_step`-th layer not in
//! `mlp_only_layers` (those keep a dense MLP of `intermediate_size`). With
//! `output_router_logits` the loss adds `router_aux_loss_coef` times the
//! load-balancing loss. Keys config.json leaves out take Qwen3MoeConfig's
//! defaults where they differ from Llama's.

use crate::check;
use crate::llama::{Llama, QkNorm, Variant};
use crate::moe::QwenRouting;
use crate::qwen2::full_attention_only;
use anyhow::Result;
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' Qwen3MoeConfig values for keys config.json leaves out.
fn defaults() -> [(&'static str, serde_json::Value); 7] {
    [
        ("num_key_value_heads", 4.into()),
        ("num_experts_per_tok", 8.into()),
        ("moe_intermediate_size", 768.into()),
        ("decoder_sparse_step", 1.into()),
        ("router_aux_loss_coef", 0.001.into()),
        ("norm_topk_prob", false.into()),
        ("mlp_only_layers", serde_json::Value::Null),
    ]
}

/// Qwen3-MoE's own keys besides the routing.
#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    attention_bias: bool,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    let mut moe = None;
    let llama = Llama::build(hf_config, &defaults(), |config| {
        full_attention_only(config, "Qwen3-MoE")?;
        let keys: Keys = check::parse(config)?;
        moe = Some(QwenRouting::experts(config, 128, None)?);
        Ok(Variant { qkv_bias: keys.attention_bias, o_bias: keys.attention_bias, qk_norm: QkNorm::PerHead, ..Variant::plain("Qwen3-MoE") })
    })?;
    llama.with_experts(moe.expect("read with the variant"))
}

inventory::submit! {
    ModelRegistration {
        model_type: "qwen3_moe",
        summary: "Qwen3-MoE (Qwen3's block with top-k routed SwiGLU experts, dense layers by mlp_only_layers / decoder_sparse_step)",
        build: |c| Ok(Box::new(new(c)?)),
    }
}
