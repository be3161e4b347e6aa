//! OPT (facebook/opt-*): learned positions offset by 2, ReLU MLP, pre- or
//! post-LayerNorm (`do_layer_norm_before`), optional project_in/out when the
//! embedding is narrower than the model, LM head tied to the embedding.

use crate::check;
use anyhow::{bail, Result};
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, Model, ModelRegistration, ParamSpec, Params, Saved, UnitSpec};
use serde::Deserialize;
use tch::{Kind, Tensor};

/// OPT's learned position table starts at row 2 (rows 0 and 1 are legacy padding slots).
const POSITION_OFFSET: i64 = 2;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: i64,
    pub ffn_dim: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub vocab_size: i64,
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub word_embed_proj_dim: Option<i64>,
    #[serde(default = "yes")]
    pub do_layer_norm_before: bool,
    #[serde(default, rename = "_remove_final_layer_norm")]
    pub remove_final_layer_norm: bool,
    #[serde(default = "yes")]
    pub enable_bias: bool,
    #[serde(default = "yes")]
    pub layer_norm_elementwise_affine: bool,
    #[serde(default = "relu")]
    pub activation_function: String,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default = "default_std")]
    pub init_std: f64,
}

fn yes() -> bool {
    true
}
fn relu() -> String {
    "relu".into()
}
fn default_std() -> f64 {
    0.02
}

impl Config {
    /// Refuses what the math below does not compute, naming the key.
    fn validate(&self) -> Result<()> {
        check::sizes(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("ffn_dim", self.ffn_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        if let Some(proj) = self.word_embed_proj_dim {
            check::sizes(&[("word_embed_proj_dim", proj)])?;
        }
        check::layers("num_hidden_layers", self.num_hidden_layers)?;
        check::multiple_of(("hidden_size", self.hidden_size), ("num_attention_heads", self.num_attention_heads))?;
        check::probabilities(&[("dropout", self.dropout)])?;
        check::std("init_std", self.init_std)?;
        if self.activation_function != "relu" {
            bail!("OPT activation_function {:?} is not supported (only relu)", self.activation_function);
        }
        if !self.enable_bias || !self.layer_norm_elementwise_affine {
            bail!("OPT without biases or LayerNorm affine parameters is not supported");
        }
        Ok(())
    }
}

pub struct Opt {
    config: Config,
    layout: Layout,
}

impl Opt {
    pub fn new(hf_config: serde_json::Value) -> Result<Opt> {
        let config: Config = check::parse(&hf_config)?;
        config.validate()?;
        let (d, std) = (config.hidden_size, config.init_std);
        let proj = config.word_embed_proj_dim.unwrap_or(d);
        let normal = Init::Normal { std };
        let prefix = "model.decoder.";
        let norm = |prefix: &str, name: &str| {
            vec![
                ParamSpec::new(prefix, &format!("{name}.weight"), &[d], Init::Ones),
                ParamSpec::new(prefix, &format!("{name}.bias"), &[d], Init::Zeros),
            ]
        };
        let mut embed = vec![
            ParamSpec::new(prefix, "embed_tokens.weight", &[config.vocab_size, proj], normal),
            ParamSpec::new(prefix, "embed_positions.weight", &[config.max_position_embeddings + POSITION_OFFSET, d], normal),
        ];
        if proj != d {
            embed.push(ParamSpec::new(prefix, "project_in.weight", &[d, proj], normal));
            embed.push(ParamSpec::new(prefix, "project_out.weight", &[proj, d], normal));
        }
        if config.do_layer_norm_before && !config.remove_final_layer_norm {
            embed.extend(norm(prefix, "final_layer_norm"));
        }
        let mut units = vec![UnitSpec { name: "embed+head".into(), params: embed }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("{prefix}layers.{layer}.");
            let mut params = vec![];
            for (name, out, inp) in [
                ("self_attn.q_proj", d, d),
                ("self_attn.k_proj", d, d),
                ("self_attn.v_proj", d, d),
                ("self_attn.out_proj", d, d),
                ("fc1", config.ffn_dim, d),
                ("fc2", d, config.ffn_dim),
            ] {
                params.push(ParamSpec::new(&prefix, &format!("{name}.weight"), &[out, inp], normal));
                params.push(ParamSpec::new(&prefix, &format!("{name}.bias"), &[out], Init::Zeros));
            }
            params.extend(norm(&prefix, "self_attn_layer_norm"));
            params.extend(norm(&prefix, "final_layer_norm"));
            units.push(UnitSpec { name: format!("block {layer}"), params });
        }
        // The embedding unit runs again as the head: the LM head is the embedding.
        let layout = Layout::new(hf_config, units, 1..config.num_hidden_layers as usize + 1, 0);
        Ok(Opt { config, layout })
    }
}

impl Model for Opt {
    /// OPT's MLP has no gate.
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        &[
            ("q", &["self_attn.q_proj"]),
            ("k", &["self_attn.k_proj"]),
            ("v", &["self_attn.v_proj"]),
            ("o", &["self_attn.out_proj"]),
            ("up", &["fc1"]),
            ("down", &["fc2"]),
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
            kv_heads: c.num_attention_heads,
            vocab: c.vocab_size,
            intermediate: c.ffn_dim,
        }
    }

    fn max_positions(&self) -> Option<i64> {
        Some(self.config.max_position_embeddings)
    }

    /// ReLU keeps only its output (which fc2 reads too); training drops out
    /// the attention and MLP outputs, keeping a mask each.
    fn activations(&self) -> Activations {
        let dims = self.dims();
        let (d, i) = (dims.hidden, dims.intermediate);
        let mut block = vec![
            Saved::compute("attention norm's output", d),
            Saved::compute("query, key and value", 3 * d),
            Saved::compute("attention output", d),
            Saved::fp32("attention's log-sum-exp", dims.heads),
            Saved::compute("residual sum", d),
            Saved::compute("MLP norm's output", d),
            Saved::compute("ReLU output", i),
            Saved::fp32("two norms' mean and reciprocal deviation", 4),
            Saved::compute("block output", d),
        ];
        if self.config.dropout > 0.0 {
            block.push(Saved::mask("two dropout masks", 2 * d));
        }
        Activations { block, block_backward: 2 * i, embed: d, bias_per_position_pair: 0, block_per_position_pair: 0 }
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        let longest = past + inputs.input_ids.size()[1];
        if longest > self.config.max_position_embeddings {
            bail!("sequence of {longest} tokens is longer than OPT's max_position_embeddings ({})", self.config.max_position_embeddings);
        }
        let positions = model::decoder_positions(inputs, past);
        // Without padding or packing, plain causal attention (no materialised mask).
        let attention_bias = match inputs.attention_mask.is_some() || inputs.packed() {
            true => Some(model::decoder_mask_bias(inputs, past, dtype)?),
            false => None,
        };
        Ok(Context { train, positions, attention_bias, rope: None, local: None, auxiliary: Default::default(), experts: None })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, ctx: &Context) -> Tensor {
        let mut x = Tensor::embedding(p.get("embed_tokens.weight"), &inputs.input_ids, -1, false, false);
        if let Some(project_in) = p.maybe("project_in.weight") {
            x = x.linear::<Tensor>(project_in, None);
        }
        let positions = Tensor::embedding(p.get("embed_positions.weight"), &(&ctx.positions + POSITION_OFFSET), -1, false, false);
        x + positions
    }

    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, _layer: usize, cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, d) = x.size3().expect("hidden states are [batch, seq, dim]");
        let heads = self.config.num_attention_heads;
        let pre_norm = self.config.do_layer_norm_before;
        let (dropout, train) = (self.config.dropout, ctx.train);

