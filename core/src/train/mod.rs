//! The training engine: one process's training state — the model's units
//! as flat buffers (`distributed/flat.rs`) and AdamW — run data-parallel as a strategy's
//! policy says. One micro-batch's forward and backward is `step.rs`, the
//! gradient reductions it starts are `reduce.rs`, the optimizer step is
//! `optim.rs`, the causal-LM head's loss is `loss.rs`, and the process
//! groups a strategy needs are `distributed/parallel.rs`. docs/ARCHITECTURE.md follows
//! one training step through these files.

pub mod loss;
mod optim;
mod reduce;
mod step;

pub use crate::distributed::flat::unflatten;
/// Which kernels the step runs: the engine's choice, made below the models (`crate::kernels`).
pub use crate::kernels::Kernels;
pub use step::{GatheredPolicy, ReferenceModel};
pub(crate) use reduce::reductions_in_flight;

use crate::config::TrainConfig;
use crate::distributed::comm_hook::{Builtin, CommHook, Restored, UnitInfo, Workspace, WorldChange};
use crate::distributed::experts::{ExpertGroups, ExpertSeat, SharedHook};
use crate::distributed::flat::{FlatUnit, MemoryAccount, ShardLayout, UnitPlacement};
use crate::distributed::float8_gather::Float8Amaxes;
use crate::distributed::packed_base::PackedLayout;
use crate::distributed::parallel::{DataParallel, UnitGroups};
use crate::distributed::strategy::{ParamPlacement, ShardingPolicy};
use crate::model::{Float8Layers, Model, ParamSpec};
use crate::offload::Offload;
use anyhow::Result;
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use ft_sys::float8::{Float8, Recipe};
use ft_sys::AdamW;
use optim::LossScaler;
use tch::{Kind, Tensor};

/// Which of an optimizer step's micro-batches `Trainer::forward_backward` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroBatch {
    pub index: usize,
    /// The step's micro-batches (on each rank).
    pub count: usize,
}

impl MicroBatch {
    /// A step of one micro-batch.
    pub const ONLY: MicroBatch = MicroBatch { index: 0, count: 1 };

    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }
}

/// Whether block `layer` (from 0) recomputes its forward in backward:
/// every block under activation checkpointing, or its first `layers`.
pub fn recomputes(activation_checkpointing: bool, layers: Option<usize>, layer: usize) -> bool {
    activation_checkpointing && layers.is_none_or(|layers| layer < layers)
}

#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Compute dtype (fp32 masters are kept whatever this is).
    pub dtype: Kind,
    pub adamw: AdamW,
    pub max_grad_norm: Option<f64>,
    /// Keep only each block's input and recompute the block in backward.
    pub activation_checkpointing: bool,
    /// Only the first N blocks so (`train.checkpoint_layers`); None: all.
    pub checkpoint_layers: Option<usize>,
    /// Seeds dropout, so recomputation repeats the same masks.
    pub seed: i64,
    /// fp16's first loss scale (dynamic: halved on overflow, doubled after
    /// 2000 clean steps, as torch.amp.GradScaler does).
    pub initial_loss_scale: f64,
    /// The blocks' linear layers in float8 (`Params::linear`); None: in `dtype`.
    pub float8: Option<Float8>,
    /// Under float8, the block weight shapes [out, in] that stay in `dtype`
    /// (`plan::float8_kept`); None: those too small for float8 to pay
    /// ([`float8_slow_shapes`]), none when emulated.
    pub float8_kept: Option<BTreeSet<[i64; 2]>>,
    /// Under tensorwise float8, gather sharded blocks whose weights all run
    /// in float8 as float8 bytes (`float8_gather`): None, by default (on);
    /// Some, as the run asked (a run asking for them where no block is
    /// gathered so is told).
    pub float8_gathers: Option<bool>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            dtype: Kind::Float,
            adamw: AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
            max_grad_norm: Some(1.0),
            activation_checkpointing: false,
            checkpoint_layers: None,
            seed: 0,
            initial_loss_scale: 65536.0,
            float8: None,
            float8_kept: None,
            float8_gathers: None,
        }
    }
}

impl TrainOptions {
    /// Whether block `layer` (from 0) is recomputed in backward.
    pub fn recomputes(&self, layer: usize) -> bool {
        recomputes(self.activation_checkpointing, self.checkpoint_layers, layer)
    }

    /// A run's options from its `train.*` configuration.
    pub fn from_config(config: &TrainConfig, dtype: Kind) -> TrainOptions {
        TrainOptions {
            dtype,
            adamw: AdamW {
                lr: config.lr,
                beta1: config.adam_beta1,
                beta2: config.adam_beta2,
                weight_decay: config.weight_decay,
                eps: config.adam_eps,
            },
            max_grad_norm: (config.max_grad_norm > 0.0).then_some(config.max_grad_norm),
            activation_checkpointing: config.activation_checkpointing,
            checkpoint_layers: config.checkpoint_layers,
            seed: config.seed as i64,
            initial_loss_scale: config.initial_loss_scale,
            float8: config.float8(),
            float8_kept: None,
            float8_gathers: config.fp8_gathers,
        }
    }
}

