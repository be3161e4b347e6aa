//! Mixture-of-experts MLPs, written once for every MoE family (`qwen3_moe.rs`,
//! …, which read their own config keys into a [`Moe`]): a router scores each
//! token's experts, the token goes to its top k (dropless: always all k),
//! each expert is a SwiGLU MLP, and the block's output is the experts'
//! outputs weighed by the router (plus, in Qwen2-MoE, a shared expert every
//! token goes through).
//!
//! The experts of a layer are held fused, as transformers 5 holds them:
//! `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its
//! up rows) and `mlp.experts.down_proj` [E, H, I], so a grouped GEMM can take
//! them whole. The Hub's files name each expert's matrices instead
//! (`mlp.experts.{e}.gate_proj.weight` …): `hf.rs` reads either layout and
//! writes the Hub's, as `save_pretrained` does, through [`hub_parts`]
//! (Mixtral's files name the block `block_sparse_moe`, [`Moe::hub_module`]).
//! Each is a unit of its own (`Stage::experts`): under expert parallelism a
//! rank holds its rows of them and exchanges tokens with the ranks holding
//! the others ([`Moe::exchanged_mlps`], through `Context::experts`).
//!
//! The router's load-balancing loss (transformers' `load_balancing_loss_func`,
//! added when config.json has `output_router_logits`) is the model's
//! auxiliary loss (`ft_core::model::AuxiliaryLoss`): each sparse block
//! records its router probabilities summed over the real tokens (the
//! values) and its top-k assignments per expert with the tokens counted
//! (the statistics); transformers concatenates every layer's router logits,
//! so the assignments are counted over all layers before they weigh any.

use crate::check;
use anyhow::{bail, Result};
use ft_core::model::{self, AuxiliaryLoss, AuxiliaryTerm, Context, ExpertExchange, Init, ParamSpec, Params, Saved};
use serde::Deserialize;
use tch::{Device, Kind, Tensor};

/// A family's mixture of experts, from its config.json.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub experts: i64,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: i64,
    /// Each expert's inner width.
    pub inner: i64,
    /// The top k probabilities renormalised to sum to 1 (`norm_topk_prob`; Mixtral's always).
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is the experts (else the dense MLP).
    pub sparse: Vec<bool>,
    /// `router_aux_loss_coef` when config.json's `output_router_logits` adds the load-balancing loss.
    pub aux_loss_coef: Option<f64>,
    /// The inner width of a SwiGLU MLP every token also goes through, its
    /// output scaled by a sigmoid gate of its own (Qwen2-MoE's `shared_expert`).
    pub shared_expert: Option<i64>,
    /// The sparse block's module in the Hub's files: `mlp` (Qwen, OLMoE) or
    /// Mixtral's `block_sparse_moe` (whose experts name their matrices w1,
    /// w3, w2 there; transformers 5 calls it `mlp` in memory).
    pub hub_module: &'static str,
}

/// The router keys every family shares.
#[derive(Deserialize)]
pub(crate) struct RouterKeys {
    pub num_experts_per_tok: i64,
    #[serde(default)]
    pub output_router_logits: bool,
    pub router_aux_loss_coef: f64,
}

impl RouterKeys {
    /// Checks the keys against `experts`; returns top-k and the loss's coefficient where it is on.
    pub(crate) fn validate(&self, (key, experts): (&str, i64)) -> Result<(i64, Option<f64>)> {
        check::sizes(&[("num_experts_per_tok", self.num_experts_per_tok)])?;
        if self.num_experts_per_tok > experts {
            bail!("num_experts_per_tok ({}) must be at most {key} ({experts})", self.num_experts_per_tok);
        }
        check::std("router_aux_loss_coef", self.router_aux_loss_coef)?;
        Ok((self.num_experts_per_tok, self.output_router_logits.then_some(self.router_aux_loss_coef)))
    }
}

/// The number of experts: `num_experts` (the Hub's Qwen and OLMoE configs)
/// or `num_local_experts` (Mixtral's, and what transformers 5 writes for
/// every family: its attribute map makes them one key).
#[derive(Deserialize)]
pub(crate) struct ExpertCount {
    #[serde(default)]
    num_experts: Option<i64>,
    #[serde(default)]
    num_local_experts: Option<i64>,
}

impl ExpertCount {
    /// The key that gives the count and the count (`default` when
    /// config.json gives neither key, under the family's own `key`).
    pub(crate) fn read(&self, key: &'static str, default: i64) -> Result<(&'static str, i64)> {
        let (key, experts) = match (self.num_experts, self.num_local_experts) {
            (Some(a), Some(b)) if a != b => bail!("num_experts ({a}) and num_local_experts ({b}) name the same number: give one, or the same in both"),
            (Some(count), _) => ("num_experts", count),
            (None, Some(count)) => ("num_local_experts", count),
            (None, None) => (key, default),
        };
        check::sizes(&[(key, experts)])?;
        Ok((key, experts))
    }
}

