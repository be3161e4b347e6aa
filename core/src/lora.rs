//! LoRA (Hu et al., 2021), as Hugging Face peft does it: the base model is
//! frozen and each targeted linear layer gains a trainable low-rank update,
//! `W x + (alpha / r) · B A dropout(x)`, A drawn Kaiming-uniform and B zero so
//! training starts from the base model's function. A mixture of experts'
//! fused experts ([E, N, K], target [`EXPERTS`]) gain one such update per
//! expert, as peft's `target_parameters` adds them (its `ParamWrapper`: no
//! dropout), stored as peft stores them ([`expert_factors`]).
//!
//! A [`LoraModel`] is a [`Model`]: the base's units, frozen (a
//! question-answering head stays trained, as peft's `modules_to_save` does
//! for that task), then one adapter unit per block with targets, holding
//! `{module}.lora_A.weight` [r, in] and `{module}.lora_B.weight` [out, r]
//! (for a fused expert parameter `{name}.lora_A.weight` [r·E, K] and
//! `{name}.lora_B.weight` [N, r·E]). Each block's stage names its adapter
//! unit and `Params::linear` (the experts' GEMMs through
//! `Params::expert_adapter`) adds the update, so the architectures' math is
//! untouched. The engine keeps a
//! frozen unit in the compute dtype only — sharded as the strategy says, no
//! fp32 master, gradient or moments (`distributed/flat.rs`) — and trains the adapters
//! like any unit.

use crate::config::LoraConfig;
use crate::model::{self, Activations, AdapterScaling, Context, Dims, Init, Inputs, KvCache, Layout, Model, ParamSpec, Params, StageKind, UnitSpec};
use crate::nf4::Quantization;
use anyhow::{bail, Context as _, Result};
use std::collections::BTreeSet;
use tch::{Device, Kind, Tensor};

/// The target that names every linear layer of the blocks, as peft's
/// `target_modules="all-linear"` does (every linear layer but the LM head,
/// which ft keeps outside the blocks; peft's also takes a linear layer
/// outside the blocks, OPT's `project_in` and `project_out`, which ft's
/// adapters, one unit per block, do not reach).
pub const ALL_LINEAR: &str = "all-linear";

/// The target that names the fused experts of a mixture of experts' sparse
/// blocks (`Model::expert_parameters`: `mlp.experts.gate_up_proj` and
/// `mlp.experts.down_proj`), as peft's `target_parameters` adapts them.
/// peft's `all-linear` names no experts on Qwen2-MoE; on Qwen3-MoE, OLMoE
/// and Mixtral it converts transformers 4's expert and router layers into
/// parameters at twice the rank for `gate_up_proj`, which ft does not: its
/// `all-linear` is the linear layers alone, and `experts` adds the experts.
pub const EXPERTS: &str = "experts";

/// One adapted linear layer or fused expert parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The unit holding its A and B, and the base unit holding its weight.
    pub adapter_unit: usize,
    pub base_unit: usize,
    /// Its name inside the base unit (`self_attn.q_proj`, whose weight is
    /// `….weight`; a fused expert parameter's own name,
    /// `mlp.experts.gate_up_proj`) and in the Hugging Face model
    /// (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    pub hf_module: String,
    /// Whether it is a fused expert parameter [E, N, K] (peft's `target_parameters`).
    pub fused_experts: bool,
}

/// peft's adapter on a fused expert parameter [E, N, K] of `experts`
/// experts (its `ParamWrapper`) stores A [r·E, K], expert e's rows at
/// e·r…, and B [N, r·E], expert e's columns at e, E + e, …: per expert, A
/// [E, r, K] and B [E, N, r] (contiguous, as a grouped GEMM reads them);
/// expert e's update is B[e]·A[e].
pub fn expert_factors(a: &Tensor, b: &Tensor, experts: i64) -> (Tensor, Tensor) {
    let (in_features, out_features) = (a.size()[1], b.size()[0]);
    (a.reshape([experts, -1, in_features]), b.reshape([out_features, -1, experts]).permute([2, 0, 1]).contiguous())
}