/// What offloading moved and cost, cumulative over the run.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct OffloadStats {
    pub device_to_host_bytes: f64,
    pub host_to_device_bytes: f64,
    /// Time the step waited for the device's backward and copies to finish.
    pub wait_seconds: f64,
    /// Time in the host optimizer step after that (gradient norm and AdamW).
    pub cpu_step_seconds: f64,
}

/// One process's training state: the model's units as flat buffers and the
/// optimizer, data-parallel as the strategy's policy says. Built by
/// [`TrainerBuilder`].
pub struct Trainer<'m> {
    model: &'m dyn Model,
    units: Vec<FlatUnit>,
    /// A frozen copy of the starting parameters, one unit per model unit:
    /// the reference model whose outputs the objective asks for when the
    /// model has no adapters to turn off (`TrainerBuilder::reference_copy`);
    /// empty otherwise. Never reduced, stepped or checkpointed.
    reference: Vec<FlatUnit>,
    /// What the communication hook is told of each unit.
    unit_info: Vec<UnitInfo>,
    /// ... and of each unit of the reference copy: the model unit's, under
    /// an id of its own (so no hook takes state kept for a trained unit,
    /// such as a float8 gather's amaxes, for the copy's).
    reference_info: Vec<UnitInfo>,
    /// How gradients are reduced, sharded parameters gathered and tokens
    /// exchanged (shared with the token exchanges of expert parallelism).
    hook: SharedHook,
    /// The hook's scratch memory, counted.
    workspace: Workspace,
    /// Where offloaded state is stored and how it is stepped (None: nothing is offloaded).
    offload: Option<&'m dyn Offload>,
    /// Optimizer steps taken (what hooks are told).
    steps: usize,
    options: TrainOptions,
    /// AdamW's step count, on the device, shared by every buffer.
    step: Tensor,
    micro_steps: i64,
    /// Micro-batches since the last optimizer step.
    pending_micro_batches: usize,
    /// This rank's share of the model's auxiliary loss since the last
    /// `take_auxiliary`, before its coefficient, and its statistics
    /// (summed over the ranks), on the device.
    auxiliary: Option<(Tensor, Tensor)>,
    parallel: Option<&'m DataParallel<'m>>,
    /// Present when computing in fp16.
    scaler: Option<LossScaler>,
    /// Bytes of sharded units gathered now, and the most at once.
    gathered_bytes: i64,
    gathered_peak: i64,
    offload_stats: OffloadStats,
    kernels: Kernels,
    /// Which block linear layers run in float8 (from `options`).
    float8: Option<Float8Layers>,
    /// Under float8 gathers: the amaxes they cast with, refreshed before a
    /// step's first gather when the shards have changed.
    float8_amaxes: Option<Float8Amaxes>,
}

/// Where a trainer's initial parameters come from: each unit's tensors
/// (on the training device), asked for once each, in unit order, and
/// placed before the next is asked for — so a source that makes or reads
/// them one unit at a time never holds the whole model in full precision
/// (a 4-bit base is packed unit by unit).
pub trait InitialParams {
    fn unit(&mut self, unit: usize) -> Result<Vec<Tensor>>;
}

/// Parameters already whole, per unit.
impl InitialParams for &[Vec<Tensor>] {
    fn unit(&mut self, unit: usize) -> Result<Vec<Tensor>> {
        Ok(self[unit].iter().map(Tensor::shallow_clone).collect())
    }
}

impl InitialParams for &Vec<Vec<Tensor>> {
    fn unit(&mut self, unit: usize) -> Result<Vec<Tensor>> {
        self.as_slice().unit(unit)
    }
}

/// Each unit's parameters made when asked for.
impl<F: FnMut(usize) -> Result<Vec<Tensor>>> InitialParams for F {
    fn unit(&mut self, unit: usize) -> Result<Vec<Tensor>> {
        self(unit)
    }
}

/// The one way to make a [`Trainer`]: a model and options, optionally data
/// parallel over a strategy's groups, then the initial parameters.
pub struct TrainerBuilder<'m> {
    model: &'m dyn Model,
    options: TrainOptions,
    parallel: Option<&'m DataParallel<'m>>,
    hook: Box<dyn CommHook>,
    offload: Option<&'m dyn Offload>,
    reference_copy: bool,
}

