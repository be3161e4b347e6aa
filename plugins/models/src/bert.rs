//! BERT (google-bert/bert-*) for extractive question answering, as
//! transformers' `BertForQuestionAnswering`: word + learned absolute
//! position + token type embeddings, post-LayerNorm bidirectional encoder
//! blocks with an exact-erf GELU MLP, and `qa_outputs`, a Linear(hidden, 2)
//! giving each token's start and end score. A base checkpoint (`BertModel`,
//! `BertForMaskedLM`, `BertForPreTraining`) loads too: `qa_outputs` starts
//! from its init and the pooler and pretraining heads are skipped.

use crate::check;
use anyhow::{bail, Result};
use ft_core::model::{self, Activations, Context, Dims, Init, Inputs, KvCache, Layout, Model, ModelRegistration, ParamSpec, Params, Saved, UnitSpec};
use serde::Deserialize;
use tch::{Kind, Tensor};

/// The defaults are `BertConfig`'s (bert-base's shape aside, which
/// config.json must give).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub intermediate_size: i64,
    #[serde(default = "gelu")]
    pub hidden_act: String,
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f64,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: i64,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: i64,
    #[serde(default = "default_std")]
    pub initializer_range: f64,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The word embedding's padding_idx: padding tokens leave its row's gradient zero.
    #[serde(default = "default_pad")]
    pub pad_token_id: Option<i64>,
    #[serde(default)]
    pub is_decoder: bool,
    /// Labels of a classification head; `qa_outputs` has two (start, end).
    #[serde(default)]
    pub id2label: Option<serde_json::Map<String, serde_json::Value>>,
}

fn gelu() -> String {
    "gelu".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_max_positions() -> i64 {
    512
}
fn default_type_vocab() -> i64 {
    2
}
fn default_std() -> f64 {
    0.02
}
fn default_eps() -> f64 {
    1e-12
}
fn default_pad() -> Option<i64> {
    Some(0)
}

impl Config {
    /// Refuses what the math below does not compute, naming the key.
    fn validate(&self) -> Result<()> {
        check::sizes(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ])?;
        check::layers("num_hidden_layers", self.num_hidden_layers)?;
        check::multiple_of(("hidden_size", self.hidden_size), ("num_attention_heads", self.num_attention_heads))?;
        check::probabilities(&[
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            ("attention_probs_dropout_prob", self.attention_probs_dropout_prob),
        ])?;
        check::positive("layer_norm_eps", self.layer_norm_eps)?;
        check::std("initializer_range", self.initializer_range)?;
        // transformers' "gelu" is the exact erf form; "gelu_new" and the others would differ.
        if self.hidden_act != "gelu" {
            bail!("BERT hidden_act {:?} is not supported (only \"gelu\", the exact erf GELU)", self.hidden_act);
        }
        if let Some(pad) = self.pad_token_id.filter(|pad| !(0..self.vocab_size).contains(pad)) {
            bail!("BERT pad_token_id ({pad}) must be a token id below vocab_size ({})", self.vocab_size);
        }
        if self.is_decoder {
            bail!("BERT with is_decoder (causal self-attention) is not supported: question answering reads the whole context");
        }
        if let Some(labels) = self.id2label.as_ref().filter(|labels| labels.len() != 2) {
            bail!(
                "BERT id2label names {} labels, but the question-answering head has 2 (start, end): \
                 remove id2label and label2id from config.json",
                labels.len()
            );
        }
        Ok(())
    }
}

pub struct Bert {
    config: Config,
    layout: Layout,
}

