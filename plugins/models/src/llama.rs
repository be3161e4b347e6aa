//! Llama / CodeLlama / Llama 3.x: RMSNorm, rotary position embeddings,
//! SwiGLU MLP, grouped-query attention, LM head untied unless
//! `tie_word_embeddings` (the small Llama 3.2 models tie it).
//!
//! Its relatives share this block and differ in a few switches, a
//! [`Variant`]: which projections carry biases and whether attention slides
//! over a window. Qwen2 (`qwen2.rs`) and Mistral (`mistral.rs`) are each a
//! short file that reads its own config keys, names transformers' defaults
//! for its model_type, says in its top comment how it differs from Llama,
//! registers its model_type and builds this file's [`Llama`] with its
//! variant: the math is written once.
//!
//! RoPE reads `rope_theta` and `rope_scaling` (hub configs) or transformers
//! 5's `rope_parameters`; the scalings are "default", "linear" and "llama3"
//! (Llama 3.1's frequency-dependent rescaling, transformers'
//! `_compute_llama3_parameters`).

use crate::check;
use anyhow::{bail, Context as _, Result};
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, Model, ModelRegistration, ParamSpec, Params, Saved, UnitSpec};
use serde::Deserialize;
use std::f64::consts::PI;
use tch::{Device, Kind, Tensor};

/// `rope_scaling` (hub configs) or `rope_parameters` (transformers 5): the
/// rotation's base and how its frequencies are rescaled.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_type: Option<String>,
    /// The older name of `rope_type`; configs saved by transformers 4.4x carry both.
    #[serde(default, rename = "type")]
    pub legacy_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<i64>,
}

/// The config.json keys Llama and its relatives share.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    pub vocab_size: i64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Read only as llama3 scaling's fallback for `original_max_position_embeddings`.
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default = "default_std")]
    pub initializer_range: f64,
    #[serde(default)]
    pub attention_dropout: f64,
}

/// Llama's own keys (Qwen2 and Mistral fix their biases in code).
#[derive(Debug, Clone, Deserialize)]
struct LlamaKeys {
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

fn default_eps() -> f64 {
    1e-6
}
/// transformers' `default_theta`, for configs that give no `rope_theta`.
const DEFAULT_THETA: f64 = 10000.0;
fn silu() -> String {
    "silu".into()
}
fn default_std() -> f64 {
    0.02
}

/// What a relative of Llama changes in its block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// The architecture's name in refusals ("Qwen2 hidden_act …").
    pub name: &'static str,
    /// Biases on the query, key and value projections; on the output projection; on the MLP's three.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Each query attends to at most this many keys, itself included (None: every earlier key).
    pub sliding_window: Option<i64>,
}

/// How RoPE's inverse frequencies are rescaled (transformers' `ROPE_INIT_FUNCTIONS`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scaling {
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Wavelengths longer than `original / low_freq_factor` divided by
    /// `factor`, shorter than `original / high_freq_factor` kept, a smooth
    /// blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Rope {
    theta: f64,
    scaling: Scaling,
}

impl RopeParameters {
    fn is_empty(&self) -> bool {
        self == &RopeParameters::default()
    }
}