impl<'m> TrainerBuilder<'m> {
    pub fn new(model: &'m dyn Model, options: TrainOptions) -> TrainerBuilder<'m> {
        TrainerBuilder { model, options, parallel: None, hook: Box::new(Builtin), offload: None, reference_copy: false }
    }

    /// When `wanted` (the objective asks for a reference model's outputs,
    /// `Objective::wants_reference_outputs`) and the model has no adapters
    /// whose base would be one: keeps a frozen copy of the initial
    /// parameters as the reference, in the compute dtype, placed as the
    /// policy places parameters (sharded when it shards them; in host
    /// memory when the run offloads: `UnitPlacement::frozen_copy`).
    pub fn reference_copy(mut self, wanted: bool) -> TrainerBuilder<'m> {
        self.reference_copy = wanted && self.model.adapter_scaling().is_none();
        self
    }

    /// Keeps fp32 masters, gradients and optimizer state where `offload`
    /// says and steps them as it does (`--offload`; `none` changes nothing).
    pub fn offload(mut self, offload: &'m dyn Offload) -> TrainerBuilder<'m> {
        self.offload = offload.to_host().then_some(offload);
        self
    }

    /// Reduces gradients and gathers parameters through `hook` instead of
    /// the built-in collectives.
    pub fn comm(mut self, hook: Box<dyn CommHook>) -> TrainerBuilder<'m> {
        self.hook = hook;
        self
    }

    /// Trains data-parallel over `parallel`'s ranks (nothing changes on one rank).
    pub fn data_parallel(mut self, parallel: &'m DataParallel<'m>) -> TrainerBuilder<'m> {
        self.parallel = (parallel.world.size() > 1).then_some(parallel);
        self
    }

    /// The trainer, from initial parameters `params` (every rank passes the
    /// same ones and keeps what the policy assigns it).
    pub fn build(self, mut params: impl InitialParams) -> Result<Trainer<'m>> {
        let TrainerBuilder { model, options, parallel, mut hook, offload, reference_copy } = self;
        let blocks = crate::model::block_count(model);
        if let Some(layers) = options.checkpoint_layers.filter(|&layers| layers > blocks) {
            anyhow::bail!("train.checkpoint_layers (--checkpoint-layers) {layers} is more than the model's {blocks} blocks");
        }
        // One rank alone, or a policy that shards nothing, is a group of one.
        let policy = parallel.map_or(ShardingPolicy::replicated(false), |p| p.policy);
        let (group_size, group_rank) = parallel.and_then(DataParallel::shard).map_or((1, 0), |group| (group.size(), group.rank()));
        let experts = parallel.and_then(|p| p.experts.as_ref());
        let placed = unit_placements(model, &policy, group_size, group_rank, offload.is_some(), options.dtype, experts.map(ExpertGroups::seat));
        let (mut units, mut reference) = (vec![], vec![]);
        for (unit, (spec, (placement, packed))) in model.units().iter().zip(placed).enumerate() {
            let t = params.unit(unit)?;
            if let (Some(groups), Some(_)) = (experts, placement.expert_rows) {
                // This rank's experts: its rows of the unit's parameter, placed over their shard group.
                let rows = groups.rows(spec.params[0].shape[0]);
                let mut local = spec.clone();
                local.params[0].shape[0] = rows.end - rows.start;
                if let Some(layout) = packed {
                    // Its part of the whole tensor's 4-bit blocks, cut from the whole.
                    units.push(FlatUnit::new_packed(&local, &t, options.dtype, placement, layout)?);
                    continue;
                }
                let t: Vec<Tensor> = t.iter().map(|t| t.narrow(0, rows.start, rows.end - rows.start)).collect();
                if reference_copy {
                    reference.push(FlatUnit::new(&local, &t, options.dtype, placement.frozen_copy(), offload)?);
                }
                units.push(FlatUnit::new(&local, &t, options.dtype, placement, offload)?);
                continue;
            }
            if reference_copy {
                // From the same tensors, so no unit is read twice.
                reference.push(FlatUnit::new(spec, &t, options.dtype, placement.frozen_copy(), offload)?);
            }
            units.push(match packed {
                Some(layout) => FlatUnit::new_packed(spec, &t, options.dtype, placement, layout)?,
                None => FlatUnit::new(spec, &t, options.dtype, placement, offload)?,
            });
        }
        let device = units[0].device();
        if units.iter().all(|u| !u.trainable()) {
            anyhow::bail!("every parameter of the model is frozen: nothing to train");
        }
        let unit_info: Vec<UnitInfo> = units.iter().map(|u| UnitInfo::new(&u.spec, crate::distributed::flat::param_offsets(&u.spec), u.placement().shard.padded)).collect();
        let reference_info = unit_info
            .iter()
            .take(reference.len())
            .map(|info| UnitInfo { id: format!("reference-{}", info.id), name: format!("{} (reference copy)", info.name), ..info.clone() })
            .collect();
        let float8 = match options.float8 {
            Some(float8) => {
                anyhow::ensure!(options.dtype != Kind::Half, FLOAT8_WITH_FP16);
                float8_serves(float8, device)?;
                warn_of_narrow_layers(model, float8);
                let layers = float8_layers(model, float8, options.float8_kept.as_ref());
                say_which_layers_stay(model, &layers.kept, options.float8_kept.is_some());
                Some(layers)
            }
            None => None,
        };
        // ft's SwiGLU and RMSNorm kernels compute their outputs' amaxes as they write them, for the next layers' tensorwise casts.
        let kernels = crate::kernels::Kernels::loaded(device);
        let tensorwise_casts = float8.as_ref().is_some_and(|layers| layers.float8.recipe == Recipe::Tensorwise && layers.float8.casts_with_kernels(kernels));
        ft_sys::float8::fuse_activation_amaxes(tensorwise_casts);
        let mut float8_amaxes = None;
        if let Some(layers) = float8.as_ref().filter(|layers| options.float8_gathers != Some(false) && layers.float8.recipe == Recipe::Tensorwise) {
            let placements: Vec<UnitPlacement> = units.iter().map(|unit| *unit.placement()).collect();
            let gathered = float8_gathered_units(model, &placements, layers);
            if gathered.is_empty() && options.float8_gathers == Some(true) {
                tracing::warn!(
                    "train.fp8_gathers: no block is gathered in float8: the strategy gathers no sharded parameters (use full_shard, shard_grad_op or hybrid_shard), or every block keeps a layer in the compute dtype"
                );
            } else if !gathered.is_empty() {
                tracing::info!("train.fp8_gathers: {} sharded blocks gathered as float8 (their vectors in the compute dtype)", gathered.len());
                let gathered: Vec<(usize, &UnitInfo)> = gathered.into_iter().map(|unit| (unit, &unit_info[unit])).collect();
                let (gathers, amaxes) = crate::distributed::float8_gather::float8_gathers(hook, &gathered, options.dtype, device);
                hook = Box::new(gathers);
                float8_amaxes = Some(amaxes);
            }
        }
        let scaler = (options.dtype == Kind::Half).then(|| LossScaler::new(options.initial_loss_scale, device));
        Ok(Trainer {
            scaler,
            model,
            units,
            reference,
            unit_info,
            reference_info,
            hook: Rc::new(RefCell::new(hook)),
            workspace: Workspace::default(),
            offload,
            steps: 0,
            options,
            step: Tensor::zeros([], (Kind::Float, device)),
            micro_steps: 0,
            pending_micro_batches: 0,
            auxiliary: None,
            parallel,
            gathered_bytes: 0,
            gathered_peak: 0,
            offload_stats: OffloadStats::default(),
            kernels: Kernels::select(device),
            float8,
            float8_amaxes,
        })
    }
}