/// Which of `layers` layers are sparse, as transformers' Qwen MoE decoder
/// layers decide: not in `mlp_only_layers`, and every `decoder_sparse_step`-th.
pub(crate) fn sparse_layers(layers: i64, decoder_sparse_step: i64, mlp_only_layers: &[i64]) -> Result<Vec<bool>> {
    check::sizes(&[("decoder_sparse_step", decoder_sparse_step)])?;
    if let Some(layer) = mlp_only_layers.iter().find(|&&layer| !(0..layers).contains(&layer)) {
        bail!("mlp_only_layers names layer {layer}: the model's layers are 0 to {} (num_hidden_layers {layers})", layers - 1);
    }
    Ok((0..layers).map(|layer| !mlp_only_layers.contains(&layer) && (layer + 1) % decoder_sparse_step == 0).collect())
}

/// The Qwen MoE families' routing keys (Qwen2-MoE's and Qwen3-MoE's): the
/// experts' width, top-k's renormalisation and which layers are sparse.
#[derive(Deserialize)]
pub(crate) struct QwenRouting {
    num_hidden_layers: i64,
    moe_intermediate_size: i64,
    norm_topk_prob: bool,
    decoder_sparse_step: i64,
    /// None is transformers' empty list.
    mlp_only_layers: Option<Vec<i64>>,
}

impl QwenRouting {
    /// The experts a Qwen MoE `config` describes (`default_experts` when it
    /// gives no count), with a shared expert of `shared_expert` width (Qwen2-MoE's).
    pub(crate) fn experts(config: &serde_json::Value, default_experts: i64, shared_expert: Option<i64>) -> Result<Moe> {
        let keys: QwenRouting = check::parse(config)?;
        let (experts_key, experts) = check::parse::<ExpertCount>(config)?.read("num_experts", default_experts)?;
        check::sizes(&[("moe_intermediate_size", keys.moe_intermediate_size)])?;
        check::layers("num_hidden_layers", keys.num_hidden_layers)?;
        let (top_k, aux_loss_coef) = check::parse::<RouterKeys>(config)?.validate((experts_key, experts))?;
        let sparse = sparse_layers(keys.num_hidden_layers, keys.decoder_sparse_step, keys.mlp_only_layers.as_deref().unwrap_or_default())?;
        Ok(Moe { experts, top_k, inner: keys.moe_intermediate_size, norm_topk_prob: keys.norm_topk_prob, sparse, aux_loss_coef, shared_expert, hub_module: "mlp" })
    }
}

/// The fused expert parameters of a sparse layer, by in-block name
/// (transformers 5's under the block): what LoRA's `experts` target adapts.
pub(crate) const EXPERT_PARAMETERS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// A sparse layer's router [E, hidden], by in-block name.
const ROUTER: &str = "mlp.router";

/// Whether QLoRA holds a sparse model's block parameter in 4 bits: the
/// linear layers' weights (a shared expert's and its gate's), as
/// bitsandbytes quantizes them, and the fused experts, blocked flat as
/// bitsandbytes' `quantize_4bit` blocks a 3-D tensor; not the router, which
/// bitsandbytes leaves in the compute dtype (in transformers 5 it is no `nn.Linear`).
pub(crate) fn held_in_4bit(param: &ParamSpec) -> bool {
    EXPERT_PARAMETERS.contains(&param.name.as_str()) || (param.shape.len() == 2 && param.name != ROUTER)
}

/// A fused expert weight [E, N, K] and its adapter, if LoRA adapts it.
struct Projection<'a> {
    weight: &'a Tensor,
    adapter: Option<model::ExpertAdapter>,
}

/// How a sparse layer runs its experts' GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertGemms {
    /// ATen's grouped GEMM (`_grouped_mm`): one kernel per projection over
    /// every expert, the slices' ends read on the device.
    Grouped,
    /// One matmul per expert, the slices' sizes read on the host.
    Loop,
}

/// The environment variable that forces [`ExpertGemms::Loop`] (`FT_MOE_GEMM=loop`).
const GEMM_VARIABLE: &str = "FT_MOE_GEMM";

impl ExpertGemms {
    /// Grouped where ATen runs `_grouped_mm` as one CUTLASS kernel: bf16 on
    /// a GPU of compute capability 9.x or 10.x (Hopper, Blackwell). Elsewhere
    /// ATen's own fallback loops over the groups after copying their ends to
    /// the host, as the loop does, so the loop runs (the CPU, where the
    /// equality tests run, included); and wherever `FT_MOE_GEMM=loop`.
    pub(crate) fn on(device: Device, kind: Kind) -> ExpertGemms {
        let Device::Cuda(index) = device else { return ExpertGemms::Loop };
        let hopper_or_blackwell = ft_core::kernels::compute_capability(index).is_ok_and(|(major, _)| major == 9 || major == 10);
        // A bad FT_MOE_GEMM was refused when the model was built (`check_environment`).
        if kind == Kind::BFloat16 && hopper_or_blackwell && !Self::loop_asked().unwrap_or(true) {
            ExpertGemms::Grouped
        } else {
            ExpertGemms::Loop
        }
    }

