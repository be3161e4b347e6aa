//! Gemma 2 and Gemma 3's text model (google/gemma-2-*, gemma-3-1b-*:
//! config.json's model_type `gemma2`, `gemma3_text`), as transformers'
//! `modeling_gemma2.py` and `modeling_gemma3.py` compute them:
//!
//! - the embedding scaled by √hidden_size (in the weights' dtype);
//! - RMSNorms that scale by `1 + weight` (weights start at zero), in fp32;
//! - a norm before and after both the attention and the MLP;
//! - GeGLU: `down(gelu_tanh(gate) · up)` (`hidden_activation`
//!   "gelu_pytorch_tanh");
//! - attention scaled by `query_pre_attn_scalar`^-½, not head_dim^-½;
//! - layers alternating between a sliding window (`sliding_attention`:
//!   each query sees at most `sliding_window` keys, itself included) and
//!   global attention, as `layer_types` says, else Gemma 2's every other
//!   layer and Gemma 3's `sliding_window_pattern` (5 local : 1 global);
//! - Gemma 2: attention scores soft-capped, `c · tanh(s / c)` with `c =
//!   attn_logit_softcapping`, before the mask (outside SDPA: ft computes
//!   those layers' attention itself, as transformers' eager attention), and
//!   the final logits soft-capped by `final_logit_softcapping`
//!   (`Model::logit_softcap`);
//! - Gemma 3: an RMSNorm over each head's query and key (`q_norm`,
//!   `k_norm`) and RoPE bases of their own for the two kinds of layer
//!   (`rope_local_base_freq` for the local ones, `rope_theta` and
//!   `rope_scaling` for the global ones; transformers 5 writes them as
//!   `rope_parameters.sliding_attention` and `.full_attention`).
//!
//! Gemma 3's `attn_logit_softcapping` is refused unless null: transformers'
//! Gemma 3 attention does not read it. Bidirectional attention (an encoder's)
//! is refused. Keys config.json leaves out take the config classes' defaults.

use crate::check;
use crate::llama::{self, RopeParameters, TopLevel};
use anyhow::{bail, Context as _, Result};
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, LocalAttention, Model, ModelRegistration, ParamSpec, Params, Saved, UnitSpec};
use serde::{Deserialize, Deserializer};
use tch::{Kind, Tensor};

/// What tells the two generations apart.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Family {
    name: &'static str,
    /// Per-head RMSNorm of the query and key (Gemma 3).
    qk_norm: bool,
    /// Every `pattern`-th layer is global unless `layer_types` says otherwise.
    default_pattern: i64,
    /// The config class's values for absent soft-capping keys.
    attn_softcap: Option<f64>,
    final_softcap: Option<f64>,
    /// Local and global layers read RoPE dicts of their own (Gemma 3).
    per_layer_rope: bool,
    /// The base of the global layers' RoPE when config.json gives none.
    global_theta: f64,
}

const GEMMA2: Family =
    Family { name: "Gemma2", qk_norm: false, default_pattern: 2, attn_softcap: Some(50.0), final_softcap: Some(30.0), per_layer_rope: false, global_theta: 10_000.0 };
const GEMMA3: Family =
    Family { name: "Gemma3", qk_norm: true, default_pattern: 6, attn_softcap: None, final_softcap: None, per_layer_rope: true, global_theta: 1_000_000.0 };

/// Gemma 3's local layers' base when config.json gives none.
const LOCAL_THETA: f64 = 10_000.0;

/// A key that may be absent (Some(None) only when it is present and null).
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(deserializer).map(Some)
}

#[derive(Debug, Clone, Deserialize)]
struct Config {
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    #[serde(default = "four")]
    num_key_value_heads: i64,
    #[serde(default = "head_dim")]
    head_dim: i64,
    vocab_size: i64,
    #[serde(default = "eps")]
    rms_norm_eps: f64,
    #[serde(default = "gelu_tanh")]
    hidden_activation: String,
    #[serde(default = "yes")]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    attention_dropout: f64,
    #[serde(default = "scalar")]
    query_pre_attn_scalar: f64,
    #[serde(default = "window")]
    sliding_window: Option<i64>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    sliding_window_pattern: Option<i64>,
    #[serde(default, deserialize_with = "present")]
    attn_logit_softcapping: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    final_logit_softcapping: Option<Option<f64>>,
    #[serde(default)]
    use_bidirectional_attention: Option<bool>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<RopeParameters>,
    /// One dict (Gemma 2) or one per kind of layer (Gemma 3), read below.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(flatten)]
    top: TopLevel,
    #[serde(default = "std")]
    initializer_range: f64,
}

