//! What a model is to `ft`: named units of parameters (the sharding
//! granularity) and the math of each stage. A model owns no parameter
//! storage: whoever runs it (a sharding strategy, `ft generate`) owns the
//! storage and hands the model views before each stage, so every strategy
//! works with every model.
//!
//! A forward pass runs `stages()` in order. A unit may serve several stages:
//! a tied embedding unit runs first (embed) and last (head), so its gradient
//! accumulates over both uses.

use anyhow::{bail, ensure, Result};
use crate::kernels::Kernels;
use ft_sys::float8::Float8;
use tch::{Device, Kind, Tensor};

/// How a parameter is initialised when no checkpoint provides it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    /// U(−bound, bound): LoRA's A, as `kaiming_uniform_(a=√5)` draws it.
    Uniform { bound: f64 },
    Zeros,
    Ones,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Tensor name in the Hugging Face checkpoint, e.g. `transformer.h.3.mlp.dense_4h_to_h.weight`.
    pub hf_name: String,
    /// Name inside the unit, what the model's math asks for, e.g. `mlp.dense_4h_to_h.weight`.
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
}

impl ParamSpec {
    pub fn new(prefix: &str, name: &str, shape: &[i64], init: Init) -> ParamSpec {
        ParamSpec { hf_name: format!("{prefix}{name}"), name: name.into(), shape: shape.to_vec(), init }
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// A fresh tensor as `init` says, drawn from tch's global generator.
    pub fn initial(&self, dtype: Kind, device: Device) -> Tensor {
        let options = (Kind::Float, device);
        let tensor = match self.init {
            Init::Normal { std } => Tensor::randn(&self.shape, options) * std,
            Init::Uniform { bound } => Tensor::rand(&self.shape, options) * (2.0 * bound) - bound,
            Init::Zeros => Tensor::zeros(&self.shape, options),
            Init::Ones => Tensor::ones(&self.shape, options),
        };
        tensor.to_kind(dtype)
    }
}

/// A group of parameters gathered, run and reduced together (embeddings,
/// one transformer block, the final norm and head).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

impl UnitSpec {
    pub fn numel(&self) -> i64 {
        self.params.iter().map(ParamSpec::numel).sum()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageKind {
    /// Token ids → hidden states.
    Embed,
    /// Hidden states → hidden states (one transformer block).
    Block,
    /// Hidden states → normalised hidden states and the LM head's weight.
    Head,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub unit: usize,
    pub kind: StageKind,
    /// The unit holding this stage's low-rank adapters, if it has any (`lora.rs`).
    pub adapter: Option<usize>,
    /// A mixture of experts' sparse layer: the units holding its experts'
    /// fused `gate_up_proj` and `down_proj`, one parameter each whose rows
    /// are the experts (what expert parallelism splits over ranks), whose
    /// parameters join the stage's.
    pub experts: Option<[usize; 2]>,
}

impl Stage {
    /// The units whose parameters the stage computes with, its adapters' apart: its own, then its experts'.
    pub fn units(&self) -> impl Iterator<Item = usize> {
        std::iter::once(self.unit).chain(self.experts.into_iter().flatten())
    }
}

/// How adapters join the linear layers they target: `W x + scale · B A dropout(x)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterScaling {
    /// LoRA's alpha / r.
    pub scale: f64,
    /// Dropout on the adapter's input while training.
    pub dropout: f64,
}

/// A stage's adapters: `{module}.lora_A.weight` and `{module}.lora_B.weight` per targeted linear layer.
struct Adapters<'a> {
    params: Params<'a>,
    scaling: AdapterScaling,
    train: bool,
}

impl Adapters<'_> {
    /// Whether dropout applies to the adapters' input (training with
    /// dropout): their share is then a node of its own, added after.
    fn drops_out(&self) -> bool {
        self.train && self.scaling.dropout > 0.0
    }

    /// The adapter's share of linear layer `name` under dropout
    /// ([`Self::drops_out`]): `scale · (dropout(x)·Aᵀ)·Bᵀ`.
    fn delta(&self, x: &Tensor, a: &Tensor, name: &str) -> Tensor {
        let b = self.params.get(&format!("{name}.lora_B.weight"));
        let AdapterScaling { scale, dropout } = self.scaling;
        (x.dropout(dropout, true).linear::<&Tensor>(a, None) * scale).linear::<&Tensor>(b, None)
    }
}

/// An adapter on a fused expert parameter [E, N, K] (`Params::expert_adapter`):
/// expert e's GEMM gains `scale · (x·A[e]ᵀ)·B[e]ᵀ`, the update
/// `scale · B[e]·A[e]` peft adds to W[e], never formed.
pub struct ExpertAdapter {
    /// [E, r, K].
    pub a: Tensor,
    /// [E, N, r].
    pub b: Tensor,
    pub scale: f64,
}

impl ExpertAdapter {
    /// The adapters of experts `start..start + len` (an expert-parallel rank's).
    pub fn rows(&self, start: i64, len: i64) -> ExpertAdapter {
        ExpertAdapter { a: self.a.narrow(0, start, len), b: self.b.narrow(0, start, len), scale: self.scale }
    }
}

/// Which linear layers run in float8 (`Params::linear`): every block layer
/// whose widths are multiples of 16 (any layer, emulated) in `float8`'s
/// recipe, except those whose weight shape [out, in] `kept` lists, which
/// stay in the compute dtype (float8 is slower for them).
#[derive(Debug, Clone)]
pub struct Float8Layers {
    pub float8: Float8,
    pub kept: std::collections::BTreeSet<[i64; 2]>,
}

impl Float8Layers {
    /// Every layer float8 can run.
    pub fn all(float8: Float8) -> Float8Layers {
        Float8Layers { float8, kept: Default::default() }
    }

    /// Whether the layer of `weight` runs in float8.
    pub fn runs(&self, weight: &Tensor) -> bool {
        self.runs_shape(&weight.size())
    }

    /// Whether a layer of weight shape `shape` runs in float8.
    pub fn runs_shape(&self, shape: &[i64]) -> bool {
        let aligned = self.float8.emulate || shape.iter().all(|width| width % 16 == 0);
        aligned && !(shape.len() == 2 && self.kept.contains(&[shape[0], shape[1]]))
    }
}

/// The tensors of one unit, looked up by their in-unit name.
pub struct Params<'a> {
    spec: &'a UnitSpec,
    tensors: &'a [Tensor],
    adapters: Option<Box<Adapters<'a>>>,
    /// `linear`'s GEMMs in float8 (`ft_sys::float8`); None: in the tensors' dtype.
    float8: Option<&'a Float8Layers>,
    /// Another unit's parameters looked up after these (a stage's experts).
    joined: Option<Box<Params<'a>>>,
}

/// bf16 and fp16 matrices on a CPU: ATen multiplies them in oneDNN only
/// with AVX-512, elsewhere one dot product at a time (`cpublas_gemm_impl`:
/// the demo BLOOM's bf16 step took 6 times its fp32 step on a 2-core AVX2
/// EPYC). [`linear`] and [`matmul`] run them in fp32 over the exactly widened
/// operands and round the product once to its kind, as ATen's own reduced
/// GEMM accumulates in fp32 and rounds once (in another order).
fn widened_on_cpu(x: &Tensor) -> Option<Kind> {
    (x.device() == Device::Cpu && matches!(x.kind(), Kind::BFloat16 | Kind::Half)).then(|| x.kind())
}

/// `x·wᵀ + b`, ATen's `linear` ([`widened_on_cpu`] on a CPU).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    match widened_on_cpu(x) {
        Some(kind) => x.to_kind(Kind::Float).linear(&w.to_kind(Kind::Float), b.map(|b| b.to_kind(Kind::Float)).as_ref()).to_kind(kind),
        None => x.linear(w, b),
    }
}

/// `a·b`, ATen's `matmul` ([`widened_on_cpu`] on a CPU).
pub fn matmul(a: &Tensor, b: &Tensor) -> Tensor {
    match widened_on_cpu(a) {
        Some(kind) => a.to_kind(Kind::Float).matmul(&b.to_kind(Kind::Float)).to_kind(kind),
        None => a.matmul(b),
    }
}

