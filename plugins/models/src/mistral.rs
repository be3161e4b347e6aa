//! Mistral (mistralai/Mistral-7B-*): Llama's block (`llama.rs`) with
//! sliding-window attention — each query attends to at most the last
//! `sliding_window` keys, itself included; `null` means every earlier key —
//! in training and in generation's KV-cache steps alike (the window is in
//! the attention mask, `model::sliding_window_bias`). No projection has a
//! bias: `attention_bias` and `mlp_bias` are Llama's keys, which
//! transformers' Mistral does not read. Keys config.json leaves out take
//! MistralConfig's defaults where they differ from Llama's: 8 key-value
//! heads and a window of 4096.

use crate::check;
use crate::llama::{Llama, Variant};
use anyhow::Result;
use ft_core::model::ModelRegistration;
use serde::Deserialize;

/// transformers' MistralConfig values for keys config.json leaves out
/// (an explicit `null` stays null: no window, as many key-value heads as heads).
fn defaults() -> [(&'static str, serde_json::Value); 2] {
    [("num_key_value_heads", 8.into()), ("sliding_window", 4096.into())]
}

/// Mistral's own key.
#[derive(Deserialize)]
struct Keys {
    sliding_window: Option<i64>,
}

pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
    Llama::build(hf_config, &defaults(), |config| {
        let keys: Keys = check::parse(config)?;
        if let Some(window) = keys.sliding_window {
            check::sizes(&[("sliding_window", window)])?;
        }
        Ok(Variant { sliding_window: keys.sliding_window, ..Variant::plain("Mistral") })
    })
}

inventory::submit! {
    ModelRegistration { model_type: "mistral", summary: "Mistral (Llama's block with sliding-window attention)", build: |c| Ok(Box::new(new(c)?)) }
}

#[cfg(test)]
mod tests {
    use ft_core::model::Model;
    use serde_json::json;

    /// A key config.json leaves out takes MistralConfig's default; an
    /// explicit null means no window and as many key-value heads as heads.
    #[test]
    fn absent_keys_take_mistrals_defaults_and_null_turns_them_off() {
        let mut config = json!({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 16, "vocab_size": 8});
        let absent = super::new(config.clone()).unwrap();
        assert_eq!((absent.dims().kv_heads, absent.activations().bias_per_position_pair), (8, 1));
        config["num_key_value_heads"] = serde_json::Value::Null;
        config["sliding_window"] = serde_json::Value::Null;
        let null = super::new(config).unwrap();
        assert_eq!((null.dims().kv_heads, null.activations().bias_per_position_pair), (16, 0));
    }
}