/// The Hugging Face path of a block unit's module: where its parameters'
/// names end in their in-block names (`model.layers.0.`).
fn block_path(unit: &UnitSpec) -> Option<&str> {
    unit.params.iter().find_map(|p| p.hf_name.strip_suffix(&p.name))
}

pub struct LoraModel {
    base: Box<dyn Model>,
    layout: Layout,
    config: LoraConfig,
    scaling: AdapterScaling,
    /// The base model's units come first in `layout.units`; adapters after.
    base_units: usize,
    /// Base units trained whole: the question-answering head.
    trained_base_units: Vec<usize>,
    targets: Vec<Target>,
    /// The base's blocks held in 4 bits (`model.quantize`).
    quantization: Option<Quantization>,
}

/// A linear layer of a base unit: (unit, its weight's spec, in-unit module name).
fn linear_layers(units: &[UnitSpec]) -> impl Iterator<Item = (usize, &ParamSpec, &str)> {
    units.iter().enumerate().flat_map(|(u, unit)| {
        unit.params.iter().filter(|p| p.shape.len() == 2).filter_map(move |p| Some((u, p, p.name.strip_suffix(".weight")?)))
    })
}

/// peft's rule: a target names a module by its whole name or its last dotted components.
fn names_module(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

impl LoraModel {
    /// `base` with adapters of `config` on the linear layers of its blocks that `config.targets` name.
    pub fn new(base: Box<dyn Model>, config: &LoraConfig) -> Result<LoraModel> {
        config.validate()?;
        let r = config.r as i64;
        let base_layout = base.layout();
        let blocks: BTreeSet<usize> = base.stages().iter().filter(|s| s.kind == StageKind::Block).map(|s| s.unit).collect();
        let aliases = base.lora_modules();
        let mut selected: BTreeSet<(usize, String)> = BTreeSet::new();
        for target in &config.targets {
            if target == EXPERTS {
                let experts = base.expert_parameters();
                if experts.is_empty() {
                    bail!("train.lora.targets: {EXPERTS} adapts a mixture of experts' fused experts, and {} has none", base.model_type());
                }
                if config.dropout > 0.0 {
                    bail!(
                        "train.lora.dropout is {}: adapters on the experts take no dropout, as peft's on parameters (target_parameters) take none; set it to 0 or drop {EXPERTS} from train.lora.targets",
                        config.dropout
                    );
                }
                // A sparse block's experts are units of their own (`Stage::experts`).
                for unit in base.stages().iter().filter(|s| s.kind == StageKind::Block).flat_map(|s| s.units()) {
                    selected.extend(base_layout.units[unit].params.iter().filter(|p| experts.contains(&p.name.as_str())).map(|p| (unit, p.name.clone())));
                }
                continue;
            }
            // `all-linear` takes every linear layer of the blocks (peft's: all but the LM head);
            // a short name stands for exact in-block names; any other is matched as peft matches it.
            let selects: Box<dyn Fn(&str) -> bool> = match aliases.iter().find(|(alias, _)| alias == target) {
                _ if target == ALL_LINEAR => Box::new(|_: &str| true),
                Some((_, modules)) => Box::new(move |module: &str| modules.contains(&module)),
                None => Box::new(|module: &str| names_module(module, target)),
            };
            let mut matched = false;
            for (unit, _, module) in linear_layers(&base_layout.units).filter(|(u, _, _)| blocks.contains(u)) {
                if selects(module) {
                    selected.insert((unit, module.to_string()));
                    matched = true;
                }
            }
            if !matched {
                let first_block = blocks.first().copied().unwrap_or(0);
                let modules: Vec<&str> = linear_layers(&base_layout.units).filter(|(u, _, _)| *u == first_block).map(|(_, _, m)| m).collect();
                let short: Vec<&str> = aliases.iter().map(|(alias, _)| *alias).collect();
                bail!(
                    "train.lora.targets: {target:?} names no linear layer of {}'s blocks; use {ALL_LINEAR}, {}the layers' names ({}){}",
                    base.model_type(),
                    if short.is_empty() { String::new() } else { format!("{} or ", short.join(", ")) },
                    modules.join(", "),
                    if base.expert_parameters().is_empty() { String::new() } else { format!("; {EXPERTS} adapts the experts") }
                );
            }
        }
        let mut units = base_layout.units.clone();
        let base_units = units.len();
        let mut stages = base_layout.stages.clone();
        let mut targets = vec![];
        for stage in stages.iter_mut().filter(|s| s.kind == StageKind::Block) {
            let block = stage.unit;
            let mut params = vec![];
            // A and B of `module` ([r, in] and [out, r], for r·E of a fused expert parameter), under `peft_module` in peft's file.
            let mut adapt = |module: &str, peft_module: &str, rank: i64, (out_features, in_features): (i64, i64)| {
                let spec = |matrix: &str, shape: &[i64], init| ParamSpec {
                    hf_name: format!("base_model.model.{peft_module}.{matrix}.weight"),
                    name: format!("{module}.{matrix}.weight"),
                    shape: shape.to_vec(),
                    init,
                };
                // kaiming_uniform_(a=√5) on [r, in]: bound = √(6 / ((1 + 5) · in)) = 1/√in.
                params.push(spec("lora_A", &[rank, in_features], Init::Uniform { bound: 1.0 / (in_features as f64).sqrt() }));
                params.push(spec("lora_B", &[out_features, rank], Init::Zeros));
            };
            for (_, weight, module) in linear_layers(&base_layout.units).filter(|(u, _, m)| *u == block && selected.contains(&(*u, m.to_string()))) {
                let hf_module = weight.hf_name.strip_suffix(".weight").unwrap_or(&weight.hf_name).to_string();
                adapt(module, &hf_module, r, (weight.shape[0], weight.shape[1]));
                targets.push(Target { adapter_unit: units.len(), base_unit: block, module: module.to_string(), hf_module, fused_experts: false });
            }
            let experts: Vec<(usize, &ParamSpec)> =
                stage.units().flat_map(|unit| units[unit].params.iter().map(move |p| (unit, p))).filter(|(unit, p)| selected.contains(&(*unit, p.name.clone()))).collect();
            for (i, &(expert_unit, parameter)) in experts.iter().enumerate() {
                let path = block_path(&units[block]).with_context(|| format!("{}: no parameter names its block's Hugging Face path", units[block].name))?;
                let (module, _) = parameter.name.rsplit_once('.').unwrap_or(("", &parameter.name));
                // peft wraps a module's parameters one in another, in their order: each wrapped later adds a `base_layer`.
                let later = experts[i + 1..].iter().filter(|(_, p)| p.name.rsplit_once('.').map(|(m, _)| m) == Some(module)).count();
                let peft_module = format!("{path}{module}{}", ".base_layer".repeat(later));
                let (count, out_features, in_features) = (parameter.shape[0], parameter.shape[1], parameter.shape[2]);
                adapt(&parameter.name, &peft_module, r * count, (out_features, in_features));
                let hf_module = format!("{path}{}", parameter.name);
                targets.push(Target { adapter_unit: units.len(), base_unit: expert_unit, module: parameter.name.clone(), hf_module, fused_experts: true });
            }
            if !params.is_empty() {
                stage.adapter = Some(units.len());
                units.push(UnitSpec { name: format!("{} lora", units[block].name), params });
            }
        }
        let trained_base_units = base
            .stages()
            .iter()
            .filter(|s| s.kind == StageKind::Head && base.head_kind() == model::head::QUESTION_ANSWERING)
            .map(|s| s.unit)
            .collect();
        let layout = Layout { hf_config: base_layout.hf_config.clone(), units, stages };
        let scaling = AdapterScaling { scale: config.alpha() / r as f64, dropout: config.dropout };
        Ok(LoraModel { base, layout, config: config.clone(), scaling, base_units, trained_base_units, targets, quantization: None })
    }

    pub fn base(&self) -> &dyn Model {
        self.base.as_ref()
    }

    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// This model over a base whose frozen blocks are held in 4 bits as
    /// `quantization` says (None: in the compute dtype): QLoRA.
    pub fn with_quantized_base(self, quantization: Option<Quantization>) -> LoraModel {
        LoraModel { quantization, ..self }
    }

    /// The base's frozen block weights in `params` (fp32, per unit) as the
    /// 4-bit base holds them — quantized and dequantized — for what reads
    /// a QLoRA run's model without its packed units (`ft forward`, `ft
    /// eval`, merging); nothing changes when the base is not quantized.
    pub fn round_base_to_4bit(&self, params: &mut [Vec<Tensor>]) -> Result<()> {
        let Some(quantization) = self.quantization else { return Ok(()) };
        for unit in model::block_units(self).filter(|&u| self.frozen(u)) {
            for (spec, tensor) in self.layout.units[unit].params.iter().zip(params[unit].iter_mut()) {
                if self.held_in_4bit(spec) {
                    *tensor = quantization.round_trip(tensor)?;
                }
            }
        }
        Ok(())
    }

    /// The units of the base model, `0..base_units()`; adapters follow.
    pub fn base_units(&self) -> usize {
        self.base_units
    }

    /// Base units trained whole besides the adapters (peft's `modules_to_save`).
    pub fn trained_base_units(&self) -> &[usize] {
        &self.trained_base_units
    }

    /// The adapted layers as peft's `target_modules`: their last name
    /// (`q_proj`) when those select exactly these layers among all of the
    /// model's linear layers, else their whole names.
    pub fn peft_target_modules(&self) -> Vec<String> {
        let chosen: BTreeSet<&str> = self.targets.iter().filter(|t| !t.fused_experts).map(|t| t.hf_module.as_str()).collect();
        let short: BTreeSet<&str> = chosen.iter().map(|m| m.rsplit('.').next().unwrap_or(m)).collect();
        let all = linear_layers(&self.base.layout().units).filter_map(|(_, p, _)| p.hf_name.strip_suffix(".weight"));
        let selected_by_short: BTreeSet<&str> = all.filter(|m| short.iter().any(|s| names_module(m, s))).collect();
        let names = if selected_by_short == chosen { short } else { chosen };
        names.into_iter().map(String::from).collect()
    }

    /// The adapted fused expert parameters as peft's `target_parameters`
    /// (`mlp.experts.down_proj`, …), sorted as peft writes them.
    pub fn peft_target_parameters(&self) -> Vec<String> {
        let names: BTreeSet<&str> = self.targets.iter().filter(|t| t.fused_experts).map(|t| t.module.as_str()).collect();
        names.into_iter().map(String::from).collect()
    }

    /// Fresh adapters for every adapter unit (A Kaiming-uniform, B zero), seeded.
    pub fn initial_adapters(&self, seed: i64, device: Device) -> Vec<Vec<Tensor>> {
        tch::manual_seed(seed);
        self.layout.units[self.base_units..].iter().map(|unit| unit.params.iter().map(|p| p.initial(Kind::Float, device)).collect()).collect()
    }

    /// What the run trains, in one line: rank, scale, layers and parameter counts.
    pub fn describe(&self) -> String {
        let frozen = self.frozen_numel();
        format!(
            "LoRA r={} alpha={} on {} layers ({}): {:.2}M trained parameters, the base's {:.1}M frozen",
            self.config.r,
            self.config.alpha(),
            self.targets.len(),
            [self.peft_target_modules(), self.peft_target_parameters()].concat().join(", "),
            (self.numel() - frozen) as f64 / 1e6,
            frozen as f64 / 1e6
        )
    }

    /// What QLoRA holds in 4 bits on a rank, in one line (None when the
    /// base is not quantized): the frozen blocks' weight matrices and fused
    /// experts (a rank of `expert_parallel` holding its share of each),
    /// how they are quantized, and the bytes that saves against holding
    /// them in `dtype`, the compute dtype (the blocks' vectors, and a
    /// router, stay in it either way).
    pub fn describe_quantized_base(&self, dtype: Kind, expert_parallel: usize) -> Option<String> {
        let quantization = self.quantization?;
        let units = self.units();
        let quantized: Vec<&ParamSpec> =
            model::block_units(self).filter(|&unit| self.frozen(unit)).flat_map(|unit| units[unit].params.iter().filter(|p| self.held_in_4bit(p))).collect();
        let is_experts = |p: &ParamSpec| self.expert_parameters().contains(&p.name.as_str());
        let held_here = |p: &ParamSpec| if is_experts(p) { p.numel() / expert_parallel as i64 } else { p.numel() };
        let params: i64 = quantized.iter().map(|p| held_here(p)).sum();
        let held: i64 = quantized.iter().map(|p| quantization.bytes(held_here(p))).sum();
        let unquantized = params * dtype.elt_size_in_bytes() as i64;
        let megabytes = |bytes: i64| format!("{:.2} MB", bytes as f64 / 1e6);
        let expert_tensors = quantized.iter().filter(|p| is_experts(p)).count();
        let experts = match (expert_tensors, expert_parallel) {
            (0, _) => String::new(),
            (_, 1) => format!(" and {expert_tensors} fused expert tensors (every expert)"),
            (_, degree) => format!(" and {expert_tensors} fused expert tensors (a rank's 1/{degree} of the experts, --expert-parallel {degree})"),
        };
        Some(format!(
            "QLoRA: {} weight matrices{experts} of the base's blocks ({params} parameters) held in {}, blocks of {} values{}: {} instead of {} in {}, {} saved",
            quantized.len() - expert_tensors,
            quantization.quant_type.name(),
            quantization.blocksize,
            if quantization.double_quant { ", double quantized" } else { "" },
            megabytes(held),
            megabytes(unquantized),
            crate::distributed::collectives_bench::dtype_name(dtype),
            megabytes(unquantized - held)
        ))
    }

    /// Folds the adapters into the base weights: W += (alpha / r) · B A
    /// (per expert for a fused expert parameter). `params` holds every unit
    /// of this model (base units first).
    pub fn merge(&self, params: &mut [Vec<Tensor>]) {
        let _no_grad = tch::no_grad_guard();
        for target in &self.targets {
            let (index, merged) = self.merged_weight(target, params);
            let weight = &mut params[target.base_unit][index];
            *weight = merged.to_kind(weight.kind());
        }
    }

    /// The base model's units with the adapters folded in, for decoding
    /// alone (online RL's rollouts, where [`samples_folded`]): each adapted
    /// unit ([`adapted_units`]) copied into one buffer laid out as its flat
    /// buffer is (`flat::unflatten`, so `Params::joined_linear` still runs
    /// q/k/v as one GEMM), W + (alpha / r) · B A rounded once into it; the
    /// other units are `params`' own. Each adapted layer's two low-rank GEMMs
    /// and add cost ~15 µs a decoding step on an H200 (`plan`'s fit): 3.4 of
    /// a Llama-7B step's 10 ms with every linear layer adapted. The copies
    /// take the adapted units' bytes again.
    pub fn merged_base(&self, params: &[Vec<Tensor>]) -> Vec<Vec<Tensor>> {
        use crate::distributed::flat;
        let _no_grad = tch::no_grad_guard();
        let mut base: Vec<Vec<Tensor>> = params[..self.base_units()].iter().map(|unit| unit.iter().map(Tensor::shallow_clone).collect()).collect();
        for u in adapted_units(self) {
            let spec = &self.layout.units[u];
            let laid_out: Vec<Tensor> = flat::param_offsets(spec).into_iter().map(|(i, _)| base[u][i].reshape(-1)).collect();
            base[u] = flat::unflatten(spec, &Tensor::cat(&laid_out, 0));
            for target in self.targets.iter().filter(|target| target.base_unit == u) {
                let (index, merged) = self.merged_weight(target, params);
                base[u][index].copy_(&merged);
            }
        }
        base
    }

    /// `target`'s base weight with its update, W + (alpha / r) · B A in
    /// fp32, and the weight's index in its base unit.
    fn merged_weight(&self, target: &Target, params: &[Vec<Tensor>]) -> (usize, Tensor) {
        let adapter = model::Params::new(&self.layout.units[target.adapter_unit], &params[target.adapter_unit]);
        let a = adapter.get(&format!("{}.lora_A.weight", target.module)).to_kind(Kind::Float);
        let b = adapter.get(&format!("{}.lora_B.weight", target.module)).to_kind(Kind::Float);
        let base = &self.layout.units[target.base_unit];
        let weight_name = if target.fused_experts { target.module.clone() } else { format!("{}.weight", target.module) };
        let index = base.params.iter().position(|p| p.name == weight_name).expect("targets name base weights");
        let weight = &params[target.base_unit][index];
        let update = if target.fused_experts {
            let (a, b) = expert_factors(&a, &b, weight.size()[0]);
            b.bmm(&a)
        } else {
            b.matmul(&a)
        };
        (index, weight.to_kind(Kind::Float) + update * self.scaling.scale)
    }
}

/// Whether online RL samples from the base with the adapters folded in
/// ([`LoraModel::merged_base`]): a LoRA model over a base in the compute
/// dtype, held whole (not gathered a unit at a time: `per_unit`). A 4-bit
/// base's unpacked copy is already the rollout's largest buffer.
pub fn samples_folded(model: &dyn Model, per_unit: bool) -> bool {
    !per_unit && model.adapter_scaling().is_some() && model.quantized_base().is_none()
}

/// The base units `model`'s adapters adapt, from its layout alone (what
/// `ft plan` sees): a stage's units holding a weight its adapter unit
/// names — `{module}.lora_A.weight` adapts `{module}.weight`, or the fused
/// expert parameter `{module}`.
pub fn adapted_units(model: &dyn Model) -> BTreeSet<usize> {
    let units = model.units();
    let adapts = |u: usize, modules: &[&str]| units[u].params.iter().any(|p| modules.contains(&p.name.strip_suffix(".weight").unwrap_or(&p.name)));
    let mut adapted = BTreeSet::new();
    for stage in &model.layout().stages {
        let Some(adapter) = stage.adapter else { continue };
        let modules: Vec<&str> = units[adapter].params.iter().filter_map(|p| p.name.strip_suffix(".lora_A.weight")).collect();
        adapted.extend(stage.units().filter(|&u| adapts(u, &modules)));
    }
    adapted
}

/// The model a run trains: every parameter of it, or LoRA adapters on it.
pub enum RunModel {
    Full(Box<dyn Model>),
    Lora(Box<LoraModel>),
}

impl RunModel {
    /// `base` as `config` (`train.lora`) says: wrapped in adapters when
    /// `r` is set, over blocks held in 4 bits as `quantization`
    /// (`model.quantize`) says, which needs adapters.
    pub fn new(base: Box<dyn Model>, config: &LoraConfig, quantization: Option<Quantization>) -> Result<RunModel> {
        Ok(match (config.enabled(), quantization) {
            (true, _) => RunModel::Lora(Box::new(LoraModel::new(base, config)?.with_quantized_base(quantization))),
            (false, None) => RunModel::Full(base),
            (false, Some(q)) => anyhow::bail!(
                "model.quantize={} (--quantize) holds a LoRA run's frozen base in 4 bits: set train.lora.r (--lora-r) to train adapters on it (a fully fine-tuned model cannot train in 4 bits)",
                q.quant_type.name()
            ),
        })
    }

    /// What the engine trains.
    pub fn model(&self) -> &dyn Model {
        match self {
            RunModel::Full(model) => model.as_ref(),
            RunModel::Lora(lora) => lora.as_ref(),
        }
    }

    /// The model whose weights files the run reads.
    pub fn base(&self) -> &dyn Model {
        match self {
            RunModel::Full(model) => model.as_ref(),
            RunModel::Lora(lora) => lora.base(),
        }
    }

    pub fn lora(&self) -> Option<&LoraModel> {
        match self {
            RunModel::Full(_) => None,
            RunModel::Lora(lora) => Some(lora),
        }
    }
}

impl Model for LoraModel {
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn quantized_base(&self) -> Option<Quantization> {
        self.quantization
    }
    fn dims(&self) -> Dims {
        self.base.dims()
    }
    fn activations(&self) -> Activations {
        self.base.activations()
    }
    fn head_kind(&self) -> &str {
        self.base.head_kind()
    }
    fn context(&self, inputs: &Inputs, past: i64, dtype: Kind, train: bool) -> Result<Context> {
        self.base.context(inputs, past, dtype, train)
    }
    fn embed(&self, params: &Params, inputs: &Inputs, ctx: &Context) -> Tensor {
        self.base.embed(params, inputs, ctx)
    }
    fn block(&self, params: &Params, x: &Tensor, ctx: &Context, layer: usize, cache: Option<&mut KvCache>) -> Tensor {
        self.base.block(params, x, ctx, layer, cache)
    }
    fn head(&self, params: &Params, x: &Tensor) -> Vec<Tensor> {
        self.base.head(params, x)
    }
    fn max_positions(&self) -> Option<i64> {
        self.base.max_positions()
    }
    fn initialised_if_missing(&self, hf_name: &str) -> bool {
        self.base.initialised_if_missing(hf_name)
    }
    fn ignored_if_unexpected(&self, checkpoint_name: &str) -> bool {
        self.base.ignored_if_unexpected(checkpoint_name)
    }
    fn frozen(&self, unit: usize) -> bool {
        unit < self.base_units && !self.trained_base_units.contains(&unit)
    }
    fn adapter_scaling(&self) -> Option<AdapterScaling> {
        Some(self.scaling)
    }
    fn lora_modules(&self) -> &'static [(&'static str, &'static [&'static str])] {
        self.base.lora_modules()
    }
    fn expert_parameters(&self) -> &'static [&'static str] {
        self.base.expert_parameters()
    }
    fn held_in_4bit(&self, param: &ParamSpec) -> bool {
        self.base.held_in_4bit(param)
    }
    fn auxiliary_loss(&self) -> Option<&dyn model::AuxiliaryLoss> {
        self.base.auxiliary_loss()
    }
    /// Not with adapters on the experts, whose rank may send their GEMMs
    /// through the loop, which reads sizes on the host (`moe.rs`).
    fn graph_capturable(&self, device: Device, dtype: Kind) -> bool {
        self.base.graph_capturable(device, dtype) && self.targets.iter().all(|t| !t.fused_experts)
    }
    fn logit_softcap(&self) -> Option<f64> {
        self.base.logit_softcap()
    }
    fn experts(&self) -> Option<crate::model::Experts> {
        self.base.experts()
    }

    /// The base's idle parameters (a mixture of experts' unchosen experts)
    /// and, in the same share, the adapters on its experts: one per expert,
    /// each run only for the tokens routed to it.
    fn idle_numel(&self) -> i64 {
        let base_idle = self.base.idle_numel();
        let experts = self.base.expert_parameters();
        let expert_numel: i64 = self.layout.units[..self.base_units].iter().flat_map(|u| &u.params).filter(|p| experts.contains(&p.name.as_str())).map(ParamSpec::numel).sum();
        if base_idle == 0 || expert_numel == 0 {
            return base_idle;
        }
        let adapted: Vec<String> = self.targets.iter().filter(|t| t.fused_experts).flat_map(|t| ["lora_A", "lora_B"].map(|m| format!("{}.{m}.weight", t.module))).collect();
        let expert_adapters: i64 = self.layout.units[self.base_units..].iter().flat_map(|u| &u.params).filter(|p| adapted.contains(&p.name)).map(ParamSpec::numel).sum();
        base_idle + (expert_adapters as f64 * base_idle as f64 / expert_numel as f64).round() as i64
    }

    /// The frozen parameters a token runs take forward and the input's
    /// gradient (4 of the 6 FLOPs per parameter), the adapters all 6.
    fn train_flops_per_token(&self, seq: i64) -> f64 {
        let base_idle = self.base.idle_numel();
        let frozen = self.frozen_numel() - base_idle;
        let adapters: i64 = self.layout.units[self.base_units..].iter().map(UnitSpec::numel).sum::<i64>() - (self.idle_numel() - base_idle);
        self.base.train_flops_per_token(seq) - 2.0 * frozen as f64 + 6.0 * adapters as f64
    }
}