impl<'a> Params<'a> {
    pub fn new(spec: &'a UnitSpec, tensors: &'a [Tensor]) -> Params<'a> {
        assert_eq!(spec.params.len(), tensors.len(), "unit {} needs one tensor per parameter", spec.name);
        Params { spec, tensors, adapters: None, float8: None, joined: None }
    }

    /// These parameters and, after them, `other`'s (another unit's, the same stage's).
    pub fn with_joined(self, other: Params<'a>) -> Params<'a> {
        let joined = match self.joined {
            Some(joined) => joined.with_joined(other),
            None => other,
        };
        Params { joined: Some(Box::new(joined)), ..self }
    }

    /// These parameters with `linear`'s GEMMs in float8 as `float8` says.
    pub fn with_float8(self, float8: Option<&'a Float8Layers>) -> Params<'a> {
        Params { float8, ..self }
    }

    /// These parameters with a stage's adapters, which `linear` adds to the
    /// layers they name; their dropout acts only when `train`.
    pub fn with_adapters(self, adapters: Params<'a>, scaling: AdapterScaling, train: bool) -> Params<'a> {
        Params { adapters: Some(Box::new(Adapters { params: adapters, scaling, train })), ..self }
    }

    /// Panics on a name the unit does not declare: that is a bug in the model file.
    pub fn get(&self, name: &str) -> &'a Tensor {
        self.maybe(name).unwrap_or_else(|| panic!("unit {} has no parameter {name}", self.spec.name))
    }

    pub fn maybe(&self, name: &str) -> Option<&'a Tensor> {
        match self.spec.params.iter().position(|p| p.name == name) {
            Some(i) => Some(&self.tensors[i]),
            None => self.joined.as_ref().and_then(|joined| joined.maybe(name)),
        }
    }

    /// The low-rank update of fused expert parameter `name` ([E, N, K]:
    /// expert e's GEMM is x·W[e]ᵀ) when an adapter targets it (LoRA's
    /// `experts` target), for the experts' GEMMs to add; `experts` is the
    /// layer's E (an expert-parallel rank's `name` holds only its rows;
    /// `ExpertAdapter::rows` takes theirs).
    pub fn expert_adapter(&self, name: &str, experts: i64) -> Option<ExpertAdapter> {
        let adapters = self.adapters.as_ref()?;
        let a = adapters.params.maybe(&format!("{name}.lora_A.weight"))?;
        let b = adapters.params.get(&format!("{name}.lora_B.weight"));
        let (a, b) = crate::lora::expert_factors(a, b, experts);
        Some(ExpertAdapter { a, b, scale: adapters.scaling.scale })
    }

    /// `x·Wᵀ + b` with `{name}.weight` and, when the unit has one,
    /// `{name}.bias`; plus `scale · (dropout(x)·Aᵀ)·Bᵀ` when an adapter
    /// targets the layer (scaled at rank r, the narrowest point). Without
    /// dropout that is one autograd node (`ft_sys::lora_linear`) whose
    /// GEMMs accumulate the adapter's share instead of adding it after.
    /// Under float8 (`with_float8`), x·Wᵀ's GEMMs — forward and both
    /// backward — run in float8 (`ft_sys::float8::linear`, with an adapter
    /// and no dropout `lora_linear`: one node again) and the bias is added
    /// after in the output's dtype, as torchao's `Float8Linear` adds it; a layer whose widths are not multiples
    /// of 16, which float8 GEMMs need, stays in the compute dtype unless
    /// emulated (torchao's auto-filter skips such layers too), as does one
    /// whose shape `Float8Layers::kept` lists.
    pub fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let (weight, bias) = (self.get(&format!("{name}.weight")), self.maybe(&format!("{name}.bias")));
        let adapter = self.adapters.as_ref().and_then(|adapters| Some((adapters, adapters.params.maybe(&format!("{name}.lora_A.weight"))?)));
        if let Some(float8) = self.float8.filter(|layers| layers.runs(weight)).map(|layers| layers.float8) {
            let layer = ft_sys::float8::layer_id(&self.spec.name, name);
            let fused_casts = Kernels::loaded(x.device());
            let out = match adapter {
                Some((adapters, a)) if !adapters.drops_out() => {
                    let b = adapters.params.get(&format!("{name}.lora_B.weight"));
                    ft_sys::float8::lora_linear(x, weight, a, b, adapters.scaling.scale, float8, fused_casts, layer)
                }
                _ => ft_sys::float8::linear(x, weight, float8, fused_casts, layer),
            };
            let out = out.unwrap_or_else(|e| panic!("float8 linear {name}: {e}"));
            let out = match bias {
                Some(bias) => out + bias.to_kind(x.kind()),
                None => out,
            };
            return match adapter {
                Some((adapters, a)) if adapters.drops_out() => out + adapters.delta(x, a, name),
                _ => out,
            };
        }
        // ft's kernel sums the bias gradient where it serves (a GPU, fp32 or bf16).
        let fused = bias.is_some_and(|b| matches!(b.kind(), Kind::Float | Kind::BFloat16)) && Kernels::loaded(x.device());
        let Some((adapters, a)) = adapter else {
            return match bias {
                Some(bias) if fused => ft_sys::bias_linear(x, weight, bias).unwrap_or_else(|e| panic!("linear {name}: {e}")),
                _ => linear(x, weight, bias),
            };
        };
        if adapters.drops_out() {
            return linear(x, weight, bias) + adapters.delta(x, a, name);
        }
        let b = adapters.params.get(&format!("{name}.lora_B.weight"));
        ft_sys::lora_linear(x, weight, bias, a, b, adapters.scaling.scale, fused).unwrap_or_else(|e| panic!("LoRA linear {name}: {e}"))
    }

    /// The linear layers `names` over the same `x` (`linear` each), from
    /// one GEMM where [`Self::joined_linear`] can run them as one: each
    /// output then a view of its columns.
    pub fn linears<const N: usize>(&self, x: &Tensor, names: [&str; N]) -> [Tensor; N] {
        let Some(joined) = self.joined_linear(x, &names) else {
            return names.map(|name| self.linear(x, name));
        };
        let mut start = 0;
        names.map(|name| {
            let width = self.get(&format!("{name}.weight")).size()[0];
            start += width;
            joined.narrow(-1, start - width, width)
        })
    }

    /// The outputs of the linear layers `names` over the same `x`, side by
    /// side on the last dimension, from one GEMM over their weights as one
    /// matrix — where no gradient is taken, no adapter or float8 changes
    /// their GEMMs, and their weights (and biases, if every one has one)
    /// lie one after another in one buffer, as a unit's flat buffer lays
    /// its matrices out: a view, nothing copied. None otherwise. Decoding
    /// runs a few rows a step, where each GEMM is bound by its launch and
    /// latency more than its bytes: q/k/v and gate/up joined ran a
    /// Qwen2.5-1.5B step's GEMMs in 1.18 ms instead of 1.50 on an H200
    /// (bench/results/2026-11-28-h200-gemm-choices.md).
    pub fn joined_linear(&self, x: &Tensor, names: &[&str]) -> Option<Tensor> {
        if self.adapters.is_some() || self.float8.is_some() || ft_sys::grad_enabled() {
            return None;
        }
        let weights: Vec<&Tensor> = names.iter().map(|name| self.get(&format!("{name}.weight"))).collect();
        let biases: Vec<Option<&Tensor>> = names.iter().map(|name| self.maybe(&format!("{name}.bias"))).collect();
        let bias = match biases.iter().all(Option::is_none) {
            true => None,
            // Every layer's bias, or none: one layer without one stays apart.
            false => Some(adjacent(&biases.into_iter().collect::<Option<Vec<_>>>()?)?),
        };
        Some(linear(x, &adjacent(&weights)?, bias.as_ref()))
    }

    /// LayerNorm over the last dimension with `{name}.weight` and `{name}.bias`.
    /// On a GPU where ft's kernels load, the weight's and bias's gradients
    /// come from ft's kernel (`ft_sys::layer_norm`).
    pub fn layer_norm(&self, x: &Tensor, name: &str, eps: f64) -> Tensor {
        let (weight, bias) = (self.get(&format!("{name}.weight")), self.get(&format!("{name}.bias")));
        let same = weight.kind() == x.kind() && bias.kind() == x.kind();
        if same && matches!(x.kind(), Kind::Float | Kind::BFloat16) && Kernels::loaded(x.device()) {
            return ft_sys::layer_norm(x, weight, bias, eps).unwrap_or_else(|e| panic!("LayerNorm {name}: {e}"));
        }
        x.layer_norm(weight.size(), Some(weight), Some(bias), eps, true)
    }
}

/// `tensors` as one tensor along their first dimension — a view — when
/// each starts where the one before it ends in one storage (contiguous,
/// one kind and device, the same other dimensions); None otherwise.
fn adjacent(tensors: &[&Tensor]) -> Option<Tensor> {
    let first = tensors.first()?;
    let (kind, device, dims) = (first.kind(), first.device(), first.size());
    let trailing = &dims[1..];
    let mut next = first.data_ptr() as usize;
    for t in tensors {
        if !t.is_contiguous() || t.kind() != kind || t.device() != device || &t.size()[1..] != trailing || t.data_ptr() as usize != next {
            return None;
        }
        next += t.numel() * kind.elt_size_in_bytes();
    }
    let mut size = dims.clone();
    size[0] = tensors.iter().map(|t| t.size()[0]).sum();
    // Adjacent allocations of separate storages fail as_strided's bounds check.
    first.f_as_strided(size.as_slice(), first.stride().as_slice(), None).ok()
}