impl Bert {
    pub fn new(mut hf_config: serde_json::Value) -> Result<Bert> {
        let config: Config = check::parse(&hf_config)?;
        config.validate()?;
        // Whatever head the source checkpoint had, this model (and what `hf::save` writes) is the QA one.
        hf_config["architectures"] = serde_json::json!(["BertForQuestionAnswering"]);
        let (d, normal) = (config.hidden_size, Init::Normal { std: config.initializer_range });
        let layer_norm = |prefix: &str, name: &str| {
            [
                ParamSpec::new(prefix, &format!("{name}.weight"), &[d], Init::Ones),
                ParamSpec::new(prefix, &format!("{name}.bias"), &[d], Init::Zeros),
            ]
        };
        let linear = |prefix: &str, name: &str, out: i64, inp: i64| {
            [
                ParamSpec::new(prefix, &format!("{name}.weight"), &[out, inp], normal),
                ParamSpec::new(prefix, &format!("{name}.bias"), &[out], Init::Zeros),
            ]
        };
        // transformers zeroes the pad_token_id row of the word embeddings at init; `Init` has no
        // such variant, so that row is drawn like the others (fine-tuning starts from a checkpoint).
        let prefix = "bert.embeddings.";
        let mut embed = vec![
            ParamSpec::new(prefix, "word_embeddings.weight", &[config.vocab_size, d], normal),
            ParamSpec::new(prefix, "position_embeddings.weight", &[config.max_position_embeddings, d], normal),
            ParamSpec::new(prefix, "token_type_embeddings.weight", &[config.type_vocab_size, d], normal),
        ];
        embed.extend(layer_norm(prefix, "LayerNorm"));
        let mut units = vec![UnitSpec { name: "embed".into(), params: embed }];
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("bert.encoder.layer.{layer}.");
            let mut params = vec![];
            for name in ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"] {
                params.extend(linear(&prefix, name, d, d));
            }
            params.extend(layer_norm(&prefix, "attention.output.LayerNorm"));
            params.extend(linear(&prefix, "intermediate.dense", config.intermediate_size, d));
            params.extend(linear(&prefix, "output.dense", d, config.intermediate_size));
            params.extend(layer_norm(&prefix, "output.LayerNorm"));
            units.push(UnitSpec { name: format!("block {layer}"), params });
        }
        units.push(UnitSpec { name: "head".into(), params: linear("", "qa_outputs", 2, d).to_vec() });
        let head_unit = units.len() - 1;
        let layout = Layout::new(hf_config, units, 1..head_unit, head_unit);
        Ok(Bert { config, layout })
    }
}

impl Model for Bert {
    /// The MLP has no gate; `output.dense` alone would also name the
    /// attention's output layer, so each short name is exact.
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        &[
            ("q", &["attention.self.query"]),
            ("k", &["attention.self.key"]),
            ("v", &["attention.self.value"]),
            ("o", &["attention.output.dense"]),
            ("up", &["intermediate.dense"]),
            ("down", &["output.dense"]),
        ]
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn head_kind(&self) -> &str {
        model::head::QUESTION_ANSWERING
    }
    fn dims(&self) -> Dims {
        let c = &self.config;
        Dims {
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_attention_heads,
            vocab: c.vocab_size,
            intermediate: c.intermediate_size,
        }
    }

    /// Post-norm: each norm keeps its residual sum, and training drops out
    /// the attention and MLP outputs, keeping a mask each. The embedding's
    /// LayerNorm keeps the summed embeddings besides its output.
    fn activations(&self) -> Activations {
        let dims = self.dims();
        let (d, i) = (dims.hidden, dims.intermediate);
        let mut block = vec![
            Saved::compute("query, key and value", 3 * d),
            Saved::compute("attention output", d),
            Saved::fp32("attention's log-sum-exp", dims.heads),
            Saved::compute("attention residual sum", d),
            Saved::compute("attention norm's output", d),
            Saved::compute("MLP up-projection", i),
            Saved::compute("GELU output", i),
            Saved::compute("MLP residual sum", d),
            Saved::fp32("two norms' mean and reciprocal deviation", 4),
            Saved::compute("block output", d),
        ];
        if self.config.hidden_dropout_prob > 0.0 {
            block.push(Saved::mask("two dropout masks", 2 * d));
        }
        Activations { block, block_backward: 2 * i, embed: 2 * d, bias_per_position_pair: 0, block_per_position_pair: 0 }
    }

    /// A base checkpoint has the encoder but no `qa_outputs`.
    fn initialised_if_missing(&self, hf_name: &str) -> bool {
        hf_name.starts_with("qa_outputs.")
    }

    /// The pooler (`BertModel`) and the pretraining heads (`cls.predictions`,
    /// `cls.seq_relationship`), with or without the "bert." prefix.
    fn ignored_if_unexpected(&self, checkpoint_name: &str) -> bool {
        let name = checkpoint_name.strip_prefix("bert.").unwrap_or(checkpoint_name);
        name.starts_with("pooler.") || name.starts_with("cls.")
    }

