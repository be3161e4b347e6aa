//! A unit's parameters as flat buffers, whole or sharded (docs/ARCHITECTURE.md, "Flat buffers").
//!
//! Each unit has:
//! - `compute`: the whole unit in the compute dtype, padded to a multiple of
//!   the shard group. It is the autograd leaf the model's views come from, so
//!   backward yields one flat gradient per unit (FSDP's FlatParameter). When
//!   parameters are sharded, its storage is freed between uses and refilled
//!   by an all-gather before each use.
//! - `master`: fp32 values the optimizer updates: the whole buffer, or only
//!   this rank's shard when optimizer state is sharded. Under fp32 compute
//!   with replicated parameters it is (a slice of) `compute` itself.
//! - `grad`: the fp32 gradient, whole when all-reduced or this rank's shard
//!   when reduce-scattered; `exp_avg`/`exp_avg_sq` cover what `master` covers.
//!   On the device it exists only from a step's first reduction to the
//!   optimizer (FSDP's `set_to_none`), so it never sits beside the next
//!   forward's activations.
//!
//! Offloaded (`--offload cpu`), `master`, `grad` and the moments live in host
//! memory (the master pinned, for asynchronous uploads); the GPU keeps only
//! the compute-dtype copy the model reads (whole, or this rank's shard to
//! gather from), and each micro-batch's reduced gradient is copied back as a
//! host piece as soon as its reduction is done.
//!
//! A frozen unit (a LoRA model's base) keeps only `compute` — whole, or
//! this rank's shard in the compute dtype to gather from when parameters are
//! sharded — and no master, gradient or moments; it is never reduced. A
//! packed one (QLoRA's base blocks, `packed_base.rs`) keeps its parameters
//! as 4-bit bytes instead — whole, or this rank's slice of them — and its
//! compute buffer exists only while it is used: each gather dequantizes
//! into it, and each release frees it, whatever the policy. A frozen copy
//! (a preference loss's reference model, `UnitPlacement::frozen_copy`) is
//! a frozen unit that, when the run offloads, keeps its compute-dtype
//! parameters (whole, or this rank's shard) in host memory instead: each
//! gather uploads them into a compute buffer that each release frees.
//!
//! Inside the buffers the matrices come first and the vectors (biases, norm
//! weights) after, so AdamW's weight decay — which, as in Hugging Face's
//! Trainer, skips biases and norms — applies to one prefix.

use crate::distributed::comm::{ProcessGroup, Work};
use crate::distributed::comm_hook::{CommHook, GatherPhase, ParamGather, Pending, UnitInfo, Wire, WireRequest, Workspace};
use crate::distributed::packed_base::{PackedBase, PackedLayout};
use crate::distributed::strategy::{GradReduction, ParamPlacement, ShardingPolicy};
use crate::model::UnitSpec;
use crate::offload::Offload;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

fn is_decayed(shape: &[i64]) -> bool {
    shape.len() >= 2
}

/// How `spec`'s parameters sit in its unit's flat buffer: their order
/// (matrices first), and the end of the weight-decayed prefix.
fn flat_layout(spec: &UnitSpec) -> (Vec<usize>, i64) {
    let order: Vec<usize> = (0..spec.params.len())
        .filter(|&i| is_decayed(&spec.params[i].shape))
        .chain((0..spec.params.len()).filter(|&i| !is_decayed(&spec.params[i].shape)))
        .collect();
    let decayed = order.iter().filter(|&&i| is_decayed(&spec.params[i].shape)).map(|&i| spec.params[i].numel()).sum();
    (order, decayed)
}

/// Each parameter of `spec` (by index) and where it starts in the unit's
/// flat buffer, in buffer order: what a checkpoint's manifest records so a
/// reader can check the buffers it holds are laid out as this model's.
pub fn param_offsets(spec: &UnitSpec) -> Vec<(usize, i64)> {
    let mut offset = 0;
    flat_layout(spec)
        .0
        .into_iter()
        .map(|i| {
            let start = offset;
            offset += spec.params[i].numel();
            (i, start)
        })
        .collect()
}

/// Views of a flat buffer laid out in `order`, returned in `spec` order and
/// shaped; padding past the parameters is left out. One `split_with_sizes`
/// makes them all, so autograd returns the gradient of the buffer with one
/// concatenation (a narrow per parameter would zero-fill a buffer-sized
/// tensor per parameter). A unit that is one parameter filling the buffer
/// (an embedding, a mixture of experts' fused experts) gets a plain view:
/// its gradient then becomes the buffer's as it is, where the
/// concatenation would copy it (a second gradient-sized tensor for a moment).
fn split_views(spec: &UnitSpec, order: &[usize], flat: &Tensor) -> Vec<Tensor> {
    if one_view(spec, flat.size()[0]) {
        return vec![flat.view(spec.params[0].shape.as_slice())];
    }
    let mut sizes: Vec<i64> = order.iter().map(|&i| spec.params[i].numel()).collect();
    let padding = flat.size()[0] - sizes.iter().sum::<i64>();
    if padding > 0 {
        sizes.push(padding);
    }
    let mut by_spec: Vec<Option<Tensor>> = (0..order.len()).map(|_| None).collect();
    for (piece, &i) in flat.split_with_sizes(&sizes, 0).into_iter().zip(order) {
        by_spec[i] = Some(piece);
    }
    by_spec
        .into_iter()
        .zip(&spec.params)
        .map(|(piece, p)| piece.expect("every parameter has a piece").view(p.shape.as_slice()))
        .collect()
}

/// Whether `spec` is one parameter filling a flat buffer of `len` elements,
/// which the model then reads through a plain view ([`split_views`]).
pub(crate) fn one_view(spec: &UnitSpec, len: i64) -> bool {
    matches!(spec.params.as_slice(), [whole] if whole.numel() == len)
}