/// A batch's inputs, each [batch, seq] of int64.
pub struct Inputs {
    pub input_ids: Tensor,
    /// 1 for real tokens, 0 for padding, over the cached and the new
    /// positions ([batch, past+seq]). None: no position attends to padding
    /// (no padding, or right padding under a causal mask).
    pub attention_mask: Option<Tensor>,
    /// Each token's segment (BERT's token_type_ids); None: segment 0 everywhere.
    pub token_type_ids: Option<Tensor>,
    /// Packed rows ([batch, seq]): which example of its row each token
    /// belongs to, counting from 0 along the row (padding after the last
    /// example is an example of its own). A decoder restarts positions at
    /// each example and keeps attention inside it, so a packed row computes
    /// what its examples would alone. None: a row is one example.
    pub documents: Option<Tensor>,
    /// Examples that share a prefix ([batch, seq]; a preference pair's
    /// prompt, computed once for both completions): 0 for a token of its
    /// example's shared prefix, b > 0 for one of its b-th continuation. A
    /// continuation's tokens see the prefix and their own continuation
    /// only, at positions that follow the prefix's, so each continuation
    /// computes what prefix + continuation would alone. None: no branches.
    pub branches: Option<Tensor>,
    /// 1 for real tokens, 0 for padding ([batch, seq]), where the batch is
    /// padded but `attention_mask` is None (right padding, which a causal
    /// mask already hides from attention): what counts tokens rather than
    /// attends to them (a router's load statistics) skips padding. None:
    /// `attention_mask` says, or nothing is padding.
    pub token_mask: Option<Tensor>,
}

impl Inputs {
    /// Token ids alone: no padding mask, one segment, one example a row.
    pub fn ids(input_ids: &Tensor) -> Inputs {
        Inputs { input_ids: input_ids.shallow_clone(), attention_mask: None, token_type_ids: None, documents: None, branches: None, token_mask: None }
    }

    /// Which of the new tokens are real ([batch, seq], 1 or 0): `token_mask`,
    /// else the attention mask's last `seq` positions; None: all of them.
    pub fn real_tokens(&self) -> Option<Tensor> {
        let seq = self.input_ids.size()[1];
        self.token_mask.as_ref().map(Tensor::shallow_clone).or_else(|| self.attention_mask.as_ref().map(|mask| mask.narrow(1, mask.size()[1] - seq, seq)))
    }

    /// Whether a row holds more than one sequence (packed examples or branches).
    pub fn packed(&self) -> bool {
        self.documents.is_some() || self.branches.is_some()
    }
}

/// Checks token ids a user gives a model (`ft forward`'s rows, prompts to
/// continue by `generated` tokens) before any reaches a kernel, where a
/// bad one aborts inside libtorch ("index out of range in self"): no row is
/// empty, every id is a row of the embedding (0 to vocab_size − 1), and no
/// row runs past the model's learned positions.
pub fn check_token_ids(model: &dyn Model, rows: &[Vec<i64>], generated: usize) -> Result<()> {
    let (vocab, model_type) = (model.dims().vocab, model.model_type());
    for (r, row) in rows.iter().enumerate() {
        ensure!(!row.is_empty(), "row {r} of the token ids is empty: give at least one token id");
        if let Some((position, id)) = row.iter().enumerate().find(|(_, id)| !(0..vocab).contains(*id)) {
            bail!("token id {id} (row {r}, position {position}) is not in this {model_type} model's vocabulary: ids run from 0 to {} (vocab_size {vocab} in its config.json)", vocab - 1);
        }
        // The last generated token is never run through the model.
        let positions = row.len().saturating_add(generated.saturating_sub(1));
        if let Some(learned) = model.max_positions().filter(|&learned| i64::try_from(positions).map_or(true, |positions| positions > learned)) {
            let and_generated = if generated > 0 { format!(" and {generated} tokens generated after them") } else { String::new() };
            bail!("row {r}'s {} token ids{and_generated} take {positions} positions, more than this {model_type} model's max_position_embeddings ({learned}, in its config.json)", row.len());
        }
    }
    Ok(())
}

/// Rows of token ids as one [batch, seq] batch on `device`, each checked by
/// [`check_token_ids`]: at least one row, and every row of the same length.
pub fn token_batch(model: &dyn Model, rows: &[Vec<i64>], device: Device) -> Result<Tensor> {
    ensure!(!rows.is_empty(), "no rows of token ids: give at least one row");
    check_token_ids(model, rows, 0)?;
    if let Some((r, row)) = rows.iter().enumerate().find(|(_, row)| row.len() != rows[0].len()) {
        bail!("row {r} has {} token ids and row 0 has {}: the rows of a batch must all be of one length", row.len(), rows[0].len());
    }
    Ok(Tensor::from_slice2(rows).to_device(device))
}

/// Per-batch inputs every block needs, built once by `Model::context`.
pub struct Context {
    /// Dropout is active.
    pub train: bool,
    /// Absolute position of every token, [batch, seq] (counts the KV cache).
    pub positions: Tensor,
    /// What the sliding-window layers of a model whose layers alternate
    /// (Gemma's local and global attention) use in place of `attention_bias`
    /// and `rope`; None where every layer attends alike.
    pub local: Option<LocalAttention>,
    /// Additive attention bias broadcastable to [batch, heads, seq, keys], in the
    /// compute dtype, with the causal and padding masks folded in; `None` means
    /// plain causal attention (SDPA's `is_causal`, no materialised mask).
    pub attention_bias: Option<Tensor>,
    /// RoPE's cos and sign-folded sin (−sin on the first half of head_dim,
    /// +sin on the second), [batch, seq, 1, head_dim], when the model rotates:
    /// a rotation is x·cos + roll(x, head_dim/2)·signed_sin.
    pub rope: Option<(Tensor, Tensor)>,
    /// What a block's auxiliary loss counts, and the term it recorded.
    pub auxiliary: Auxiliary,
    /// Expert parallelism, when the trainer runs it: a mixture of experts'
    /// blocks hold only their rank's experts and exchange tokens through it.
    pub experts: Option<std::rc::Rc<dyn ExpertExchange>>,
}

/// A mixture of experts' routing, as the engine and `ft plan` count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    /// Experts in each sparse layer.
    pub count: i64,
    /// Experts each token goes through (top-k).
    pub per_token: i64,
    /// Layers whose MLP is the experts.
    pub sparse_layers: i64,
}

/// Expert parallelism as a mixture of experts' block sees it: this rank
/// holds experts `rank·E/size .. (rank+1)·E/size` of each sparse layer
/// (its experts units' rows) and exchanges rows with the other ranks of
/// its expert group (`Context::experts`; the trainer's, through the run's
/// communication hook).
pub trait ExpertExchange {
    /// This rank's place in its expert group.
    fn rank(&self) -> usize;
    /// The ranks of the group.
    fn size(&self) -> usize;
    /// `rows`' first `sent[0]` rows to member 0, the next `sent[1]` to
    /// member 1, …; returns the rows received, `received[j]` from member j
    /// in member order. Differentiable: backward sends the gradient of
    /// what was received back the way it came.
    fn exchange(&self, rows: &Tensor, sent: &[i64], received: &[i64]) -> Result<Tensor>;
}

/// A block's share of an auxiliary loss (a mixture of experts' load
/// balancing): linear in `values`, which carry the gradient, with weights
/// that `Model::auxiliary_loss` makes from every recording block's
/// `statistics`, summed over the forward's blocks and the data-parallel
/// ranks. So a block's share of the gradient is known once forward has
/// run every block, and `train/step.rs` feeds it to the block's backward
/// beside its output's gradient.
pub struct AuxiliaryTerm {
    /// Differentiable, [n].
    pub values: Tensor,
    /// Without gradient, [m], summable over blocks and ranks (a router's tokens per expert, and the tokens counted).
    pub statistics: Tensor,
}

/// How a model's blocks' auxiliary terms make a loss (`Model::auxiliary_loss`).
pub trait AuxiliaryLoss: Send + Sync {
    /// Each recording block's weights ([blocks, n]) from their statistics
    /// ([blocks, m], in block order, summed over the data-parallel ranks):
    /// the loss is Σ_b ⟨weights_b, values_b⟩, before `coefficient`.
    fn weights(&self, statistics: &Tensor) -> Tensor;
    /// What the loss is multiplied by where it joins the objective's.
    fn coefficient(&self) -> f64;
    /// Figures for a step's log from its statistics ([blocks, m], summed
    /// over the step's micro-batches and the ranks), each a 0-dim tensor
    /// read only when the step is logged (a router's load per layer).
    fn figures(&self, _statistics: &Tensor) -> Vec<(String, Tensor)> {
        vec![]
    }
}

/// Per batch: which tokens a block's auxiliary statistics count, and the
/// term the last block recorded (taken by whoever runs the blocks).
#[derive(Default)]
pub struct Auxiliary {
    /// 1 for real tokens, 0 for padding, [batch·seq] (None: every token).
    pub real_tokens: Option<Tensor>,
    term: std::sync::Mutex<Option<AuxiliaryTerm>>,
}

impl Auxiliary {
    /// For a batch of `inputs` (its real tokens, `Inputs::real_tokens`).
    pub fn of(inputs: &Inputs) -> Auxiliary {
        Auxiliary { real_tokens: inputs.real_tokens().map(|mask| mask.reshape([-1])), term: Default::default() }
    }

    /// Records the running block's term (a block records at most one).
    pub fn record(&self, term: AuxiliaryTerm) {
        *self.term.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(term);
    }

    /// The term the block that just ran recorded, if it did.
    pub fn take(&self) -> Option<AuxiliaryTerm> {
        self.term.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take()
    }
}

