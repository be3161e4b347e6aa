//! One optimizer step's time: the model's FLOPs at the GPU's achieved rate,
//! AdamW's pass over the optimizer state and each dequantization of a 4-bit
//! unit at memory bandwidth, the bytes each
//! collective moves at the bus bandwidth (nccl-tests' busbw, what `ft
//! comm-test` measures), offload's host optimizer and transfers, and a
//! reference model's forward run with each step — each rate from the
//! tables below, or as `ft calibrate` measured it (`calibrate.rs`: float8
//! layers at their float8 rates).
//!
//! Calibrated on `ft bench` rows measured on H200s (bench/results/
//! 2026-11-22-h200x2-performance.md: BLOOM-560m on 1 and 2 GPUs under ddp,
//! shard_grad_op and full_shard, OPT-1.3B on 1 and 2, CodeLlama-7B on 2 at
//! 2 × 2048; 2026-11-22-h200x2-offload.md for offload): tests/plan.rs checks
//! each prediction against them.

use super::memory::StepMemory;
use super::{Cluster, Setup, Workload};
use crate::distributed::collectives_bench::Collective;
use crate::distributed::comm_hook::{CommHook, ReduceStage, UnitInfo, Wire, WireRequest};
use crate::distributed::flat::UnitPlacement;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use tch::Kind;

/// The share of the dense peak ft's step reaches on a GPU of the table:
/// its model FLOPs utilisation measured 33-49% for BLOOM-560m, OPT-1.3B and
/// CodeLlama-7B on H200s; 0.42 makes the largest error over those rows
/// smallest.
pub const ACHIEVED_FRACTION: f64 = 0.42;

/// The share of the memory bandwidth AdamW's kernel reaches (3.8 of 4.8 TB/s on an H200).
const OPTIMIZER_BANDWIDTH_FRACTION: f64 = 0.8;

/// The share of the memory bandwidth ft's 4-bit dequantization kernel
/// reaches: 1.4-2.0 of an H100's 3.35 TB/s on Llama-7B's weights
/// (bench/results/2026-11-26-qlora.md).
const DEQUANTIZE_BANDWIDTH_FRACTION: f64 = 0.5;

/// The share of the memory bandwidth LoRA's adapters on a mixture's fused
/// experts run at (`expert_adapter_seconds`): rank-r grouped GEMMs over
/// every assignment's row, bound by the rows they read and write, not by
/// their FLOPs. Fitted to the bf16 row of
/// bench/results/2026-11-28-h200-moe-lora.md (Qwen3-30B-A3B, r16, 255 ms
/// a step beyond the FLOPs); its NF4 and offloaded rows are then within 15%.
const EXPERT_ADAPTER_BANDWIDTH_FRACTION: f64 = 0.25;

/// Bytes AdamW moves per element it updates: master, gradient and two
/// moments read, master and moments written (28), and the gradient norm's read (4).
const OPTIMIZER_BYTES: f64 = 32.0;

/// How much of the communication that runs beside compute still costs
/// time: NCCL's kernels take SMs from the GEMMs they overlap (~8% slower
/// GEMMs under OPT-1.3B's 27 ms of collectives per step) besides the gaps
/// where a unit waits for its gather. Fitted to the 2-GPU rows.
const CONTENTION: f64 = 0.3;

/// A step's time by where it goes, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Forward and backward (with activation checkpointing, the blocks'
    /// forward again) at the GPU's achieved FLOP/s.
    pub compute: f64,
    /// Collectives the compute does not hide.
    pub communication: f64,
    /// AdamW on the GPU.
    pub optimizer: f64,
    /// Offloaded: the host's AdamW and the transfers nothing hides.
    pub offload: f64,
    /// A communication hook's compression and decompression at its measured rate.
    #[serde(default)]
    pub compress: f64,
    /// 4-bit units dequantized for each use (QLoRA's base).
    #[serde(default)]
    pub dequantize: f64,
    /// A reference model's forward without gradients before each
    /// micro-batch's (a preference task's), and the uploads of a frozen
    /// copy in host memory it does not hide; its gathers are in `communication`.
    #[serde(default)]
    pub reference: f64,
    /// Expert parallelism's token exchanges: each sparse layer's dispatch
    /// and combine, forward and backward (and forward again when
    /// recomputed), which nothing overlaps.
    #[serde(default)]
    pub all_to_all: f64,
    /// Online RL's sampling, a generation's share per step it serves (`RolloutShape::seconds`).
    #[serde(default)]
    pub rollout: f64,
}