/// A unit's parameters (in `spec` order, shaped) as views of its flat buffer.
pub fn unflatten(spec: &UnitSpec, flat: &Tensor) -> Vec<Tensor> {
    split_views(spec, &flat_layout(spec).0, flat)
}

/// Bytes a rank holds for one purpose, summed over units (what a strategy buys).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryAccount {
    /// fp32 masters plus the compute-dtype copies kept between steps.
    pub params: f64,
    pub grads: f64,
    pub optimizer_state: f64,
    /// The most bytes of gathered (temporarily whole) sharded units at once.
    pub gathered_peak: f64,
    /// How much of params + grads + optimizer state is in host memory (offload).
    pub host: f64,
    /// How much of `params` is frozen parameters (LoRA's base model);
    /// absent from rows written before LoRA.
    #[serde(default)]
    pub frozen: f64,
    /// What the communication hook keeps (`CommHook::state_bytes`: error
    /// feedback, factors) plus its workspace's peak in flight; absent from
    /// rows written before hooks.
    #[serde(default)]
    pub comm_state: f64,
}

/// Field by field (`gathered_peak` too: units have none of their own).
impl std::ops::Add for MemoryAccount {
    type Output = MemoryAccount;
    fn add(self, other: MemoryAccount) -> MemoryAccount {
        MemoryAccount {
            params: self.params + other.params,
            grads: self.grads + other.grads,
            optimizer_state: self.optimizer_state + other.optimizer_state,
            gathered_peak: self.gathered_peak + other.gathered_peak,
            host: self.host + other.host,
            frozen: self.frozen + other.frozen,
            comm_state: self.comm_state + other.comm_state,
        }
    }
}

impl std::iter::Sum for MemoryAccount {
    fn sum<I: Iterator<Item = MemoryAccount>>(accounts: I) -> MemoryAccount {
        accounts.fold(MemoryAccount::default(), |total, account| total + account)
    }
}

/// How one unit is split over its shard group.
#[derive(Debug, Clone, Copy)]
pub struct ShardLayout {
    /// Elements of the flat buffers (the parameters plus padding).
    pub padded: i64,
    /// This rank's slice of them.
    pub start: i64,
    pub len: i64,
}

impl ShardLayout {
    pub fn new(numel: i64, group_size: usize, group_rank: usize) -> ShardLayout {
        let n = group_size.max(1) as i64;
        let len = (numel + n - 1) / n;
        ShardLayout { padded: len * n, start: len * group_rank as i64, len }
    }
}

/// Where a unit keeps what (see the module comment); chosen from the strategy's policy.
#[derive(Debug, Clone, Copy)]
pub struct UnitPlacement {
    pub shard: ShardLayout,
    pub params_sharded: bool,
    pub optimizer_sharded: bool,
    pub grads_sharded: bool,
    /// Master, gradient and optimizer state in host memory.
    pub offload: bool,
    /// Parameters only, in the compute dtype: no master, gradient or optimizer state.
    pub frozen: bool,
    /// Frozen and held as 4-bit bytes: `shard` is over the bytes of the
    /// unit's `PackedLayout`, not its elements.
    pub packed: bool,
    /// An expert-parallel rank's rows of an experts unit, which its
    /// buffers hold (split over the experts' shard group when the policy
    /// shards): where they start in the unit as the model declares it.
    /// None for every other unit.
    pub expert_rows: Option<i64>,
}

impl UnitPlacement {
    /// What `policy` asks of a unit of `numel` elements on rank
    /// `group_rank` of a shard group of `group_size` ranks. A group of one
    /// shards nothing, whatever the policy.
    pub fn new(policy: &ShardingPolicy, numel: i64, group_size: usize, group_rank: usize, offload: bool) -> UnitPlacement {
        let sharded = group_size > 1;
        UnitPlacement {
            shard: ShardLayout::new(numel, group_size, group_rank),
            params_sharded: sharded && matches!(policy.params, ParamPlacement::Sharded { .. }),
            optimizer_sharded: sharded && policy.optimizer_state_sharded,
            grads_sharded: sharded && policy.grads == GradReduction::ReduceScatter,
            offload,
            frozen: false,
            packed: false,
            expert_rows: None,
        }
    }

    /// This placement for an expert-parallel rank's rows of an experts
    /// unit, from element `origin` of the unit on (the other holders of
    /// these experts hold the same rows).
    pub fn at_expert_rows(self, origin: i64) -> UnitPlacement {
        UnitPlacement { expert_rows: Some(origin), ..self }
    }

    /// This placement for a frozen unit: its parameters where the policy
    /// puts them, nothing else (so nothing to offload).
    pub fn frozen(self) -> UnitPlacement {
        UnitPlacement { frozen: true, offload: false, ..self }
    }

    /// This placement for a frozen unit held as `bytes` bytes of 4-bit
    /// blocks and kept vectors (`PackedLayout::bytes`), sharded as the
    /// policy shards parameters.
    pub fn packed(self, bytes: i64, group_size: usize, group_rank: usize) -> UnitPlacement {
        let shard = if self.params_sharded { ShardLayout::new(bytes, group_size, group_rank) } else { ShardLayout::new(bytes, 1, 0) };
        UnitPlacement { shard, packed: true, ..self.frozen() }
    }

    /// This placement for a frozen copy that only a forward without
    /// gradients reads (a preference loss's reference model): its
    /// parameters where the policy puts them, in host memory when the run
    /// offloads (uploaded for each use, and freed after). LoRA's frozen base
    /// stays on the device (`frozen`): backward reads it too.
    pub fn frozen_copy(self) -> UnitPlacement {
        UnitPlacement { frozen: true, ..self }
    }

