//! BLOOM (bigscience/bloom-*): ALiBi attention, LayerNorm after the
//! embedding, fused per-head QKV, tanh-GELU MLP, LM head tied to the embedding.

use crate::check;
use anyhow::Result;
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, Model, ModelRegistration, ParamSpec, Params, UnitSpec};
use serde::Deserialize;
use tch::{Kind, Tensor};

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(alias = "n_embed")]
    pub hidden_size: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub vocab_size: i64,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_std")]
    pub initializer_range: f64,
    #[serde(default)]
    pub apply_residual_connection_post_layernorm: bool,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_std() -> f64 {
    0.02
}

impl Config {
    /// Refuses what the math below does not compute, naming the key.
    fn validate(&self) -> Result<()> {
        check::sizes(&[("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size), ("n_head", self.n_head)])?;
        check::layers("n_layer", self.n_layer)?;
        check::multiple_of(("hidden_size", self.hidden_size), ("n_head", self.n_head))?;
        check::positive("layer_norm_epsilon", self.layer_norm_epsilon)?;
        check::std("initializer_range", self.initializer_range)
    }
}

pub struct Bloom {
    config: Config,
    layout: Layout,
    /// ALiBi slope of each head.
    slopes: Vec<f64>,
}

/// ALiBi slopes: a geometric series per head, interleaved when the head
/// count is not a power of two (as in the BLOOM paper and transformers).
fn alibi_slopes(heads: i64) -> Vec<f64> {
    let closest = 2f64.powi((heads as f64).log2().floor() as i32) as i64;
    let base = 2f64.powf(-(2f64.powf(-((closest as f64).log2() - 3.0))));
    let mut slopes: Vec<f64> = (1..=closest).map(|i| base.powi(i as i32)).collect();
    if closest != heads {
        let extra_base = 2f64.powf(-(2f64.powf(-((2 * closest) as f64).log2() + 3.0)));
        let extra = (heads - closest).min(closest);
        slopes.extend((0..extra).map(|i| extra_base.powi((1 + 2 * i) as i32)));
    }
    slopes
}

impl Bloom {
    pub fn new(hf_config: serde_json::Value) -> Result<Bloom> {
        let config: Config = check::parse(&hf_config)?;
        config.validate()?;
        let (d, std) = (config.hidden_size, config.initializer_range);
        let norm = |prefix: &str, name: &str| {
            vec![
                ParamSpec::new(prefix, &format!("{name}.weight"), &[d], Init::Ones),
                ParamSpec::new(prefix, &format!("{name}.bias"), &[d], Init::Zeros),
            ]
        };
        let mut embed = vec![ParamSpec::new("transformer.", "word_embeddings.weight", &[config.vocab_size, d], Init::Normal { std })];
        embed.extend(norm("transformer.", "word_embeddings_layernorm"));
        embed.extend(norm("transformer.", "ln_f"));
        let mut units = vec![UnitSpec { name: "embed+head".into(), params: embed }];
        for layer in 0..config.n_layer {
            let prefix = format!("transformer.h.{layer}.");
            let mut params = norm(&prefix, "input_layernorm");
            for (name, out, inp) in [
                ("self_attention.query_key_value", 3 * d, d),
                ("self_attention.dense", d, d),
                ("mlp.dense_h_to_4h", 4 * d, d),
                ("mlp.dense_4h_to_h", d, 4 * d),
            ] {
                params.push(ParamSpec::new(&prefix, &format!("{name}.weight"), &[out, inp], Init::Normal { std }));
                params.push(ParamSpec::new(&prefix, &format!("{name}.bias"), &[out], Init::Zeros));
            }
            params.extend(norm(&prefix, "post_attention_layernorm"));
            units.push(UnitSpec { name: format!("block {layer}"), params });
        }
        // The embedding unit runs again as the head: the LM head is the embedding.
        let layout = Layout::new(hf_config, units, 1..config.n_layer as usize + 1, 0);
        Ok(Bloom { slopes: alibi_slopes(config.n_head), config, layout })
    }
}

impl Model for Bloom {
    /// Query, key and value are one fused layer: any of q, k, v adapts it
    /// (as peft's `query_key_value` does); the MLP has no gate.
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        &[
            ("q", &["self_attention.query_key_value"]),
            ("k", &["self_attention.query_key_value"]),
            ("v", &["self_attention.query_key_value"]),
            ("o", &["self_attention.dense"]),
            ("up", &["mlp.dense_h_to_4h"]),
            ("down", &["mlp.dense_4h_to_h"]),
        ]
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn head_kind(&self) -> &str {
        model::head::CAUSAL_LM
    }
    fn dims(&self) -> Dims {
        let c = &self.config;
        Dims {
            layers: c.n_layer,
            hidden: c.hidden_size,
            heads: c.n_head,
            kv_heads: c.n_head,
            vocab: c.vocab_size,
            intermediate: 4 * c.hidden_size,
        }
    }

    /// A pre-norm block; the embedding's LayerNorm keeps the lookup's
    /// output besides its own, and ALiBi's bias is one [seq, seq] per head.
    fn activations(&self) -> Activations {
        let dims = self.dims();
        Activations { embed: 2 * dims.hidden, bias_per_position_pair: dims.heads, ..Activations::pre_norm_block(&dims) }
    }

    /// ALiBi adds slope·(key − query) to each score: transformers adds
    /// slope·key, which differs by a per-row constant that softmax ignores,
    /// but the relative form stays small near the diagonal and so loses less
    /// in bf16.
    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let device = inputs.input_ids.device();
        let positions = model::decoder_positions(inputs, past);
        // Positions count real tokens only, as transformers' ALiBi does under
        // left padding, and restart at each packed example.
        let (query, key) = model::query_key_positions(&positions, past, inputs);
        let distance = (key.unsqueeze(1).unsqueeze(1) - query.unsqueeze(1).unsqueeze(3)).to_kind(Kind::Float);
        // Filled on the device, not copied from the host: a decoding step's
        // context is recorded into a CUDA graph, which cannot hold host copies.
        let slopes: Vec<Tensor> = self.slopes.iter().map(|&slope| Tensor::scalar_tensor(slope, (Kind::Float, device))).collect();
        let slopes = Tensor::stack(&slopes, 0).view([1, -1, 1, 1]);
        let bias = (slopes * distance).to_kind(dtype) + model::decoder_mask_bias(inputs, past, dtype)?;
        Ok(Context { train, positions, attention_bias: Some(bias), rope: None, local: None, auxiliary: Default::default(), experts: None })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, _ctx: &Context) -> Tensor {
        let x = Tensor::embedding(p.get("word_embeddings.weight"), &inputs.input_ids, -1, false, false);
        p.layer_norm(&x, "word_embeddings_layernorm", self.config.layer_norm_epsilon)
    }

    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, _layer: usize, cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, d) = x.size3().expect("hidden states are [batch, seq, dim]");
        let heads = self.config.n_head;
        let head_dim = d / heads;
        let normed = p.layer_norm(x, "input_layernorm", self.config.layer_norm_epsilon);
        let residual = if self.config.apply_residual_connection_post_layernorm { &normed } else { x };
        // BLOOM's fused QKV is laid out per head: [.., heads, 3, head_dim].
        let qkv = p.linear(&normed, "self_attention.query_key_value").view([batch, seq, heads, 3, head_dim]);
        // unbind, not three selects: its backward stacks the three gradients
        // in one kernel, where each select's would zero a whole QKV-sized
        // gradient, copy its third in, and autograd would add the three.
        let [q, mut k, mut v]: [Tensor; 3] = qkv.unbind(3).into_iter().map(|t| t.transpose(1, 2)).collect::<Vec<_>>().try_into().expect("QKV has 3 parts");
        if let Some(cache) = cache {
            (k, v) = cache.extend(k, v);
        }
        let attn = model::attention(&q, &k, &v, ctx, false).transpose(1, 2).reshape([batch, seq, d]);
        let attn = p.linear(&attn, "self_attention.dense");
        let x = residual + attn;
        let normed = p.layer_norm(&x, "post_attention_layernorm", self.config.layer_norm_epsilon);
        let residual = if self.config.apply_residual_connection_post_layernorm { &normed } else { &x };
        let h = p.linear(&p.linear(&normed, "mlp.dense_h_to_4h").gelu("tanh"), "mlp.dense_4h_to_h");
        residual + h
    }

    fn head(&self, p: &Params, x: &Tensor) -> Vec<Tensor> {
        vec![p.layer_norm(x, "ln_f", self.config.layer_norm_epsilon), p.get("word_embeddings.weight").shallow_clone()]
    }
}

inventory::submit! {
    ModelRegistration { model_type: "bloom", summary: "BLOOM (ALiBi, tied head)", build: |c| Ok(Box::new(Bloom::new(c)?)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alibi_slopes_match_transformers() {
        // transformers' build_alibi_tensor for 16 heads: 2^(-0.5 i), i = 1..16.
        let s = alibi_slopes(16);
        assert!((s[0] - 2f64.powf(-0.5)).abs() < 1e-12 && (s[15] - 2f64.powf(-8.0)).abs() < 1e-12);
        // 12 heads: 8 powers of 2^-1, then odd powers of 2^-0.5.
        let s = alibi_slopes(12);
        assert_eq!(s.len(), 12);
        assert!((s[7] - 2f64.powi(-8)).abs() < 1e-12 && (s[8] - 2f64.powf(-0.5)).abs() < 1e-12);
        assert!((s[9] - 2f64.powf(-1.5)).abs() < 1e-12);
    }
}