impl StepTime {
    pub fn total(&self) -> f64 {
        self.compute + self.communication + self.optimizer + self.offload + self.compress + self.dequantize + self.reference + self.all_to_all + self.rollout
    }
}

/// Which ranks a collective runs over.
#[derive(Clone, Copy)]
enum Group {
    /// The shard group: consecutive ranks.
    Shard,
    /// Every rank.
    World,
    /// Hybrid sharding's replicas: the ranks holding the same shard in the other groups.
    Replicas,
    /// An expert group: consecutive ranks.
    Experts,
    /// The ranks holding the same experts in the other expert groups.
    ExpertReplicas,
    /// Those of them in a shard group, which split the experts' state.
    ExpertShard,
}

impl Group {
    /// The group splitting the state of a unit placed as `placement`.
    fn shard_of(placement: &UnitPlacement) -> Group {
        if placement.expert_rows.is_some() { Group::ExpertShard } else { Group::Shard }
    }
}

/// A cluster's groups: how many ranks each has.
#[derive(Clone, Copy)]
struct Groups {
    world: usize,
    shard: usize,
    experts: usize,
}

impl Groups {
    fn size(self, group: Group) -> usize {
        match group {
            Group::Shard => self.shard,
            Group::World => self.world,
            Group::Replicas => self.world / self.shard,
            Group::Experts => self.experts,
            Group::ExpertReplicas => self.world / self.experts,
            Group::ExpertShard => crate::distributed::experts::expert_shard_size(self.experts, self.shard).unwrap_or(1),
        }
    }
}

/// One collective of a step.
struct Transfer {
    collective: Collective,
    group: Group,
    /// The buffer's bytes, as nccl-tests counts them (an all-gather's: the gathered whole).
    bytes: f64,
    /// Nothing runs beside it: the first gather, the last reduction, zero1's gather after the step.
    exposed: bool,
}

struct Network<'a> {
    cluster: &'a Cluster,
    groups: Groups,
}

impl Network<'_> {
    fn seconds(&self, transfer: &Transfer) -> f64 {
        let ranks = self.groups.size(transfer.group);
        let across_nodes = match transfer.group {
            Group::Shard | Group::ExpertShard => self.groups.shard > self.cluster.gpus_per_node(),
            Group::Experts => self.groups.experts > self.cluster.gpus_per_node(),
            Group::World | Group::Replicas | Group::ExpertReplicas => self.cluster.nodes > 1,
        };
        if ranks <= 1 {
            return 0.0;
        }
        let bandwidth = if across_nodes { self.cluster.inter_node_bus_bandwidth } else { self.cluster.node_bus_bandwidth };
        transfer.bytes * transfer.collective.bus_factor(ranks) / bandwidth
    }
}

/// What a step's collectives carry through `hook` (None: the built-in's).
struct Wires<'a> {
    hook: Option<&'a dyn CommHook>,
    units: &'a [UnitInfo],
    groups: Groups,
    /// Elements the hook changed on their way (compressed, quantized).
    changed: f64,
}

/// A row's units: the model's placements, the reference's frozen copy's
/// (empty without one), what the hook is told of each, and which are gathered in float8.
pub(super) struct StepUnits<'a> {
    pub placements: &'a [UnitPlacement],
    pub copy: &'a [UnitPlacement],
    pub info: &'a [UnitInfo],
    pub float8_gathered: &'a [bool],
}

impl Wires<'_> {
    /// The collectives of unit `u`'s `wire` over `group`, whose input is
    /// this rank's `elements` elements of `dtype`: those the hook declares
    /// (`CommHook::wire_bytes`), or a float8 gather's (`float8`: the unit's
    /// gather in float8 bytes, around the hook), each sized for the group
    /// (an all-gather's buffer is every member's input).
    #[allow(clippy::too_many_arguments)] // each a separate part of the collective
    fn transfers(&mut self, u: usize, wire: Wire, elements: i64, dtype: Kind, group: Group, exposed: bool, float8: bool) -> Vec<Transfer> {
        let group_size = self.groups.size(group);
        let request = WireRequest { wire, elements, dtype, group_size };
        let builtin = vec![request.builtin()];
        let declared = match (float8, self.hook) {
            (true, _) => crate::distributed::float8_gather::float8_gather_bytes(&self.units[u], &request),
            (false, Some(hook)) => hook.wire_bytes(&self.units[u], &request),
            (false, None) => builtin.clone(),
        };
        // ft's own casts make a float8 gather's bytes, not the hook's compression.
        if !float8 && declared != builtin {
            // A gather's work covers the whole unit it fills (dequantized, decompressed).
            self.changed += elements as f64 * if wire == Wire::Gather { group_size as f64 } else { 1.0 };
        }
        let buffer = |collective: Collective| if collective == Collective::AllGather { group_size as f64 } else { 1.0 };
        declared.into_iter().map(|c| Transfer { collective: c.collective, group, bytes: c.bytes * buffer(c.collective), exposed }).collect()
    }
}