    /// Refuses an `FT_MOE_GEMM` other than `loop` (or empty), before any step runs.
    pub(crate) fn check_environment() -> Result<()> {
        Self::loop_asked().map(|_| ())
    }

    fn loop_asked() -> Result<bool> {
        match std::env::var(GEMM_VARIABLE).unwrap_or_default().as_str() {
            "" => Ok(false),
            "loop" => Ok(true),
            value => bail!("{GEMM_VARIABLE}={value:?}: its one value is loop (the experts' GEMMs one matmul per expert, in place of ATen's grouped GEMM); unset it for the default"),
        }
    }
}

impl Moe {
    /// The parameters of a sparse layer's MLP (names inside its block, under `prefix` in the files), for hidden size `hidden`.
    pub(crate) fn params(&self, prefix: &str, hidden: i64, init: Init) -> Vec<ParamSpec> {
        let (e, i) = (self.experts, self.inner);
        let routed = |name: &str, hub: &str, shape: &[i64]| ParamSpec { hf_name: format!("{prefix}{}.{hub}", self.hub_module), name: name.into(), shape: shape.to_vec(), init };
        // The router is no linear layer (not `….weight` inside the block), as
        // transformers 5's is none: LoRA's all-linear and float8 leave it alone.
        let mut params = vec![
            routed(ROUTER, "gate.weight", &[e, hidden]),
            routed(EXPERT_PARAMETERS[0], "experts.gate_up_proj", &[e, 2 * i, hidden]),
            routed(EXPERT_PARAMETERS[1], "experts.down_proj", &[e, hidden, i]),
        ];
        if let Some(shared) = self.shared_expert {
            params.extend([
                ParamSpec::new(prefix, "mlp.shared_expert.gate_proj.weight", &[shared, hidden], init),
                ParamSpec::new(prefix, "mlp.shared_expert.up_proj.weight", &[shared, hidden], init),
                ParamSpec::new(prefix, "mlp.shared_expert.down_proj.weight", &[hidden, shared], init),
                ParamSpec::new(prefix, "mlp.shared_expert_gate.weight", &[1, hidden], init),
            ]);
        }
        params
    }

    /// How the experts' GEMMs run for hidden size `hidden` on `device` in
    /// `kind`: grouped where [`ExpertGemms::on`] says and the rows and
    /// columns ATen's grouped kernel reads are 16-byte aligned (both widths
    /// multiples of 8 bf16 values).
    pub(crate) fn gemms(&self, hidden: i64, device: Device, kind: Kind) -> ExpertGemms {
        if hidden % 8 == 0 && self.inner % 8 == 0 {
            ExpertGemms::on(device, kind)
        } else {
            ExpertGemms::Loop
        }
    }