impl Config {
    fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Refuses what the math below does not compute, naming the key; returns RoPE's parameters.
    fn validate(&self, name: &str) -> Result<Rope> {
        let (hidden, heads) = (self.hidden_size, self.num_attention_heads);
        check::sizes(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", hidden),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", heads),
        ])?;
        check::layers("num_hidden_layers", self.num_hidden_layers)?;
        if let Some(kv_heads) = self.num_key_value_heads {
            check::sizes(&[("num_key_value_heads", kv_heads)])?;
            check::multiple_of(("num_attention_heads", heads), ("num_key_value_heads", kv_heads))?;
        }
        match self.head_dim {
            Some(head_dim) => check::sizes(&[("head_dim", head_dim)])?,
            None => check::multiple_of(("hidden_size", hidden), ("num_attention_heads", heads))?,
        }
        // RoPE rotates pairs of features, a head's first half with its second.
        if self.head_dim() % 2 != 0 {
            let key = if self.head_dim.is_some() { "head_dim" } else { "hidden_size / num_attention_heads" };
            bail!("{key} ({}) must be even: rotary embeddings rotate pairs of features", self.head_dim());
        }
        check::positive("rms_norm_eps", self.rms_norm_eps)?;
        let rope = self.rope()?;
        check::std("initializer_range", self.initializer_range)?;
        if self.hidden_act != "silu" {
            bail!("{name} hidden_act {:?} is not supported (only silu)", self.hidden_act);
        }
        check::probabilities(&[("attention_dropout", self.attention_dropout)])?;
        if self.attention_dropout != 0.0 {
            bail!("attention_dropout {} is not supported: ft's attention has no dropout (set it to 0.0)", self.attention_dropout);
        }
        Ok(rope)
    }

    /// RoPE's base and scaling, as transformers reads them: `rope_scaling`
    /// when the config has one, else `rope_parameters`; the base from
    /// either, else `rope_theta`, else 10000.
    fn rope(&self) -> Result<Rope> {
        let none = RopeParameters::default();
        let (key, params) = match (&self.rope_scaling, &self.rope_parameters) {
            (Some(scaling), _) if !scaling.is_empty() => ("rope_scaling", scaling),
            (_, Some(parameters)) => ("rope_parameters", parameters),
            _ => ("rope_scaling", &none),
        };
        let (theta_key, theta) = match params.rope_theta {
            Some(theta) => (format!("{key}.rope_theta"), theta),
            None => ("rope_theta".into(), self.rope_theta.unwrap_or(DEFAULT_THETA)),
        };
        check::positive(&theta_key, theta)?;
        let (type_key, kind) = match (&params.rope_type, &params.legacy_type) {
            (Some(kind), _) => ("rope_type", kind.as_str()),
            (None, Some(kind)) => ("type", kind.as_str()),
            (None, None) => ("rope_type", "default"),
        };
        let required = |name: &str, value: Option<f64>| -> Result<f64> {
            let value = value.with_context(|| format!("{key}.{name} is required for {type_key} {kind:?}"))?;
            check::positive(&format!("{key}.{name}"), value)?;
            Ok(value)
        };
        let scaling = match kind {
            "default" => Scaling::None,
            "linear" => Scaling::Linear { factor: required("factor", params.factor)? },
            "llama3" => {
                let factor = required("factor", params.factor)?;
                let (low_freq_factor, high_freq_factor) = (required("low_freq_factor", params.low_freq_factor)?, required("high_freq_factor", params.high_freq_factor)?);
                if high_freq_factor <= low_freq_factor {
                    bail!("{key}.high_freq_factor ({high_freq_factor}) must be greater than low_freq_factor ({low_freq_factor}): llama3 scaling blends the frequencies between them");
                }
                // transformers falls back on the model's own length, as here.
                let (length_key, original) = match (params.original_max_position_embeddings, self.max_position_embeddings) {
                    (Some(original), _) => (format!("{key}.original_max_position_embeddings"), original),
                    (None, Some(length)) => ("max_position_embeddings".into(), length),
                    (None, None) => bail!("{key}.original_max_position_embeddings is required for {type_key} \"llama3\" (or max_position_embeddings)"),
                };
                check::sizes(&[(length_key.as_str(), original)])?;
                Scaling::Llama3 { factor, low_freq_factor, high_freq_factor, original: original as f64 }
            }
            other => bail!("{key}.{type_key} {other:?} is not supported (supported: default, linear, llama3)"),
        };
        Ok(Rope { theta, scaling })
    }
}

/// `hf_config` with `defaults` for the keys it leaves out: the values
/// transformers' config class for a model_type gives them where they
/// differ from Llama's.
fn with_defaults(hf_config: &serde_json::Value, defaults: &[(&str, i64)]) -> serde_json::Value {
    let mut config = hf_config.clone();
    if let Some(object) = config.as_object_mut() {
        for (key, value) in defaults {
            object.entry(*key).or_insert_with(|| (*value).into());
        }
    }
    config
}

pub struct Llama {
    config: Config,
    variant: Variant,
    layout: Layout,
    head_dim: i64,
    kv_heads: i64,
    rope: Rope,
}

