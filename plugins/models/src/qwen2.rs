//! Qwen2 / Qwen2.5 (Qwen/Qwen2*-*): Llama's block (`llama.rs`) with biases
//! on the query, key and value projections and none on the output
//! projection or the MLP; the small models tie the LM head to the
//! embedding (`tie_word_embeddings`). Qwen2's sliding window
//! (`use_sliding_window: true`: windowed attention on the layers from
//! `max_window_layers` on) is refused: ft gives every layer the same
//! attention mask, and the released Qwen2/2.5 models leave it off. Keys
//! config.json leaves out take Qwen2Config's defaults where they differ from
//! Llama's: 32 key-value heads.

use crate::check;
use crate::llama::{Llama, Variant};
use anyhow::{bail, Result};
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' Qwen2Config value for a key config.json leaves out (an
/// explicit `null` stays null: as many key-value heads as heads).
fn defaults() -> [(&'static str, serde_json::Value); 1] {
    [("num_key_value_heads", 32.into())]
}

/// Qwen2's and Qwen3's switch for sliding windows: whether any layer
/// slides (`layer_types` is how transformers 5 writes it, one entry per layer).
#[derive(Deserialize)]
struct SlidingKeys {
    #[serde(default)]
    use_sliding_window: bool,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
}

/// Refuses a Qwen config (`name`: Qwen2, Qwen3) whose layers slide: ft
/// gives every layer the same mask, and the released models leave it off.
pub(crate) fn full_attention_only(config: &serde_json::Value, name: &str) -> Result<()> {
    let keys: SlidingKeys = check::parse(config)?;
    if keys.use_sliding_window {
        bail!("use_sliding_window: true is not supported: ft runs every {name} layer with full attention (set it to false)");
    }
    if let Some((layer, kind)) = keys.layer_types.iter().flatten().enumerate().find(|(_, kind)| *kind != "full_attention") {
        bail!("layer_types[{layer}] is {kind:?}: ft runs every {name} layer with full attention (only \"full_attention\")");
    }
    Ok(())
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    Llama::build(hf_config, &defaults(), |config| {
        full_attention_only(config, "Qwen2")?;
        Ok(Variant { qkv_bias: true, ..Variant::plain("Qwen2") })
    })
}

inventory::submit! {
    ModelRegistration { model_type: "qwen2", summary: "Qwen2 / Qwen2.5 (Llama's block with q/k/v biases)", build: |c| Ok(Box::new(new(c)?)) }
}