fn four() -> i64 {
    4
}
fn head_dim() -> i64 {
    256
}
fn eps() -> f64 {
    1e-6
}
fn gelu_tanh() -> String {
    "gelu_pytorch_tanh".into()
}
fn yes() -> bool {
    true
}
fn scalar() -> f64 {
    256.0
}
fn window() -> Option<i64> {
    Some(4096)
}
fn std() -> f64 {
    0.02
}

pub struct Gemma {
    config: Config,
    family: Family,
    layout: Layout,
    /// Whether each layer attends through the sliding window.
    sliding: Vec<bool>,
    global_rope: llama::Rope,
    local_rope: llama::Rope,
    attn_softcap: Option<f64>,
    final_softcap: Option<f64>,
}

impl Config {
    /// Each layer's kind: `layer_types`, else the family's pattern (every
    /// `pattern`-th layer global, as the config classes make them).
    fn sliding_layers(&self, family: &Family) -> Result<Vec<bool>> {
        let layers = self.num_hidden_layers as usize;
        let Some(types) = &self.layer_types else {
            let pattern = self.sliding_window_pattern.unwrap_or(family.default_pattern);
            check::sizes(&[("sliding_window_pattern", pattern)])?;
            return Ok((0..layers as i64).map(|i| (i + 1) % pattern != 0).collect());
        };
        if types.len() != layers {
            bail!("layer_types has {} entries: it needs one per layer, {layers} (num_hidden_layers)", types.len());
        }
        types
            .iter()
            .enumerate()
            .map(|(i, kind)| match kind.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => bail!("layer_types[{i}] is {other:?}: {} layers are \"sliding_attention\" or \"full_attention\"", family.name),
            })
            .collect()
    }

    /// The global and the local layers' RoPE, as the config classes read them.
    fn ropes(&self, family: &Family) -> Result<(llama::Rope, llama::Rope)> {
        let global_theta = ("rope_theta", self.rope_theta.unwrap_or(family.global_theta));
        if !family.per_layer_rope {
            // Gemma 2: one RoPE, read as Llama's.
            let parameters: Option<RopeParameters> = self.rope_parameters.as_ref().map(check::parse).transpose().context("rope_parameters")?;
            let (key, params) = match (&self.rope_scaling, &parameters) {
                (Some(scaling), _) => ("rope_scaling", scaling.clone()),
                (None, Some(parameters)) => ("rope_parameters", parameters.clone()),
                (None, None) => ("rope_scaling", RopeParameters::default()),
            };
            let rope = llama::read_rope(key, &params, global_theta, &self.top, self.head_dim)?;
            return Ok((rope.clone(), rope));
        }
        // Gemma 3: `rope_parameters.{full,sliding}_attention` (transformers 5), else the hub's keys.
        let nested = |kind: &str| -> Result<Option<RopeParameters>> {
            let Some(parameters) = &self.rope_parameters else { return Ok(None) };
            let Some(dict) = parameters.get(kind) else {
                bail!("rope_parameters has no {kind:?}: {} gives its full_attention and sliding_attention layers a RoPE dict each", family.name)
            };
            Ok(Some(check::parse(dict).with_context(|| format!("rope_parameters.{kind}"))?))
        };
        let mut global = nested("full_attention")?.unwrap_or_default();
        if let Some(scaling) = &self.rope_scaling {
            // transformers updates the global dict with `rope_scaling`.
            let theta = global.rope_theta;
            global = RopeParameters { rope_theta: scaling.rope_theta.or(theta), ..scaling.clone() };
        }
        let local = nested("sliding_attention")?.unwrap_or_default();
        let local_theta = ("rope_local_base_freq", self.rope_local_base_freq.unwrap_or(LOCAL_THETA));
        let key = |kind: &str| if self.rope_parameters.is_some() { format!("rope_parameters.{kind}") } else { "rope_scaling".into() };
        Ok((
            llama::read_rope(&key("full_attention"), &global, global_theta, &self.top, self.head_dim)?,
            llama::read_rope(&key("sliding_attention"), &local, local_theta, &self.top, self.head_dim)?,
        ))
    }
}