/// Where each of `model`'s units keeps what under `policy`, on rank
/// `group_rank` of a shard group of `group_size`, computing in `dtype` —
/// the trainer's rules, which `ft plan` predicts with: a frozen unit (LoRA's
/// base) only its parameters, an adapter its parameters whole, and, when
/// the base is held in 4 bits (`Model::quantized_base`), the frozen blocks
/// as the bytes of their `PackedLayout` (what `Model::held_in_4bit` picks:
/// the blocks' linear layers, as bitsandbytes quantizes them, and a mixture
/// of experts' fused experts; the embeddings and the head keep the compute
/// dtype). Under expert parallelism (`experts`: where this rank sits) a
/// rank holds its rows of the experts units — of a 4-bit one, its part of
/// the whole tensor's blocks (`PackedLayout::expert_part`) — placed as the
/// policy places a unit over the experts' shard group.
pub fn unit_placements(model: &dyn Model, policy: &ShardingPolicy, group_size: usize, group_rank: usize, offload: bool, dtype: Kind, experts: Option<ExpertSeat>) -> Vec<(UnitPlacement, Option<PackedLayout>)> {
    let is_adapter = |unit: usize| model.stages().iter().any(|s| s.adapter == Some(unit));
    let blocks: BTreeSet<usize> = crate::model::block_units(model).collect();
    let expert_units = expert_units(model);
    model
        .units()
        .iter()
        .enumerate()
        .map(|(unit, spec)| {
            let seat = experts.filter(|_| expert_units.contains(&unit));
            // An experts unit's rows of this rank, split over the experts' shard group; any other unit over the shard group.
            let (numel, (shard_size, shard_rank)) = match seat {
                Some(seat) => (spec.numel() / seat.degree as i64, (seat.shard_size, seat.shard_rank)),
                None => (spec.numel(), (group_size, group_rank)),
            };
            let placement = UnitPlacement::new(policy, numel, shard_size, shard_rank, offload);
            let placement = seat.map_or(placement, |seat| placement.at_expert_rows(numel * seat.rank as i64));
            let placement = match (model.frozen(unit), is_adapter(unit)) {
                (true, _) => placement.frozen(),
                (false, true) => placement.whole_params(),
                (false, false) => placement,
            };
            match model.quantized_base().filter(|_| model.frozen(unit) && blocks.contains(&unit)) {
                Some(quantization) => {
                    let held_in_4bit = |param: &ParamSpec| model.held_in_4bit(param);
                    let layout = match seat {
                        Some(seat) => PackedLayout::expert_part(spec, dtype, quantization, held_in_4bit, (seat.degree, seat.rank)),
                        None => PackedLayout::new(spec, &crate::distributed::flat::param_offsets(spec), dtype, quantization, held_in_4bit),
                    };
                    (placement.packed(layout.bytes(), shard_size, shard_rank), Some(layout))
                }
                None => (placement, None),
            }
        })
        .collect()
}