impl Llama {
    /// Llama itself: biases where `attention_bias` and `mlp_bias` say, full attention.
    pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
        Llama::build(hf_config, &[], |config| {
            let keys: LlamaKeys = check::parse(config)?;
            Ok(Variant { name: "Llama", qkv_bias: keys.attention_bias, o_bias: keys.attention_bias, mlp_bias: keys.mlp_bias, sliding_window: None })
        })
    }

    /// The block of a Llama relative: its config read with `defaults` for
    /// the keys it leaves out, and checked; `variant` reads (and checks) the
    /// family's own keys from the same config. `hf_config` is kept as given
    /// (written back on export).
    pub fn build(hf_config: serde_json::Value, defaults: &[(&str, i64)], variant: impl FnOnce(&serde_json::Value) -> Result<Variant>) -> Result<Llama> {
        let read = with_defaults(&hf_config, defaults);
        let config: Config = check::parse(&read)?;
        let variant = variant(&read)?;
        let rope = config.validate(variant.name)?;
        let (d, heads, head_dim, kv_heads) = (config.hidden_size, config.num_attention_heads, config.head_dim(), config.kv_heads());
        let normal = Init::Normal { std: config.initializer_range };
        let embed = ParamSpec::new("model.", "embed_tokens.weight", &[config.vocab_size, d], normal);
        let norm = ParamSpec::new("model.", "norm.weight", &[d], Init::Ones);
        let mut units = vec![UnitSpec { name: "embed".into(), params: vec![embed] }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{layer}.");
            let mut params = vec![ParamSpec::new(&prefix, "input_layernorm.weight", &[d], Init::Ones)];
            let linears = [
                ("self_attn.q_proj", heads * head_dim, d, variant.qkv_bias),
                ("self_attn.k_proj", kv_heads * head_dim, d, variant.qkv_bias),
                ("self_attn.v_proj", kv_heads * head_dim, d, variant.qkv_bias),
                ("self_attn.o_proj", d, heads * head_dim, variant.o_bias),
                ("mlp.gate_proj", config.intermediate_size, d, variant.mlp_bias),
                ("mlp.up_proj", config.intermediate_size, d, variant.mlp_bias),
                ("mlp.down_proj", d, config.intermediate_size, variant.mlp_bias),
            ];
            for (name, out, inp, bias) in linears {
                params.push(ParamSpec::new(&prefix, &format!("{name}.weight"), &[out, inp], normal));
                if bias {
                    params.push(ParamSpec::new(&prefix, &format!("{name}.bias"), &[out], Init::Zeros));
                }
            }
            params.push(ParamSpec::new(&prefix, "post_attention_layernorm.weight", &[d], Init::Ones));
            units.push(UnitSpec { name: format!("block {layer}"), params });
        }
        let blocks = 1..config.num_hidden_layers as usize + 1;
        let head_unit = if config.tie_word_embeddings {
            units[0].params.push(norm);
            units[0].name = "embed+head".into();
            0
        } else {
            let lm_head = ParamSpec::new("", "lm_head.weight", &[config.vocab_size, d], normal);
            units.push(UnitSpec { name: "head".into(), params: vec![norm, lm_head] });
            units.len() - 1
        };
        let layout = Layout::new(hf_config, units, blocks, head_unit);
        Ok(Llama { config, variant, layout, head_dim, kv_heads, rope })
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        x.rms_norm([self.config.hidden_size], Some(weight), Some(self.config.rms_norm_eps))
    }

    /// RoPE's inverse frequencies [head_dim / 2], fp32 on `device`, in
    /// transformers' operations and order so that they round alike.
    fn inverse_frequencies(&self, device: Device) -> Tensor {
        let exponents = Tensor::arange_start_step(0, self.head_dim, 2, (Kind::Float, device)) / self.head_dim as f64;
        // A fill on the device, not a host copy: a decoding step's context
        // is recorded into a CUDA graph, which cannot hold host copies.
        let theta = Tensor::scalar_tensor(self.rope.theta, (Kind::Double, device));
        let inv_freq = theta.pow(&exponents).reciprocal();
        match self.rope.scaling {
            Scaling::None => inv_freq,
            Scaling::Linear { factor } => inv_freq / factor,
            Scaling::Llama3 { factor, low_freq_factor, high_freq_factor, original } => {
                let (low_freq_wavelen, high_freq_wavelen) = (original / low_freq_factor, original / high_freq_factor);
                let wavelen = inv_freq.reciprocal() * (2.0 * PI);
                let scaled = (&inv_freq / factor).where_self(&wavelen.gt(low_freq_wavelen), &inv_freq);
                let smooth = (wavelen.reciprocal() * original - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor = (1.0 - &smooth) * &scaled / factor + smooth * &scaled;
                let medium = wavelen.lt(high_freq_wavelen).logical_not().logical_and(&wavelen.gt(low_freq_wavelen).logical_not());
                smoothed.where_self(&medium, &scaled)
            }
        }
    }
}