/// The attention bias and RoPE of a model's sliding-window layers, beside
/// its global layers' in [`Context`].
pub struct LocalAttention {
    pub attention_bias: Option<Tensor>,
    pub rope: Option<(Tensor, Tensor)>,
}

/// Keys and values of earlier positions for one block, [batch, kv_heads,
/// len, head_dim], in buffers with room for `capacity` positions, so a
/// decoding step writes its key and value in place instead of copying the
/// whole cache (it grows by doubling past the capacity).
#[derive(Default)]
pub struct KvCache {
    buffers: Option<(Tensor, Tensor)>,
    len: i64,
    capacity: i64,
    /// Set by `fix_shapes`: the slot the next position goes to.
    slot: Option<Tensor>,
}

impl KvCache {
    /// A cache that will hold up to `positions` positions without growing.
    pub fn with_capacity(positions: i64) -> KvCache {
        KvCache { buffers: None, len: 0, capacity: positions, slot: None }
    }

    /// From now on each step writes its one position at the slot `slot`
    /// holds (an int64 tensor of one element on the cache's device, which
    /// the caller advances) and gets back the whole buffer: every decoding
    /// step then has the same shapes and addresses, which a CUDA graph
    /// needs. The attention mask must hide the slots not yet written; they
    /// are zeroed so that a hidden slot never contributes a NaN.
    pub fn fix_shapes(&mut self, slot: &Tensor) -> Result<()> {
        let Some((keys, values)) = &self.buffers else { bail!("fix_shapes needs a filled cache: run the prompt first") };
        let unwritten = keys.size()[2] - self.len;
        for buffer in [keys, values] {
            let _ = buffer.narrow(2, self.len, unwritten).zero_();
        }
        self.slot = Some(slot.shallow_clone());
        Ok(())
    }

    /// Appends this step's keys and values; returns all of them (views of
    /// the buffers). After `fix_shapes`: writes them at the slot and returns
    /// the whole buffers.
    pub fn extend(&mut self, key: Tensor, value: Tensor) -> (Tensor, Tensor) {
        if let (Some(slot), Some((keys, values))) = (&self.slot, &mut self.buffers) {
            let _ = keys.index_copy_(2, slot, &key);
            let _ = values.index_copy_(2, slot, &value);
            return (keys.shallow_clone(), values.shallow_clone());
        }
        let new = key.size()[2];
        let needed = self.len + new;
        let room = self.buffers.as_ref().map_or(0, |(k, _)| k.size()[2]);
        if needed > room {
            let positions = needed.max(self.capacity).max(2 * room);
            let grown = |old: Option<&Tensor>, like: &Tensor| {
                let mut shape = like.size();
                shape[2] = positions;
                let buffer = Tensor::empty(shape.as_slice(), (like.kind(), like.device()));
                if let Some(old) = old {
                    buffer.narrow(2, 0, self.len).copy_(&old.narrow(2, 0, self.len));
                }
                buffer
            };
            let old = self.buffers.take();
            self.buffers = Some((grown(old.as_ref().map(|b| &b.0), &key), grown(old.as_ref().map(|b| &b.1), &value)));
        }
        let (keys, values) = self.buffers.as_ref().expect("allocated above");
        keys.narrow(2, self.len, new).copy_(&key);
        values.narrow(2, self.len, new).copy_(&value);
        self.len = needed;
        (keys.narrow(2, 0, self.len), values.narrow(2, 0, self.len))
    }

    /// Attention's inputs from a block's `q`, `k` and `v` ([batch, seq,
    /// heads, head_dim]: the projections' views): the queries and keys
    /// rotated by `rotate`, the keys and values appended to the cache, each
    /// transposed to [batch, heads, positions, head_dim]. A decoding step
    /// after `fix_shapes` whose RoPE (`cos`, `signed_sin`) covers each head
    /// whole runs as one kernel on a GPU where ft's kernels load, without
    /// gradients (`kernels::rope_cache_`: the same values as `rotate` and
    /// `extend`, in one launch where they take six).
    pub fn rotate_and_extend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, rope: (&Tensor, &Tensor), rotate: impl Fn(&Tensor) -> Tensor) -> [Tensor; 3] {
        self.rotate_and_extend_with(q, k, v, rope, rotate, Kernels::loaded(q.device()))
    }

    /// [`Self::rotate_and_extend`] with ft's kernel only when `fused`: `ft
    /// bench --breakdown` compares the two.
    pub fn rotate_and_extend_with(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, (cos, signed_sin): (&Tensor, &Tensor), rotate: impl Fn(&Tensor) -> Tensor, fused: bool) -> [Tensor; 3] {
        if let (Some(slot), Some((keys, values))) = (&self.slot, &mut self.buffers) {
            let [rows, seq, heads, head_dim] = q.size()[..] else { panic!("a block's queries are [batch, seq, heads, head_dim], not {:?}", q.size()) };
            let kernel = fused && seq == 1 && cos.size().last() == Some(&head_dim) && !ft_sys::grad_enabled();
            if kernel && matches!(q.kind(), Kind::Float | Kind::BFloat16) && [k, v, keys, values].iter().all(|t| t.kind() == q.kind()) && cos.is_contiguous() && signed_sin.is_contiguous() {
                let mut queries = Tensor::empty([rows, heads, head_dim], (q.kind(), q.device()));
                crate::kernels::rope_cache_(q, k, v, cos, signed_sin, slot, &mut queries, keys, values).unwrap_or_else(|e| crate::panic::raise(anyhow::anyhow!("decoding's RoPE and cache write: {e}")));
                return [queries.unsqueeze(2), keys.shallow_clone(), values.shallow_clone()];
            }
        }
        let (keys, values) = self.extend(rotate(k).transpose(1, 2), v.transpose(1, 2));
        [rotate(q).transpose(1, 2), keys, values]
    }

    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Sizes that throughput, MFU and memory figures need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub layers: i64,
    pub hidden: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub vocab: i64,
    /// The MLP's inner width (ffn_dim, intermediate_size).
    pub intermediate: i64,
}

/// The dtype of a tensor kept for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavedDtype {
    /// The compute dtype (bf16 under mixed precision).
    Compute,
    /// fp32 statistics: a norm's mean and reciprocal deviation, attention's log-sum-exp.
    Fp32,
    /// One byte per element: a dropout's keep-mask.
    Mask,
}

/// A tensor a block keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub what: &'static str,
    /// Elements per token.
    pub per_token: i64,
    pub dtype: SavedDtype,
}

impl Saved {
    pub fn compute(what: &'static str, per_token: i64) -> Saved {
        Saved { what, per_token, dtype: SavedDtype::Compute }
    }
    pub fn fp32(what: &'static str, per_token: i64) -> Saved {
        Saved { what, per_token, dtype: SavedDtype::Fp32 }
    }
    pub fn mask(what: &'static str, per_token: i64) -> Saved {
        Saved { what, per_token, dtype: SavedDtype::Mask }
    }
}

/// What training keeps for backward, per token of a micro-batch, by the
/// model's block structure: `ft plan`'s activation memory. Counted as
/// autograd keeps them on a GPU (SDPA's fused kernels keep the log-sum-exp,
/// not the attention matrix; a tensor two ops save is counted once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activations {
    /// The tensors one block keeps, its output (the next stage's input) included.
    pub block: Vec<Saved>,
    /// Compute-dtype elements per token that a block's backward holds at
    /// once besides them: the gradients of its widest intermediates.
    pub block_backward: i64,
    /// What the embedding stage keeps, its output included, compute-dtype elements per token.
    pub embed: i64,
    /// Compute-dtype elements of the attention bias every block reads, per
    /// (query, key) position pair of a micro-batch: one per head for
    /// ALiBi, 0 when attention masks itself.
    pub bias_per_position_pair: i64,
    /// Compute-dtype elements each block keeps per (query, key) position
    /// pair of a micro-batch: an attention computed outside SDPA's fused
    /// kernels (Gemma 2's soft-capped scores) keeps its scores and
    /// probabilities; 0 under SDPA.
    pub block_per_position_pair: i64,
}

impl Activations {
    /// A pre-norm block (GPT-2's, BLOOM's): attention through SDPA, then
    /// an MLP of two matrices around an activation that keeps its input.
    pub fn pre_norm_block(dims: &Dims) -> Activations {
        let (d, i) = (dims.hidden, dims.intermediate);
        let kv = dims.kv_heads * (d / dims.heads);
        Activations {
            block: vec![
                Saved::compute("attention norm's output", d),
                Saved::compute("query, key and value", d + 2 * kv),
                Saved::compute("attention output", d),
                Saved::fp32("attention's log-sum-exp", dims.heads),
                Saved::compute("residual sum", d),
                Saved::compute("MLP norm's output", d),
                Saved::compute("MLP up-projection", i),
                Saved::compute("activation's output", i),
                Saved::fp32("two norms' mean and reciprocal deviation", 4),
                Saved::compute("block output", d),
            ],
            // The gradients of the activation's output and input.
            block_backward: 2 * i,
            embed: d,
            bias_per_position_pair: 0,
            block_per_position_pair: 0,
        }
    }