impl Gemma {
    fn new(hf_config: serde_json::Value, family: Family) -> Result<Gemma> {
        let config: Config = check::parse(&hf_config)?;
        let (d, heads, head_dim, kv_heads, inner) = (config.hidden_size, config.num_attention_heads, config.head_dim, config.num_key_value_heads, config.intermediate_size);
        check::sizes(&[
            ("vocab_size", config.vocab_size),
            ("hidden_size", d),
            ("intermediate_size", inner),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
        ])?;
        check::layers("num_hidden_layers", config.num_hidden_layers)?;
        // The query's width: sizes that pass one by one can still multiply past any model.
        check::sizes(&[("num_attention_heads × head_dim", heads * head_dim)])?;
        check::multiple_of(("num_attention_heads", heads), ("num_key_value_heads", kv_heads))?;
        if head_dim % 2 != 0 {
            bail!("head_dim ({head_dim}) must be even: rotary embeddings rotate pairs of features");
        }
        check::positive("rms_norm_eps", config.rms_norm_eps)?;
        check::positive("query_pre_attn_scalar", config.query_pre_attn_scalar)?;
        check::std("initializer_range", config.initializer_range)?;
        let name = family.name;
        if config.hidden_activation != "gelu_pytorch_tanh" {
            bail!("{name} hidden_activation {:?} is not supported (only \"gelu_pytorch_tanh\")", config.hidden_activation);
        }
        check::probabilities(&[("attention_dropout", config.attention_dropout)])?;
        if config.attention_dropout != 0.0 {
            bail!("attention_dropout {} is not supported: ft's attention has no dropout (set it to 0.0)", config.attention_dropout);
        }
        if config.use_bidirectional_attention == Some(true) {
            bail!("use_bidirectional_attention: true is not supported: ft trains {name} as a causal LM");
        }
        let softcap = |key: &str, value: Option<Option<f64>>, default: Option<f64>| -> Result<Option<f64>> {
            let cap = value.unwrap_or(default);
            if let Some(cap) = cap {
                check::positive(key, cap)?;
            }
            Ok(cap)
        };
        let attn_softcap = softcap("attn_logit_softcapping", config.attn_logit_softcapping, family.attn_softcap)?;
        if family.qk_norm && attn_softcap.is_some() {
            bail!("attn_logit_softcapping is not supported for {name}: transformers' {name} attention does not apply it (set it to null)");
        }
        let final_softcap = softcap("final_logit_softcapping", config.final_logit_softcapping, family.final_softcap)?;
        let sliding = config.sliding_layers(&family)?;
        match config.sliding_window {
            Some(window) => check::sizes(&[("sliding_window", window)])?,
            None if sliding.contains(&true) => bail!("sliding_window is null but layer_types has sliding_attention layers: give the window"),
            None => {}
        }
        let (global_rope, local_rope) = config.ropes(&family)?;

        let normal = Init::Normal { std: config.initializer_range };
        // Gemma's norms scale by 1 + weight: a zero weight is the identity.
        let norm = |prefix: &str, name: &str, size: i64| ParamSpec::new(prefix, name, &[size], Init::Zeros);
        let mut units = vec![UnitSpec { name: "embed".into(), params: vec![ParamSpec::new("model.", "embed_tokens.weight", &[config.vocab_size, d], normal)] }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{layer}.");
            let mut params = vec![norm(&prefix, "input_layernorm.weight", d)];
            let linears = [
                ("self_attn.q_proj", heads * head_dim, d, config.attention_bias),
                ("self_attn.k_proj", kv_heads * head_dim, d, config.attention_bias),
                ("self_attn.v_proj", kv_heads * head_dim, d, config.attention_bias),
                ("self_attn.o_proj", d, heads * head_dim, config.attention_bias),
                ("mlp.gate_proj", inner, d, false),
                ("mlp.up_proj", inner, d, false),
                ("mlp.down_proj", d, inner, false),
            ];
            for (name, out, inp, bias) in linears {
                params.push(ParamSpec::new(&prefix, &format!("{name}.weight"), &[out, inp], normal));
                if bias {
                    params.push(ParamSpec::new(&prefix, &format!("{name}.bias"), &[out], Init::Zeros));
                }
            }
            if family.qk_norm {
                params.extend([norm(&prefix, "self_attn.q_norm.weight", head_dim), norm(&prefix, "self_attn.k_norm.weight", head_dim)]);
            }
            for name in ["post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                params.push(norm(&prefix, &format!("{name}.weight"), d));
            }
            units.push(UnitSpec { name: format!("block {layer}"), params });
        }
        let blocks = 1..config.num_hidden_layers as usize + 1;
        let final_norm = norm("model.", "norm.weight", d);
        let head_unit = if config.tie_word_embeddings {
            units[0].params.push(final_norm);
            units[0].name = "embed+head".into();
            0
        } else {
            units.push(UnitSpec { name: "head".into(), params: vec![final_norm, ParamSpec::new("", "lm_head.weight", &[config.vocab_size, d], normal)] });
            units.len() - 1
        };
        let layout = Layout::new(hf_config, units, blocks, head_unit);
        Ok(Gemma { config, family, layout, sliding, global_rope, local_rope, attn_softcap, final_softcap })
    }