    /// Whether layer `layer`'s MLP is the experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse.get(layer).copied().unwrap_or(false)
    }

    /// What a sparse layer's experts keep for backward per token (`ft
    /// plan`'s activations), for hidden size `hidden`: the router's fp32
    /// probabilities and top-k weights, and for each of the k assignments
    /// its permuted input (the grouped GEMM's), its gate and up projections
    /// (SwiGLU's), the SwiGLU output (the down GEMM's input) and the
    /// expert's output (weighed by the router); a shared expert's MLP too.
    pub(crate) fn saved(&self, hidden: i64) -> Vec<Saved> {
        let k = self.top_k;
        let mut saved = vec![
            Saved::fp32("router probabilities and top-k weights", self.experts + k),
            Saved::compute("each assignment's input and expert output", 2 * k * hidden),
            Saved::compute("each assignment's gate and up projections and SwiGLU output", 3 * k * self.inner),
        ];
        if let Some(shared) = self.shared_expert {
            saved.push(Saved::compute("the shared expert's projections, SwiGLU output and gate", 3 * shared + 1));
        }
        saved
    }

    /// Compute-dtype elements per token a sparse layer's backward holds at
    /// once besides them: the gradients of the assignments' gate and up
    /// projections and SwiGLU output.
    pub(crate) fn backward_per_token(&self) -> i64 {
        3 * self.top_k * self.inner
    }

    /// The parameters the experts add beyond the k a token uses, per sparse layer: what training FLOPs leave out.
    pub(crate) fn idle_params_per_layer(&self, hidden: i64) -> i64 {
        (self.experts - self.top_k) * 3 * hidden * self.inner
    }

    /// The sparse MLP of `x` ([batch, seq, hidden], after the norm): the
    /// router (softmax, top k, renormalised if asked) and the experts;
    /// records the load-balancing term in `ctx` when the loss is on.
    pub fn forward(&self, p: &Params, x: &Tensor, ctx: &Context) -> Tensor {
        let (batch, seq, hidden) = x.size3().expect("hidden states are [batch, seq, hidden]");
        let tokens = x.reshape([-1, hidden]);
        let logits = tokens.linear::<&Tensor>(p.get(ROUTER), None);
        let probs = logits.softmax(-1, Kind::Float);
        let (top, chosen) = probs.topk(self.top_k, -1, true, true);
        let top = if self.norm_topk_prob { &top / top.sum_dim_intlist(-1, true, Kind::Float) } else { top };
        let projections = EXPERT_PARAMETERS.map(|name| Projection { weight: p.get(name), adapter: p.expert_adapter(name, self.experts) });
        let gemms = self.gemms(hidden, x.device(), x.kind());
        let mut out = self.experts(&projections, &tokens, &chosen, &top, gemms, ctx.experts.as_deref());
        if self.shared_expert.is_some() {
            let gated = model::swiglu(&p.linear(&tokens, "mlp.shared_expert.gate_proj"), &p.linear(&tokens, "mlp.shared_expert.up_proj"));
            out += p.linear(&tokens, "mlp.shared_expert_gate").sigmoid() * p.linear(&gated, "mlp.shared_expert.down_proj");
        }
        if self.aux_loss_coef.is_some() {
            ctx.auxiliary.record(self.load_balancing_term(&probs, &chosen, ctx.auxiliary.real_tokens.as_ref()));
        }
        out.view([batch, seq, hidden])
    }

    /// Every token's k experts, weighed: the assignments sorted by expert, so
    /// each expert's tokens are one contiguous slice, one SwiGLU MLP per
    /// slice through `gemms` (`gate_up` then `down`, each with its adapter's
    /// update where LoRA adapts it), then each token's outputs weighed by
    /// `weights` ([tokens, k], fp32) and summed in one pass
    /// (`model::combine_experts`). Under expert parallelism (`exchange`), the slices go to
    /// the ranks holding their experts and the outputs come back
    /// ([`Self::exchanged_mlps`]). Only the GEMMs differ by `gemms`.
    fn experts(&self, projections: &[Projection; 2], tokens: &Tensor, chosen: &Tensor, weights: &Tensor, gemms: ExpertGemms, exchange: Option<&dyn ExpertExchange>) -> Tensor {
        let (sorted, order) = chosen.reshape([-1]).sort_stable(true, 0, false);
        let token_of = order.divide_scalar_mode(self.top_k, "floor");
        let inputs = tokens.index_select(0, &token_of);
        let outputs = match exchange {
            None => self.mlps(projections, &inputs, &expert_ends(&sorted, self.experts, true), gemms),
            Some(exchange) => self.exchanged_mlps(projections, &inputs, &sorted, gemms, exchange).unwrap_or_else(|e| ft_core::panic::raise(e)),
        };
        // Where each assignment's row is among the sorted ones: `order`'s inverse.
        let at = order.zeros_like().scatter(0, &order, &Tensor::arange(order.size()[0], (Kind::Int64, order.device())));
        model::combine_experts(&outputs, weights, &at)
    }

    /// The assignments' rows `inputs`, sorted by expert over all E, through
    /// this rank's experts (`projections`' weights hold rows `rank·E/N ..`
    /// of the layer's, N the expert group's ranks; their adapters, every
    /// expert's, are narrowed to those rows): each member's rows for the
    /// experts a rank holds are sent to it — the counts first, so each
    /// knows what it receives — run through those experts, and sent back,
    /// in `inputs`' order.
    fn exchanged_mlps(&self, projections: &[Projection; 2], inputs: &Tensor, sorted: &Tensor, gemms: ExpertGemms, exchange: &dyn ExpertExchange) -> anyhow::Result<Tensor> {
        let (ranks, local) = (exchange.size() as i64, projections[0].weight.size()[0]);
        let start = exchange.rank() as i64 * local;
        let projections = projections.each_ref().map(|p| Projection { weight: p.weight, adapter: p.adapter.as_ref().map(|adapter| adapter.rows(start, local)) });
        // Rows per expert, then per rank holding it; what each member sends each rank, per local expert.
        let ends = expert_ends(sorted, self.experts, false);
        let counts = ends.diff(1, 0, Some(ends.zeros_like().narrow(0, 0, 1)), None::<Tensor>);
        let received_counts = exchange.exchange(&counts.view([self.experts, 1]), &vec![local; ranks as usize], &vec![local; ranks as usize])?.reshape([-1]);
        // The splits on the host (c10d takes them there): the layer's one wait for the device, both counts in one copy.
        let on_host = Vec::<i64>::try_from(Tensor::cat(&[&counts, &received_counts], 0).to_device(Device::Cpu))?;
        let (counts, received_blocks) = on_host.split_at(self.experts as usize);
        let sent: Vec<i64> = counts.chunks(local as usize).map(|chunk| chunk.iter().sum()).collect();
        let received: Vec<i64> = received_blocks.chunks(local as usize).map(|chunk| chunk.iter().sum()).collect();
        let rows = exchange.exchange(inputs, &sent, &received)?;
        // Received grouped by member, then by expert: regrouped by expert, as
        // the GEMMs take them, on the device (a copy of indices from the host
        // would wait for the device again).
        let total: i64 = received.iter().sum();
        let expert_of_row = Tensor::repeat_interleave(&received_counts, total).remainder(local);
        let (by_expert_ids, by_expert) = expert_of_row.sort_stable(true, 0, false);
        let outputs = self.mlps(&projections, &rows.index_select(0, &by_expert), &expert_ends(&by_expert_ids, local, true), gemms);
        let outputs = outputs.zeros_like().index_copy(0, &by_expert, &outputs);
        exchange.exchange(&outputs, &received, &sent)
    }

    /// One SwiGLU MLP per expert of `projections` (`gate_up`, `down`) over
    /// `inputs`, sorted by expert, expert e's rows ending at `ends[e]`
    /// (int32, on the device).
    fn mlps(&self, projections: &[Projection; 2], inputs: &Tensor, ends: &Tensor, gemms: ExpertGemms) -> Tensor {
        let [gate_up, down] = projections;
        // A weight the flat buffer holds at an offset not 16-byte aligned, or
        // an adapter whose rank rows are not 16 bytes: ATen's kernel refuses it.
        let aligned = |weight: &Tensor| weight.data_ptr() as usize % 16 == 0;
        let readable = |projection: &Projection| {
            aligned(projection.weight) && projection.adapter.as_ref().is_none_or(|adapter| aligned(&adapter.a) && adapter.a.size()[1] * adapter.a.kind().elt_size_in_bytes() as i64 % 16 == 0)
        };
        let gemms = if readable(gate_up) && readable(down) { gemms } else { ExpertGemms::Loop };
        // The loop's slice sizes, read on the host once per layer (the grouped GEMM reads `ends` on the device).
        let sizes = (gemms == ExpertGemms::Loop).then(|| {
            let ends = Vec::<i32>::try_from(ends).expect("expert offsets are int32");
            ends.iter().scan(0, |start, &end| Some(i64::from(end - std::mem::replace(start, end)))).collect::<Vec<i64>>()
        });
        // `x` [assignments, K] times each expert's slice of `weight` [E, N, K] transposed: [assignments, N].
        let gemm = |x: &Tensor, weight: &Tensor| match &sizes {
            None => x.internal_grouped_mm(&weight.transpose(-2, -1), Some(ends), None, None),
            Some(sizes) => {
                let slices: Vec<Tensor> = x.split_with_sizes(sizes, 0).iter().zip(weight.unbind(0)).map(|(x, w)| x.matmul(&w.tr())).collect();
                Tensor::cat(&slices, 0)
            }
        };
        // The experts' GEMM, plus LoRA's `scale · (x·A[e]ᵀ)·B[e]ᵀ` where an adapter targets the weight.
        let project = |x: &Tensor, projection: &Projection| match &projection.adapter {
            None => gemm(x, projection.weight),
            Some(adapter) => gemm(x, projection.weight) + gemm(&gemm(x, &adapter.a), &adapter.b) * adapter.scale,
        };
        let gated = model::swiglu_halves(&project(inputs, gate_up));
        project(&gated, down)
    }

    /// The load-balancing term of one layer over its real tokens (`real`,
    /// [tokens] of 1 and 0; None: all): the router probabilities summed per
    /// expert (values), and the top-k assignments per expert with the
    /// tokens counted (statistics, [experts + 1]).
    fn load_balancing_term(&self, probs: &Tensor, chosen: &Tensor, real: Option<&Tensor>) -> AuxiliaryTerm {
        let real = match real {
            Some(mask) => mask.to_kind(Kind::Float),
            None => Tensor::ones([probs.size()[0]], (Kind::Float, probs.device())),
        };
        let values = (probs * real.unsqueeze(1)).sum_dim_intlist(0, false, Kind::Float);
        let counted = real.unsqueeze(1).expand([-1, self.top_k], false).reshape([-1]);
        let assignments = Tensor::zeros([self.experts], (Kind::Float, probs.device())).scatter_add(0, &chosen.reshape([-1]), &counted);
        let statistics = Tensor::cat(&[assignments, real.sum(Kind::Float).unsqueeze(0)], 0).detach();
        AuxiliaryTerm { values, statistics }
    }
}