    /// Bytes one block keeps per token when the compute dtype's elements have `compute_bytes`.
    pub fn block_bytes_per_token(&self, compute_bytes: i64) -> i64 {
        self.block
            .iter()
            .map(|saved| {
                saved.per_token
                    * match saved.dtype {
                        SavedDtype::Compute => compute_bytes,
                        SavedDtype::Fp32 => 4,
                        SavedDtype::Mask => 1,
                    }
            })
            .sum()
    }
}

/// What an architecture declares once, from its config.json: its units and
/// the order its stages run in.
pub struct Layout {
    /// The config.json the model was built from (written back on export).
    pub hf_config: serde_json::Value,
    pub units: Vec<UnitSpec>,
    pub stages: Vec<Stage>,
}

impl Layout {
    /// Embedding on unit 0, one block per unit of `blocks`, head on `head_unit`.
    pub fn new(hf_config: serde_json::Value, units: Vec<UnitSpec>, blocks: std::ops::Range<usize>, head_unit: usize) -> Layout {
        let mut stages = vec![Stage { unit: 0, kind: StageKind::Embed, adapter: None, experts: None }];
        stages.extend(blocks.map(|unit| Stage { unit, kind: StageKind::Block, adapter: None, experts: None }));
        stages.push(Stage { unit: head_unit, kind: StageKind::Head, adapter: None, experts: None });
        Layout { hf_config, units, stages }
    }
}

/// The units of `model`'s transformer blocks (its `Block` stages, a sparse
/// block's experts included: `Stage::units`), in stage order.
pub fn block_units(model: &dyn Model) -> impl Iterator<Item = usize> + '_ {
    model.stages().iter().filter(|s| s.kind == StageKind::Block).flat_map(|s| s.units())
}

/// How many transformer blocks `model` has (its `Block` stages).
pub fn block_count(model: &dyn Model) -> usize {
    model.stages().iter().filter(|s| s.kind == StageKind::Block).count()
}

/// Which block of the model stage `index` of `stages` is (the blocks before it).
pub fn block_number(stages: &[Stage], index: usize) -> usize {
    stages[..index].iter().filter(|stage| stage.kind == StageKind::Block).count()
}

/// Fresh parameters for every unit of `model` as its specs ask (linear and
/// embedding weights N(0, std), biases zero, norms one — transformers'
/// `_init_weights`), seeded for reproducibility; libtorch's refusal (more
/// memory than there is) is an error.
pub fn init_params(model: &dyn Model, seed: i64, dtype: Kind, device: Device) -> Result<Vec<Vec<Tensor>>> {
    tch::manual_seed(seed);
    crate::panic::libtorch_errors("initialising the parameters", || {
        model.units().iter().map(|unit| unit.params.iter().map(|spec| spec.initial(dtype, device)).collect()).collect()
    })
}

/// What a head stage returns, by the name of its kind (`Model::head_kind`);
/// a task checks the model has the head it trains.
pub mod head {
    /// `[normalised hidden states [batch, seq, dim], LM weight [vocab, dim]]`:
    /// the logits are their product, which the loss forms chunk by chunk.
    pub const CAUSAL_LM: &str = "causal_lm";
    /// `[start_logits [batch, seq], end_logits [batch, seq]]`, in the compute
    /// dtype: each token's score as the first and as the last token of the
    /// answer span (extractive question answering); the task's loss casts
    /// them to fp32.
    pub const QUESTION_ANSWERING: &str = "question_answering";
}

/// An architecture's registration, keyed by config.json's `model_type`:
/// `inventory::submit! { ModelRegistration { … } }` beside its file.
pub struct ModelRegistration {
    pub model_type: &'static str,
    pub summary: &'static str,
    pub build: fn(serde_json::Value) -> Result<Box<dyn Model>>,
}
inventory::collect!(ModelRegistration);

pub trait Model: Send + Sync {
    fn layout(&self) -> &Layout;
    fn dims(&self) -> Dims;

    /// What training keeps for backward, per token (`ft plan`). The default
    /// is a pre-norm block of `dims()` ([`Activations::pre_norm_block`]);
    /// an architecture whose block keeps other tensors says so.
    fn activations(&self) -> Activations {
        Activations::pre_norm_block(&self.dims())
    }

    /// The kind of head the last stage is, e.g. [`head::CAUSAL_LM`].
    fn head_kind(&self) -> &str;

    /// The Hugging Face `model_type`.
    fn model_type(&self) -> &str {
        self.layout().hf_config["model_type"].as_str().unwrap_or("unknown")
    }
    fn units(&self) -> &[UnitSpec] {
        &self.layout().units
    }
    fn stages(&self) -> &[Stage] {
        &self.layout().stages
    }
    fn hf_config(&self) -> &serde_json::Value {
        &self.layout().hf_config
    }

    /// Builds what the blocks share for a batch of `inputs` that follows
    /// `past` cached positions.
    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context>;

    fn embed(&self, params: &Params, inputs: &Inputs, ctx: &Context) -> Tensor;

    /// Block number `layer` (counting from 0) of the stages: an
    /// architecture whose layers differ (Gemma's sliding and global
    /// attention) reads it; the others ignore it.
    fn block(&self, params: &Params, x: &Tensor, ctx: &Context, layer: usize, cache: Option<&mut KvCache>) -> Tensor;

    /// The head's outputs, as its kind defines them (see [`head`]); a
    /// causal LM returns the final norm's hidden states and the LM weight
    /// (the embedding's, when tied).
    fn head(&self, params: &Params, x: &Tensor) -> Vec<Tensor>;

    /// The longest sequence the model can embed, for a model with a table of
    /// learned positions (config.json's `max_position_embeddings`); None
    /// where positions are computed (RoPE, ALiBi). Tasks refuse a longer
    /// `data.max_seq_len` before training starts.
    fn max_positions(&self) -> Option<i64> {
        None
    }

    /// Whether a parameter (by its Hugging Face name) that a checkpoint lacks
    /// starts from its `Init` instead: a task head that a base model's
    /// checkpoint has no weights for. Loading reports each one.
    fn initialised_if_missing(&self, _hf_name: &str) -> bool {
        false
    }

    /// Whether a checkpoint tensor (by its name in the file) that no
    /// parameter reads is skipped: another head's weights (a base model's
    /// pooler or pretraining heads). Loading reports each one.
    fn ignored_if_unexpected(&self, _checkpoint_name: &str) -> bool {
        false
    }

    /// Whether unit `unit` stays as loaded: no gradient, no optimizer state
    /// (a LoRA model's base units).
    fn frozen(&self, _unit: usize) -> bool {
        false
    }

    /// How the units that stages name as `adapter` join the linear layers
    /// (None: the model has no adapters).
    /// How the frozen blocks' weights are held in 4 bits, if they are
    /// (QLoRA's base: the trainer packs them, `distributed/packed_base.rs`).
    fn quantized_base(&self) -> Option<crate::nf4::Quantization> {
        None
    }

    fn adapter_scaling(&self) -> Option<AdapterScaling> {
        None
    }

    /// The short names LoRA's `train.lora.targets` may use for this
    /// architecture's linear layers, each with the in-block module names
    /// it stands for (`q` → `self_attn.q_proj`); empty where LoRA is not
    /// supported.
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        &[]
    }

    /// The in-block names of the blocks' fused expert parameters ([E, N, K],
    /// a mixture of experts' `mlp.experts.gate_up_proj` …: transformers 5's
    /// names under the block, as peft's `target_parameters` name them),
    /// which LoRA's `experts` target adapts; empty (the default) where the
    /// model has none.
    fn expert_parameters(&self) -> &'static [&'static str] {
        &[]
    }

    /// The cap `c` of a causal LM's final logits, `c · tanh(logits / c)`
    /// (Gemma 2's `final_logit_softcapping`), which the losses, `ft
    /// forward` and generation apply; None where logits are used as they are.
    fn logit_softcap(&self) -> Option<f64> {
        None
    }

    /// Whether a frozen block's parameter is held in 4 bits when the base
    /// is (QLoRA: `model.quantize`): by default its matrices, the weights
    /// of the linear layers bitsandbytes quantizes; the rest (norms,
    /// biases) stays in the compute dtype.
    fn held_in_4bit(&self, param: &ParamSpec) -> bool {
        param.shape.len() == 2
    }

    /// Whether a forward on `device` in `dtype` may be recorded as a CUDA
    /// graph (generation's decoding steps): false where a block reads device
    /// values on the host (a mixture of experts' tokens per expert, where
    /// its GEMMs loop over the experts).
    fn graph_capturable(&self, _device: Device, _dtype: Kind) -> bool {
        true
    }

    /// A mixture of experts' experts (what `train.expert_parallel` splits
    /// over ranks, and `ft plan` counts); None for a dense model.
    fn experts(&self) -> Option<Experts> {
        None
    }

    /// The loss the blocks add beside the objective's from the terms they
    /// record (`Auxiliary::record`): a mixture of experts' load balancing
    /// when its config asks for it; None (the default) where none is added.
    fn auxiliary_loss(&self) -> Option<&dyn AuxiliaryLoss> {
        None
    }

    /// Total parameters.
    fn numel(&self) -> i64 {
        self.units().iter().map(UnitSpec::numel).sum()
    }

    /// Parameters of the frozen units.
    fn frozen_numel(&self) -> i64 {
        self.units().iter().enumerate().filter(|(unit, _)| self.frozen(*unit)).map(|(_, spec)| spec.numel()).sum()
    }

    /// The parameters a token does not run (a mixture of experts' experts
    /// beyond the k it is routed to): training FLOPs leave them out.
    fn idle_numel(&self) -> i64 {
        0
    }

    /// Training FLOPs per token at sequence length `seq`: 6N for the matmuls
    /// over the parameters a token runs plus 12·L·d·S for attention (PaLM's
    /// MFU formula).
    fn train_flops_per_token(&self, seq: i64) -> f64 {
        let d = self.dims();
        6.0 * (self.numel() - self.idle_numel()) as f64 + 12.0 * (d.layers * d.hidden * seq) as f64
    }
}

