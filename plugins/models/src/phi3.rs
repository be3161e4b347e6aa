//! Phi-3 and Phi-4-mini (microsoft/Phi-3*-mini-*, Phi-4-mini-*: config.json's
//! model_type `phi3`): Llama's block (`llama.rs`) with the query, key and
//! value in one `self_attn.qkv_proj` and the gate and up projections in one
//! `mlp.gate_up_proj` (split as transformers' `Phi3Attention` and
//! `Phi3MLP` split them), no biases, every layer under `sliding_window`
//! when the config has one (as Mistral's), and RoPE that may be LongRoPE
//! (`rope_scaling.type` "longrope", or "su" in the first configs:
//! `short_factor` within `original_max_position_embeddings`, `long_factor`
//! once a batch's positions pass it) and may rotate only part of each head
//! (`partial_rotary_factor`, Phi-4-mini's 0.75). transformers' generation
//! recomputes the whole cache with the long factors when a sequence first
//! crosses the original length; ft's cache keeps the keys it rotated, so a
//! prompt shorter than that length generates differently past it. Keys
//! config.json leaves out take Phi3Config's defaults where they differ from
//! Llama's: rms_norm_eps 1e-5 and lengths of 4096. Residual and embedding
//! dropout (`resid_pdrop`, `embd_pdrop`) are refused unless 0, as Llama's
//! attention dropout is.

use crate::check;
use crate::llama::{Llama, Variant};
use anyhow::{bail, Result};
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' Phi3Config values for keys config.json leaves out.
fn defaults() -> [(&'static str, serde_json::Value); 3] {
    [("rms_norm_eps", 1e-5.into()), ("max_position_embeddings", 4096.into()), ("original_max_position_embeddings", 4096.into())]
}

/// Phi-3's own keys.
#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    sliding_window: Option<i64>,
    #[serde(default)]
    resid_pdrop: f64,
    #[serde(default)]
    embd_pdrop: f64,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    Llama::build(hf_config, &defaults(), |config| {
        let keys: Keys = check::parse(config)?;
        if let Some(window) = keys.sliding_window {
            check::sizes(&[("sliding_window", window)])?;
        }
        for (key, p) in [("resid_pdrop", keys.resid_pdrop), ("embd_pdrop", keys.embd_pdrop)] {
            check::probabilities(&[(key, p)])?;
            if p != 0.0 {
                bail!("{key} {p} is not supported: ft's Phi-3 has no dropout (set it to 0.0)");
            }
        }
        Ok(Variant { sliding_window: keys.sliding_window, fused: true, partial_rotary: true, ..Variant::plain("Phi3") })
    })
}

inventory::submit! {
    ModelRegistration {
        model_type: "phi3",
        summary: "Phi-3 / Phi-4-mini (Llama's block with fused qkv and gate-up projections, LongRoPE, partial rotary)",
        build: |c| Ok(Box::new(new(c)?)),
    }
}
