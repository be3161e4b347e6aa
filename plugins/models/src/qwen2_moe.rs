//! Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's block
//! (`qwen2.rs`: biases on the query, key and value projections when
//! `qkv_bias`, as by default) whose MLP is `moe.rs`'s experts — softmax over
//! `num_experts`, the top `num_experts_per_tok`, renormalised when
//! `norm_topk_prob` — plus a shared expert every token goes through
//! (`shared_expert_intermediate_size` wide, scaled by the sigmoid of
//! `shared_expert_gate`), in every `decoder_sparse_step`-th layer not in
//! `mlp_only_layers` (those keep a dense MLP of `intermediate_size`).
//! Sliding windows are refused as for Qwen2. Keys config.json leaves out
//! take Qwen2MoeConfig's defaults where they differ from Llama's.

use crate::check;
use crate::llama::{Llama, Variant};
use crate::moe::QwenRouting;
use crate::qwen2::full_attention_only;
use anyhow::Result;
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' Qwen2MoeConfig values for keys config.json leaves out.
fn defaults() -> [(&'static str, serde_json::Value); 9] {
    [
        ("num_key_value_heads", 16.into()),
        ("num_experts_per_tok", 4.into()),
        ("moe_intermediate_size", 1408.into()),
        ("shared_expert_intermediate_size", 5632.into()),
        ("decoder_sparse_step", 1.into()),
        ("router_aux_loss_coef", 0.001.into()),
        ("norm_topk_prob", false.into()),
        ("mlp_only_layers", serde_json::Value::Null),
        ("qkv_bias", true.into()),
    ]
}

/// Qwen2-MoE's own keys besides the routing.
#[derive(Deserialize)]
struct Keys {
    qkv_bias: bool,
    shared_expert_intermediate_size: i64,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    let mut moe = None;
    let llama = Llama::build(hf_config, &defaults(), |config| {
        full_attention_only(config, "Qwen2-MoE")?;
        let keys: Keys = check::parse(config)?;
        check::sizes(&[("shared_expert_intermediate_size", keys.shared_expert_intermediate_size)])?;
        moe = Some(QwenRouting::experts(config, 60, Some(keys.shared_expert_intermediate_size))?);
        Ok(Variant { qkv_bias: keys.qkv_bias, ..Variant::plain("Qwen2-MoE") })
    })?;
    llama.with_experts(moe.expect("read with the variant"))
}

inventory::submit! {
    ModelRegistration {
        model_type: "qwen2_moe",
        summary: "Qwen2-MoE (Qwen2's block with top-k routed SwiGLU experts and a gated shared expert)",
        build: |c| Ok(Box::new(new(c)?)),
    }
}