    /// Gemma's RMSNorm over the last dimension: `x / rms(x) · (1 + weight)`, in fp32.
    fn norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        let normed = x.to_kind(Kind::Float).rms_norm(weight.size(), None::<&Tensor>, Some(self.config.rms_norm_eps));
        (normed * (weight.to_kind(Kind::Float) + 1.0)).to_kind(x.kind())
    }

    fn scale(&self) -> f64 {
        self.config.query_pre_attn_scalar.powf(-0.5)
    }

    fn any_sliding(&self) -> bool {
        self.sliding.contains(&true)
    }
}

/// Gemma 2's attention over [batch, heads, seq, head_dim] tensors, as
/// transformers' eager attention: scores scaled, soft-capped `cap ·
/// tanh(s / cap)`, masked (`bias`, else causally), softmax in fp32.
fn softcapped_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Option<Tensor>, scale: f64, cap: f64) -> Tensor {
    let (heads, kv_heads, seq, keys) = (q.size()[1], k.size()[1], q.size()[2], k.size()[2]);
    let (k, v) = match heads / kv_heads {
        1 => (k.shallow_clone(), v.shallow_clone()),
        repeats => (k.repeat_interleave_self_int(repeats, 1, None), v.repeat_interleave_self_int(repeats, 1, None)),
    };
    let scores = ((q.matmul(&k.transpose(2, 3)) * scale) / cap).tanh() * cap;
    let masked = match bias {
        Some(bias) => scores + bias,
        None => scores + model::causal_bias(seq, keys - seq, q.kind(), q.device()),
    };
    // A query that sees no key (left padding's) gets zeros, as SDPA's safe softmax gives it, not NaN.
    masked.softmax(-1, Kind::Float).nan_to_num(0.0, None, None).to_kind(q.kind()).matmul(&v)
}

