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
use crate::moe::{self, Moe};
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
    /// LongRoPE's per-frequency divisors within and beyond the original length.
    #[serde(default)]
    pub short_factor: Option<Vec<f64>>,
    #[serde(default)]
    pub long_factor: Option<Vec<f64>>,
    /// LongRoPE's scale of cos and sin (default from the length's growth).
    #[serde(default)]
    pub attention_factor: Option<f64>,
    /// The share of each head's features that rotate (the rest pass through).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
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
    /// Read only by the RoPE scalings: the length they fall back on.
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    /// The pretraining length of a scaled RoPE; transformers puts it before
    /// the one inside `rope_scaling` (Phi-3 keeps it at the top level).
    #[serde(default)]
    pub original_max_position_embeddings: Option<i64>,
    /// The share of each head's features that rotate (Phi-4-mini's 0.75).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
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
    /// RMSNorm over the query and key before RoPE (`q_norm`, `k_norm`).
    pub qk_norm: QkNorm,
    /// One `self_attn.qkv_proj` for the query, key and value, and one
    /// `mlp.gate_up_proj` for the gate and up projections (Phi-3).
    pub fused: bool,
    /// `partial_rotary_factor` may rotate only part of each head (Phi-3's
    /// `apply_rotary_pos_emb` passes the rest through; Llama's rotates all).
    pub partial_rotary: bool,
}

/// Where a block normalises its query and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head (Qwen3's: weights of `head_dim`).
    PerHead,
    /// Over the whole projection, before it is split into heads (OLMoE's:
    /// weights of heads × head_dim and kv_heads × head_dim).
    Projection,
}

impl Variant {
    /// Llama's block under `name`: no biases, full attention, nothing fused.
    pub fn plain(name: &'static str) -> Variant {
        Variant { name, qkv_bias: false, o_bias: false, mlp_bias: false, sliding_window: None, qk_norm: QkNorm::None, fused: false, partial_rotary: false }
    }
}

/// How RoPE's inverse frequencies are rescaled (transformers' `ROPE_INIT_FUNCTIONS`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scaling {
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Wavelengths longer than `original / low_freq_factor` divided by
    /// `factor`, shorter than `original / high_freq_factor` kept, a smooth
    /// blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original: f64 },
    /// LongRoPE (Phi-3's "su"/"longrope"): frequency i divided by
    /// `short[i]`, or by `long[i]` once a batch's positions pass `original`
    /// (transformers' `longrope_frequency_update` picks by the largest
    /// position), and cos and sin scaled by `attention`.
    LongRope { short: Vec<f64>, long: Vec<f64>, original: i64, attention: f64 },
}

/// RoPE as one kind of layer applies it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rope {
    pub(crate) theta: f64,
    pub(crate) scaling: Scaling,
    /// The leading features of each head that rotate (the head's size unless partial).
    pub(crate) rotary_dim: i64,
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
    fn validate(&self, variant: &Variant) -> Result<Rope> {
        let name = variant.name;
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
        // The query's width: sizes that pass one by one can still multiply past any model.
        check::sizes(&[("num_attention_heads × head_dim", heads * self.head_dim())])?;
        // RoPE rotates pairs of features, a head's first half with its second.
        if self.head_dim() % 2 != 0 {
            let key = if self.head_dim.is_some() { "head_dim" } else { "hidden_size / num_attention_heads" };
            bail!("{key} ({}) must be even: rotary embeddings rotate pairs of features", self.head_dim());
        }
        check::positive("rms_norm_eps", self.rms_norm_eps)?;
        let rope = self.rope()?;
        if rope.rotary_dim != self.head_dim() && !variant.partial_rotary {
            bail!("partial_rotary_factor is not supported for {name}: transformers' {name} rotates every feature of a head (remove it)");
        }
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
        let theta = ("rope_theta", self.rope_theta.unwrap_or(DEFAULT_THETA));
        let top = TopLevel {
            original_max_position_embeddings: self.original_max_position_embeddings,
            max_position_embeddings: self.max_position_embeddings,
            partial_rotary_factor: self.partial_rotary_factor,
        };
        read_rope(key, params, theta, &top, self.head_dim())
    }
}