/// The units holding a mixture of experts' experts (`Stage::experts`), which expert parallelism splits by rows.
pub fn expert_units(model: &dyn Model) -> BTreeSet<usize> {
    model.stages().iter().flat_map(|stage| stage.experts.into_iter().flatten()).collect()
}

/// The sharded units gathered in float8: blocks whose weight matrices all run in float8.
pub fn float8_gathered_units(model: &dyn Model, placements: &[UnitPlacement], layers: &Float8Layers) -> Vec<usize> {
    let units = model.units();
    crate::model::block_units(model)
        .filter(|&unit| {
            let matrices: Vec<&Vec<i64>> = units[unit].params.iter().map(|p| &p.shape).filter(|shape| shape.len() == 2).collect();
            placements[unit].params_sharded && !placements[unit].packed && !matrices.is_empty() && matrices.iter().all(|shape| layers.runs_shape(shape))
        })
        .collect()
}

/// The block layers a run of `model` casts under `float8`: all but those
/// of the weight shapes `kept` (`TrainOptions::float8_kept`), else of
/// [`float8_slow_shapes`] (none when emulated).
pub fn float8_layers(model: &dyn Model, float8: Float8, kept: Option<&BTreeSet<[i64; 2]>>) -> Float8Layers {
    let kept = match kept {
        Some(kept) => kept.clone(),
        None if float8.emulate => BTreeSet::new(),
        None => float8_slow_shapes(model),
    };
    Float8Layers { float8, kept }
}

/// Why fp16 is refused with float8: `setup::validate` says it before any rank starts, the builder for every other caller.
pub const FLOAT8_WITH_FP16: &str = "train.fp8 (--fp8) with train.dtype fp16 (--dtype fp16): float8 training keeps its activations and gradients in bf16 (or f32) around the float8 GEMMs, as torchao's recipes do, and fp16's loss scaling does not compose with float8's own scales; use --dtype bf16";

/// Refuses float8 GEMMs where they cannot run: on a CPU unless emulated,
/// or on a GPU before compute capability 8.9 (Ada, Hopper), which has no
/// float8 tensor cores.
pub fn float8_serves(float8: Float8, device: tch::Device) -> Result<()> {
    if float8.emulate {
        return Ok(());
    }
    let tch::Device::Cuda(index) = device else {
        anyhow::bail!(
            "train.fp8 (--fp8) needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper) for its float8 GEMMs; this rank computes on {}. \
             To run float8 training's numerics on a CPU (slowly: for tests), set train.fp8_emulate=true (--set train.fp8_emulate=true)",
            format!("{device:?}").to_lowercase()
        );
    };
    capability_serves_float8(index, ft_sys::kernels::compute_capability(index)?)
}

/// Says which of the blocks' weight matrices keep the compute dtype under
/// float8: those with a width that is not a multiple of 16, which float8
/// GEMMs need (`Params::linear` skips them, as torchao's auto-filter does).
fn warn_of_narrow_layers(model: &dyn Model, float8: Float8) {
    if float8.emulate {
        return;
    }
    let units = model.units();
    let blocks = crate::model::block_units(model).map(|unit| &units[unit]);
    let narrow: Vec<&str> =
        blocks.flat_map(|u| &u.params).filter(|p| p.shape.len() == 2 && p.shape.iter().any(|w| w % 16 != 0)).map(|p| p.hf_name.as_str()).collect();
    if let Some(first) = narrow.first() {
        tracing::warn!(
            "train.fp8: {} linear layers keep the compute dtype, their widths not multiples of 16 as float8 GEMMs need (the first: {first})",
            narrow.len()
        );
    }
}