    /// Whether the unit's compute buffer is freed between uses and filled
    /// again for each: sharded parameters, packed ones, or a frozen copy in
    /// host memory.
    pub fn transient(&self) -> bool {
        self.params_sharded || self.packed || (self.frozen && self.offload)
    }

    /// This placement with whole parameters on every rank (gradients and
    /// optimizer state still as the policy says): LoRA's adapters, too
    /// small to be worth gathering.
    pub fn whole_params(self) -> UnitPlacement {
        UnitPlacement { params_sharded: false, ..self }
    }

    /// Elements of `master` and the moments (and, offloaded, of the host
    /// gradient and the device's compute shard): this rank's shard when
    /// optimizer state is sharded, else the whole padded unit.
    pub fn owned_len(&self) -> i64 {
        if self.optimizer_sharded { self.shard.len } else { self.shard.padded }
    }

    /// Where `master` starts in the padded flat buffer: with `owned_len`,
    /// the range of it this rank updates and checkpoints.
    pub fn owned_start(&self) -> i64 {
        if self.optimizer_sharded { self.shard.start } else { 0 }
    }

    /// Elements of the device gradient: this rank's shard, or the padded whole unit.
    pub fn grad_len(&self) -> i64 {
        if self.grads_sharded { self.shard.len } else { self.shard.padded }
    }

    /// Whether `master` is (a slice of) the compute buffer rather than
    /// memory of its own: fp32 compute with whole parameters on the device.
    pub fn master_is_compute(&self, dtype: Kind) -> bool {
        dtype == Kind::Float && !self.params_sharded && !self.offload
    }

    /// The part of a whole (padded) flat tensor that `master` covers.
    fn owned_part_of(&self, whole: &Tensor) -> Tensor {
        if self.optimizer_sharded {
            whole.narrow(0, self.shard.start, self.shard.len)
        } else {
            whole.shallow_clone()
        }
    }

    /// Whether the compute buffer is freed after the unit's forward, not
    /// only after its backward: packed units always (at most two blocks are
    /// held dequantized), sharded ones when the policy reshards after forward.
    pub fn released_after_forward(&self, reshard_after_forward: bool) -> bool {
        self.packed || (reshard_after_forward && self.params_sharded)
    }

    /// Whether the device keeps this rank's shard in the compute dtype:
    /// sharded parameters with no master on the device to gather from
    /// (offloaded: it is on the host; frozen: there is none), unless the
    /// shard itself is in host memory (a frozen copy offloaded).
    pub fn keeps_compute_shard(&self) -> bool {
        (self.offload || self.frozen) && self.params_sharded && !(self.frozen && self.offload)
    }

    /// What this rank holds for the unit when computing in `dtype`:
    /// parameters and optimizer state between steps, the gradient from
    /// backward to the optimizer step (in fp32; with ft's kernels, one
    /// micro-batch's whole gradient on one rank stays in the compute dtype
    /// and its reduced shard in the reduce dtype, `accumulate_grad`, which
    /// `ft plan`'s walk counts). `FlatUnit::new` allocates by the
    /// same methods, and a test checks the two against each other.
    pub fn memory(&self, dtype: Kind) -> MemoryAccount {
        let compute_element = dtype.elt_size_in_bytes() as f64;
        if self.frozen {
            let held = if self.params_sharded { self.shard.len } else { self.shard.padded };
            let element = if self.packed { 1.0 } else { compute_element };
            let params = element * held as f64;
            let host = if self.offload { params } else { 0.0 };
            return MemoryAccount { params, frozen: params, host, ..MemoryAccount::default() };
        }
        let owned = self.owned_len() as f64;
        let master = if self.master_is_compute(dtype) { 0.0 } else { 4.0 * owned };
        let compute_copy = match (self.params_sharded, self.keeps_compute_shard()) {
            (false, _) => compute_element * self.shard.padded as f64,
            (true, true) => compute_element * owned,
            (true, false) => 0.0,
        };
        let optimizer_state = 2.0 * 4.0 * owned;
        // Offloaded, the host gradient covers what the master covers.
        let grads = 4.0 * if self.offload { owned } else { self.grad_len() as f64 };
        let host = if self.offload { master + grads + optimizer_state } else { 0.0 };
        MemoryAccount { params: master + compute_copy, grads, optimizer_state, gathered_peak: 0.0, host, frozen: 0.0, comm_state: 0.0 }
    }
}

/// What every `FlatUnit` constructor starts from: where its parameters sit.
struct FlatLayout<'a> {
    spec: &'a UnitSpec,
    order: Vec<usize>,
    decayed: i64,
    numel: i64,
    placement: UnitPlacement,
}

impl FlatLayout<'_> {
    /// The unit over these buffers, released if its parameters are sharded.
    fn assemble(self, compute: Tensor, master: Tensor, compute_shard: Option<Tensor>, grad: Tensor, moments: [Tensor; 2]) -> Result<FlatUnit> {
        let compute_alias = ft_sys::storage_alias(&compute)?;
        let [exp_avg, exp_avg_sq] = moments;
        let mut unit = FlatUnit {
            spec: self.spec.clone(),
            order: self.order,
            decayed: self.decayed,
            numel: self.numel,
            placement: self.placement,
            grad,
            exp_avg,
            exp_avg_sq,
            compute,
            compute_alias,
            gathering: None,
            gathered: true,
            master,
            compute_shard,
            host_copy: None,
            host_pieces: vec![],
            host_grad_filled: false,
            packed: None,
        };
        unit.release()?;
        Ok(unit)
    }
}