/// Runs every stage with full parameters `params[unit]` (views in the compute
/// dtype); returns the head's outputs.
pub fn forward(model: &dyn Model, params: &[Vec<Tensor>], inputs: &Inputs, ctx: &Context, caches: Option<&mut [KvCache]>) -> Vec<Tensor> {
    forward_with_auxiliary(model, params, inputs, ctx, caches).0
}

/// [`forward`], and the model's auxiliary loss over this batch alone
/// (`Model::auxiliary_loss`, before its coefficient, as transformers
/// reports `aux_loss`; None where the model adds none): differentiable as
/// the loss it joins.
pub fn forward_with_auxiliary(model: &dyn Model, params: &[Vec<Tensor>], inputs: &Inputs, ctx: &Context, caches: Option<&mut [KvCache]>) -> (Vec<Tensor>, Option<Tensor>) {
    forward_from(model, &mut Held(params), inputs, ctx, caches).expect("held parameters are fetched without fail")
}

/// Where a forward takes each unit's parameters (shaped as the model
/// declares them, in the compute dtype): held whole ([`Held`]), or fetched
/// for the stage that computes with them and dropped after it (the
/// trainer's `train::GatheredPolicy`, which gathers a sharded unit: a
/// collective, so every rank of the job fetches the same units in the same order).
pub trait UnitSource {
    /// Makes `units` ready for one stage (collective when they are gathered).
    fn fetch(&mut self, units: &[usize]) -> Result<()>;
    /// A fetched unit's tensors.
    fn tensors(&self, unit: usize) -> &[Tensor];
    /// The stage that fetched `units` is done with them (outputs that are views of them keep their storage).
    fn done(&mut self, units: &[usize]);
    /// Whether `fetch` is a collective: decoding then steps in lockstep
    /// with the other ranks ([`Self::all_done`]) and records no CUDA graph
    /// (a graph cannot replay gathers).
    fn gathers(&self) -> bool;
    /// Whether every rank's decoding is `done`, this rank's being `done`:
    /// one small reduction when `fetch` is collective.
    fn all_done(&mut self, done: bool) -> Result<bool>;
    /// Where the parameters are.
    fn device(&self) -> Device;
}

/// Parameters held whole, `params[unit]`.
pub struct Held<'a>(pub &'a [Vec<Tensor>]);

impl UnitSource for Held<'_> {
    fn fetch(&mut self, _units: &[usize]) -> Result<()> {
        Ok(())
    }

    fn tensors(&self, unit: usize) -> &[Tensor] {
        &self.0[unit]
    }

    fn done(&mut self, _units: &[usize]) {}

    fn gathers(&self) -> bool {
        false
    }

    fn all_done(&mut self, done: bool) -> Result<bool> {
        Ok(done)
    }

    fn device(&self) -> Device {
        self.0.iter().flatten().next().map_or(Device::Cpu, Tensor::device)
    }
}

/// The units stage `stage` computes with: its own, its experts' and its adapters'.
pub fn stage_units(stage: &Stage) -> Vec<usize> {
    stage.units().chain(stage.adapter).collect()
}

/// [`forward_with_auxiliary`] over the parameters `source` fetches stage by stage.
pub fn forward_from(model: &dyn Model, source: &mut dyn UnitSource, inputs: &Inputs, ctx: &Context, mut caches: Option<&mut [KvCache]>) -> Result<(Vec<Tensor>, Option<Tensor>)> {
    let mut x = None;
    let mut block = 0;
    let mut terms = vec![];
    for stage in model.stages() {
        let units = stage_units(stage);
        source.fetch(&units)?;
        let p = stage_params(model, stage, |unit| source.tensors(unit), ctx.train);
        let head = match stage.kind {
            StageKind::Embed => {
                x = Some(model.embed(&p, inputs, ctx));
                None
            }
            StageKind::Block => {
                let cache = caches.as_deref_mut().map(|c| &mut c[block]);
                x = Some(model.block(&p, x.as_ref().expect("embed runs first"), ctx, block, cache));
                terms.extend(ctx.auxiliary.take());
                block += 1;
                None
            }
            StageKind::Head => {
                let outputs = model.head(&p, x.as_ref().expect("embed runs first"));
                let auxiliary = model.auxiliary_loss().filter(|_| !terms.is_empty()).map(|loss| {
                    let statistics = Tensor::stack(&terms.iter().map(|t| t.statistics.shallow_clone()).collect::<Vec<_>>(), 0);
                    let values = Tensor::stack(&terms.iter().map(|t| t.values.shallow_clone()).collect::<Vec<_>>(), 0);
                    (loss.weights(&statistics) * &values).sum(values.kind())
                });
                Some((outputs, auxiliary))
            }
        };
        drop(p);
        source.done(&units);
        if let Some(head) = head {
            return Ok(head);
        }
    }
    panic!("model {} has no head stage", model.model_type());
}

/// The parameters stage `stage` runs with, its experts' and adapters
/// joined, from each unit's tensors as `tensors(unit)` gives them.
pub fn stage_params<'a>(model: &'a dyn Model, stage: &Stage, tensors: impl Fn(usize) -> &'a [Tensor], train: bool) -> Params<'a> {
    let units = model.units();
    let mut p = Params::new(&units[stage.unit], tensors(stage.unit));
    for unit in stage.experts.into_iter().flatten() {
        p = p.with_joined(Params::new(&units[unit], tensors(unit)));
    }
    match (stage.adapter, model.adapter_scaling()) {
        (Some(adapter), Some(scaling)) => p.with_adapters(Params::new(&units[adapter], tensors(adapter)), scaling, train),
        _ => p,
    }
}

/// A causal LM's head outputs: (normalised hidden states, LM weight).
pub fn lm_outputs(outputs: Vec<Tensor>) -> Result<(Tensor, Tensor)> {
    match <[Tensor; 2]>::try_from(outputs) {
        Ok([hidden, weight]) => Ok((hidden, weight)),
        Err(outputs) => bail!("a causal LM head returns [hidden, weight], this one returned {} tensors", outputs.len()),
    }
}

/// Rotary embeddings of `x` ([batch, seq, heads, head_dim]): x·cos +
/// rotate_half(x)·sin, written roll(x, half)·`signed_sin` (sin with
/// rotate_half's sign folded in, [batch, seq, 1, head_dim] like `cos`).
/// On a GPU where ft's kernels load, one kernel each way (`ft_sys::rope`);
/// ATen's three forward and four backward kernels elsewhere.
pub fn rotary(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    rotary_with(x, cos, signed_sin, Kernels::loaded(x.device()))
}

/// `rotary` with ft's kernel when `fused` (and it serves the kind and
/// shapes), ATen's ops otherwise: `ft bench --breakdown` compares the two.
pub fn rotary_with(x: &Tensor, cos: &Tensor, signed_sin: &Tensor, fused: bool) -> Tensor {
    let [batch, seq, _, head_dim] = x.size()[..] else { panic!("RoPE's input is [batch, seq, heads, head_dim], not {:?}", x.size()) };
    let fits = |t: &Tensor| t.size() == [batch, seq, 1, head_dim] && t.kind() == x.kind() && t.is_contiguous();
    if fused && matches!(x.kind(), Kind::Float | Kind::BFloat16) && fits(cos) && fits(signed_sin) {
        return ft_sys::rope(x, cos, signed_sin).unwrap_or_else(|e| panic!("RoPE: {e}"));
    }
    (x * cos).addcmul(&x.roll([head_dim / 2], [3]), signed_sin)
}

/// RMSNorm over the last dimension with `weight`. Where float8 layers read
/// its output and ft's kernels load, ft's kernel writes it and its amax in
/// one pass (`ft_sys::rms_norm`), so their casts take no pass of their own;
/// ATen's own kernel elsewhere (one pass too, without the amax).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let hidden = x.size().last().copied().unwrap_or(0);
    let fits = matches!(x.kind(), Kind::Float | Kind::BFloat16) && weight.kind() == x.kind() && weight.size() == [hidden];
    if fits && ft_sys::float8::activation_amaxes_wanted() && Kernels::loaded(x.device()) {
        return ft_sys::rms_norm(x, weight, eps).unwrap_or_else(|e| panic!("RMSNorm: {e}"));
    }
    x.rms_norm([hidden], Some(weight), Some(eps))
}