/// Weights of fewer elements than this (4096 × 4096) keep the compute
/// dtype under float8 without a calibration: `ft calibrate --fp8` on an H100
/// at 8 × 1024 tokens measured ft's float8 layer (GEMMs and casts) at
/// 0.43–0.90x of bf16's for BLOOM-560m's and OPT-1.3B's smaller shapes (up
/// to 4096 × 1024 and 2048 × 2048) and 1.11–1.14x for OPT's 2048 × 8192
/// (bench/results/2026-11-26-h100-fp8-calibration.md); torchao's own
/// auto-filter (out ≤ 1024 with in ≤ 4096) leaves BLOOM slower than bf16.
pub const FLOAT8_MIN_WEIGHT: i64 = 4096 * 4096;

/// The blocks' weight shapes [out, in] too small for float8 to pay
/// ([`FLOAT8_MIN_WEIGHT`]): what a run without `train.fp8_calibration` or
/// `train.fp8_layers=all` keeps in the compute dtype.
pub fn float8_slow_shapes(model: &dyn Model) -> BTreeSet<[i64; 2]> {
    block_weight_shapes(model).into_iter().filter(|&[out, input]| out * input < FLOAT8_MIN_WEIGHT).collect()
}

/// The shapes [out, in] of the blocks' weight matrices.
pub fn block_weight_shapes(model: &dyn Model) -> BTreeSet<[i64; 2]> {
    let units = model.units();
    let blocks = crate::model::block_units(model).map(|unit| &units[unit]);
    blocks.flat_map(|u| &u.params).filter(|p| p.shape.len() == 2).map(|p| [p.shape[0], p.shape[1]]).collect()
}

/// Logs which block weight shapes `kept` leaves in the compute dtype, and
/// by whose measurement; and that a mixture's experts stay there.
fn say_which_layers_stay(model: &dyn Model, kept: &BTreeSet<[i64; 2]>, calibrated: bool) {
    if model.experts().is_some() {
        tracing::info!(
            "train.fp8: the experts' grouped GEMMs stay in the compute dtype: on an H200 at 2 x 2048 tokens, float8 saved under 0.40 ms of a Qwen3-30B-A3B layer's expert GEMMs, and the casts they need (the experts' weights both ways, their inputs and gradients) cost 1.96 ms (bench/results/2026-11-28-h200-gemm-choices.md)"
        );
    }
    let shapes = block_weight_shapes(model);
    let stay: Vec<String> = shapes.iter().filter(|s| kept.contains(*s)).map(|[out, input]| format!("{out}x{input}")).collect();
    if stay.is_empty() {
        return;
    }
    let why = match calibrated {
        true => "train.fp8_calibration measured float8 slower there",
        false => "ft measured float8 slower for weights under 4096 x 4096 on an H100; `ft calibrate --fp8` measures this GPU (train.fp8_calibration uses it), train.fp8_layers=all casts every layer",
    };
    tracing::info!("train.fp8: the block linear layers of weight shapes {} stay in the compute dtype: {why}", stay.join(", "));
}

/// Whether GPU `index` of compute capability (major, minor) has float8 tensor cores.
fn capability_serves_float8(index: usize, (major, minor): (i32, i32)) -> Result<()> {
    if (major, minor) < (8, 9) {
        anyhow::bail!(
            "train.fp8 (--fp8): GPU cuda:{index} has compute capability {major}.{minor}, and float8 GEMMs need 8.9 or newer (Ada, Hopper); train without --fp8 (bf16) on it"
        );
    }
    Ok(())
}

impl<'m> Trainer<'m> {
    pub fn units(&self) -> &[FlatUnit] {
        &self.units
    }