/// Where a head's size comes from, for refusals that depend on it.
const HEAD_DIM_KEYS: &str = "head_dim, or hidden_size / num_attention_heads";

/// What config.json's top level gives a RoPE dict that lacks it
/// (transformers' `standardize_rope_params`).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct TopLevel {
    #[serde(default)]
    pub original_max_position_embeddings: Option<i64>,
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

/// One RoPE dict of config.json (`key`: where it is, for refusals) read as
/// transformers reads it: the base from the dict, else `theta` (its key and
/// value); the pretraining length from config.json's top level
/// (`original_max_position_embeddings`), else the dict's, else
/// `max_position_embeddings`; the rotated share from the dict, else the top
/// level, of each head's `head_dim` features.
pub(crate) fn read_rope(key: &str, params: &RopeParameters, theta: (&str, f64), config: &TopLevel, head_dim: i64) -> Result<Rope> {
    let (theta_key, theta) = match params.rope_theta {
        Some(theta) => (format!("{key}.rope_theta"), theta),
        None => (theta.0.to_string(), theta.1),
    };
    check::positive(&theta_key, theta)?;
    let partial = match (params.partial_rotary_factor, config.partial_rotary_factor) {
        (Some(partial), _) => Some((format!("{key}.partial_rotary_factor"), partial)),
        (None, Some(partial)) => Some(("partial_rotary_factor".to_string(), partial)),
        (None, None) => None,
    };
    let rotary_dim = match &partial {
        None => head_dim,
        Some((partial_key, partial)) => {
            if !(*partial > 0.0 && *partial <= 1.0) {
                bail!("{partial_key} must lie in (0, 1], not {partial}");
            }
            // transformers' int(head_dim * partial_rotary_factor).
            let rotary_dim = (head_dim as f64 * partial) as i64;
            if rotary_dim < 2 || rotary_dim % 2 != 0 {
                bail!("{partial_key} ({partial}) rotates {rotary_dim} of a head's {head_dim} features ({HEAD_DIM_KEYS}): rotary embeddings rotate pairs of features (an even number, at least 2)");
            }
            rotary_dim
        }
    };
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
    // The pretraining length the scalings measure against, as transformers' `standardize_rope_params` finds it.
    let original = || -> Result<i64> {
        let (length_key, original) = match (config.original_max_position_embeddings, params.original_max_position_embeddings, config.max_position_embeddings) {
            (Some(original), _, _) => ("original_max_position_embeddings".to_string(), original),
            (None, Some(original), _) => (format!("{key}.original_max_position_embeddings"), original),
            (None, None, Some(length)) => ("max_position_embeddings".into(), length),
            (None, None, None) => bail!("{key}.original_max_position_embeddings is required for {type_key} {kind:?} (or max_position_embeddings)"),
        };
        check::sizes(&[(length_key.as_str(), original)])?;
        Ok(original)
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
            Scaling::Llama3 { factor, low_freq_factor, high_freq_factor, original: original()? as f64 }
        }
        // Phi-3's older configs say "su" (and a few "yarn") for what transformers reads as LongRoPE.
        // Phi-3's first configs say "su" for what transformers reads as LongRoPE.
        "longrope" | "su" => {
            let factors = |name: &str, factors: &Option<Vec<f64>>| -> Result<Vec<f64>> {
                let factors = factors.clone().with_context(|| format!("{key}.{name} is required for {type_key} {kind:?}"))?;
                if factors.len() as i64 != rotary_dim / 2 {
                    bail!(
                        "{key}.{name} has {} factors: it needs one per rotated pair of a head's features, {} ({rotary_dim} of {head_dim} rotate: partial_rotary_factor × {HEAD_DIM_KEYS})",
                        factors.len(),
                        rotary_dim / 2
                    );
                }
                for (i, &factor) in factors.iter().enumerate() {
                    check::positive(&format!("{key}.{name}[{i}]"), factor)?;
                }
                Ok(factors)
            };
            let (short, long, original) = (factors("short_factor", &params.short_factor)?, factors("long_factor", &params.long_factor)?, original()?);
            // transformers' `_compute_longrope_parameters`: the factor from the lengths when not given.
            let factor = match (params.factor, config.max_position_embeddings) {
                (Some(factor), _) => factor,
                (None, Some(length)) => {
                    check::sizes(&[("max_position_embeddings", length)])?;
                    length as f64 / original as f64
                }
                (None, None) => bail!("{key}.factor (or max_position_embeddings) is required for {type_key} {kind:?}"),
            };
            check::positive(&format!("{key}.factor"), factor)?;
            let attention = match params.attention_factor {
                Some(attention) => attention,
                None if factor <= 1.0 => 1.0,
                // √(1 + ln factor / ln original): an original length of 1 would divide by zero.
                None if original < 2 => bail!("original_max_position_embeddings ({original}) must be at least 2 for {type_key} {kind:?} without {key}.attention_factor"),
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            check::positive(&format!("{key}.attention_factor"), attention)?;
            Scaling::LongRope { short, long, original, attention }
        }
        other => bail!("{key}.{type_key} {other:?} is not supported (supported: default, linear, llama3, longrope)"),
    };
    Ok(Rope { theta, scaling, rotary_dim })
}