/// SwiGLU's gating, silu(gate) · up, as one autograd node that keeps only
/// `gate` and `up` for backward (`ft_sys::swiglu`), in one kernel each way
/// on a GPU where ft's kernels load. Panics only on inputs that do not
/// broadcast, a bug in the model file.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    let same = gate.size() == up.size() && gate.kind() == up.kind() && gate.is_contiguous() && up.is_contiguous();
    let fused = same && matches!(gate.kind(), Kind::Float | Kind::BFloat16) && Kernels::loaded(gate.device());
    ft_sys::swiglu(gate, up, fused).unwrap_or_else(|e| panic!("swiglu: {e}"))
}

/// SwiGLU over the gate and up halves of each row of `x` [rows, 2·width]
/// (a mixture of experts' fused gate-and-up projection), the halves read in
/// place and only `x` kept for backward (`ft_sys::swiglu_halves`): one
/// kernel each way on a GPU where ft's kernels load. libtorch's errors
/// (memory) are raised for `panic::libtorch_errors`.
pub fn swiglu_halves(x: &Tensor) -> Tensor {
    let fused = matches!(x.kind(), Kind::Float | Kind::BFloat16) && x.is_contiguous() && Kernels::loaded(x.device());
    ft_sys::swiglu_halves(x, fused).unwrap_or_else(|e| crate::panic::raise(anyhow::anyhow!("the experts' SwiGLU: {e}")))
}

/// A mixture of experts' combine: each token's Σ_i weights[t,i] ·
/// rows[at[t·k + i]] over its k assignments, from the experts' output
/// `rows` [tokens·k, width], the router's `weights` [tokens, k] (fp32) and
/// where each assignment's row is (`at`, int64) — one autograd node
/// (`ft_sys::combine`), one kernel each way on a GPU where ft's kernels
/// load, summed in fp32.
pub fn combine_experts(rows: &Tensor, weights: &Tensor, at: &Tensor) -> Tensor {
    let fits = matches!(rows.kind(), Kind::Float | Kind::BFloat16) && rows.is_contiguous() && weights.size().last().is_some_and(|&k| k <= crate::kernels::COMBINE_MAX_K);
    let fused = fits && Kernels::loaded(rows.device());
    ft_sys::combine(rows, &weights.to_kind(Kind::Float).contiguous(), at, fused).unwrap_or_else(|e| crate::panic::raise(anyhow::anyhow!("the experts' combine: {e}")))
}

/// Scaled-dot-product attention over [batch, heads, seq, head_dim] tensors:
/// causal without a materialised mask when there is no bias and no cache.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, ctx: &Context, grouped_kv: bool) -> Tensor {
    scaled_attention(q, k, v, &ctx.attention_bias, ctx.train, grouped_kv, None)
}

/// [`attention`] under `bias` (in place of the context's: a model whose
/// layers mask differently) with the scores scaled by `scale` (None:
/// 1/√head_dim).
pub fn scaled_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Option<Tensor>, train: bool, grouped_kv: bool, scale: Option<f64>) -> Tensor {
    let (seq, keys) = (q.size()[2], k.size()[2]);
    if seq == 1 && !train {
        let fused = Kernels::loaded(q.device()) && decode_kernel_fits(q, k, bias.as_ref());
        return decode_attention(q, k, v, bias.as_ref(), grouped_kv, scale, fused);
    }
    match bias {
        Some(bias) => Tensor::scaled_dot_product_attention(q, k, v, Some(bias), 0.0, false, scale, grouped_kv),
        // One new token attends to every cached key: nothing to mask.
        None if seq == 1 => Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, false, scale, grouped_kv),
        None if seq == keys => Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, scale, grouped_kv),
        None => {
            let bias = causal_bias(seq, keys - seq, q.kind(), q.device());
            Tensor::scaled_dot_product_attention(q, k, v, Some(&bias), 0.0, false, scale, grouped_kv)
        }
    }
}

/// Whether ft's decoding kernel takes these shapes: contiguous, 16-byte
/// aligned keys, a head size and grouping it has, a bias of one row per row
/// (broadcast over the heads, or one per head).
fn decode_kernel_fits(q: &Tensor, k: &Tensor, bias: Option<&Tensor>) -> bool {
    let (heads, kv_heads, head_dim) = (q.size()[1], k.size()[1], q.size()[3]);
    let grouping = kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= crate::kernels::DECODE_MAX_GROUPS;
    let bias_fits = bias.is_none_or(|bias| matches!(bias.size().as_slice(), &[rows, h, 1, _] if rows == q.size()[0] && (h == 1 || h == heads)));
    let aligned = k.is_contiguous() && k.data_ptr() as usize % 16 == 0;
    matches!(q.kind(), Kind::Float | Kind::BFloat16) && aligned && grouping && bias_fits && crate::kernels::DECODE_HEAD_DIMS.contains(&head_dim)
}

/// One query per row over cached keys (a decoding step). With `fused`
/// (on a GPU, shapes `decode_kernel_fits` takes), ft's flash-decoding kernel
/// (`kernels::decode_attention_`): each row's keys read once, a hidden slot
/// not at all, split among blocks that fill the GPU. Else two
/// matrix-vector products and a softmax: SDPA's GPU backends would pick
/// cuDNN, which plans anew for every key length — milliseconds of host time
/// per call, more than the step's arithmetic. Grouped keys and values
/// (GQA) are never repeated per head: each key head's queries go through
/// it together, as [groups, head_dim] rows — copying the cache for every
/// head each step would cost more than the step's weights.
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>, grouped_kv: bool, scale: Option<f64>, fused: bool) -> Tensor {
    let (batch, heads, kv_heads, head_dim) = (q.size()[0], q.size()[1], k.size()[1], q.size()[3]);
    if fused {
        let scale = scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
        let capacity = k.size()[2];
        let bias = match bias {
            Some(bias) => bias.to_kind(q.kind()).reshape([batch, -1, capacity]).contiguous(),
            None => Tensor::zeros([batch, 1, capacity], (q.kind(), q.device())),
        };
        let mut out = Tensor::empty([batch, heads, head_dim], (q.kind(), q.device()));
        let queries = q.reshape([batch, heads, head_dim]).contiguous();
        crate::kernels::decode_attention_(&queries, k, &v.contiguous(), &bias, scale, &mut out).unwrap_or_else(|e| crate::panic::raise(anyhow::anyhow!("decoding's attention: {e}")));
        return out.reshape([batch, heads, 1, head_dim]);
    }
    let groups = if grouped_kv { heads / kv_heads } else { 1 };
    // [batch, kv_heads, groups, head_dim]: the queries of each key head.
    let q = q.reshape([batch, kv_heads, groups, head_dim]);
    let mut scores = q.matmul(&k.transpose(2, 3)).to_kind(Kind::Float) * scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
    if let Some(bias) = bias {
        // A bias per head ([batch, heads, 1, keys]: ALiBi) splits its heads as the queries are; others broadcast.
        let size = bias.size();
        let bias = match size.as_slice() {
            &[rows, h, 1, keys] if h == heads && heads > 1 => bias.reshape([rows, kv_heads, groups, keys]),
            _ => bias.shallow_clone(),
        };
        scores += bias.to_kind(Kind::Float);
    }
    scores.softmax(-1, Kind::Float).to_kind(q.kind()).matmul(v).reshape([batch, heads, 1, head_dim])
}

/// [seq, past+seq] additive mask: 0 where query i may see key j (j <= past+i), -inf elsewhere.
pub fn causal_bias(seq: i64, past: i64, dtype: Kind, device: tch::Device) -> Tensor {
    let q = Tensor::arange(seq, (Kind::Int64, device)).unsqueeze(1) + past;
    let k = Tensor::arange(past + seq, (Kind::Int64, device)).unsqueeze(0);
    Tensor::zeros([seq, past + seq], (dtype, device)).masked_fill(&k.gt_tensor(&q), f64::NEG_INFINITY)
}

/// A decoder's additive attention mask for `inputs`, broadcastable to
/// [batch, 1, seq, past+seq]: causal ([`causal_bias`]), with the padding mask
/// folded in when there is one, and for packed rows block-diagonal — a query
/// sees the keys up to itself of its own example (and branch) only
/// ([`packed_visibility`]). Packed rows take no KV cache.
pub fn decoder_mask_bias(inputs: &Inputs, past: i64, dtype: Kind) -> Result<Tensor> {
    let (seq, device) = (inputs.input_ids.size()[1], inputs.input_ids.device());
    let causal = match packed_visibility(inputs) {
        None => causal_bias(seq, past, dtype, device),
        Some(visible) => {
            ensure!(past == 0, "packed rows are for training: they take no KV cache");
            Tensor::zeros(visible.size(), (dtype, device)).masked_fill(&visible.logical_not(), f64::NEG_INFINITY).unsqueeze(1)
        }
    };
    // Sums, not in-place adds: each term may broadcast the other to more dimensions.
    Ok(match &inputs.attention_mask {
        Some(mask) => padding_bias(mask, dtype) + causal,
        None => causal,
    })
}