/// transformers' `load_balancing_loss_func`: E · Σ_e f_e · P_e, with f_e the
/// share of all layers' top-k assignments that went to expert e and P_e its
/// mean router probability, both over every sparse layer's real tokens.
/// Linear in each layer's probability sums, with weight E · count_e / T²
/// (T: tokens counted over the layers).
impl AuxiliaryLoss for Moe {
    fn weights(&self, statistics: &Tensor) -> Tensor {
        let totals = statistics.sum_dim_intlist(0, false, Kind::Float);
        let (assignments, tokens) = (totals.narrow(0, 0, self.experts), totals.narrow(0, self.experts, 1));
        let weights = assignments * self.experts as f64 / tokens.square().clamp_min(1.0);
        weights.unsqueeze(0).expand([statistics.size()[0], self.experts], true)
    }

    fn coefficient(&self) -> f64 {
        self.aux_loss_coef.unwrap_or(0.0)
    }

    /// Per sparse layer, its experts' load over the step's real tokens: the
    /// least and the most loaded expert's share of the layer's assignments
    /// (1/E each when balanced) and the coefficient of variation of the
    /// assignments per expert (0 when balanced); and the assignments the
    /// router's statistics are short of k per token (always 0: dropless).
    fn figures(&self, statistics: &Tensor) -> Vec<(String, Tensor)> {
        let assignments = statistics.narrow(1, 0, self.experts);
        let tokens = statistics.narrow(1, self.experts, 1).sum(Kind::Float);
        let shares = &assignments / assignments.sum_dim_intlist(1, true, Kind::Float).clamp_min(1.0);
        let variation = assignments.std_dim(1, false, false) / assignments.mean_dim(1, false, Kind::Float).clamp_min(1e-12);
        let layers = self.sparse.iter().enumerate().filter(|(_, &sparse)| sparse).map(|(layer, _)| layer);
        let mut figures = vec![];
        for (row, layer) in layers.enumerate().take(statistics.size()[0] as usize) {
            let row = row as i64;
            figures.push((format!("moe/layer_{layer}/load_min"), shares.get(row).min()));
            figures.push((format!("moe/layer_{layer}/load_max"), shares.get(row).max()));
            figures.push((format!("moe/layer_{layer}/load_cv"), variation.get(row)));
        }
        figures.push(("moe/dropped_assignments".into(), tokens * self.top_k as f64 - assignments.sum(Kind::Float)));
        figures
    }
}