pub struct FlatUnit {
    pub(crate) spec: UnitSpec,
    /// The parameters (indices into `spec`) in the order the flat buffers hold them.
    order: Vec<usize>,
    /// Elements of the weight-decayed prefix.
    decayed: i64,
    numel: i64,
    placement: UnitPlacement,
    compute: Tensor,
    /// `compute`'s storage without autograd state: gathers and updates write
    /// through it without bumping the version counter of the graph's views.
    compute_alias: Tensor,
    gathering: Option<Pending>,
    gathered: bool,
    pub(crate) master: Tensor,
    /// Offloaded sharded parameters: this rank's shard on the device in the
    /// compute dtype, uploaded after each step (what gathers send).
    compute_shard: Option<Tensor>,
    /// A frozen copy offloaded: its parameters (whole, or this rank's
    /// shard) in the compute dtype in host memory, what each gather uploads.
    host_copy: Option<Tensor>,
    pub(crate) grad: Tensor,
    pub(crate) exp_avg: Tensor,
    pub(crate) exp_avg_sq: Tensor,
    /// Offloaded: this step's reduced gradients (the part `master` covers)
    /// after the first, which is copied into `grad` itself; one per
    /// micro-batch, on their way to or in host memory.
    host_pieces: Vec<Tensor>,
    /// Offloaded: whether this step's first gradient is in (or on its way to) `grad`.
    host_grad_filled: bool,
    /// A packed unit's bytes (its placement says `packed`).
    packed: Option<PackedBase>,
}

impl FlatUnit {
    /// Flattens `tensors` (one per parameter of `spec`, on the training
    /// device) and keeps what `placement` says this rank keeps; offloaded
    /// state is stored by `offload`.
    pub fn new(spec: &UnitSpec, tensors: &[Tensor], dtype: Kind, placement: UnitPlacement, offload: Option<&dyn Offload>) -> Result<FlatUnit> {
        let _no_grad = tch::no_grad_guard();
        let (order, decayed) = flat_layout(spec);
        let numel = spec.numel();
        let padded = placement.shard.padded;
        let mut pieces: Vec<Tensor> = order.iter().map(|&i| tensors[i].to_kind(Kind::Float).reshape([-1])).collect();
        let device = tensors[0].device();
        if padded > numel {
            pieces.push(Tensor::zeros([padded - numel], (Kind::Float, device)));
        }
        let full = Tensor::cat(&pieces, 0);
        drop(pieces);
        let layout = FlatLayout { spec, order, decayed, numel, placement };
        if placement.frozen {
            return FlatUnit::frozen(layout, full, dtype, offload);
        }
        if placement.offload {
            let offload = offload.ok_or_else(|| anyhow::anyhow!("unit {} is placed off the device, but no offload stores it", spec.name))?;
            return FlatUnit::offloaded(layout, full, dtype, offload);
        }
        let (compute, master) = if placement.master_is_compute(dtype) {
            let compute = full.set_requires_grad(true);
            let master = placement.owned_part_of(&ft_sys::storage_alias(&compute)?);
            (compute, master)
        } else {
            let compute = if placement.params_sharded {
                // Gathers cast the fp32 shard as they send it: no second copy is kept.
                Tensor::empty([padded], (dtype, device))
            } else {
                full.to_kind(dtype)
            };
            // A shard is copied out, so the whole fp32 buffer is freed.
            let master = if placement.optimizer_sharded { placement.owned_part_of(&full).copy() } else { full };
            (compute.set_requires_grad(true), master)
        };
        let moments = [master.zeros_like(), master.zeros_like()];
        layout.assemble(compute, master, None, Tensor::new(), moments)
    }

    /// A packed unit (`placement.packed`, from `layout`'s size): `tensors`
    /// quantized into `layout`'s bytes, of which this rank keeps its slice
    /// when parameters are sharded; the compute buffer is released.
    pub fn new_packed(spec: &UnitSpec, tensors: &[Tensor], dtype: Kind, placement: UnitPlacement, mut layout: PackedLayout) -> Result<FlatUnit> {
        let _no_grad = tch::no_grad_guard();
        let offsets = param_offsets(spec);
        let whole = layout.pack(spec, &offsets, tensors, placement.shard.padded)?;
        let held = if placement.params_sharded { whole.narrow(0, placement.shard.start, placement.shard.len).copy() } else { whole };
        let device = held.device();
        let (order, decayed) = flat_layout(spec);
        let numel = spec.numel();
        let none = || Tensor::empty([0], (Kind::Float, device));
        let flat = FlatLayout { spec, order, decayed, numel, placement };
        let mut unit = flat.assemble(Tensor::empty([numel], (dtype, device)), none(), None, Tensor::new(), [none(), none()])?;
        unit.packed = Some(PackedBase::new(layout, held, placement.shard.padded));
        Ok(unit)
    }

    /// The frozen layout: the compute copy only (whole, or this rank's
    /// shard to gather from; in host memory, stored by `offload`, for a
    /// frozen copy offloaded), no autograd leaf.
    fn frozen(layout: FlatLayout, full: Tensor, dtype: Kind, offload: Option<&dyn Offload>) -> Result<FlatUnit> {
        let placement = layout.placement;
        let device = full.device();
        let held = if placement.params_sharded { full.narrow(0, placement.shard.start, placement.shard.len) } else { full.shallow_clone() };
        // A buffer to gather into (`assemble` frees it until the first gather).
        let released = || Tensor::empty([placement.shard.padded], (dtype, device));
        let (compute, compute_shard, host_copy) = match (placement.offload, placement.params_sharded) {
            (true, _) => {
                let offload = offload.ok_or_else(|| anyhow::anyhow!("unit {} is a frozen copy placed in host memory, but no offload stores it", layout.spec.name))?;
                (released(), None, Some(offload.store(&held.to_kind(dtype), device)?))
            }
            // Copied out (a cast to fp32 would be a view), so the whole fp32 buffer is freed.
            (false, true) => (released(), Some(held.to_kind(dtype).copy()), None),
            (false, false) => (full.to_kind(dtype).copy(), None, None),
        };
        drop((held, full));
        let none = || Tensor::empty([0], (Kind::Float, device));
        let mut unit = layout.assemble(compute, none(), compute_shard, Tensor::new(), [none(), none()])?;
        unit.host_copy = host_copy;
        Ok(unit)
    }