/// Which keys each query of a packed row sees ([batch, seq, seq] of bool),
/// None for rows of one sequence: the keys up to itself of its own example
/// and, where examples branch, of the shared prefix and its own branch.
fn packed_visibility(inputs: &Inputs) -> Option<Tensor> {
    let rows = inputs.documents.as_ref().or(inputs.branches.as_ref())?;
    let order = Tensor::arange(rows.size()[1], (Kind::Int64, rows.device()));
    let mut visible = order.unsqueeze(1).ge_tensor(&order.unsqueeze(0)).unsqueeze(0);
    if let Some(documents) = &inputs.documents {
        visible = visible.logical_and(&documents.unsqueeze(2).eq_tensor(&documents.unsqueeze(1)));
    }
    if let Some(branches) = &inputs.branches {
        let key_branch = branches.unsqueeze(1);
        visible = visible.logical_and(&branches.unsqueeze(2).eq_tensor(&key_branch).logical_or(&key_branch.eq(0)));
    }
    Some(visible)
}

/// A decoder's token positions for `inputs` after `past` cached ones:
/// [`positions`], or for packed rows each token's place in its own example
/// (after its prefix, in a branch).
pub fn decoder_positions(inputs: &Inputs, past: i64) -> Tensor {
    if inputs.branches.is_some() {
        // As many positions precede a token as keys it sees besides itself.
        let visible = packed_visibility(inputs).expect("branched rows are packed");
        return visible.sum_dim_intlist(-1, false, Kind::Int64) - 1;
    }
    let Some(documents) = &inputs.documents else { return positions(&inputs.input_ids, past, inputs.attention_mask.as_ref()) };
    let seq = documents.size()[1];
    let order = Tensor::arange(seq, (Kind::Int64, documents.device())).unsqueeze(0).expand_as(documents);
    // A token starts an example where the example differs from its left neighbour's;
    // each token's example started at the last such index at or before it.
    let left = Tensor::cat(&[documents.narrow(1, 0, 1) - 1, documents.narrow(1, 0, seq - 1)], 1);
    let start = order.where_self(&documents.ne_tensor(&left), &order.zeros_like()).cummax(1).0;
    order - start
}

/// Each query's and each key's position, counted over real tokens as
/// [`decoder_positions`] counts them: [batch, seq] and [batch, past+seq], or
/// one row each when there is no padding mask, no packing and every row is
/// alike. ALiBi's distances and sliding windows are measured on them, so a
/// left-padded prompt or a packed example sees what it would alone.
pub fn query_key_positions(positions: &Tensor, past: i64, inputs: &Inputs) -> (Tensor, Tensor) {
    match (inputs.packed(), &inputs.attention_mask) {
        (true, _) => (positions.shallow_clone(), positions.shallow_clone()),
        (false, Some(mask)) => (positions.shallow_clone(), (mask.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0)),
        (false, None) => (positions.narrow(0, 0, 1), Tensor::arange(past + positions.size()[1], (Kind::Int64, positions.device())).unsqueeze(0)),
    }
}

/// [batch or 1, 1, seq, past+seq] additive mask of a sliding window: -inf
/// where a key lies `window` or more positions before its query, so each
/// query sees at most `window` keys, itself included (Mistral's
/// `sliding_window`). Distances count real tokens ([`query_key_positions`]);
/// transformers counts left padding's slots too, which differs only for a
/// left-padded batch, where this keeps each row as it would be alone.
pub fn sliding_window_bias(positions: &Tensor, past: i64, inputs: &Inputs, window: i64, dtype: Kind) -> Tensor {
    let (query, key) = query_key_positions(positions, past, inputs);
    let outside = key.unsqueeze(1).le_tensor(&(query.unsqueeze(2) - window));
    Tensor::zeros(outside.size(), (dtype, positions.device())).masked_fill(&outside, f64::NEG_INFINITY).unsqueeze(1)
}

/// Folds a padding mask [batch, keys] (1 = token, 0 = padding) into an
/// additive bias [batch, 1, 1, keys].
pub fn padding_bias(padding_mask: &Tensor, dtype: Kind) -> Tensor {
    let keep = padding_mask.to_kind(Kind::Bool).unsqueeze(1).unsqueeze(1);
    Tensor::zeros(keep.size(), (dtype, padding_mask.device())).masked_fill(&keep.logical_not(), f64::NEG_INFINITY)
}

/// Positions [batch, seq] of tokens after `past` cached ones: counted over
/// real tokens only when a padding mask is given (left padding), as Hugging
/// Face does.
pub fn positions(input_ids: &Tensor, past: i64, padding_mask: Option<&Tensor>) -> Tensor {
    let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
    match padding_mask {
        Some(mask) => {
            let counted = mask.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1;
            counted.clamp_min(0).narrow(1, past, seq)
        }
        None => (Tensor::arange(seq, (Kind::Int64, input_ids.device())) + past).unsqueeze(0).expand([batch, seq], true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three linear layers (the second without a bias where `biased` is
    /// partial) laid out as a unit's flat buffer lays them: matrices, then
    /// vectors.
    fn three_layers(biased: [bool; 3]) -> (UnitSpec, Vec<Tensor>) {
        let widths = [6, 2, 2];
        let mut params: Vec<ParamSpec> = widths.iter().enumerate().map(|(i, &w)| ParamSpec::new("", &format!("l{i}.weight"), &[w, 4], Init::Zeros)).collect();
        params.extend(widths.iter().enumerate().filter(|&(i, _)| biased[i]).map(|(i, &w)| ParamSpec::new("", &format!("l{i}.bias"), &[w], Init::Zeros)));
        let sizes: Vec<i64> = params.iter().map(ParamSpec::numel).collect();
        let flat = Tensor::randn([sizes.iter().sum::<i64>()], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let tensors = flat.split_with_sizes(&sizes, 0).into_iter().zip(&params).map(|(t, p)| t.view(p.shape.as_slice())).collect();
        (UnitSpec { name: "block 0".into(), params }, tensors)
    }

    #[test]
    fn adjacent_linear_layers_run_as_one_gemm_without_gradients_and_give_each_layers_output() {
        let names = ["l0", "l1", "l2"];
        let x = Tensor::randn([2, 3, 4], (Kind::Float, Device::Cpu));
        let (spec, tensors) = three_layers([true; 3]);
        let p = Params::new(&spec, &tensors);
        let alone = names.map(|name| p.linear(&x, name).detach());
        let joined = tch::no_grad(|| {
            assert!(p.joined_linear(&x, &names).is_some(), "one buffer, no gradient: one GEMM");
            p.linears(&x, names)
        });
        for ((joined, alone), name) in joined.iter().zip(&alone).zip(names) {
            assert_eq!(joined.size(), alone.size(), "{name}");
            assert!(joined.allclose(alone, 1e-6, 1e-6, false), "{name}'s columns of the joined GEMM equal its own GEMM");
        }
        assert!(p.joined_linear(&x, &names).is_none(), "a gradient is taken: each layer alone");
        tch::no_grad(|| {
            let (spec, tensors) = three_layers([true, false, true]);
            assert!(Params::new(&spec, &tensors).joined_linear(&x, &names).is_none(), "one layer has no bias");
            let (spec, tensors) = three_layers([false; 3]);
            assert!(Params::new(&spec, &tensors).joined_linear(&x, &names).is_some(), "no layer has a bias");
            let apart: Vec<Tensor> = tensors.iter().map(Tensor::copy).collect();
            assert!(Params::new(&spec, &apart).joined_linear(&x, &names).is_none(), "weights in storages of their own");
            assert!(p.joined_linear(&x, &["l0", "l2"]).is_none(), "weights with another between them");
        });
    }

    #[test]
    fn a_cache_of_fixed_shapes_writes_at_its_slot_and_returns_every_slot() {
        let step = |value: f64| Tensor::full([1, 1, 1, 2], value, (Kind::Float, Device::Cpu));
        let mut cache = KvCache::with_capacity(4);
        let mut slot = Tensor::from_slice(&[2i64]);
        assert!(cache.fix_shapes(&slot).is_err(), "an empty cache has no buffers to fix");
        let prompt = Tensor::ones([1, 1, 2, 2], (Kind::Float, Device::Cpu));
        let _ = cache.extend(prompt.shallow_clone(), prompt);
        cache.fix_shapes(&slot).unwrap();
        let (keys, values) = cache.extend(step(5.0), step(7.0));
        assert_eq!(keys.size(), [1, 1, 4, 2], "the whole capacity comes back");
        let slots = |t: &Tensor| Vec::<f32>::try_from(t.select(3, 0).reshape([-1])).unwrap();
        assert_eq!(slots(&keys), [1.0, 1.0, 5.0, 0.0], "written at slot 2; the unwritten slot zeroed");
        assert_eq!(slots(&values), [1.0, 1.0, 7.0, 0.0]);
        let _ = slot.g_add_scalar_(1);
        let (keys, _) = cache.extend(step(6.0), step(8.0));
        assert_eq!(slots(&keys), [1.0, 1.0, 5.0, 6.0], "the caller's slot moved it on");
    }
}