/// The all-gathers of `gathers` (one micro-batch's, in order, by unit of
/// `placements`, those `float8_gathered` says in float8 bytes), the first exposed.
fn gather_transfers(placements: &[UnitPlacement], gathers: &[(usize, f64)], float8_gathered: &[bool], dtype: Kind, wires: &mut Wires, out: &mut Vec<Transfer>) {
    for (i, &(u, _)) in gathers.iter().enumerate() {
        let float8 = float8_gathered.get(u).copied().unwrap_or(false);
        let placement = &placements[u];
        match (placement.params_sharded, placement.packed) {
            // A whole 4-bit unit is dequantized where it is, a whole frozen copy uploaded: nothing moves between ranks.
            (false, _) => {}
            // 4-bit bytes go through the built-in all-gather, never a hook (`distributed/packed_base.rs`).
            (true, true) => out.push(Transfer { collective: Collective::AllGather, group: Group::shard_of(placement), bytes: placement.shard.padded as f64, exposed: i == 0 }),
            (true, false) => out.extend(wires.transfers(u, Wire::Gather, placement.shard.len, dtype, Group::shard_of(placement), i == 0, float8)),
        }
    }
}

/// The collectives of one step (`step`'s gathers are one micro-batch's),
/// and the elements the hook compressed.
fn transfers(workload: &Workload, units: &StepUnits, step: &StepMemory, data_parallel: bool, wires: &mut Wires) -> Vec<Transfer> {
    let mut out = vec![];
    if !data_parallel {
        return out;
    }
    let (placements, copy) = (units.placements, units.copy);
    // Float8 gathers cast with every gathered weight's amax, reduced over the shard group once a step before any gather.
    let float8_weights: usize = (0..placements.len())
        .filter(|&u| units.float8_gathered[u])
        .map(|u| units.info[u].params.iter().filter(|p| p.shape.len() == 2).count())
        .sum();
    if float8_weights > 0 {
        out.push(Transfer { collective: Collective::AllReduce, group: Group::Shard, bytes: 4.0 * float8_weights as f64, exposed: true });
    }
    let (compute, reduce) = (workload.dtype, workload.reduce_dtype.kind(workload.dtype));
    let micro_batches = workload.grad_accum;
    for micro in 0..micro_batches {
        let last = micro + 1 == micro_batches;
        // The reference's frozen copy first: its forward runs before the micro-batch's own.
        gather_transfers(copy, &step.copy_gathers, &[], compute, wires, &mut out);
        gather_transfers(placements, &step.gathers, units.float8_gathered, compute, wires, &mut out);
        // Backward reduces the units in reverse: the first stage's unit last.
        let first_unit = workload.model.stages()[0].unit;
        for (u, placement) in placements.iter().enumerate().filter(|(_, p)| !p.frozen) {
            let exposed = u == first_unit;
            let (padded, shard) = (placement.shard.padded, placement.shard.len);
            if placement.grads_sharded {
                out.extend(wires.transfers(u, Wire::Reduce(ReduceStage::Shard), padded, reduce, Group::shard_of(placement), exposed, false));
                // Replicas sum their shards: each micro-batch's when it goes to the host.
                let replica = if placement.offload { Some(reduce) } else { last.then_some(Kind::Float) };
                if let Some(dtype) = replica {
                    out.extend(wires.transfers(u, Wire::Reduce(ReduceStage::Replica), shard, dtype, Group::Replicas, exposed, false));
                }
            } else if placement.offload || last {
                // An expert-parallel rank's experts are summed over their other holders.
                let group = if placement.expert_rows.is_some() { Group::ExpertReplicas } else { Group::World };
                out.extend(wires.transfers(u, Wire::Reduce(ReduceStage::World), padded, reduce, group, exposed, false));
            }
        }
    }
    // zero1: each rank updated its slice of the replicated parameters.
    let compute = compute.elt_size_in_bytes() as f64;
    for placement in placements.iter().filter(|p| p.optimizer_sharded && !p.params_sharded && !p.frozen) {
        out.push(Transfer { collective: Collective::AllGather, group: Group::shard_of(placement), bytes: placement.shard.padded as f64 * compute, exposed: true });
    }
    out
}