    /// The offloaded layout: fp32 state on the host, the compute copy (whole,
    /// or this rank's shard when parameters are sharded) on the device.
    fn offloaded(layout: FlatLayout, full: Tensor, dtype: Kind, offload: &dyn Offload) -> Result<FlatUnit> {
        let placement = layout.placement;
        let padded = placement.shard.padded;
        let device = full.device();
        let owned = placement.owned_part_of(&full);
        let master = offload.store(&owned, device)?;
        let (compute, compute_shard) = if placement.keeps_compute_shard() {
            (Tensor::empty([padded], (dtype, device)).set_requires_grad(true), Some(owned.to_kind(dtype)))
        } else {
            (full.to_kind(dtype).copy().set_requires_grad(true), None)
        };
        drop(full);
        // Stored like the master: each step's first reduced gradient is copied straight into it.
        let grad = offload.store(&master.zeros_like(), device)?;
        let moments = [master.zeros_like(), master.zeros_like()];
        layout.assemble(compute, master, compute_shard, grad, moments)
    }

    /// Whether this unit has a gradient and optimizer state (it is not frozen).
    pub fn trainable(&self) -> bool {
        !self.placement.frozen
    }

    /// The device the model computes on.
    pub fn device(&self) -> tch::Device {
        self.compute.device()
    }

    pub fn offloaded_to_host(&self) -> bool {
        self.placement.offload
    }

    /// Offloaded: starts copying a reduced micro-batch gradient (whole, or
    /// this rank's shard) back to host memory; returns the bytes moved.
    pub(crate) fn send_to_host(&mut self, reduced: &Tensor) -> Result<i64> {
        let owned = self.owned_part(reduced);
        let bytes = (owned.numel() * owned.kind().elt_size_in_bytes()) as i64;
        // Non-blocking into pinned memory: the copy queues behind the reduction.
        if !self.host_grad_filled && owned.kind() == Kind::Float {
            // Into the host gradient itself: no host memory is allocated per step.
            ft_sys::copy_async(&self.grad, &owned)?;
            self.host_grad_filled = true;
        } else {
            // Accumulation's later micro-batches (or a gradient reduced in bf16) are staged.
            self.host_pieces.push(owned.to_device_(tch::Device::Cpu, owned.kind(), true, false));
        }
        Ok(bytes)
    }

    /// Offloaded, once the device's queued copies are done: this step's host
    /// gradient is the sum of its micro-batch pieces, in fp32.
    pub(crate) fn collect_host_grad(&mut self) {
        if !self.host_grad_filled {
            let _ = self.grad.zero_();
        }
        for piece in std::mem::take(&mut self.host_pieces) {
            let _ = self.grad.g_add_(&piece);
        }
        self.host_grad_filled = false;
    }
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Elements of the parameters (without padding).
    pub fn numel(&self) -> i64 {
        self.numel
    }

    pub fn placement(&self) -> &UnitPlacement {
        &self.placement
    }

    /// The dtype the model computes in.
    pub fn compute_kind(&self) -> Kind {
        self.compute.kind()
    }

    /// Views of the compute buffer: what the model reads, what autograd
    /// differentiates. Only while the unit is gathered.
    pub(crate) fn views(&self) -> Vec<Tensor> {
        assert!(self.gathered, "unit {} used while released", self.spec.name);
        split_views(&self.spec, &self.order, &self.compute)
    }

    /// Views of one of the unit's whole flat buffers, shaped like its parameters.
    pub(crate) fn shaped(&self, flat: &Tensor) -> Vec<Tensor> {
        split_views(&self.spec, &self.order, flat)
    }

    /// Adds a micro-batch's gradient (`fresh`, undefined when backward gave
    /// none) into `grad`, in fp32; the first micro-batch of a step takes it
    /// as the gradient (no zeroed buffer). `whole`: it is the step's whole
    /// gradient (one micro-batch, nothing to reduce) and stays in its own
    /// dtype, for AdamW to read: an fp32 copy would hold the same values in
    /// twice the memory (13.5 GB more for a 7B model).
    pub(crate) fn accumulate_grad(&mut self, fresh: &Tensor, first_micro_batch: bool, whole: bool) {
        match (fresh.defined(), first_micro_batch) {
            (true, true) if whole => self.grad = fresh.shallow_clone(),
            (true, true) => self.grad = fresh.to_kind(Kind::Float),
            (true, false) => {
                let _ = self.grad.g_add_(fresh);
            }
            (false, true) => self.grad = Tensor::zeros([self.placement.grad_len()], (Kind::Float, self.device())),
            (false, false) => {}
        }
    }

    /// Frees the device gradient once the optimizer has used it.
    pub(crate) fn release_grad(&mut self) {
        if !self.placement.offload {
            self.grad = Tensor::new();
        }
    }

    /// The accumulated gradient (fp32, or the compute dtype when it was
    /// `whole`), shaped (only when it is whole).
    pub fn grad_views(&self) -> Vec<Tensor> {
        assert!(!self.placement.grads_sharded, "unit {}: the gradient is sharded", self.spec.name);
        self.shaped(&self.grad)
    }