impl Model for Llama {
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        &[
            ("q", &["self_attn.q_proj"]),
            ("k", &["self_attn.k_proj"]),
            ("v", &["self_attn.v_proj"]),
            ("o", &["self_attn.o_proj"]),
            ("gate", &["mlp.gate_proj"]),
            ("up", &["mlp.up_proj"]),
            ("down", &["mlp.down_proj"]),
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
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: self.kv_heads,
            vocab: c.vocab_size,
            intermediate: c.intermediate_size,
        }
    }

    /// RoPE keeps only the rotated query and key (cos and sin are the
    /// batch's), RMSNorm its reciprocal deviation, and SwiGLU's node its
    /// gate and up projections. A sliding window is a [seq, seq] mask once
    /// the sequence outgrows it, counted always (`ft plan` does not know the
    /// sequence here): at most two bytes per position pair.
    fn activations(&self) -> Activations {
        let (d, i) = (self.config.hidden_size, self.config.intermediate_size);
        let (q, kv) = (self.config.num_attention_heads * self.head_dim, self.kv_heads * self.head_dim);
        let block = vec![
            Saved::compute("attention norm's output", d),
            Saved::compute("rotated query", q),
            Saved::compute("rotated key and value", 2 * kv),
            Saved::compute("attention output", q),
            Saved::fp32("attention's log-sum-exp", self.config.num_attention_heads),
            Saved::compute("residual sum", d),
            Saved::compute("MLP norm's output", d),
            Saved::compute("gate and up projections", 2 * i),
            Saved::compute("SwiGLU output", i),
            Saved::fp32("two norms' reciprocal deviation", 2),
            Saved::compute("block output", d),
        ];
        // The gradients of the SwiGLU output, the gate and the up projection.
        let bias_per_position_pair = i64::from(self.variant.sliding_window.is_some());
        Activations { block, block_backward: 3 * i, embed: d, bias_per_position_pair }
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let (device, seq) = (inputs.input_ids.device(), inputs.input_ids.size()[1]);
        let positions = model::decoder_positions(inputs, past);
        let freqs = positions.to_kind(Kind::Float).unsqueeze(2) * self.inverse_frequencies(device).view([1, 1, -1]);
        let angles = Tensor::cat(&[&freqs, &freqs], 2).unsqueeze(2);
        // rotate_half(x)·sin = roll(x, half)·[−sin, +sin]: the sign folded in once per batch.
        let half = self.head_dim / 2;
        let sign = Tensor::cat(&[Tensor::full([half], -1.0, (Kind::Float, device)), Tensor::ones([half], (Kind::Float, device))], 0);
        let rope = Some((angles.cos().to_kind(dtype), (angles.sin() * sign).to_kind(dtype)));
        // The window hides something only once there are more keys than it holds.
        let window = self.variant.sliding_window.filter(|&window| past + seq > window);
        // Sums, not in-place adds: each term may broadcast the causal mask to more dimensions.
        // Without padding, packing or a window that hides anything, plain causal attention (no materialised mask).
        let attention_bias = match inputs.attention_mask.is_some() || inputs.documents.is_some() || window.is_some() {
            false => None,
            true => {
                let masked = model::decoder_mask_bias(inputs, past, dtype)?;
                Some(match window {
                    Some(window) => masked + model::sliding_window_bias(&positions, past, inputs, window, dtype),
                    None => masked,
                })
            }
        };
        Ok(Context { train, positions, attention_bias, rope })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, _ctx: &Context) -> Tensor {
        Tensor::embedding(p.get("embed_tokens.weight"), &inputs.input_ids, -1, false, false)
    }

    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, _) = x.size3().expect("hidden states are [batch, seq, dim]");
        let (heads, head_dim) = (self.config.num_attention_heads, self.head_dim);
        let h = self.rms_norm(x, p.get("input_layernorm.weight"));
        let split = |t: Tensor, n: i64| t.view([batch, seq, n, head_dim]);
        let (cos, signed_sin) = ctx.rope.as_ref().expect("Llama's context has RoPE");
        // RoPE in the projections' own [batch, seq, heads, head_dim] layout.
        let rotate = |t: Tensor| model::rotary(&t, cos, signed_sin).transpose(1, 2);
        let q = rotate(split(p.linear(&h, "self_attn.q_proj"), heads));
        let mut k = rotate(split(p.linear(&h, "self_attn.k_proj"), self.kv_heads));
        let mut v = split(p.linear(&h, "self_attn.v_proj"), self.kv_heads).transpose(1, 2);
        if let Some(cache) = cache {
            (k, v) = cache.extend(k, v);
        }
        let grouped = self.kv_heads != heads;
        let attn = model::attention(&q, &k, &v, ctx, grouped).transpose(1, 2).reshape([batch, seq, heads * head_dim]);
        let x = x + p.linear(&attn, "self_attn.o_proj");
        let h = self.rms_norm(&x, p.get("post_attention_layernorm.weight"));
        let gated = model::swiglu(&p.linear(&h, "mlp.gate_proj"), &p.linear(&h, "mlp.up_proj"));
        x + p.linear(&gated, "mlp.down_proj")
    }

    fn head(&self, p: &Params, x: &Tensor) -> Vec<Tensor> {
        let weight = p.maybe("lm_head.weight").unwrap_or_else(|| p.get("embed_tokens.weight"));
        vec![self.rms_norm(x, p.get("norm.weight")), weight.shallow_clone()]
    }
}