/// Training FLOPs per token of the blocks alone (what recomputation repeats in forward).
/// What LoRA's adapters on a mixture's fused experts (`lora::EXPERTS`)
/// take beyond their FLOPs: for each assignment and adapted [E, N, K]
/// parameter, a pass reads the row's K inputs and moves its N outputs about
/// six times (the update's two products, its scale and its add; backward's
/// likewise), once forward, again where the block is recomputed, and as
/// two passes backward.
fn expert_adapter_seconds(workload: &Workload, cluster: &Cluster, tokens: f64, recomputed: f64) -> f64 {
    let model = workload.model;
    let Some(experts) = model.experts() else { return 0.0 };
    let params = || model.units().iter().flat_map(|unit| &unit.params);
    let adapted = |name: &str| params().any(|p| p.name == format!("{name}.lora_A.weight"));
    let per_assignment: i64 = params()
        .filter(|p| model.expert_parameters().contains(&p.name.as_str()) && p.shape.len() == 3 && adapted(&p.name))
        .map(|p| p.shape[2] + 6 * p.shape[1])
        .sum();
    let element = workload.dtype.elt_size_in_bytes() as f64;
    let bytes = tokens * experts.per_token as f64 * per_assignment as f64 * element * (3.0 + recomputed);
    bytes / (cluster.memory_bandwidth * EXPERT_ADAPTER_BANDWIDTH_FRACTION)
}

/// The share of the blocks whose forward runs again in backward.
fn recomputed_share(workload: &Workload, setup: &Setup) -> f64 {
    let blocks = crate::model::block_count(workload.model);
    match (setup.activation_checkpointing, setup.checkpoint_layers) {
        (false, _) => 0.0,
        (true, None) => 1.0,
        (true, Some(layers)) => layers.min(blocks) as f64 / blocks.max(1) as f64,
    }
}

fn block_flops_per_token(workload: &Workload) -> f64 {
    let model = workload.model;
    let block_units: BTreeSet<usize> = crate::model::block_units(model).collect();
    let other_params: i64 = (0..model.units().len()).filter(|u| !block_units.contains(u)).map(|u| model.units()[u].numel()).sum();
    model.train_flops_per_token(workload.seq) - 6.0 * other_params as f64
}

/// FLOPs per token of a forward without gradients through the model's
/// stages, adapters off: a third of training's (2N and attention's 4·layers·hidden·seq).
fn forward_flops_per_token(workload: &Workload) -> f64 {
    let model = workload.model;
    let units: BTreeSet<usize> = model.stages().iter().flat_map(|stage| stage.units()).collect();
    let params: i64 = units.iter().map(|&u| model.units()[u].numel()).sum();
    let dims = model.dims();
    2.0 * params as f64 + 4.0 * (dims.layers * dims.hidden * workload.seq) as f64
}

/// Seconds of a step's reference forwards (one a micro-batch) at the
/// step's rates, and the uploads of `copy`'s units in host memory
/// (`copy_gathers` a micro-batch's) where that compute does not hide them.
fn reference_seconds(workload: &Workload, cluster: &Cluster, copy: &[UnitPlacement], copy_gathers: &[(usize, f64)]) -> f64 {
    let tokens = (workload.batch * workload.seq) as f64 * workload.grad_accum as f64;
    // A forward's share of the memory-bound kernels, as activation checkpointing's recomputation counts it.
    let compute = tokens * forward_flops_per_token(workload) / cluster.flops + cluster.memory_bound_seconds(workload, tokens, 0.0) / 3.0;
    let element = workload.dtype.elt_size_in_bytes() as f64;
    let uploaded: f64 = copy_gathers
        .iter()
        .filter(|&&(u, _)| copy[u].offload)
        .map(|&(u, _)| element * if copy[u].params_sharded { copy[u].shard.len } else { copy[u].shard.padded } as f64)
        .sum();
    let (to_device, _) = cluster.host_link();
    compute.max(workload.grad_accum as f64 * uploaded / to_device)
}