    /// The compute buffer's fresh gradient (undefined if backward gave none), dropped from the leaf.
    pub(crate) fn take_compute_grad(&self) -> Result<Tensor> {
        let grad = self.compute.grad();
        ft_sys::clear_grad(&self.compute).map_err(anyhow::Error::msg)?;
        Ok(grad)
    }

    /// The part of `grad` that `master` covers (what this rank's optimizer reads).
    pub(crate) fn owned_grad(&self) -> Tensor {
        self.owned_part(&self.grad)
    }

    /// The part of a whole-or-shard flat tensor that `master` covers.
    fn owned_part(&self, flat: &Tensor) -> Tensor {
        if flat.size()[0] == self.placement.shard.padded {
            self.placement.owned_part_of(flat)
        } else {
            flat.shallow_clone()
        }
    }

    /// Elements of `master` under weight decay: the decayed prefix, cut to the slice `master` covers.
    pub(crate) fn decayed_in_master(&self) -> i64 {
        let master_start = if self.master_is_whole() { 0 } else { self.placement.shard.start };
        (self.decayed - master_start).clamp(0, self.master.size()[0])
    }

    fn master_is_whole(&self) -> bool {
        self.master.size()[0] == self.placement.shard.padded
    }

    /// Sharded parameters: this rank's shard as the device holds it — the
    /// compute-dtype copy where one is kept, else the fp32 master — which a
    /// gather sends cast to the compute dtype (`gather_source`).
    pub(crate) fn held_shard(&self) -> &Tensor {
        self.compute_shard.as_ref().unwrap_or(&self.master)
    }

    /// Sharded parameters: the shard a gather sends, in the compute dtype
    /// (half the bytes of fp32 under bf16; a cast of this rank's shard).
    fn gather_source(&self) -> Tensor {
        match &self.host_copy {
            // A frozen copy's shard in (pinned) host memory, uploaded asynchronously.
            Some(host) if self.compute_shard.is_none() => host.to_device_(self.device(), host.kind(), true, false),
            _ => self.held_shard().to_kind(self.compute.kind()),
        }
    }

    /// Starts gathering a released sharded unit (allocating its buffer)
    /// through `hook`, or a packed one's bytes (from `group`, the shard
    /// group, when sharded) to dequantize; returns the bytes allocated. A
    /// no-op when gathered or in flight.
    #[allow(clippy::too_many_arguments)] // each a separate part the trainer owns
    pub(crate) fn start_gather(&mut self, group: Option<&ProcessGroup>, hook: &mut dyn CommHook, workspace: &Workspace, info: &UnitInfo, phase: GatherPhase, step: usize, seed: u64) -> Result<i64> {
        if self.gathered || self.gathering.is_some() {
            return Ok(0);
        }
        let bytes = self.gathered_bytes();
        ft_sys::resize_storage(&self.compute_alias, bytes as usize)?;
        let group = group.filter(|_| self.placement.params_sharded);
        if let (None, Some(host)) = (group, &self.host_copy) {
            // A frozen copy held whole in host memory: uploaded, asynchronously from pinned memory.
            ft_sys::copy_async(&self.compute_alias, host)?;
            return Ok(bytes);
        }
        if let Some(packed) = &self.packed {
            if let Some(group) = group {
                group.note_caller(|| format!("gathered the 4-bit bytes of unit {} ({phase:?}, step {step})", info.name));
            }
            self.gathering = Some(packed.start_unpack(group, self.compute_alias.shallow_clone())?);
            return Ok(bytes);
        }
        let group = group.ok_or_else(|| anyhow::anyhow!("unit {} is sharded but the trainer has no shard group to gather it from", info.name))?;
        group.note_caller(|| format!("comm `{}` gathered unit {} ({phase:?}, step {step})", hook.name(), info.name));
        let (shard, output) = (self.gather_source(), self.compute_alias.shallow_clone());
        let gathering = workspace
            .issue(hook, info, &WireRequest { wire: Wire::Gather, elements: shard.size()[0], dtype: shard.kind(), group_size: group.size() }, shard.device(), |hook, workspace| {
                hook.gather(ParamGather { unit: info, phase, group, shard, output, step, seed, workspace })
            })
            .map_err(|e| e.context(format!("comm `{}`: gathering unit {}", hook.name(), info.name)))?;
        self.gathering = Some(gathering);
        Ok(bytes)
    }

    /// Waits for the gather `start_gather` began, if any: the unit is usable after.
    pub(crate) fn finish_gather(&mut self) -> Result<()> {
        if let Some(pending) = self.gathering.take() {
            pending.wait()?;
        }
        self.gathered = true;
        Ok(())
    }

    /// Frees a sharded unit's gathered buffer; returns the bytes freed.
    pub(crate) fn release(&mut self) -> Result<i64> {
        if !self.transient() || !self.gathered {
            return Ok(0);
        }
        // A float8 gather's notes of weights in the buffer (and the bytes they hold) go with it.
        ft_sys::float8::forget_gathered_in(&self.compute_alias);
        ft_sys::resize_storage(&self.compute_alias, 0)?;
        self.gathered = false;
        Ok(self.gathered_bytes())
    }

    /// Whether the compute buffer is freed between uses (`UnitPlacement::transient`).
    pub(crate) fn transient(&self) -> bool {
        self.placement.transient()
    }

    /// Bytes of the unit's buffer while gathered.
    fn gathered_bytes(&self) -> i64 {
        self.compute.size()[0] * self.compute.kind().elt_size_in_bytes() as i64
    }