impl Model for Gemma {
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        crate::llama::PROJECTIONS
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
            kv_heads: c.num_key_value_heads,
            vocab: c.vocab_size,
            intermediate: c.intermediate_size,
        }
    }

    fn logit_softcap(&self) -> Option<f64> {
        self.final_softcap
    }

    /// As Llama's block keeps, with two more norms (their inputs: the
    /// attention's and the MLP's outputs), GeGLU's GELU output and, with
    /// q/k norms, the projections they normalise. Soft-capped attention
    /// (Gemma 2) keeps its capped scores and probabilities per position
    /// pair instead of SDPA's log-sum-exp. Sliding layers read a mask of
    /// their own beside the global layers'.
    fn activations(&self) -> Activations {
        let c = &self.config;
        let (d, i, heads, kv_heads) = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads);
        let (q, kv) = (heads * c.head_dim, kv_heads * c.head_dim);
        let mut block = vec![
            Saved::compute("attention norm's output", d),
            Saved::compute("rotated query", q),
            Saved::compute("rotated key and value", 2 * kv),
            Saved::compute("attention output", q),
            Saved::compute("attention projection", d),
            Saved::compute("residual sum", d),
            Saved::compute("MLP norm's output", d),
            Saved::compute("gate and up projections", 2 * i),
            Saved::compute("GELU output", i),
            Saved::compute("GeGLU output", i),
            Saved::compute("MLP output", d),
            Saved::fp32("four norms' reciprocal deviation", 4),
            Saved::compute("block output", d),
        ];
        if self.family.qk_norm {
            block.push(Saved::compute("query and key projections", q + kv));
            block.push(Saved::fp32("query and key norms' reciprocal deviation", heads + kv_heads));
        }
        let block_per_position_pair = match self.attn_softcap {
            Some(_) => 2 * heads,
            None => {
                block.push(Saved::fp32("attention's log-sum-exp", heads));
                0
            }
        };
        let bias_per_position_pair = if self.any_sliding() { 2 } else { 0 };
        Activations { block, block_backward: 3 * i, embed: d, bias_per_position_pair, block_per_position_pair }
    }

    /// 6N plus attention's 12 FLOPs per query feature and attended key,
    /// a sliding layer attending to at most its window.
    fn train_flops_per_token(&self, seq: i64) -> f64 {
        let features = self.config.num_attention_heads * self.config.head_dim;
        let window = self.config.sliding_window.unwrap_or(seq);
        let keys: i64 = self.sliding.iter().map(|&sliding| if sliding { seq.min(window) } else { seq }).sum();
        6.0 * self.numel() as f64 + 12.0 * (features * keys) as f64
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let positions = model::decoder_positions(inputs, past);
        let attention_bias = llama::attention_bias(inputs, &positions, past, None, dtype)?;
        let rope = Some(self.global_rope.cos_sin(&positions, dtype));
        let local = match self.any_sliding() {
            false => None,
            true => Some(LocalAttention {
                attention_bias: llama::attention_bias(inputs, &positions, past, self.config.sliding_window, dtype)?,
                rope: Some(self.local_rope.cos_sin(&positions, dtype)),
            }),
        };
        Ok(Context { train, positions, attention_bias, rope, local, auxiliary: Default::default(), experts: None })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, _ctx: &Context) -> Tensor {
        let weight = p.get("embed_tokens.weight");
        // transformers' `embed_scale`: √hidden_size as an fp32 tensor, cast to the weights' dtype.
        let scale = Tensor::scalar_tensor((self.config.hidden_size as f64).sqrt(), (Kind::Float, weight.device())).to_kind(weight.kind());
        Tensor::embedding(weight, &inputs.input_ids, -1, false, false) * scale
    }

    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, layer: usize, cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, _) = x.size3().expect("hidden states are [batch, seq, dim]");
        let (heads, kv_heads, head_dim) = (self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim);
        let (bias, rope) = match (&ctx.local, self.sliding[layer]) {
            (Some(local), true) => (&local.attention_bias, &local.rope),
            _ => (&ctx.attention_bias, &ctx.rope),
        };
        let (cos, signed_sin) = rope.as_ref().expect("Gemma's context has RoPE");
        let h = self.norm(x, p.get("input_layernorm.weight"));
        let split = |t: Tensor, n: i64| t.view([batch, seq, n, head_dim]);
        let [q, k, v] = p.linears(&h, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]);
        let (mut q, mut k) = (split(q, heads), split(k, kv_heads));
        if self.family.qk_norm {
            q = self.norm(&q, p.get("self_attn.q_norm.weight"));
            k = self.norm(&k, p.get("self_attn.k_norm.weight"));
        }
        let q = llama::rotate(&q, cos, signed_sin).transpose(1, 2);
        let mut k = llama::rotate(&k, cos, signed_sin).transpose(1, 2);
        let mut v = split(v, kv_heads).transpose(1, 2);
        if let Some(cache) = cache {
            (k, v) = cache.extend(k, v);
        }
        let attn = match self.attn_softcap {
            Some(cap) => softcapped_attention(&q, &k, &v, bias, self.scale(), cap),
            None => model::scaled_attention(&q, &k, &v, bias, ctx.train, kv_heads != heads, Some(self.scale())),
        };
        let attn = attn.transpose(1, 2).reshape([batch, seq, heads * head_dim]);
        let x = x + self.norm(&p.linear(&attn, "self_attn.o_proj"), p.get("post_attention_layernorm.weight"));
        let h = self.norm(&x, p.get("pre_feedforward_layernorm.weight"));
        let [gate, up] = p.linears(&h, ["mlp.gate_proj", "mlp.up_proj"]);
        let gated = gate.gelu("tanh") * up;
        &x + self.norm(&p.linear(&gated, "mlp.down_proj"), p.get("post_feedforward_layernorm.weight"))
    }

    fn head(&self, p: &Params, x: &Tensor) -> Vec<Tensor> {
        let weight = p.maybe("lm_head.weight").unwrap_or_else(|| p.get("embed_tokens.weight"));
        vec![self.norm(x, p.get("norm.weight")), weight.shallow_clone()]
    }
}

inventory::submit! {
    ModelRegistration {
        model_type: "gemma2",
        summary: "Gemma 2 (GeGLU, (1 + w) RMSNorms around attention and MLP, soft-capped attention and logits, alternating sliding-window layers)",
        build: |c| Ok(Box::new(Gemma::new(c, GEMMA2)?)),
    }
}

inventory::submit! {
    ModelRegistration {
        model_type: "gemma3_text",
        summary: "Gemma 3 text (Gemma 2's block with q/k norms, 5 local : 1 global layers with RoPE bases of their own)",
        build: |c| Ok(Box::new(Gemma::new(c, GEMMA3)?)),
    }
}