inventory::submit! {
    ModelRegistration {
        model_type: "llama",
        summary: "Llama / CodeLlama / Llama 3.x (RoPE with linear or llama3 scaling, SwiGLU, GQA)",
        build: |c| Ok(Box::new(Llama::new(c)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rope(config: serde_json::Value) -> Result<Rope> {
        let mut base = json!({"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8});
        base.as_object_mut().unwrap().extend(config.as_object().unwrap().clone());
        check::parse::<Config>(&base)?.rope()
    }

    /// Llama 3.2's rope keys as the hub has them and as transformers 5
    /// writes them (save_pretrained moves rope_theta into rope_parameters).
    #[test]
    fn hub_and_transformers_5_rope_keys_read_alike() {
        let scaling = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let hub = rope(json!({"rope_theta": 500000.0, "rope_scaling": scaling.clone()})).unwrap();
        let mut parameters = scaling;
        parameters["rope_theta"] = 500000.0.into();
        assert_eq!(rope(json!({"rope_parameters": parameters})).unwrap(), hub);
        let expected = Scaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original: 8192.0 };
        assert_eq!(hub, Rope { theta: 500000.0, scaling: expected });
        // transformers 4.4x saved "type" beside "rope_type"; either alone names the scaling too.
        let linear = Rope { theta: DEFAULT_THETA, scaling: Scaling::Linear { factor: 2.0 } };
        for scaling in [json!({"type": "linear", "rope_type": "linear", "factor": 2.0}), json!({"type": "linear", "factor": 2.0})] {
            assert_eq!(rope(json!({"rope_scaling": scaling})).unwrap(), linear);
        }
        let plain = Rope { theta: 1e6, scaling: Scaling::None };
        assert_eq!(rope(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})).unwrap(), plain);
        assert_eq!(rope(json!({"rope_theta": 1e6, "rope_scaling": null})).unwrap(), plain);
        // The model's length stands in for a missing original length, as in transformers.
        let fallback = rope(json!({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}));
        assert!(matches!(fallback.unwrap().scaling, Scaling::Llama3 { original, .. } if original == 4096.0));
    }

    #[test]
    fn rope_refusals_name_the_key_and_what_is_supported() {
        let message = |config| rope(config).unwrap_err().to_string();
        assert_eq!(
            message(json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})),
            "rope_scaling.rope_type \"yarn\" is not supported (supported: default, linear, llama3)"
        );
        assert_eq!(message(json!({"rope_parameters": {"type": "dynamic"}})), "rope_parameters.type \"dynamic\" is not supported (supported: default, linear, llama3)");
        assert_eq!(
            message(json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})),
            "rope_scaling.low_freq_factor is required for rope_type \"llama3\""
        );
        let inverted = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192});
        assert!(message(json!({"rope_scaling": inverted})).starts_with("rope_scaling.high_freq_factor (1) must be greater than low_freq_factor (4)"));
        let no_length = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
        assert!(message(json!({"rope_scaling": no_length})).starts_with("rope_scaling.original_max_position_embeddings is required"));
        assert_eq!(message(json!({"rope_parameters": {"rope_theta": 0.0}})), "rope_parameters.rope_theta must be a positive finite number, not 0");
    }
}