    /// Where ft's AdamW kernel may write the updated master rounded to bf16
    /// as it steps it (`kernels::adamw_`'s `compute`): the unit's own buffer,
    /// when the master is whole, on the device and apart from that bf16 copy.
    /// `refresh_compute` then has nothing left to copy.
    pub(crate) fn compute_copy_of_master(&self) -> Option<&Tensor> {
        let whole_copy = !self.placement.frozen && !self.placement.params_sharded && !self.offloaded_to_host() && self.master_is_whole();
        (whole_copy && self.compute.kind() == Kind::BFloat16).then_some(&self.compute_alias)
    }

    /// After an optimizer step: brings the compute copy up to date with the
    /// master, unless the optimizer `wrote` it already (`compute_copy_of_master`).
    /// Returns the all-gather in flight when parameters are replicated but
    /// the master is sharded (zero1).
    pub(crate) fn refresh_compute(&mut self, shard_group: Option<&ProcessGroup>, wrote: bool) -> Result<Option<Work>> {
        let _no_grad = tch::no_grad_guard();
        if self.placement.frozen {
            return Ok(None);
        }
        let dtype = self.compute.kind();
        // Offloaded: upload the host master asynchronously (it is pinned).
        let master = self.master.to_device_(self.compute.device(), Kind::Float, true, false);
        if let Some(shard) = &mut self.compute_shard {
            shard.copy_(&master);
            return Ok(None);
        }
        if self.placement.params_sharded {
            return Ok(None);
        }
        if self.master_is_whole() {
            if !self.placement.master_is_compute(dtype) && !wrote {
                self.compute_alias.copy_(&master);
            }
            return Ok(None);
        }
        // Each rank updated its slice: gather the slices into everyone's whole copy
        // (from a separate tensor: the fp32 master may be a slice of the destination).
        let source = master.to_kind(dtype).copy();
        let group = shard_group.expect("a sharded master has a shard group");
        Ok(Some(group.all_gather_into_tensor(&mut self.compute_alias, &source)?))
    }

    /// Puts back fp32 state ([master, exp_avg, exp_avg_sq], each the part
    /// `master` covers: `owned_start`, `owned_len`), then brings the compute
    /// copy up to date — under zero1 by gathering the shard group's slices,
    /// so every rank of the group calls this.
    pub(crate) fn restore(&mut self, state: &[Tensor], shard_group: Option<&ProcessGroup>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (target, source) in [&self.master, &self.exp_avg, &self.exp_avg_sq].into_iter().zip(state) {
            if source.size() != target.size() {
                anyhow::bail!("unit {}: checkpoint part {:?} does not fit this rank's {:?}", self.spec.name, source.size(), target.size());
            }
            target.shallow_clone().copy_(source);
        }
        if let Some(work) = self.refresh_compute(shard_group, false)? {
            work.wait()?;
        }
        Ok(())
    }

    /// `tensor` whole (unpadded), gathering the slices from the shard group when it is this rank's slice only.
    pub(crate) fn whole(&self, tensor: &Tensor, group: Option<&ProcessGroup>) -> Result<Tensor> {
        let shard = self.placement.shard;
        if tensor.size()[0] == shard.padded {
            return Ok(tensor.narrow(0, 0, self.numel));
        }
        // Collectives run on the compute device (an offloaded tensor is on the host).
        let device = self.compute.device();
        let mut out = Tensor::empty([shard.padded], (tensor.kind(), device));
        let group = group.expect("a sharded tensor has a shard group");
        group.all_gather_into_tensor(&mut out, &tensor.to_device(device).contiguous())?.wait()?;
        Ok(out.narrow(0, 0, self.numel))
    }

    /// The whole parameters in the compute dtype (gathered if sharded), detached.
    pub(crate) fn whole_compute(&self, group: Option<&ProcessGroup>) -> Result<Tensor> {
        if let Some(packed) = &self.packed {
            let out = Tensor::empty([self.numel], (self.compute.kind(), self.device()));
            packed.start_unpack(group.filter(|_| self.placement.params_sharded), out.shallow_clone())?.wait()?;
            return Ok(out);
        }
        if self.placement.params_sharded {
            self.whole(&self.gather_source(), group)
        } else {
            Ok(self.compute_alias.shallow_clone())
        }
    }

