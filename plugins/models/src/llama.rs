//! Llama / CodeLlama: RMSNorm, rotary position embeddings (`rope_theta`),
//! SwiGLU MLP, grouped-query attention, LM head untied unless
//! `tie_word_embeddings`.

use crate::check;
use anyhow::{bail, Result};
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, Model, ModelRegistration, ParamSpec, Params, Saved, UnitSpec};
use serde::Deserialize;
use tch::{Kind, Tensor};

#[derive(Debug, Clone, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: f64,
}

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
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default = "default_std")]
    pub initializer_range: f64,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn silu() -> String {
    "silu".into()
}
fn default_std() -> f64 {
    0.02
}

impl Config {
    fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Refuses what the math below does not compute, naming the key.
    fn validate(&self) -> Result<()> {
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
        check::positive("rope_theta", self.rope_theta)?;
        if let Some(scaling) = &self.rope_scaling {
            if scaling.rope_type != "linear" {
                bail!("rope_scaling type {:?} is not supported (none or linear)", scaling.rope_type);
            }
            check::positive("rope_scaling.factor", scaling.factor)?;
        }
        check::std("initializer_range", self.initializer_range)?;
        if self.hidden_act != "silu" {
            bail!("Llama hidden_act {:?} is not supported (only silu)", self.hidden_act);
        }
        Ok(())
    }
}

pub struct Llama {
    config: Config,
    layout: Layout,
    head_dim: i64,
    kv_heads: i64,
    /// Positions are divided by this before rotation (linear RoPE scaling).
    position_scale: f64,
}

impl Llama {
    pub fn new(hf_config: serde_json::Value) -> Result<Llama> {
        let config: Config = check::parse(&hf_config)?;
        config.validate()?;
        let position_scale = config.rope_scaling.as_ref().map_or(1.0, |linear| linear.factor);
        let (d, heads, head_dim, kv_heads) = (config.hidden_size, config.num_attention_heads, config.head_dim(), config.kv_heads());
        let normal = Init::Normal { std: config.initializer_range };
        let embed = ParamSpec::new("model.", "embed_tokens.weight", &[config.vocab_size, d], normal);
        let norm = ParamSpec::new("model.", "norm.weight", &[d], Init::Ones);
        let mut units = vec![UnitSpec { name: "embed".into(), params: vec![embed] }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{layer}.");
            let mut params = vec![ParamSpec::new(&prefix, "input_layernorm.weight", &[d], Init::Ones)];
            let linears = [
                ("self_attn.q_proj", heads * head_dim, d, config.attention_bias),
                ("self_attn.k_proj", kv_heads * head_dim, d, config.attention_bias),
                ("self_attn.v_proj", kv_heads * head_dim, d, config.attention_bias),
                ("self_attn.o_proj", d, heads * head_dim, config.attention_bias),
                ("mlp.gate_proj", config.intermediate_size, d, config.mlp_bias),
                ("mlp.up_proj", config.intermediate_size, d, config.mlp_bias),
                ("mlp.down_proj", d, config.intermediate_size, config.mlp_bias),
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
        Ok(Llama { config, layout, head_dim, kv_heads, position_scale })
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        x.rms_norm([self.config.hidden_size], Some(weight), Some(self.config.rms_norm_eps))
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
    /// gate and up projections.
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
        Activations { block, block_backward: 3 * i, embed: d, bias_per_position_pair: 0 }
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let (input_ids, padding_mask) = (&inputs.input_ids, inputs.attention_mask.as_ref());
        let device = input_ids.device();
        let positions = model::positions(input_ids, past, padding_mask);
        let exponents = Tensor::arange_start_step(0, self.head_dim, 2, (Kind::Float, device)) / self.head_dim as f64;
        let theta = ft_core::batches::to_device_async(&Tensor::from(self.config.rope_theta), device);
        let inv_freq = theta.pow(&exponents).reciprocal();
        let scaled = positions.to_kind(Kind::Float) / self.position_scale;
        let freqs = scaled.unsqueeze(2) * inv_freq.view([1, 1, -1]);
        let angles = Tensor::cat(&[&freqs, &freqs], 2).unsqueeze(2);
        // rotate_half(x)·sin = roll(x, half)·[−sin, +sin]: the sign folded in once per batch.
        let half = self.head_dim / 2;
        let sign = Tensor::cat(&[Tensor::full([half], -1.0, (Kind::Float, device)), Tensor::ones([half], (Kind::Float, device))], 0);
        let rope = Some((angles.cos().to_kind(dtype), (angles.sin() * sign).to_kind(dtype)));
        let attention_bias = padding_mask.map(|mask| {
            model::padding_bias(mask, dtype) + model::causal_bias(input_ids.size()[1], past, dtype, device)
        });
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
        // RoPE in the projections' own [batch, seq, heads, head_dim] layout,
        // three kernels forward and four backward (rotate_half's neg and cat
        // cost more, and their backward zero-fills).
        let rotate = |t: Tensor| (&t * cos).addcmul(&t.roll([head_dim / 2], [3]), signed_sin).transpose(1, 2);
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
    ModelRegistration { model_type: "llama", summary: "Llama / CodeLlama (RoPE, SwiGLU, GQA)", build: |c| Ok(Box::new(Llama::new(c)?)) }
}