    /// The ranks unit `u`'s state is split and summed over (none on one rank).
    fn groups_of(&self, u: usize) -> UnitGroups<'m> {
        match self.parallel {
            Some(parallel) => parallel.groups(self.units[u].placement().expert_rows.is_some()),
            None => UnitGroups { shard: None, replicas: None, world: None },
        }
    }

    fn reshard_after_forward(&self) -> bool {
        self.parallel.is_some_and(|p| p.policy.params == ParamPlacement::Sharded { reshard_after_forward: true })
    }

    /// Whether optimizer state is in host memory (`--offload cpu`).
    pub fn offloaded(&self) -> bool {
        self.units.iter().any(FlatUnit::offloaded_to_host)
    }

    /// What offloading has moved and how long the host optimizer took, so far.
    pub fn offload_stats(&self) -> OffloadStats {
        self.offload_stats
    }

    pub fn adamw_step(&self) -> &Tensor {
        &self.step
    }

    /// Optimizer steps taken (with a resumed checkpoint's).
    pub fn steps(&self) -> usize {
        self.steps
    }

    pub fn micro_steps(&self) -> i64 {
        self.micro_steps
    }

    /// Ranks per shard group (1 when nothing is sharded).
    pub fn shard_group_size(&self) -> usize {
        self.parallel.map_or(1, |p| p.shard_size)
    }

    /// Expert parallelism's groups, when the trainer runs it.
    fn experts(&self) -> Option<&'m ExpertGroups> {
        self.parallel.and_then(|p| p.experts.as_ref())
    }

    /// What a mixture of experts' blocks exchange tokens through, when the trainer runs expert parallelism.
    fn token_exchanger(&self) -> Option<Rc<dyn crate::model::ExpertExchange>> {
        let groups = self.experts()?;
        Some(Rc::new(crate::distributed::experts::TokenExchanger { group: groups.group.clone(), hook: self.hook.clone() }))
    }

    /// Unit `index`'s parameters from `whole`, this rank's whole flat
    /// buffer of them, shaped as the model declares them: an
    /// expert-parallel unit's rows gathered from its expert group
    /// (collective then).
    fn model_shaped(&self, index: usize, whole: Tensor) -> Result<Vec<Tensor>> {
        let unit = &self.units[index];
        match (unit.placement().expert_rows, self.experts()) {
            (Some(_), Some(groups)) => {
                let mut all = Tensor::empty([(whole.numel() * groups.group.size()) as i64], (whole.kind(), whole.device()));
                groups.group.all_gather_into_tensor(&mut all, &whole.contiguous())?.wait()?;
                Ok(unflatten(&self.model.units()[index], &all))
            }
            _ => Ok(unflatten(&unit.spec, &whole)),
        }
    }

    /// How many ranks hold the same copy of unit `u`'s optimizer state and
    /// which of them this rank is: a sharded state's replicas (hybrid
    /// sharding's other shard groups), or every rank computing the whole
    /// unit when it is whole.
    fn holders(&self, u: usize) -> (usize, usize) {
        let groups = self.groups_of(u);
        let holders = if self.units[u].placement().optimizer_sharded { groups.replicas } else { groups.world };
        holders.map_or((1, 0), |group| (group.size(), group.rank()))
    }

    /// What this rank writes of each unit to a checkpoint: where its range
    /// of the unit's flat buffer starts, and [master, exp_avg, exp_avg_sq]
    /// over it, as views of the live state (wherever it is: copy it before
    /// training goes on). The ranks holding the same copy split it, so
    /// each element is written once and every rank writes about 1/N of the
    /// state; padding is never written, nor frozen units (empty ranges:
    /// they are the model's own files).
    pub fn checkpoint_part(&self) -> Vec<(i64, [Tensor; 3])> {
        self.units
            .iter()
            .enumerate()
            .map(|(index, u)| {
                let placement = u.placement();
                if !u.trainable() {
                    let empty = || Tensor::empty([0], (Kind::Float, tch::Device::Cpu));
                    return (0, [empty(), empty(), empty()]);
                }
                let (copies, index) = self.holders(index);
                let owned_start = placement.owned_start();
                let valid = (u.numel() - owned_start).clamp(0, placement.owned_len());
                let split = ShardLayout::new(valid, copies, index);
                let local = split.start.min(valid);
                let len = split.len.min(valid - local);
                let take = |t: &Tensor| t.narrow(0, local, len);
                (placement.expert_rows.unwrap_or(0) + owned_start + local, [take(&u.master), take(&u.exp_avg), take(&u.exp_avg_sq)])
            })
            .collect()
    }

    /// Puts back checkpointed state: `read(unit, start, len)` returns
    /// [master, exp_avg, exp_avg_sq] over elements `start..start + len` of
    /// the unit's padded flat buffer, and each rank asks only for the part
    /// it owns; frozen units keep what they were built with. Every rank
    /// calls this (zero1 gathers its compute copies). `steps` is the
    /// optimizer steps the checkpoint had taken.
    pub fn restore(
        &mut self,
        mut read: impl FnMut(usize, i64, i64) -> Result<[Tensor; 3]>,
        step: &Tensor,
        steps: usize,
        micro_steps: i64,
        loss_scale: Option<&Tensor>,
    ) -> Result<()> {
        for index in 0..self.units.len() {
            if !self.units[index].trainable() {
                continue;
            }
            let group = self.groups_of(index).shard;
            let placement = *self.units[index].placement();
            let state = read(index, placement.expert_rows.unwrap_or(0) + placement.owned_start(), placement.owned_len())?;
            self.units[index].restore(&state, group)?;
        }
        if let Some(amaxes) = &mut self.float8_amaxes {
            amaxes.shards_changed();
        }
        self.step.shallow_clone().copy_(step);
        self.steps = steps;
        self.micro_steps = micro_steps;
        // A checkpoint without one (bf16/fp32, or older) leaves the initial scale.
        if let (Some(scaler), Some(state)) = (&self.scaler, loss_scale) {
            scaler.restore(state);
        }
        Ok(())
    }

    /// The whole parameters in the compute dtype, detached, per unit
    /// (gathered when sharded; collective then).
    pub fn compute_params(&self) -> Result<Vec<Vec<Tensor>>> {
        (0..self.units.len()).map(|u| self.compute_unit(u)).collect()
    }

    /// Unit `u`'s whole parameters in the compute dtype, detached
    /// (gathered when sharded or split among experts: collective then).
    pub fn compute_unit(&self, u: usize) -> Result<Vec<Tensor>> {
        self.model_shaped(u, self.units[u].whole_compute(self.groups_of(u).shard)?.detach())
    }

    /// Whether every unit's whole compute parameters are already held
    /// (none sharded, split among experts or packed in 4 bits), so that
    /// `compute_params` allocates and gathers nothing.
    pub fn holds_compute_whole(&self) -> bool {
        self.units.iter().all(|unit| {
            let placement = unit.placement();
            !placement.params_sharded && !placement.packed && placement.expert_rows.is_none()
        })
    }

    /// Whether every rank is `done` (this one's answer): one reduction
    /// over the world, or `done` alone on one rank. Collective.
    pub fn all_ranks_done(&self, done: bool) -> Result<bool> {
        let Some(parallel) = self.parallel else { return Ok(done) };
        let mut not_done = Tensor::from_slice(&[f32::from(u8::from(!done))]).to_device(self.units[0].device());
        parallel.world.all_reduce(&mut not_done, crate::distributed::comm::Reduction::Max)?.wait()?;
        Ok(not_done.double_value(&[0]) == 0.0)
    }

    /// The current fp32 parameters of the trained units, per unit, shaped
    /// as the model declares them (gathered when sharded; collective then);
    /// a frozen unit's entry is empty (the model's files hold it).
    pub fn params(&self) -> Result<Vec<Vec<Tensor>>> {
        (0..self.units.len())
            .map(|u| match self.units[u].trainable() {
                true => self.model_shaped(u, self.units[u].whole(&self.units[u].master, self.groups_of(u).shard)?),
                false => Ok(vec![]),
            })
            .collect()
    }

    /// What this rank holds for the frozen copy kept as the reference model
    /// (`TrainerBuilder::reference_copy`; nothing without one).
    pub fn reference_memory(&self) -> MemoryAccount {
        self.reference.iter().map(FlatUnit::memory).sum()
    }

    /// What this rank holds for parameters, gradients and optimizer state,
    /// and the peak of gathered units so far (the reference copy's apart:
    /// `reference_memory`).
    pub fn memory(&self) -> MemoryAccount {
        let held: MemoryAccount = self.units.iter().map(FlatUnit::memory).sum();
        let state = self.hook.borrow().state().iter().fold(0.0, |bytes, (_, t)| bytes + (t.numel() * t.kind().elt_size_in_bytes()) as f64);
        let comm_state = state + self.workspace.peak() as f64;
        MemoryAccount { gathered_peak: self.gathered_peak as f64, comm_state, ..held }
    }

    /// fp16's loss scaler as two fp32 values on the host, for a checkpoint.
    pub fn loss_scaler_state(&self) -> Option<Tensor> {
        self.scaler.as_ref().map(|s| s.state())
    }

    /// fp16's current loss scale (None in other dtypes).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale.double_value(&[0]))
    }

    /// Whether this trainer runs ATen's or ft's kernels.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    pub fn model(&self) -> &dyn Model {
        self.model
    }

    /// The communication hook's state, for a checkpoint.
    pub fn comm_state(&self) -> Vec<(String, Tensor)> {
        self.hook.borrow().state()
    }

    /// Hands the hook its checkpointed state; what it kept.
    pub fn restore_comm_state(&mut self, state: Vec<(String, Tensor)>) -> Result<Restored> {
        let mut hook = self.hook.borrow_mut();
        let name = hook.name().to_string();
        hook.load_state(state).map_err(|e| e.context(format!("comm `{name}`: restoring its state")))
    }

    /// Offers the hook state saved at another world size; what it kept.
    pub fn reshard_comm_state(&mut self, change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Restored> {
        let mut hook = self.hook.borrow_mut();
        let name = hook.name().to_string();
        hook.reshard_state(change, state).map_err(|e| e.context(format!("comm `{name}`: re-sharding its state")))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn float8_is_refused_before_ada_by_name_and_capability() {
        let refusal = super::capability_serves_float8(1, (8, 0)).unwrap_err().to_string();
        assert!(refusal.contains("GPU cuda:1 has compute capability 8.0") && refusal.contains("8.9 or newer"), "{refusal}");
        for capability in [(8, 9), (9, 0), (10, 0)] {
            assert!(super::capability_serves_float8(0, capability).is_ok(), "{capability:?}");
        }
    }
}