        let h = if pre_norm { p.layer_norm(x, "self_attn_layer_norm", 1e-5) } else { x.shallow_clone() };
        let split_heads = |t: Tensor| t.view([batch, seq, heads, d / heads]).transpose(1, 2);
        let [q, mut k, mut v] = p.linears(&h, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]).map(split_heads);
        if let Some(cache) = cache {
            (k, v) = cache.extend(k, v);
        }
        let attn = model::attention(&q, &k, &v, ctx, false).transpose(1, 2).reshape([batch, seq, d]);
        let attn = p.linear(&attn, "self_attn.out_proj").dropout(dropout, train);
        let mut x = x + attn;
        if !pre_norm {
            x = p.layer_norm(&x, "self_attn_layer_norm", 1e-5);
        }

        let h = if pre_norm { p.layer_norm(&x, "final_layer_norm", 1e-5) } else { x.shallow_clone() };
        let h = p.linear(&p.linear(&h, "fc1").relu(), "fc2").dropout(dropout, train);
        let x = x + h;
        if pre_norm {
            x
        } else {
            p.layer_norm(&x, "final_layer_norm", 1e-5)
        }
    }

    fn head(&self, p: &Params, x: &Tensor) -> Vec<Tensor> {
        let mut h = match p.maybe("final_layer_norm.weight") {
            Some(_) => p.layer_norm(x, "final_layer_norm", 1e-5),
            None => x.shallow_clone(),
        };
        if let Some(project_out) = p.maybe("project_out.weight") {
            h = h.linear::<Tensor>(project_out, None);
        }
        vec![h, p.get("embed_tokens.weight").shallow_clone()]
    }
}

inventory::submit! {
    ModelRegistration { model_type: "opt", summary: "OPT (learned positions, ReLU, tied head)", build: |c| Ok(Box::new(Opt::new(c)?)) }
}