    /// What this rank holds for the unit: parameters and optimizer state
    /// between steps, the gradient from backward to the optimizer step.
    pub(crate) fn memory(&self) -> MemoryAccount {
        self.placement.memory(self.compute_kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::strategy::ShardGroup;
    use crate::model::{Init, ParamSpec};
    use crate::nf4::{QuantType, Quantization};

    /// Offloaded state in plain host memory (the `cpu` offload is a crate core does not depend on).
    struct HostForTests;

    impl Offload for HostForTests {
        fn name(&self) -> &str {
            "host-for-tests"
        }

        fn store(&self, values: &Tensor, _device: tch::Device) -> Result<Tensor> {
            Ok(values.to_device(tch::Device::Cpu).copy())
        }

        fn sum_of_squares(&self, _grad: &Tensor) -> Result<f64> {
            unreachable!("the memory test takes no step")
        }

        fn adamw(&self, _parts: &[[Tensor; 4]], _hyper: crate::AdamW, _step: f64, _grad_scale: f64) -> Result<()> {
            unreachable!("the memory test takes no step")
        }
    }

    /// What a unit's tensors occupy, measured on the tensors themselves.
    fn measured(unit: &FlatUnit) -> MemoryAccount {
        let bytes = |t: &Tensor| if t.defined() { (t.numel() * t.kind().elt_size_in_bytes()) as f64 } else { 0.0 };
        // A released gathered buffer has its shape but no storage.
        let compute = if unit.transient() { 0.0 } else { bytes(&unit.compute) };
        let compute_start = unit.compute.data_ptr() as usize;
        let master_in_compute = compute > 0.0 && (compute_start..compute_start + compute as usize).contains(&(unit.master.data_ptr() as usize));
        let master = if master_in_compute { 0.0 } else { bytes(&unit.master) };
        let shard = unit.compute_shard.as_ref().map_or(0.0, bytes) + unit.packed.as_ref().map_or(0.0, |p| p.held_bytes() as f64);
        let host_copy = unit.host_copy.as_ref().map_or(0.0, bytes);
        let optimizer_state = bytes(&unit.exp_avg) + bytes(&unit.exp_avg_sq);
        let grads = bytes(&unit.grad);
        let host = if unit.placement.offload { master + grads + optimizer_state + host_copy } else { 0.0 };
        let frozen = if unit.placement.frozen { compute + shard + host_copy } else { 0.0 };
        MemoryAccount { params: compute + master + shard + host_copy, grads, optimizer_state, gathered_peak: 0.0, host, frozen, comm_state: 0.0 }
    }

    /// A unit of one parameter filling its buffer hands autograd's gradient
    /// of the parameter to the buffer as it is (no gradient-sized copy: a
    /// mixture of experts' fused experts, an embedding); a unit of several,
    /// or one padded for its shard group, gets it through the concatenation.
    #[test]
    fn a_unit_of_one_parameter_takes_its_gradient_without_a_copy() {
        let param = |name: &str, shape: &[i64]| ParamSpec::new("", name, shape, Init::Zeros);
        let cases = [(vec![param("experts", &[2, 3, 4])], 1, true), (vec![param("experts", &[2, 3, 5])], 4, false), (vec![param("w", &[4, 6]), param("b", &[6])], 1, false)];
        for (params, group_size, as_it_is) in cases {
            let spec = UnitSpec { name: "unit".into(), params };
            let tensors: Vec<Tensor> = spec.params.iter().map(|p| p.initial(Kind::Float, tch::Device::Cpu)).collect();
            let placement = UnitPlacement::new(&ShardingPolicy::replicated(false), spec.numel(), group_size, 0, false);
            let unit = FlatUnit::new(&spec, &tensors, Kind::Float, placement, None).unwrap();
            let views = unit.views();
            let grads: Vec<Tensor> = views.iter().map(|v| v.randn_like()).collect();
            ft_sys::backward(&views.iter().collect::<Vec<_>>(), &grads.iter().collect::<Vec<_>>()).unwrap();
            let flat = unit.take_compute_grad().unwrap();
            let expected = Tensor::cat(&grads.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(), 0);
            assert!(flat.narrow(0, 0, spec.numel()).equal(&expected), "{spec:?}");
            assert_eq!(flat.data_ptr() == grads[0].data_ptr(), as_it_is, "{spec:?} in a group of {group_size}");
        }
    }

    #[test]
    fn the_account_is_what_flat_units_allocate() {
        // 53 elements: padding to every group size below; packed, a matrix and fused experts in 4 bits.
        let spec = UnitSpec {
            name: "unit".into(),
            params: vec![ParamSpec::new("", "w", &[4, 6], Init::Zeros), ParamSpec::new("", "b", &[5], Init::Zeros), ParamSpec::new("", "experts", &[2, 3, 4], Init::Zeros)],
        };
        let tensors: Vec<Tensor> = spec.params.iter().map(|p| p.initial(Kind::Float, tch::Device::Cpu)).collect();
        let policies = [
            ShardingPolicy::replicated(false),
            ShardingPolicy::replicated(true),
            ShardingPolicy::sharded(false, ShardGroup::World),
            ShardingPolicy::sharded(true, ShardGroup::World),
        ];
        for policy in &policies {
            for (group_size, group_rank) in [(1, 0), (2, 1), (4, 3)] {
                for dtype in [Kind::Float, Kind::BFloat16] {
                    for (offload, frozen) in [(false, false), (true, false), (false, true), (true, true)] {
                        let placement = UnitPlacement::new(policy, spec.numel(), group_size, group_rank, offload);
                        // Frozen and offloaded: a frozen copy in host memory (LoRA's base, `frozen`, stays on the device).
                        let placement = if frozen { placement.frozen_copy() } else { placement };
                        let storage: Option<&dyn Offload> = if offload { Some(&HostForTests) } else { None };
                        let mut unit = FlatUnit::new(&spec, &tensors, dtype, placement, storage).unwrap();
                        if frozen {
                            let case = format!("frozen, {policy:?} in a group of {group_size}, {dtype:?}, offload {offload}");
                            assert_eq!(unit.memory(), measured(&unit), "{case}");
                            if offload {
                                continue;
                            }
                            let quantization = Quantization { quant_type: QuantType::Nf4, blocksize: 64, double_quant: dtype == Kind::Float };
                            let layout = PackedLayout::new(&spec, &param_offsets(&spec), dtype, quantization, |param| param.shape.len() >= 2);
                            let placement = placement.packed(layout.bytes(), group_size, group_rank);
                            let unit = FlatUnit::new_packed(&spec, &tensors, dtype, placement, layout).unwrap();
                            assert_eq!(unit.memory(), measured(&unit), "packed, {case}");
                            continue;
                        }
                        if !offload {
                            // The step's gradient as a reduction leaves it.
                            unit.accumulate_grad(&Tensor::ones([placement.grad_len()], (Kind::Float, tch::Device::Cpu)), true, false);
                        }
                        let case = format!("{policy:?} in a group of {group_size}, {dtype:?}, offload {offload}");
                        assert_eq!(unit.memory(), measured(&unit), "{case}");
                    }
                }
            }
        }
    }
}
