//! Model architectures for ft, one file each (in the manner of
//! candle-transformers), and Hugging Face file I/O. Each architecture
//! registers itself under its config.json `model_type`.

pub mod bert;
pub mod bloom;
pub mod hf;
pub mod llama;
pub mod opt;

use anyhow::{Context, Result};

/// Reads an architecture's config struct from config.json's JSON.
pub(crate) fn config_field<T: serde::de::DeserializeOwned>(config: &serde_json::Value) -> Result<T> {
    serde_json::from_value(config.clone()).context("config.json does not describe this architecture")
}