/// The step's time under `setup` over `units`, `step` one micro-batch's
/// memory walk (its all-gathers by unit) and `reference_runs` whether a
/// reference model's forward runs before each micro-batch's.
pub(super) fn step_time(workload: &Workload, cluster: &Cluster, setup: &Setup, units: &StepUnits, shard_group: usize, step: &StepMemory, reference_runs: bool) -> StepTime {
    let (placements, copy) = (units.placements, units.copy);
    let tokens = (workload.batch * workload.seq) as f64 * workload.grad_accum as f64;
    let mut flops = tokens * workload.model.train_flops_per_token(workload.seq);
    let recomputed = recomputed_share(workload, setup);
    // Forward is a third of a block's training FLOPs.
    flops += recomputed * tokens * block_flops_per_token(workload) / 3.0;
    let compute = flops / cluster.flops + cluster.memory_bound_seconds(workload, tokens, recomputed) + expert_adapter_seconds(workload, cluster, tokens, recomputed);
    let reference = if reference_runs { reference_seconds(workload, cluster, copy, &step.copy_gathers) } else { 0.0 };

    let groups = Groups { world: cluster.gpus, shard: shard_group, experts: setup.expert_parallel };
    let network = Network { cluster, groups };
    let data_parallel = cluster.gpus > 1;
    let (mut exposed, mut overlapped) = (0.0, 0.0);
    let mut wires = Wires { hook: setup.comm.map(|c| c.hook.as_ref()), units: units.info, groups, changed: 0.0 };
    for transfer in transfers(workload, units, step, data_parallel, &mut wires) {
        let seconds = network.seconds(&transfer);
        if transfer.exposed {
            exposed += seconds;
        } else {
            overlapped += seconds;
        }
    }
    // The reference's forward hides gathers as the step's own compute does.
    let hiding = compute + reference;
    let communication = exposed + (overlapped - hiding).max(0.0) + CONTENTION * overlapped.min(hiding);

    let owned = super::optimized_elements(placements);
    let offloaded = placements.iter().any(|p| p.offload);
    let (optimizer, offload) = if offloaded {
        let reduce = workload.reduce_dtype.kind(workload.dtype).elt_size_in_bytes() as f64;
        // The node's ranks share its cores and memory bandwidth: the measured rate, else the table's bandwidth.
        let ranks = cluster.gpus_per_node() as f64;
        let host_optimizer = match cluster.host_optimizer_rate(setup.offload) {
            Some(elements_per_second) => owned / (elements_per_second / ranks),
            None => owned * OPTIMIZER_BYTES / (cluster.host_memory_bandwidth / ranks),
        };
        // Gradients go down while backward (two thirds of the compute) runs; masters come back after the step.
        let (to_device, to_host) = cluster.host_link();
        let down = workload.grad_accum as f64 * owned * reduce / to_host;
        let up = owned * 4.0 / to_device;
        (0.0, host_optimizer + up + (down - compute * 2.0 / 3.0).max(0.0))
    } else {
        (owned * OPTIMIZER_BYTES / (cluster.memory_bandwidth * OPTIMIZER_BANDWIDTH_FRACTION), 0.0)
    };
    let compress = setup.comm.and_then(|c| c.elements_per_second).map_or(0.0, |rate| wires.changed / rate);
    // Each use of a 4-bit unit reads its bytes and writes its compute buffer.
    let dequantized: f64 = step.gathers.iter().filter(|&&(u, _)| placements[u].packed).map(|&(u, buffer)| placements[u].shard.padded as f64 + buffer).sum();
    let dequantize = workload.grad_accum as f64 * dequantized / (cluster.memory_bandwidth * DEQUANTIZE_BANDWIDTH_FRACTION);
    let all_to_all = all_to_all_seconds(workload, setup, &network);
    StepTime { compute, communication, optimizer, offload, compress, dequantize, reference, all_to_all, rollout: 0.0 }
}

