//! Model architectures for ft, one file each (in the manner of
//! candle-transformers), and Hugging Face file I/O. Each architecture
//! registers itself under its config.json `model_type`; Llama's relatives
//! (Qwen2, Qwen3, Mistral, Phi-3) are files that build `llama.rs`'s block
//! with their own switches; Gemma 2 and 3 share `gemma.rs`; the mixture-of-experts
//! families (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) put `moe.rs`'s experts in Llama's block.

pub mod bert;
pub mod bloom;
mod check;
pub mod gemma;
pub mod hf;
pub mod llama;
pub mod mistral;
pub mod mixtral;
pub mod moe;
pub mod olmoe;
pub mod opt;
pub mod peft;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;
pub mod trained;
