//! Qwen3 (Qwen/Qwen3-*, the dense models): Llama's block (`llama.rs`) with
//! an RMSNorm over each head's query and key before RoPE (`q_norm`,
//! `k_norm`, weights of `head_dim`), and no biases unless `attention_bias`
//! (then on all four attention projections; the MLP has none). Sliding
//! windows are refused as for Qwen2 (`qwen2::full_attention_only`): the
//! released models leave them off. Keys config.json leaves out take
//! Qwen3Config's defaults where they differ from Llama's: 32 key-value heads
//! and a `head_dim` of 128 (not hidden_size / heads).

use crate::check;
use crate::llama::{Llama, QkNorm, Variant};
use crate::qwen2::full_attention_only;
use anyhow::Result;
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' Qwen3Config values for keys config.json leaves out (an
/// explicit `null` stays null: as many key-value heads as heads).
fn defaults() -> [(&'static str, serde_json::Value); 2] {
    [("num_key_value_heads", 32.into()), ("head_dim", 128.into())]
}

/// Qwen3's own key.
#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    attention_bias: bool,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    Llama::build(hf_config, &defaults(), |config| {
        full_attention_only(config, "Qwen3")?;
        let keys: Keys = check::parse(config)?;
        Ok(Variant { qkv_bias: keys.attention_bias, o_bias: keys.attention_bias, qk_norm: QkNorm::PerHead, ..Variant::plain("Qwen3") })
    })
}

inventory::submit! {
    ModelRegistration { model_type: "qwen3", summary: "Qwen3 (Llama's block with per-head q/k RMSNorm)", build: |c| Ok(Box::new(new(c)?)) }
}