    fn max_positions(&self) -> Option<i64> {
        Some(self.config.max_position_embeddings)
    }

    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        if past != 0 {
            bail!("BERT is a bidirectional encoder: it cannot continue from {past} cached positions");
        }
        let input_ids = &inputs.input_ids;
        let seq = input_ids.size()[1];
        if inputs.packed() {
            bail!("BERT reads each window whole: packed rows are for causal language models");
        }
        if seq > self.config.max_position_embeddings {
            bail!("sequence of {seq} tokens is longer than BERT's max_position_embeddings ({})", self.config.max_position_embeddings);
        }
        // Positions 0..seq whatever the padding, as BertEmbeddings slices its position_ids
        // buffer: BERT's inputs are right-padded, so real tokens keep their positions.
        let positions = model::positions(input_ids, 0, None);
        // Padding is hidden from every query as a key; a padded query still attends to the
        // real tokens (as transformers' bidirectional mask does), its output unused.
        let attention_bias = inputs.attention_mask.as_ref().map(|mask| model::padding_bias(mask, dtype));
        Ok(Context { train, positions, attention_bias, rope: None, local: None, auxiliary: Default::default(), experts: None })
    }

    fn embed(&self, p: &Params, inputs: &Inputs, ctx: &Context) -> Tensor {
        // nn.Embedding(padding_idx=pad_token_id), as BertEmbeddings builds it: no gradient reaches the pad row.
        let padding_idx = self.config.pad_token_id.unwrap_or(-1);
        let words = Tensor::embedding(p.get("word_embeddings.weight"), &inputs.input_ids, padding_idx, false, false);
        let segment_table = p.get("token_type_embeddings.weight");
        let segments = match &inputs.token_type_ids {
            Some(segments) => Tensor::embedding(segment_table, segments, -1, false, false),
            // Segment 0 everywhere: its row, broadcast over the batch and positions.
            None => segment_table.get(0),
        };
        let positions = Tensor::embedding(p.get("position_embeddings.weight"), &ctx.positions, -1, false, false);
        // Summed in BertEmbeddings' order.
        let x = words + segments + positions;
        p.layer_norm(&x, "LayerNorm", self.config.layer_norm_eps).dropout(self.config.hidden_dropout_prob, ctx.train)
    }

    /// An encoder keeps no cache: `context` refuses cached positions.
    fn block(&self, p: &Params, x: &Tensor, ctx: &Context, _layer: usize, _cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq, d) = x.size3().expect("hidden states are [batch, seq, dim]");
        let heads = self.config.num_attention_heads;
        let (hidden_dropout, train) = (self.config.hidden_dropout_prob, ctx.train);

        let split_heads = |t: Tensor| t.view([batch, seq, heads, d / heads]).transpose(1, 2);
        let q = split_heads(p.linear(x, "attention.self.query"));
        let k = split_heads(p.linear(x, "attention.self.key"));
        let v = split_heads(p.linear(x, "attention.self.value"));
        // SDPA directly rather than model::attention, which reads "no bias" as causal and
        // has no attention dropout; BERT's attention is bidirectional and drops
        // attention probabilities while training.
        let attention_dropout = if train { self.config.attention_probs_dropout_prob } else { 0.0 };
        let bias = ctx.attention_bias.as_ref();
        let attn = Tensor::scaled_dot_product_attention(&q, &k, &v, bias, attention_dropout, false, None, false);
        let attn = attn.transpose(1, 2).reshape([batch, seq, d]);
        let attn = p.linear(&attn, "attention.output.dense").dropout(hidden_dropout, train);
        let x = p.layer_norm(&(attn + x), "attention.output.LayerNorm", self.config.layer_norm_eps);

        let h = p.linear(&x, "intermediate.dense").gelu("none");
        let h = p.linear(&h, "output.dense").dropout(hidden_dropout, train);
        p.layer_norm(&(h + x), "output.LayerNorm", self.config.layer_norm_eps)
    }

    fn head(&self, p: &Params, x: &Tensor) -> Vec<Tensor> {
        // [batch, seq, 2] → start logits, end logits: transformers' `logits.split(1, dim=-1)`.
        p.linear(x, "qa_outputs").unbind(-1)
    }
}

inventory::submit! {
    ModelRegistration {
        model_type: "bert",
        summary: "BERT for question answering (post-LN encoder, start/end logits)",
        build: |c| Ok(Box::new(Bert::new(c)?)),
    }
}