impl Rope {
    /// The inverse frequencies [rotary_dim / 2], fp32 on the device of
    /// `positions` (whose largest picks LongRoPE's set), in transformers'
    /// operations and order so that they round alike.
    fn inverse_frequencies(&self, positions: &Tensor) -> Tensor {
        let device = positions.device();
        let exponents = Tensor::arange_start_step(0, self.rotary_dim, 2, (Kind::Float, device)) / self.rotary_dim as f64;
        // Fills on the device, not host copies: a decoding step's context
        // is recorded into a CUDA graph, which cannot hold host copies.
        let theta = Tensor::scalar_tensor(self.theta, (Kind::Double, device));
        let on_device = |values: &[f64]| Tensor::cat(&values.iter().map(|&v| Tensor::full([1], v, (Kind::Float, device))).collect::<Vec<_>>(), 0);
        let inv_freq = theta.pow(&exponents).reciprocal();
        match &self.scaling {
            Scaling::None => inv_freq,
            Scaling::Linear { factor } => inv_freq / *factor,
            &Scaling::Llama3 { factor, low_freq_factor, high_freq_factor, original } => {
                let (low_freq_wavelen, high_freq_wavelen) = (original / low_freq_factor, original / high_freq_factor);
                let wavelen = inv_freq.reciprocal() * (2.0 * PI);
                let scaled = (&inv_freq / factor).where_self(&wavelen.gt(low_freq_wavelen), &inv_freq);
                let smooth = (wavelen.reciprocal() * original - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor = (1.0 - &smooth) * &scaled / factor + smooth * &scaled;
                let medium = wavelen.lt(high_freq_wavelen).logical_not().logical_and(&wavelen.gt(low_freq_wavelen).logical_not());
                smoothed.where_self(&medium, &scaled)
            }
            Scaling::LongRope { short, long, original, .. } => {
                // 1 / (factors · base^exponents), as `_compute_longrope_parameters` writes it.
                let powers = theta.pow(&exponents);
                let (short, long) = ((on_device(short) * &powers).reciprocal(), (on_device(long) * &powers).reciprocal());
                let beyond = (positions.max() + 1).gt(*original);
                long.where_self(&beyond, &short)
            }
        }
    }

    /// RoPE's cos and sign-folded sin for `positions` ([batch, seq]), as
    /// `Context::rope` holds them: [batch, seq, 1, rotary_dim] in `dtype`.
    pub(crate) fn cos_sin(&self, positions: &Tensor, dtype: Kind) -> (Tensor, Tensor) {
        let device = positions.device();
        let freqs = positions.to_kind(Kind::Float).unsqueeze(2) * self.inverse_frequencies(positions).view([1, 1, -1]);
        let angles = Tensor::cat(&[&freqs, &freqs], 2).unsqueeze(2);
        // rotate_half(x)·sin = roll(x, half)·[−sin, +sin]: the sign folded in once per batch.
        let half = self.rotary_dim / 2;
        let sign = Tensor::cat(&[Tensor::full([half], -1.0, (Kind::Float, device)), Tensor::ones([half], (Kind::Float, device))], 0);
        let (cos, sin) = match self.scaling {
            Scaling::LongRope { attention, .. } => (angles.cos() * attention, angles.sin() * attention),
            _ => (angles.cos(), angles.sin()),
        };
        (cos.to_kind(dtype), (sin * sign).to_kind(dtype))
    }
}

/// A decoder's attention bias over `inputs` after `past` cached positions,
/// under a sliding `window` if any: None (plain causal attention, no
/// materialised mask) without padding, packing or a window that hides
/// anything — a window hides something only once there are more keys than
/// it holds.
pub(crate) fn attention_bias(inputs: &Inputs, positions: &Tensor, past: i64, window: Option<i64>, dtype: Kind) -> Result<Option<Tensor>> {
    let window = window.filter(|&window| past + inputs.input_ids.size()[1] > window);
    if inputs.attention_mask.is_none() && !inputs.packed() && window.is_none() {
        return Ok(None);
    }
    let masked = model::decoder_mask_bias(inputs, past, dtype)?;
    // Sums, not in-place adds: each term may broadcast the causal mask to more dimensions.
    Ok(Some(match window {
        Some(window) => masked + model::sliding_window_bias(positions, past, inputs, window, dtype),
        None => masked,
    }))
}

/// Rotates the leading `cos.size()[3]` features of each head of `x`
/// ([batch, seq, heads, head_dim]) and passes the rest through (partial
/// rotary embeddings; all of them for most models).
pub(crate) fn rotate(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    let (head_dim, rotary_dim) = (x.size()[3], cos.size()[3]);
    if rotary_dim == head_dim {
        return model::rotary(x, cos, signed_sin);
    }
    let rotated = model::rotary(&x.narrow(3, 0, rotary_dim), cos, signed_sin);
    Tensor::cat(&[rotated, x.narrow(3, rotary_dim, head_dim - rotary_dim)], 3)
}

/// `hf_config` with `defaults` for the keys it leaves out: the values
/// transformers' config class for a model_type gives them where they
/// differ from Llama's.
fn with_defaults(hf_config: &serde_json::Value, defaults: &[(&str, serde_json::Value)]) -> serde_json::Value {
    let mut config = hf_config.clone();
    if let Some(object) = config.as_object_mut() {
        for (key, value) in defaults {
            object.entry(*key).or_insert_with(|| value.clone());
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
    /// The experts that replace the MLP of the sparse layers (`moe.rs`); None: every layer is dense.
    experts: Option<Moe>,
}

impl Llama {
    /// Llama itself: biases where `attention_bias` and `mlp_bias` say, full attention.
    pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
        Llama::build(hf_config, &[], |config| {
            let keys: LlamaKeys = check::parse(config)?;
            Ok(Variant { qkv_bias: keys.attention_bias, o_bias: keys.attention_bias, mlp_bias: keys.mlp_bias, ..Variant::plain("Llama") })
        })
    }

    /// The block of a Llama relative: its config read with `defaults` for
    /// the keys it leaves out, and checked; `variant` reads (and checks) the
    /// family's own keys from the same config. `hf_config` is kept as given
    /// (written back on export).
    pub fn build(hf_config: serde_json::Value, defaults: &[(&str, serde_json::Value)], variant: impl FnOnce(&serde_json::Value) -> Result<Variant>) -> Result<Llama> {
        let read = with_defaults(&hf_config, defaults);
        let config: Config = check::parse(&read)?;
        let variant = variant(&read)?;
        let rope = config.validate(&variant)?;
        let (d, heads, head_dim, kv_heads) = (config.hidden_size, config.num_attention_heads, config.head_dim(), config.kv_heads());
        let normal = Init::Normal { std: config.initializer_range };
        let embed = ParamSpec::new("model.", "embed_tokens.weight", &[config.vocab_size, d], normal);
        let norm = ParamSpec::new("model.", "norm.weight", &[d], Init::Ones);
        let mut units = vec![UnitSpec { name: "embed".into(), params: vec![embed] }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{layer}.");
            let mut params = vec![ParamSpec::new(&prefix, "input_layernorm.weight", &[d], Init::Ones)];
            let (q, kv, inner) = (heads * head_dim, kv_heads * head_dim, config.intermediate_size);
            let linears = match variant.fused {
                false => vec![
                    ("self_attn.q_proj", q, d, variant.qkv_bias),
                    ("self_attn.k_proj", kv, d, variant.qkv_bias),
                    ("self_attn.v_proj", kv, d, variant.qkv_bias),
                    ("self_attn.o_proj", d, q, variant.o_bias),
                    ("mlp.gate_proj", inner, d, variant.mlp_bias),
                    ("mlp.up_proj", inner, d, variant.mlp_bias),
                    ("mlp.down_proj", d, inner, variant.mlp_bias),
                ],
                true => vec![
                    ("self_attn.qkv_proj", q + 2 * kv, d, variant.qkv_bias),
                    ("self_attn.o_proj", d, q, variant.o_bias),
                    ("mlp.gate_up_proj", 2 * inner, d, variant.mlp_bias),
                    ("mlp.down_proj", d, inner, variant.mlp_bias),
                ],
            };
            for (name, out, inp, bias) in linears {
                params.push(ParamSpec::new(&prefix, &format!("{name}.weight"), &[out, inp], normal));
                if bias {
                    params.push(ParamSpec::new(&prefix, &format!("{name}.bias"), &[out], Init::Zeros));
                }
            }
            let norms = match variant.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead => Some((head_dim, head_dim)),
                QkNorm::Projection => Some((q, kv)),
            };
            if let Some((q_width, k_width)) = norms {
                params.push(ParamSpec::new(&prefix, "self_attn.q_norm.weight", &[q_width], Init::Ones));
                params.push(ParamSpec::new(&prefix, "self_attn.k_norm.weight", &[k_width], Init::Ones));
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
        Ok(Llama { config, variant, layout, head_dim, kv_heads, rope, experts: None })
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        model::rms_norm(x, weight, self.config.rms_norm_eps)
    }

    /// This model with `moe`'s experts in place of the MLP of its sparse
    /// layers (a mixture-of-experts family: `qwen3_moe.rs`, …).
    pub(crate) fn with_experts(mut self, moe: Moe) -> Result<Llama> {
        moe::ExpertGemms::check_environment()?;
        if self.variant.fused || self.variant.mlp_bias {
            bail!("{}: experts replace an MLP of separate, bias-free projections", self.variant.name);
        }
        let normal = Init::Normal { std: self.config.initializer_range };
        for layer in (0..self.config.num_hidden_layers as usize).filter(|&layer| moe.is_sparse(layer)) {
            let unit = &mut self.layout.units[1 + layer];
            let at = unit.params.iter().position(|p| p.name == "mlp.gate_proj.weight").expect("a dense block has an MLP");
            unit.params.retain(|p| !p.name.starts_with("mlp."));
            let prefix = format!("model.layers.{layer}.");
            let (experts, params): (Vec<_>, Vec<_>) = moe.params(&prefix, self.config.hidden_size, normal).into_iter().partition(|p| p.name.starts_with("mlp.experts."));
            unit.params.splice(at..at, params);
            // Each fused expert parameter a unit of its own, after the others: what expert parallelism splits by rows.
            let name = unit.name.clone();
            let first = self.layout.units.len();
            self.layout.units.extend(experts.into_iter().map(|param| UnitSpec { name: format!("{name} {}", param.name), params: vec![param] }));
            self.layout.stages[1 + layer].experts = Some([first, first + 1]);
        }
        check::parameters(&self.layout.units)?;
        self.experts = Some(moe);
        Ok(self)
    }
}

/// LoRA's short names for the projections of a block with separate q, k,
/// v and gate, up (Llama's, and Gemma's, whose blocks name them alike).
pub(crate) const PROJECTIONS: &[(&str, &[&str])] = &[
    ("q", &["self_attn.q_proj"]),
    ("k", &["self_attn.k_proj"]),
    ("v", &["self_attn.v_proj"]),
    ("o", &["self_attn.o_proj"]),
    ("gate", &["mlp.gate_proj"]),
    ("up", &["mlp.up_proj"]),
    ("down", &["mlp.down_proj"]),
];

impl Model for Llama {
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        if self.experts.is_some() {
            // gate, up and down would adapt only the dense MLPs; the experts are `experts` (`expert_parameters`).
            return &PROJECTIONS[..4];
        }
        if self.variant.fused {
            return &[("qkv", &["self_attn.qkv_proj"]), ("o", &["self_attn.o_proj"]), ("gate_up", &["mlp.gate_up_proj"]), ("down", &["mlp.down_proj"])];
        }
        PROJECTIONS
    }
    fn expert_parameters(&self) -> &'static [&'static str] {
        if self.experts.is_some() {
            &moe::EXPERT_PARAMETERS
        } else {
            &[]
        }
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
        let mut block = vec![
            Saved::compute("attention norm's output", d),
            Saved::compute("rotated query", q),
            Saved::compute("rotated key and value", 2 * kv),
            Saved::compute("attention output", q),
            Saved::fp32("attention's log-sum-exp", self.config.num_attention_heads),
            Saved::compute("residual sum", d),
            Saved::compute("MLP norm's output", d),
            Saved::fp32("two norms' reciprocal deviation", 2),
            Saved::compute("block output", d),
        ];
        // And the MLP's; backward holds the gradients of the SwiGLU output, the
        // gate and the up projection. A mixture of experts' blocks are
        // counted as its sparse ones (the larger, and most).
        let (mlp, mlp_backward) = match &self.experts {
            Some(moe) => (moe.saved(d), moe.backward_per_token()),
            None => (vec![Saved::compute("gate and up projections", 2 * i), Saved::compute("SwiGLU output", i)], 3 * i),
        };
        block.extend(mlp);
        if self.variant.qk_norm != QkNorm::None {
            // The per-head norms keep their inputs (the projections) and each head's reciprocal deviation.
            block.push(Saved::compute("query and key projections", q + kv));
            block.push(Saved::fp32("query and key norms' reciprocal deviation", self.config.num_attention_heads + self.kv_heads));
        }
        let bias_per_position_pair = i64::from(self.variant.sliding_window.is_some());
        Activations { block, block_backward: mlp_backward, embed: d, bias_per_position_pair, block_per_position_pair: 0 }
    }

    /// 6N plus attention's 12 FLOPs per query feature (heads × head_dim,
    /// which need not be hidden_size: Qwen3's) and attended key, at most a
    /// sliding window's.
    fn train_flops_per_token(&self, seq: i64) -> f64 {
        let features = self.config.num_attention_heads * self.head_dim;
        let keys = self.variant.sliding_window.map_or(seq, |window| seq.min(window));
        6.0 * (self.numel() - self.idle_numel()) as f64 + 12.0 * (self.config.num_hidden_layers * features * keys) as f64
    }

    /// A token runs k of the experts: the others' parameters do no work for it.
    fn idle_numel(&self) -> i64 {
        self.experts.as_ref().map_or(0, |moe| moe.sparse.iter().filter(|&&sparse| sparse).count() as i64 * moe.idle_params_per_layer(self.config.hidden_size))
    }

    /// With experts, the router stays in the compute dtype, as bitsandbytes
    /// (through transformers 5, where it is no `nn.Linear`) leaves it, and
    /// the fused experts are held in 4 bits too (`moe::held_in_4bit`).
    fn held_in_4bit(&self, param: &ParamSpec) -> bool {
        match &self.experts {
            Some(_) => moe::held_in_4bit(param),
            None => param.shape.len() == 2,
        }
    }

    /// With experts, where their GEMMs are grouped: the loop reads each sparse layer's tokens per expert on the host (`moe.rs`).
    fn graph_capturable(&self, device: Device, dtype: Kind) -> bool {
        self.experts.as_ref().is_none_or(|moe| moe.gemms(self.config.hidden_size, device, dtype) == moe::ExpertGemms::Grouped)
    }

    fn experts(&self) -> Option<model::Experts> {
        self.experts.as_ref().map(|moe| model::Experts { count: moe.experts, per_token: moe.top_k, sparse_layers: moe.sparse.iter().filter(|&&sparse| sparse).count() as i64 })
    }

    fn auxiliary_loss(&self) -> Option<&dyn model::AuxiliaryLoss> {
        self.experts.as_ref().filter(|moe| moe.aux_loss_coef.is_some()).map(|moe| moe as &dyn model::AuxiliaryLoss)
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let positions = model::decoder_positions(inputs, past);
        let rope = Some(self.rope.cos_sin(&positions, dtype));
        let attention_bias = attention_bias(inputs, &positions, past, self.variant.sliding_window, dtype)?;
        Ok(Context { train, positions, attention_bias, rope, local: None, auxiliary: model::Auxiliary::of(inputs), experts: None })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, _ctx: &Context) -> Tensor {
        Tensor::embedding(p.get("embed_tokens.weight"), &inputs.input_ids, -1, false, false)
    }

    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, layer: usize, cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, _) = x.size3().expect("hidden states are [batch, seq, dim]");
        let (heads, head_dim) = (self.config.num_attention_heads, self.head_dim);
        let h = self.rms_norm(x, p.get("input_layernorm.weight"));
        let split = |t: Tensor, n: i64| t.view([batch, seq, n, head_dim]);
        let [q, k, v] = match self.variant.fused {
            false => p.linears(&h, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            true => {
                let qkv = p.linear(&h, "self_attn.qkv_proj");
                let (q, kv) = (heads * head_dim, self.kv_heads * head_dim);
                [qkv.narrow(2, 0, q), qkv.narrow(2, q, kv), qkv.narrow(2, q + kv, kv)]
            }
        };
        let eps = Some(self.config.rms_norm_eps);
        let norm = |t: Tensor, name: &str| {
            let weight = p.get(name);
            t.rms_norm(weight.size(), Some(weight), eps)
        };
        let (q, k) = match self.variant.qk_norm {
            QkNorm::Projection => (norm(q, "self_attn.q_norm.weight"), norm(k, "self_attn.k_norm.weight")),
            _ => (q, k),
        };
        let (mut q, mut k) = (split(q, heads), split(k, self.kv_heads));
        if self.variant.qk_norm == QkNorm::PerHead {
            (q, k) = (norm(q, "self_attn.q_norm.weight"), norm(k, "self_attn.k_norm.weight"));
        }
        let (cos, signed_sin) = ctx.rope.as_ref().expect("Llama's context has RoPE");
        // RoPE in the projections' own [batch, seq, heads, head_dim] layout.
        let rotated = |t: &Tensor| rotate(t, cos, signed_sin);
        let v = split(v, self.kv_heads);
        let [q, k, v] = match cache {
            Some(cache) => cache.rotate_and_extend(&q, &k, &v, (cos, signed_sin), rotated),
            None => [rotated(&q).transpose(1, 2), rotated(&k).transpose(1, 2), v.transpose(1, 2)],
        };
        let grouped = self.kv_heads != heads;
        let attn = model::attention(&q, &k, &v, ctx, grouped).transpose(1, 2).reshape([batch, seq, heads * head_dim]);
        let x = x + p.linear(&attn, "self_attn.o_proj");
        let h = self.rms_norm(&x, p.get("post_attention_layernorm.weight"));
        if let Some(moe) = self.experts.as_ref().filter(|moe| moe.is_sparse(layer)) {
            return x + moe.forward(p, &h, ctx);
        }
        let gated = match self.variant.fused {
            false => match p.joined_linear(&h, &["mlp.gate_proj", "mlp.up_proj"]) {
                // The gate and up halves read in place, as a mixture's experts read theirs.
                Some(gate_up) => model::swiglu_halves(&gate_up.view([batch * seq, -1])).view([batch, seq, -1]),
                None => model::swiglu(&p.linear(&h, "mlp.gate_proj"), &p.linear(&h, "mlp.up_proj")),
            },
            true => {
                let gate_up = p.linear(&h, "mlp.gate_up_proj");
                let inner = self.config.intermediate_size;
                model::swiglu(&gate_up.narrow(2, 0, inner).contiguous(), &gate_up.narrow(2, inner, inner).contiguous())
            }
        };
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
        assert_eq!(hub, Rope { theta: 500000.0, scaling: expected, rotary_dim: 8 });
        // transformers 4.4x saved "type" beside "rope_type"; either alone names the scaling too.
        let linear = Rope { theta: DEFAULT_THETA, scaling: Scaling::Linear { factor: 2.0 }, rotary_dim: 8 };
        for scaling in [json!({"type": "linear", "rope_type": "linear", "factor": 2.0}), json!({"type": "linear", "factor": 2.0})] {
            assert_eq!(rope(json!({"rope_scaling": scaling})).unwrap(), linear);
        }
        let plain = Rope { theta: 1e6, scaling: Scaling::None, rotary_dim: 8 };
        assert_eq!(rope(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})).unwrap(), plain);
        assert_eq!(rope(json!({"rope_theta": 1e6, "rope_scaling": null})).unwrap(), plain);
        // The model's length stands in for a missing original length, as in transformers.
        let fallback = rope(json!({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}));
        assert!(matches!(fallback.unwrap().scaling, Scaling::Llama3 { original, .. } if original == 4096.0));
    }

    /// LongRoPE divides each frequency by its short factor while a batch's
    /// positions stay within the original length and by its long factor
    /// beyond, and scales cos and sin by √(1 + ln(factor) / ln(original)) —
    /// on the leading `partial_rotary_factor` of each head.
    #[test]
    fn longrope_picks_its_factors_by_the_longest_position() {
        let scaling = json!({"type": "su", "short_factor": [1.0, 2.0], "long_factor": [4.0, 8.0]});
        let rope = rope(json!({"rope_scaling": scaling, "partial_rotary_factor": 0.5, "max_position_embeddings": 64, "original_max_position_embeddings": 4})).unwrap();
        let attention = (1.0 + 16f64.ln() / 4f64.ln()).sqrt();
        assert_eq!(rope.rotary_dim, 4);
        assert_eq!(rope.scaling, Scaling::LongRope { short: vec![1.0, 2.0], long: vec![4.0, 8.0], original: 4, attention });
        let plain = [1.0, 1.0 / 10000f64.sqrt()];
        for (positions, factors) in [([0i64, 3], [1.0, 2.0]), ([0, 4], [4.0, 8.0])] {
            let inverse = Vec::<f64>::try_from(rope.inverse_frequencies(&Tensor::from_slice(&positions).unsqueeze(0)).to_kind(Kind::Double)).unwrap();
            for ((inverse, plain), factor) in inverse.iter().zip(plain).zip(factors) {
                assert!((inverse - plain / factor).abs() < 1e-6, "{positions:?}: {inverse} vs {}", plain / factor);
            }
        }
        let (cos, _) = rope.cos_sin(&Tensor::from_slice(&[0i64]).unsqueeze(0), Kind::Double);
        assert!((cos.double_value(&[0, 0, 0, 0]) - attention).abs() < 1e-6, "cos(0) is the attention factor");
    }

    #[test]
    fn rope_refusals_name_the_key_and_what_is_supported() {
        let message = |config| rope(config).unwrap_err().to_string();
        assert_eq!(
            message(json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})),
            "rope_scaling.rope_type \"yarn\" is not supported (supported: default, linear, llama3, longrope)"
        );
        assert_eq!(message(json!({"rope_parameters": {"type": "dynamic"}})), "rope_parameters.type \"dynamic\" is not supported (supported: default, linear, llama3, longrope)");
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