/// Where each of `experts` experts' rows end among assignments `sorted` by
/// expert, int32 as the grouped GEMM takes them (`int32`) or int64: on the
/// device, read nowhere on the host (a bincount would read its maximum
/// there, a wait for the device).
fn expert_ends(sorted: &Tensor, experts: i64, int32: bool) -> Tensor {
    Tensor::arange(experts, (sorted.kind(), sorted.device())).searchsorted(sorted, int32, true, "right", None::<Tensor>)
}

/// The tensors the Hub's files store a fused expert parameter as: for
/// `….mlp.experts.gate_up_proj` of `experts` experts, each expert's
/// `gate_proj.weight` and `up_proj.weight` (stacked over experts, each pair
/// concatenated along the rows); for `….mlp.experts.down_proj`, each
/// expert's `down_proj.weight`; Mixtral's `….block_sparse_moe.experts.*`
/// the same as `w1` (gate), `w3` (up) and `w2` (down). None for any other
/// parameter.
pub(crate) fn hub_parts(hf_name: &str, experts: i64) -> Option<Vec<Vec<String>>> {
    let layouts: [(&str, &[&str], &[&str]); 2] = [("mlp", &["gate_proj", "up_proj"], &["down_proj"]), ("block_sparse_moe", &["w1", "w3"], &["w2"])];
    layouts.iter().find_map(|(module, gate_up, down)| {
        let (stem, projections) = match hf_name.strip_suffix(&format!("{module}.experts.gate_up_proj")) {
            Some(stem) => (stem, gate_up),
            None => (hf_name.strip_suffix(&format!("{module}.experts.down_proj"))?, down),
        };
        Some((0..experts).map(|e| projections.iter().map(|projection| format!("{stem}{module}.experts.{e}.{projection}.weight")).collect()).collect())
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    /// Each family's MoE keys are read and refused by name: what ft would
    /// otherwise compute differently from transformers, or not at all.
    #[test]
    fn moe_keys_are_checked_and_refused_by_name() {
        let base = json!({"hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 8, "num_experts": 4, "num_experts_per_tok": 2});
        let build = |model_type: &str, change: Value| {
            let mut config = base.clone();
            config.as_object_mut().unwrap().extend(change.as_object().unwrap().clone());
            let build = match model_type {
                "qwen3_moe" => |c| crate::qwen3_moe::new(c),
                "qwen2_moe" => |c| crate::qwen2_moe::new(c),
                "olmoe" => |c| crate::olmoe::new(c),
                _ => |c| crate::mixtral::new(c),
            };
            build(config).map(|_| ()).map_err(|e| e.to_string())
        };
        for family in ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"] {
            assert_eq!(build(family, json!({})), Ok(()), "{family}");
            assert_eq!(build(family, json!({"num_experts_per_tok": 5})), Err("num_experts_per_tok (5) must be at most num_experts (4)".into()), "{family}");
            assert_eq!(build(family, json!({"num_local_experts": 3})), Err("num_experts (4) and num_local_experts (3) name the same number: give one, or the same in both".into()));
            assert_eq!(build(family, json!({"router_aux_loss_coef": -1.0})), Err("router_aux_loss_coef must be a finite number of at least 0, not -1".into()));
        }
        for family in ["qwen3_moe", "qwen2_moe"] {
            assert_eq!(build(family, json!({"mlp_only_layers": [2]})), Err("mlp_only_layers names layer 2: the model's layers are 0 to 1 (num_hidden_layers 2)".into()));
            assert_eq!(build(family, json!({"decoder_sparse_step": 0})), Err("decoder_sparse_step must be at least 1, not 0".into()));
            assert!(build(family, json!({"use_sliding_window": true})).unwrap_err().starts_with("use_sliding_window: true is not supported"));
        }
        assert!(build("olmoe", json!({"clip_qkv": 8.0})).unwrap_err().starts_with("clip_qkv 8 is not supported"));
        assert!(build("olmoe", json!({"head_dim": 4})).unwrap_err().starts_with("head_dim (4) must be hidden_size / num_attention_heads (8) for OLMoE"));
        assert!(build("mixtral", json!({"router_jitter_noise": 0.01})).unwrap_err().starts_with("router_jitter_noise 0.01 is not supported"));
    }

    /// LoRA's all-linear adapts what peft's adapts on transformers 5's
    /// Qwen2-MoE — attention, the dense and shared MLPs, the shared
    /// expert's gate — never the router (no nn.Linear there) nor the
    /// experts (3-D), which `experts` adapts: the sparse layers' fused
    /// parameters, under peft's nested names; short names that would reach
    /// only the dense MLPs (`gate`, `up`, `down`) are refused, not
    /// half-served; so are `experts` with dropout, which peft's adapters on
    /// parameters refuse. Over a 4-bit base (QLoRA) the experts are held in
    /// 4 bits with the linear layers, the router as bitsandbytes leaves it.
    #[test]
    fn lora_adapts_the_experts_only_by_name() {
        let config = json!({"hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 8, "num_experts": 4,
            "num_experts_per_tok": 2, "mlp_only_layers": [1]});
        let lora = |targets: &[&str]| {
            let lora = ft_core::config::LoraConfig { r: 2, alpha: None, dropout: 0.0, targets: targets.iter().map(|t| t.to_string()).collect() };
            ft_core::lora::LoraModel::new(Box::new(crate::qwen2_moe::new(config.clone()).unwrap()), &lora)
        };
        let model = lora(&["all-linear"]).unwrap();
        let modules: std::collections::BTreeSet<&str> = model.targets().iter().map(|t| t.module.as_str()).collect();
        assert!(modules.contains("mlp.shared_expert.gate_proj") && modules.contains("mlp.shared_expert_gate") && modules.contains("mlp.gate_proj"), "{modules:?}");
        assert!(modules.iter().all(|m| !m.contains("router") && !m.contains("experts")), "{modules:?}");
        use ft_core::model::Model;
        let experts = lora(&["experts"]).unwrap();
        let adapted: Vec<(&str, bool)> = experts.targets().iter().map(|t| (t.hf_module.as_str(), t.fused_experts)).collect();
        assert_eq!(adapted, [("model.layers.0.mlp.experts.gate_up_proj", true), ("model.layers.0.mlp.experts.down_proj", true)]);
        let files: Vec<(&str, &[i64])> = experts.units()[experts.base_units()..].iter().flat_map(|u| &u.params).map(|p| (p.hf_name.as_str(), p.shape.as_slice())).collect();
        assert_eq!(
            files,
            [
                ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight", &[8, 16][..]),
                ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight", &[16, 8]),
                ("base_model.model.model.layers.0.mlp.experts.lora_A.weight", &[8, 8]),
                ("base_model.model.model.layers.0.mlp.experts.lora_B.weight", &[16, 8]),
            ]
        );
        let dropout = ft_core::config::LoraConfig { r: 2, alpha: None, dropout: 0.1, targets: vec!["experts".into()] };
        let message = ft_core::lora::LoraModel::new(Box::new(crate::qwen2_moe::new(config.clone()).unwrap()), &dropout).err().expect("refused").to_string();
        assert!(message.starts_with("train.lora.dropout is 0.1: adapters on the experts take no dropout"), "{message}");
        let dense = json!({"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 8});
        let dense = ft_core::lora::LoraModel::new(Box::new(crate::qwen2::new(dense).unwrap()), &ft_core::config::LoraConfig { dropout: 0.0, ..dropout });
        assert_eq!(dense.err().expect("refused").to_string(), "train.lora.targets: experts adapts a mixture of experts' fused experts, and qwen2 has none");
        for target in ["gate", "up", "down"] {
            let message = lora(&[target]).err().expect("refused").to_string();
            assert!(message.starts_with(&format!("train.lora.targets: \"{target}\" names no linear layer")), "{message}");
        }
        let quantization = Some(ft_core::nf4::Quantization { quant_type: ft_core::nf4::QuantType::Nf4, blocksize: 64, double_quant: false });
        let lora = ft_core::config::LoraConfig { r: 2, alpha: None, dropout: 0.0, targets: vec!["q".into()] };
        // QLoRA holds the experts, the shared expert and its gate in 4 bits, the router and norms in the compute dtype.
        let qlora = ft_core::lora::RunModel::new(Box::new(crate::qwen2_moe::new(config.clone()).unwrap()), &lora, quantization).unwrap();
        // The block's units: its own, then its experts' (`Stage::units`).
        let units = qlora.model().units();
        let block: Vec<&ft_core::model::ParamSpec> = qlora.model().stages()[1].units().flat_map(|unit| &units[unit].params).collect();
        let held: Vec<&str> = block.iter().filter(|p| qlora.model().held_in_4bit(p)).map(|p| p.name.as_str()).collect();
        let kept: Vec<&str> = block.iter().filter(|p| !qlora.model().held_in_4bit(p) && p.shape.len() > 1).map(|p| p.name.as_str()).collect();
        assert!(held.contains(&"mlp.experts.gate_up_proj") && held.contains(&"mlp.experts.down_proj") && held.contains(&"mlp.shared_expert_gate.weight"), "{held:?}");
        assert_eq!(kept, ["mlp.router"]);
    }

    /// The grouped GEMM (ATen's `_grouped_mm`, which also runs on the CPU)
    /// gives the loop's outputs and gradients, an expert with no token
    /// included, with and without adapters on the experts; on the CPU the
    /// loop is what runs.
    #[test]
    fn grouped_gemm_equals_the_loop() {
        use super::{ExpertGemms, Moe, Projection};
        use tch::{Device, Kind, Tensor};
        assert_eq!(ExpertGemms::on(Device::Cpu, Kind::BFloat16), ExpertGemms::Loop);
        tch::manual_seed(0);
        let (experts, top_k, inner, hidden, tokens, rank) = (4, 2, 8, 16, 6, 4);
        let moe = Moe { experts, top_k, inner, norm_topk_prob: true, sparse: vec![true], aux_loss_coef: None, shared_expert: None, hub_module: "mlp" };
        let x = Tensor::randn([tokens, hidden], (Kind::Float, Device::Cpu));
        // Expert 2 chosen by no token.
        let chosen = Tensor::from_slice(&[0i64, 1, 3, 0, 1, 3, 0, 1, 3, 3, 0, 1]).view([tokens, top_k]);
        let weights = Tensor::rand([tokens, top_k], (Kind::Float, Device::Cpu));
        let random = |shape: &[i64]| (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.3).set_requires_grad(true);
        let (gate_up, down) = (random(&[experts, 2 * inner, hidden]), random(&[experts, hidden, inner]));
        let (a, b) = (random(&[experts, rank, inner]), random(&[experts, hidden, rank]));
        for adapted in [false, true] {
            let run = |gemms| {
                let adapter = adapted.then(|| ft_core::model::ExpertAdapter { a: a.shallow_clone(), b: b.shallow_clone(), scale: 2.0 });
                let projections = [Projection { weight: &gate_up, adapter: None }, Projection { weight: &down, adapter }];
                let out = moe.experts(&projections, &x, &chosen, &weights, gemms, None);
                let differentiated = if adapted { vec![&gate_up, &down, &a, &b] } else { vec![&gate_up, &down] };
                let grads = Tensor::run_backward(&[(&out * &out).sum(Kind::Float)], &differentiated, false, false);
                (out.detach(), grads)
            };
            let ((grouped, grouped_grads), (looped, looped_grads)) = (run(ExpertGemms::Grouped), run(ExpertGemms::Loop));
            assert!(grouped.allclose(&looped, 1e-5, 1e-6, false), "outputs differ by {}", (&grouped - &looped).abs().max());
            for (g, l) in grouped_grads.iter().zip(&looped_grads) {
                assert!(g.allclose(l, 1e-5, 1e-6, false), "gradients differ by {}", (g - l).abs().max());
            }
            assert!(looped_grads[0].get(2).abs().sum(Kind::Float).double_value(&[]) == 0.0 && looped.abs().sum(Kind::Float).double_value(&[]) > 0.0);
        }
    }

    /// Layers are sparse as transformers' Qwen MoE decoder layers decide.
    #[test]
    fn sparse_layers_follow_the_step_and_the_dense_list() {
        assert_eq!(super::sparse_layers(4, 2, &[3]).unwrap(), [false, true, false, false]);
        assert_eq!(super::sparse_layers(3, 1, &[]).unwrap(), [true, true, true]);
    }
}