/// Seconds one forward of decoding spends gathering when it gathers the
/// policy a unit at a time (`RolloutGather::PerUnit`, as
/// `Trainer::compute_unit` does): each stage's sharded units over the shard
/// group (4-bit ones as their bytes; experts' over their shard group),
/// then experts' rows over the expert group; nothing runs beside them to
/// hide them.
pub(super) fn per_unit_gather_seconds(workload: &Workload, cluster: &Cluster, setup: &Setup, placements: &[UnitPlacement], shard_group: usize) -> f64 {
    let network = Network { cluster, groups: Groups { world: cluster.gpus, shard: shard_group, experts: setup.expert_parallel } };
    let element = workload.dtype.elt_size_in_bytes() as f64;
    let specs = workload.model.units();
    let gather = |u: usize| {
        let p = &placements[u];
        let all_gather = |group: Group, bytes: f64| network.seconds(&Transfer { collective: Collective::AllGather, group, bytes, exposed: true });
        let shards = match (p.params_sharded, p.packed) {
            (true, true) => all_gather(Group::shard_of(p), p.shard.padded as f64),
            (true, false) => all_gather(Group::shard_of(p), p.shard.padded as f64 * element),
            (false, _) => 0.0,
        };
        shards + p.expert_rows.map_or(0.0, |_| all_gather(Group::Experts, specs[u].numel() as f64 * element))
    };
    workload.model.stages().iter().flat_map(crate::model::stage_units).map(gather).sum()
}

/// What an expert-parallel exchange costs beyond its bytes: its wait on
/// the host for the splits (c10d takes them there, so the GPU's queue
/// drains) and the passes that regroup and combine its rows. Fitted to the
/// 2- and 4-GPU rows of bench/results/2026-11-28-h200x4-moe-ep.md (0.7–0.9
/// ms an exchange, 2 × 2048 tokens of 8 experts each, hidden size 2048).
const EXCHANGE_SECONDS: f64 = 0.75e-3;

/// Expert parallelism's token exchanges of a step: per micro-batch and
/// sparse layer, each assignment's hidden state to its expert's rank and
/// back, in forward and again (their gradients) in backward, and forward's
/// once more when blocks are recomputed; each rank's input to one is
/// its tokens × experts per token × hidden size.
fn all_to_all_seconds(workload: &Workload, setup: &Setup, network: &Network) -> f64 {
    let Some(experts) = workload.model.experts().filter(|_| setup.expert_parallel > 1) else { return 0.0 };
    let element = workload.dtype.elt_size_in_bytes() as f64;
    let bytes = (workload.batch * workload.seq * experts.per_token * workload.model.dims().hidden) as f64 * element;
    let exchanges = (4.0 + 2.0 * recomputed_share(workload, setup)) * experts.sparse_layers as f64 * workload.grad_accum as f64;
    exchanges * (network.seconds(&Transfer { collective: Collective::AllToAll, group: Group::Experts, bytes, exposed: true }) + EXCHANGE_SECONDS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::comm_hook::{CollectiveBytes, UnitInfo};

    /// Top-k sparsification: every rank all-gathers its largest 1% of a
    /// gradient as (fp32 value, int32 index) pairs, and sums them locally.
    struct TopK;

    impl CommHook for TopK {
        fn name(&self) -> &str {
            "topk"
        }
        fn wire_bytes(&self, _unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
            match request.wire {
                Wire::Reduce(_) => vec![CollectiveBytes { collective: Collective::AllGather, bytes: request.elements as f64 * 0.01 * 8.0 }],
                Wire::Gather => vec![request.builtin()],
            }
        }
    }

    /// The bytes each rank moves for one world reduction of `elements` fp32 elements at `world` ranks.
    fn moved(hook: Option<&dyn CommHook>, world: usize, elements: i64) -> f64 {
        let units = [UnitInfo { id: "u0".into(), name: "block 0".into(), params: vec![], numel: elements, padded: elements }];
        let groups = Groups { world, shard: 1, experts: 1 };
        let mut wires = Wires { hook, units: &units, groups, changed: 0.0 };
        let transfers = wires.transfers(0, Wire::Reduce(ReduceStage::World), elements, Kind::Float, Group::World, false, false);
        transfers.iter().map(|t| t.bytes * t.collective.bus_factor(groups.size(t.group))).sum()
    }

    #[test]
    fn an_all_gather_a_hook_declares_is_sized_for_the_world_it_runs_at() {
        let elements = 1_000_000;
        // 1% of the elements at twice the bytes each: 1/50 of the all-reduce's
        // input, but every rank receives every other rank's share.
        for (world, ratio) in [(2, 1.0 / 50.0), (8, 1.0 / 12.5)] {
            let (topk, builtin) = (moved(Some(&TopK), world, elements), moved(None, world, elements));
            assert!((topk / builtin - ratio).abs() < 1e-12, "at {world} ranks top-k moves {} of the all-reduce's bytes", topk / builtin);
        }
    }
}
