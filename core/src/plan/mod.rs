//! `ft plan`: for every registered strategy × offload × activation
//! checkpointing, each rank's peak GPU memory, its node's host memory and
//! the step time, whether it fits, the fastest that fits, and the largest
//! micro-batch each fitting one allows.
//!
//! Memory is the engine's own account, not a second formula: what a rank
//! holds between steps is each unit's `UnitPlacement::memory` (what
//! `Trainer::memory` reports), placed by `train::unit_placements` as the
//! trainer places them (LoRA's frozen base and adapters, QLoRA's 4-bit
//! blocks, a preference task's frozen reference copy included), and the
//! step's peak is a walk of `train/step.rs`'s stages over it (`memory.rs`)
//! with the model's activations per token (`Model::activations`). Time is
//! `time.rs`. `ft train --strategy auto` runs the recommendation, and a
//! GPU out-of-memory error is reported with the plan's prediction
//! (`run.rs`); `ft bench --plan-check` sets measured rows beside it (`check.rs`).
//!
//! How ft's state relates to the ZeRO paper's (Rajbhandari et al., 2020,
//! mixed-precision Adam: 2Ψ fp16 parameters + 2Ψ fp16 gradients + KΨ with
//! K = 12 for the fp32 master, momentum and variance, divided by N as each
//! stage shards them): ft's K is the same 12 (fp32 master 4 + moments 8,
//! `params` holding the master and `optimizer_state` the moments); its
//! gradients are fp32 (4Ψ, not 2Ψ), reduced and accumulated in fp32; and its
//! compute copy (2Ψ in bf16) is kept whole only when parameters are
//! replicated (ddp, zero1). So ddp and zero1 hold ZeRO's stage 0 and 1 plus
//! 2Ψ; full_shard holds stage 3's 16Ψ/N exactly (4Ψ/N fp32 gradients in
//! place of 2Ψ/N fp16 gradients and 2Ψ/N fp16 parameters); shard_grad_op,
//! which shards parameters between uses as FSDP's SHARD_GRAD_OP does,
//! holds 16Ψ/N where stage 2 holds 2Ψ + 14Ψ/N. tests/plan.rs checks this
//! for Llama-2-70B on 64 GPUs.

mod calibrate;
mod check;
mod flags;
mod memory;
mod run;
mod time;

pub use calibrate::{calibrate, CalibrateOptions, Calibration, Gemm, GemmRate, CALIBRATION_VERSION, BLOCK_BYTES_PER_TOKEN_AND_HIDDEN, HEAD_BYTES_PER_TOKEN_AND_VOCAB};
pub use check::{check_report, check_rows, check_table, BenchSettings, CheckedRow, MEMORY_TOLERANCE, TIME_TOLERANCE};
pub use flags::{float8_planned, parse_compress_rate, planned_comms, reference_planned, ClusterFlags, Float8Flags};
pub use memory::PeakBreakdown;
pub use run::{explain_out_of_memory, float8_kept, for_run};
pub use time::{StepTime, ACHIEVED_FRACTION};

use crate::config::{Config, RolloutGather};
use crate::distributed::collectives_bench::{Collective, CommTestRow};
use crate::distributed::comm_hook::{CommHook, UnitInfo};
use crate::distributed::flat::{param_offsets, MemoryAccount, UnitPlacement};
use crate::distributed::strategy::{ParamPlacement, ReduceDtype, ShardingPolicy};
use crate::gpu::GpuSpec;
use crate::model::{Float8Layers, Model};
use crate::offload::{NoOffload, Offload};
use crate::registry::Registry;
use crate::train::reductions_in_flight;
use anyhow::{bail, Context, Result};
use memory::{walk, MicroBatch};
use serde::{Deserialize, Serialize};
use tch::Kind;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The caching allocator's slack over what is allocated: with expandable
/// segments (`ft` sets them) reserved stays within 2% of allocated in
/// `ft bench`'s rows; 5% leaves room for a run's varying lengths.
pub const FRAGMENTATION: f64 = 0.05;

/// Device memory the allocator does not see: the CUDA context, NCCL's
/// buffers, cuBLAS's handles.
pub const RUNTIME_RESERVE: f64 = GIB;

/// Host memory a rank's process takes besides offloaded state: libtorch,
/// the CUDA runtime, the data.
pub const PROCESS_HOST_BYTES: f64 = 3.0 * GIB;

/// Bus bandwidth between nodes when nothing says otherwise: one 400 Gb/s
/// NIC per GPU (50 GB/s) at NCCL's ~90%.
pub const INTER_NODE_BUS_BANDWIDTH: f64 = 45e9;

/// A node's host memory bandwidth when nothing says otherwise, which its
/// ranks' CPU AdamW shares: an H200 node's AdamW over 6.7B offloaded
/// elements moved ~155 GB/s (bench/results/2026-11-22-h200x2-offload.md).
pub const HOST_MEMORY_BANDWIDTH: f64 = 150e9;

/// Host memory per GPU assumed for a machine that is not this one (`ft plan
/// --gpu …` without `--host-memory`): cloud 8-GPU nodes of A100/H100/H200
/// class carry 1.8-2 TB.
pub const ASSUMED_HOST_MEMORY_PER_GPU: f64 = 225e9;

/// The machines a plan is for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// GPUs in all: the world size.
    pub gpus: usize,
    pub nodes: usize,
    /// The GPU model (a `--gpu` key, the name NVML reports, or "cpu").
    pub gpu: String,
    /// Memory per GPU (bytes); None where unknown (ranks on CPUs): everything fits.
    pub gpu_memory: Option<f64>,
    /// FLOP/s one GPU achieves in the compute dtype.
    pub flops: f64,
    pub memory_bandwidth: f64,
    /// NCCL bus bandwidth (bytes/s) among a node's GPUs, and between nodes.
    pub node_bus_bandwidth: f64,
    pub inter_node_bus_bandwidth: f64,
    /// Host link of one GPU, one way (bytes/s).
    pub host_link_bandwidth: f64,
    /// Host memory per node (bytes) and its bandwidth (bytes/s).
    pub host_memory: f64,
    pub host_memory_bandwidth: f64,
    /// `ft calibrate`'s measurements, where they replace the table's rates
    /// (`flops` is then the calibrated step's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

impl Cluster {
    /// `gpus` GPUs like `gpu`, evenly over `nodes` nodes, computing in
    /// `dtype` at [`ACHIEVED_FRACTION`] of the dense peak; the host's memory
    /// is this machine's.
    pub fn new(gpu: &GpuSpec, gpus: usize, nodes: usize, dtype: Kind) -> Result<Cluster> {
        if gpus == 0 || nodes == 0 {
            bail!("plan for at least one GPU on at least one node (--gpus {gpus}, --nodes {nodes})");
        }
        if gpus % nodes != 0 {
            bail!("{gpus} GPUs do not spread evenly over {nodes} nodes: give --gpus as a multiple of --nodes");
        }
        let peak = gpu.peak_flops(dtype).with_context(|| format!("no peak FLOP/s for {dtype:?} in ft's GPU table: use bf16, fp16 or f32"))?;
        Ok(Cluster {
            gpus,
            nodes,
            gpu: gpu.key.into(),
            gpu_memory: Some(gpu.memory_bytes),
            flops: peak * ACHIEVED_FRACTION,
            memory_bandwidth: gpu.memory_bandwidth,
            node_bus_bandwidth: gpu.node_bus_bandwidth,
            inter_node_bus_bandwidth: INTER_NODE_BUS_BANDWIDTH,
            host_link_bandwidth: gpu.host_link_bandwidth,
            host_memory: crate::metrics::host_memory().unwrap_or(512e9),
            host_memory_bandwidth: HOST_MEMORY_BANDWIDTH,
            calibration: None,
        })
    }

    pub fn gpus_per_node(&self) -> usize {
        self.gpus / self.nodes
    }

    /// Takes the bus bandwidth `ft comm-test --json` measured (the mean
    /// busbw of all_reduce, all_gather and reduce_scatter at the largest
    /// size, over the world): the node's, or between nodes when the test
    /// spanned several.
    pub fn use_comm_test(&mut self, report: &CommTestReport) -> Result<()> {
        let world: Vec<&CommTestRow> = report.rows.iter().filter(|r| r.group == "world").collect();
        let largest = world.iter().map(|r| r.bytes).max().unwrap_or(0);
        let measured = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter].map(Collective::name);
        let busbw: Vec<f64> = world.iter().filter(|r| r.bytes == largest && measured.contains(&r.op.as_str())).map(|r| r.busbw_gbps).collect();
        if busbw.is_empty() {
            bail!("the comm-test report has no all_reduce, all_gather or reduce_scatter row over the world");
        }
        let bandwidth = busbw.iter().sum::<f64>() / busbw.len() as f64 * 1e9;
        if report.nodes > 1 {
            self.inter_node_bus_bandwidth = bandwidth;
        } else {
            self.node_bus_bandwidth = bandwidth;
        }
        Ok(())
    }
}

/// What a plan reads of `ft comm-test --json`'s report (or
/// bench/peers/comm_bench.py's).
#[derive(Debug, Clone, Deserialize)]
pub struct CommTestReport {
    /// Absent from comm_bench.py's report, which runs on one node.
    #[serde(default)]
    pub nodes: usize,
    pub rows: Vec<CommTestRow>,
}

/// What is trained and how, whatever the strategy.
pub struct Workload<'a> {
    pub model: &'a dyn Model,
    /// Examples per GPU per micro-batch, of `seq` tokens.
    pub batch: i64,
    pub seq: i64,
    pub grad_accum: usize,
    pub dtype: Kind,
    pub reduce_dtype: ReduceDtype,
    pub loss_chunk_tokens: i64,
    /// `--shard-group-size`, for the strategies that shard.
    pub shard_group_size: Option<usize>,
    /// The reference model a preference task compares with (None: none).
    pub reference: Option<Reference>,
    /// The block linear layers that run in float8 (`--fp8`; None: none).
    pub float8: Option<&'a Float8Layers>,
    /// Under tensorwise float8, sharded blocks whose weights all run in
    /// float8 gathered as float8 bytes (`train.fp8_gathers`).
    pub float8_gathers: bool,
    /// Online RL's sampling before the steps it serves (None: none).
    pub rollout: Option<RolloutShape>,
}

/// What a decoding step costs beyond reading its bytes, fitted to ft's
/// rollouts on an H200 (bench/results/2026-11-29-h200-grpo-kernel-cache.md:
/// the 1.5B row at 32 and 64 rows, the 7B LoRA row with its adapters apart, one call; CUDA
/// graphs, so no launch costs): per block, ~60 kernels of a few µs (norms, RoPE, the cache's
/// writes, the attention, the small GEMMs'
/// latency); per row of a block, the attention's and GEMMs' growth with the
/// rows; per LoRA-adapted layer, its two low-rank GEMMs and the add.
const DECODE_SECONDS_PER_BLOCK: f64 = 70.5e-6;
const DECODE_SECONDS_PER_ROW_BLOCK: f64 = 0.329e-6;
const DECODE_SECONDS_PER_ADAPTER: f64 = 15.0e-6;

/// What online RL samples each generation (`Task::rollouts`), on each rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutShape {
    /// Completions this rank samples a generation.
    pub rows: i64,
    /// Tokens a completion generates at most; its context's longest (prompt and completion).
    pub new_tokens: i64,
    pub positions: i64,
    /// Optimizer steps one generation serves.
    pub steps: usize,
    /// How decoding holds the policy (`train.rollout_gather`; `auto`: the
    /// plan decides each row, [`PlanRow::rollout_gather`]).
    pub gather: RolloutGather,
}

impl RolloutShape {
    /// What a run of `config` samples for `rollouts` on each rank.
    pub fn of_run(config: &Config, rollouts: &dyn crate::task::Rollouts) -> RolloutShape {
        let steps = rollouts.window().steps;
        RolloutShape {
            rows: (config.train.batch_size * config.train.grad_accum * steps) as i64,
            new_tokens: rollouts.max_new_tokens() as i64,
            positions: config.data.max_seq_len as i64,
            steps,
            gather: config.train.rollout_gather,
        }
    }

    /// What the rollout holds on the device beside the state kept between
    /// steps: the policy whole in the compute dtype (`Trainer::compute_params`,
    /// a 4-bit base unpacked too), every block's KV cache over the whole
    /// context, and sampling's buffers over the vocabulary (the logits and
    /// their softmax and its copy padded to whole blocks in float32, the
    /// tokens seen: `generate::sampling::draw`).
    /// Where sampling folds LoRA's adapters in (`lora::samples_folded`), the
    /// copies of the adapted units too (`lora::adapted_units`).
    pub fn device_bytes(&self, model: &dyn Model, dtype: Kind) -> f64 {
        let params: i64 = model.units().iter().map(|unit| unit.numel()).sum();
        let folded: i64 = match crate::lora::samples_folded(model, false) {
            true => crate::lora::adapted_units(model).into_iter().map(|u| model.units()[u].numel()).sum(),
            false => 0,
        };
        (params + folded) as f64 * dtype.elt_size_in_bytes() as f64 + self.cache_and_sampling_bytes(model, dtype)
    }

    /// [`Self::device_bytes`] when decoding gathers the policy a unit at a
    /// time (`train::GatheredPolicy`): of `fetched` (what each stage's units
    /// take gathered, [`fetched_stage_bytes`]) the largest stage's, and the
    /// next largest as margin for a gather's own buffers and the head's
    /// weight kept to the logits; the KV cache and sampling's buffers alike.
    pub fn per_unit_device_bytes(&self, model: &dyn Model, dtype: Kind, fetched: &[f64]) -> f64 {
        let mut largest = fetched.to_vec();
        largest.sort_by(|a, b| b.total_cmp(a));
        largest.iter().take(2).sum::<f64>() + self.cache_and_sampling_bytes(model, dtype)
    }

    /// Every block's KV cache over the whole context, and sampling's buffers over the vocabulary.
    fn cache_and_sampling_bytes(&self, model: &dyn Model, dtype: Kind) -> f64 {
        (self.rows * self.positions) as f64 * Self::kv_per_token(model) * dtype.elt_size_in_bytes() as f64 + (self.rows * model.dims().vocab) as f64 * 13.0
    }

    /// Seconds a step spends sampling (a generation's share per step it
    /// serves): each decoding step reads the policy and the KV cache's mean
    /// context once, at the memory bandwidth (the roofline), and pays what
    /// its small kernels cost beyond their bytes — per block, per row of a
    /// block, per LoRA-adapted layer of a block where the adapters stay
    /// apart ([`DECODE_SECONDS_PER_BLOCK`] …; `per_unit`: the policy gathered a unit at a time).
    pub fn seconds(&self, model: &dyn Model, dtype: Kind, memory_bandwidth: f64, per_unit: bool) -> f64 {
        let element = dtype.elt_size_in_bytes() as f64;
        let params: i64 = model.units().iter().map(|unit| unit.numel()).sum();
        let mean_context = (self.positions - self.new_tokens / 2) as f64;
        let bytes_per_token = (params as f64 + self.rows as f64 * mean_context * Self::kv_per_token(model)) * element;
        let blocks = crate::model::block_count(model) as f64;
        let adapted: usize = match crate::lora::samples_folded(model, per_unit) {
            true => 0,
            false => model.units().iter().flat_map(|unit| &unit.params).filter(|p| p.name.ends_with(".lora_A.weight")).count(),
        };
        let kernels = blocks * (DECODE_SECONDS_PER_BLOCK + self.rows as f64 * DECODE_SECONDS_PER_ROW_BLOCK) + adapted as f64 * DECODE_SECONDS_PER_ADAPTER;
        self.new_tokens as f64 * (bytes_per_token / memory_bandwidth + kernels) / self.steps.max(1) as f64
    }

    /// Elements of keys and values a token keeps in the cache.
    fn kv_per_token(model: &dyn Model) -> f64 {
        let dims = model.dims();
        (dims.layers * 2 * dims.kv_heads * (dims.hidden / dims.heads.max(1))) as f64
    }
}

/// How a run keeps the reference model a preference task (`--task dpo`)
/// compares with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reference {
    /// Its log-probabilities computed once before training (DPO's
    /// `task.precompute_ref=true`): a forward without gradients over the
    /// pairs through the trainer's own units, and two f64 a pair in host memory.
    Precomputed,
    /// Run without gradients before each micro-batch's forward
    /// (`task.precompute_ref=false`): LoRA's base (the model's own units,
    /// its adapters off), or, for a model without adapters, the frozen copy
    /// the trainer keeps (`TrainerBuilder::reference_copy`).
    EachStep,
}

impl Reference {
    /// Every option, in the order the plan lists them.
    pub const ALL: [Reference; 2] = [Reference::Precomputed, Reference::EachStep];

    /// `--reference precomputed|each-step` (the flag's spelling of the serde names).
    pub fn parse(text: &str) -> Result<Reference, String> {
        serde_json::from_value(serde_json::Value::from(text.replace('-', "_"))).map_err(|_| format!("{text:?}: expected precomputed or each-step"))
    }

    /// Whether the trainer keeps a frozen copy of `model` for it: run with
    /// each step and no adapters to turn off (as `TrainerBuilder::reference_copy` decides).
    fn keeps_copy(self, model: &dyn Model) -> bool {
        self == Reference::EachStep && model.adapter_scaling().is_none()
    }

    /// What it is, for `model`, as the plan's table names it.
    pub fn describe(self, model: &dyn Model) -> &'static str {
        match (self, self.keeps_copy(model)) {
            (Reference::Precomputed, _) => "log-probabilities precomputed before training (task.precompute_ref=true)",
            (Reference::EachStep, false) => "LoRA's base, its adapters off, run with each micro-batch (task.precompute_ref=false)",
            (Reference::EachStep, true) => "a frozen copy of the model, run with each micro-batch (task.precompute_ref=false)",
        }
    }
}

/// Host bytes a precomputed reference keeps per preference pair: the
/// chosen and the rejected completion's log-probability, an f64 each.
pub const PRECOMPUTED_REFERENCE_BYTES_PER_PAIR: f64 = 16.0;

/// What a row's reference model costs each rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReferenceCost {
    pub reference: Reference,
    /// What it is (`Reference::describe`).
    pub kind: String,
    /// Held between steps on the device and in host memory (a frozen copy,
    /// or its shard): what a run's summary reports as its `reference`.
    pub device_bytes: f64,
    pub host_bytes: f64,
    /// Host bytes per training pair besides (precomputed log-probabilities).
    pub host_bytes_per_pair: f64,
    /// Its forward over one optimizer step's micro-batches, gathers and
    /// uploads included: part of `step_seconds` when it runs with each
    /// step, else spent once before training for each step's pairs.
    pub forward_seconds: f64,
    pub in_step: bool,
}

impl<'a> Workload<'a> {
    /// A run of `config`: micro-batches of `train.batch_size` examples of
    /// `data.max_seq_len` tokens.
    pub fn of_run(model: &'a dyn Model, config: &Config, dtype: Kind) -> Workload<'a> {
        let t = &config.train;
        Workload {
            model,
            batch: t.batch_size as i64,
            seq: config.data.max_seq_len as i64,
            grad_accum: t.grad_accum,
            dtype,
            reduce_dtype: t.reduce_dtype,
            loss_chunk_tokens: t.loss_chunk_tokens,
            shard_group_size: t.shard_group_size,
            reference: None,
            float8: None,
            float8_gathers: false,
            rollout: None,
        }
    }
}

/// Which activation checkpointing rows a plan has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// Rows with and without.
    #[default]
    Auto,
    On,
    Off,
}

impl Checkpointing {
    fn choices(self) -> &'static [bool] {
        match self {
            Checkpointing::Auto => &[false, true],
            Checkpointing::On => &[true],
            Checkpointing::Off => &[false],
        }
    }
}

impl std::str::FromStr for Checkpointing {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> Result<Checkpointing> {
        Ok(match text {
            "auto" => Checkpointing::Auto,
            "on" => Checkpointing::On,
            "off" => Checkpointing::Off,
            _ => bail!("unknown activation checkpointing {text:?}: expected auto, on or off"),
        })
    }
}

/// A communication hook to plan rows with.
pub struct PlanComm {
    pub hook: Box<dyn CommHook>,
    /// How many gradient or parameter elements it compresses and
    /// decompresses per second on the GPU, as measured (`ft bench` beside
    /// the built-in); None: its compute is left out.
    pub elements_per_second: Option<f64>,
}

/// One way to run the workload.
pub struct Setup<'a> {
    pub strategy: &'a str,
    pub policy: ShardingPolicy,
    pub offload: &'a str,
    pub offload_to_host: bool,
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, the first blocks recomputed (None: all).
    pub checkpoint_layers: Option<usize>,
    /// The communication hook: the strategy's own, or one planned beside it (None: the built-in collectives).
    pub comm: Option<&'a PlanComm>,
    /// `train.expert_parallel`: the ranks that split a mixture of experts' experts (1: none).
    pub expert_parallel: usize,
}

/// What one way of running it costs, per rank (every rank holds the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRow {
    pub strategy: String,
    /// A communication plug-in planned beside the strategy's own collectives (`ft plan --comm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
    pub offload: String,
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, the first blocks recomputed (`train.checkpoint_layers`; None: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_layers: Option<usize>,
    pub shard_group_size: usize,
    /// `train.expert_parallel` above 1: the ranks that split the experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_parallel: Option<usize>,
    pub fits: bool,
    /// What it does not fit in, when it does not.
    pub exceeds: Option<String>,
    /// Device memory at the step's peak: allocated, the allocator's
    /// fragmentation margin and the CUDA runtime's reserve.
    pub peak_gpu_bytes: f64,
    /// What the CUDA caching allocator's peak allocated counter reads.
    pub peak_allocated_bytes: f64,
    /// The allocated bytes at the step's peak by what holds them.
    pub peak: PeakBreakdown,
    /// Online RL: the allocated bytes while sampling (the state kept
    /// between steps and what `RolloutShape::device_bytes` counts); the
    /// row's peak is the larger of the two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_bytes: Option<f64>,
    /// Online RL: how its decoding holds the policy — `whole`, or
    /// `per_unit` where `auto` finds the policy whole and its KV cache do
    /// not fit and some unit is gathered (sharded, 4-bit, experts' rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_gather: Option<RolloutGather>,
    /// What the rank holds (the trainer's account: a run's `state_per_rank`).
    pub state: MemoryAccount,
    /// Host memory of a node: its ranks' offloaded state and processes.
    pub host_bytes: f64,
    pub step_seconds: f64,
    pub time: StepTime,
    pub tokens_per_second_per_gpu: f64,
    /// The largest micro-batch per GPU that fits (0: none; None: no limit known).
    pub max_batch: Option<i64>,
    /// The workload's reference model, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<ReferenceCost>,
}

impl PlanRow {
    /// "full_shard + cpu offload + activation checkpointing".
    pub fn label(&self) -> String {
        let mut label = self.strategy.clone();
        if let Some(comm) = &self.comm {
            label += &format!(" + comm {comm}");
        }
        if self.offload != NoOffload.name() {
            label += &format!(" + {} offload", self.offload);
        }
        match (self.activation_checkpointing, self.checkpoint_layers) {
            (true, Some(layers)) => label += &format!(" + activation checkpointing of {layers} blocks"),
            (true, None) => label += " + activation checkpointing",
            (false, _) => {}
        }
        if let Some(degree) = self.expert_parallel {
            label += &format!(" + expert parallel {degree}");
        }
        label
    }

    /// The row of the strategy with its own communication (and no expert parallelism).
    fn is(&self, strategy: &str, offload: &str, activation_checkpointing: bool, checkpoint_layers: Option<usize>) -> bool {
        let checkpointing = self.activation_checkpointing == activation_checkpointing && self.checkpoint_layers == checkpoint_layers;
        self.strategy == strategy && self.comm.is_none() && self.offload == offload && checkpointing && self.expert_parallel.is_none()
    }
}

/// Every row of a workload on a cluster, and the fastest that fits.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// "llama 6738.4M", as `ft bench` names models.
    pub model: String,
    /// A mixture of experts' parameters: all of them, and those a token's forward uses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertParameters>,
    pub cluster: Cluster,
    pub batch: i64,
    pub seq: i64,
    pub grad_accum: usize,
    pub dtype: String,
    /// The blocks' float8 linear layers (`--fp8`), if any: their recipe, and whether gathered in float8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub float8: Option<String>,
    pub rows: Vec<PlanRow>,
    pub recommended: Option<PlanRow>,
    /// With a reference model: what each way of keeping it costs under the
    /// recommended configuration (else the first row's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reference_options: Vec<(String, ReferenceCost)>,
}

/// A mixture of experts' parameters as a plan counts them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ExpertParameters {
    pub total: i64,
    /// What a token's forward uses: all but the experts it is not routed to.
    pub active: i64,
    pub experts: i64,
    pub per_token: i64,
    pub sparse_layers: i64,
}

impl ExpertParameters {
    /// `model`'s, when it is a mixture of experts.
    pub fn of(model: &dyn Model) -> Option<ExpertParameters> {
        let experts = model.experts()?;
        let held: i64 = crate::train::expert_units(model).iter().map(|&unit| model.units()[unit].numel()).sum();
        let idle = held / experts.count * (experts.count - experts.per_token);
        let total = model.numel();
        Some(ExpertParameters { total, active: total - idle, experts: experts.count, per_token: experts.per_token, sparse_layers: experts.sparse_layers })
    }
}

/// The expert-parallel degrees a plan weighs for `model` on `cluster`:
/// 1, and for a mixture of experts each degree within a node that `ft
/// train` takes there (`setup::check_expert_parallel`): it divides the
/// node's GPUs and the experts, and over QLoRA's 4-bit base each rank's
/// experts hold whole 4-bit blocks.
fn expert_parallel_degrees(model: &dyn Model, cluster: &Cluster) -> Vec<usize> {
    let node = cluster.gpus_per_node();
    (1..=node).filter(|&degree| crate::setup::check_expert_parallel(degree, node, model).is_ok()).collect()
}

/// The placements of `workload`'s units under `setup` in a shard group of `group`.
fn placements(workload: &Workload, setup: &Setup, group: usize) -> Vec<UnitPlacement> {
    // The plan's degrees divide a node's GPUs (`expert_parallel_degrees`), so every shard group.
    let experts = (setup.expert_parallel > 1).then(|| {
        let shard_size = crate::distributed::experts::expert_shard_size(setup.expert_parallel, group).unwrap_or(1);
        crate::distributed::experts::ExpertSeat { degree: setup.expert_parallel, rank: 0, shard_size, shard_rank: 0 }
    });
    let placed = crate::train::unit_placements(workload.model, &setup.policy, group, 0, setup.offload_to_host, workload.dtype, experts);
    placed.into_iter().map(|(placement, _)| placement).collect()
}

/// The frozen copy the trainer keeps as the reference model, unit by unit
/// as it places it (`UnitPlacement::frozen_copy`); empty without one.
fn reference_copy(workload: &Workload, placements: &[UnitPlacement]) -> Vec<UnitPlacement> {
    match workload.reference {
        Some(reference) if reference.keeps_copy(workload.model) => placements.iter().map(|p| p.frozen_copy()).collect(),
        _ => vec![],
    }
}

/// The units the reference's forward reads before each micro-batch's, when
/// it runs with each step: the frozen copy (`copy`), or LoRA's base (the model's own).
fn reference_units<'p>(workload: &Workload, placements: &'p [UnitPlacement], copy: &'p [UnitPlacement]) -> Option<memory::ReferenceUnits<'p>> {
    match workload.reference {
        Some(Reference::EachStep) if copy.is_empty() => Some(memory::ReferenceUnits { placements, copy: false }),
        Some(Reference::EachStep) => Some(memory::ReferenceUnits { placements: copy, copy: true }),
        _ => None,
    }
}

/// Which units the trainer gathers as float8 bytes (`train.fp8_gathers`
/// under tensorwise float8), by unit.
fn float8_gathered(workload: &Workload, placements: &[UnitPlacement]) -> Vec<bool> {
    let mut gathered = vec![false; placements.len()];
    if let Some(layers) = workload.float8.filter(|layers| workload.float8_gathers && layers.float8.recipe == ft_sys::float8::Recipe::Tensorwise) {
        for unit in crate::train::float8_gathered_units(workload.model, placements, layers) {
            gathered[unit] = true;
        }
    }
    gathered
}

/// Device bytes at a micro-batch's peak with `batch` examples and
/// `reference` run before it: allocated, and with the margins.
#[allow(clippy::too_many_arguments)] // each a separate part of the row
fn device_peak(
    workload: &Workload,
    setup: &Setup,
    placements: &[UnitPlacement],
    state: &MemoryAccount,
    cluster: &Cluster,
    batch: i64,
    reference: Option<memory::ReferenceUnits>,
) -> memory::StepMemory {
    let micro = MicroBatch {
        batch,
        seq: workload.seq,
        dtype: workload.dtype,
        reduce: workload.reduce_dtype.kind(workload.dtype),
        activation_checkpointing: setup.activation_checkpointing,
        checkpoint_layers: setup.checkpoint_layers,
        expert_parallel: setup.expert_parallel,
        experts_unreplicated: setup.expert_parallel > 1 && setup.expert_parallel == cluster.gpus,
        accumulating: workload.grad_accum > 1,
        data_parallel: cluster.gpus > 1,
        loss_chunk_tokens: workload.loss_chunk_tokens,
        float8: workload.float8.map(|layers| memory::Float8Memory::new(workload.model, layers)),
    };
    let reshard_after_forward = setup.policy.params == ParamPlacement::Sharded { reshard_after_forward: true };
    walk(workload.model, placements, state, reshard_after_forward, &micro, reference)
}

/// Elements this rank's optimizer updates (frozen units have none).
fn optimized_elements(placements: &[UnitPlacement]) -> f64 {
    placements.iter().filter(|p| !p.frozen).map(|p| p.owned_len() as f64).sum()
}

fn with_margins(allocated: f64) -> f64 {
    allocated * (1.0 + FRAGMENTATION) + RUNTIME_RESERVE
}

/// What `hook` keeps for the stages of `plan` over `units` placed as
/// `placements`, plus the most workspace it can have in flight: the
/// largest `reductions_in_flight` unit reductions', every unit's
/// replica reduction (the step waits for those at its end) and two
/// gathers' (the one in use and the one prefetched).
fn comm_state(hook: &dyn CommHook, workload: &Workload, units: &[UnitInfo], placements: &[UnitPlacement], plan: &crate::distributed::comm_hook::CommPlan, shard_group: usize) -> f64 {
    use crate::distributed::comm_hook::{ReduceStage, Wire, WireRequest};
    let (mut bytes, mut reductions, mut replicas, mut gathers) = (0.0, vec![], 0, vec![]);
    let reduce = workload.reduce_dtype.kind(workload.dtype);
    for (unit, placement) in units.iter().zip(placements) {
        let (whole, shard) = (placement.shard.padded, placement.shard.len);
        // A frozen unit has no gradient to reduce.
        let stages = if placement.frozen { &[][..] } else { &plan.stages[..] };
        for &stage in stages {
            let request = match stage {
                ReduceStage::World => WireRequest { wire: Wire::Reduce(stage), elements: whole, dtype: reduce, group_size: plan.world_size },
                ReduceStage::Shard => WireRequest { wire: Wire::Reduce(stage), elements: whole, dtype: reduce, group_size: shard_group },
                ReduceStage::Replica => {
                    let dtype = if plan.offload { reduce } else { tch::Kind::Float };
                    WireRequest { wire: Wire::Reduce(stage), elements: shard, dtype, group_size: plan.world_size / shard_group }
                }
            };
            bytes += hook.state_bytes(unit, &request);
            let workspace = hook.workspace_bytes(unit, &request);
            match stage {
                ReduceStage::Replica => replicas += workspace,
                _ => reductions.push(workspace),
            }
        }
        // 4-bit bytes are gathered by the built-in collective, never the hook.
        if plan.gathers && placement.params_sharded && !placement.packed {
            let request = WireRequest { wire: Wire::Gather, elements: shard, dtype: workload.dtype, group_size: shard_group };
            bytes += hook.state_bytes(unit, &request);
            gathers.push(hook.workspace_bytes(unit, &request));
        }
    }
    let largest = |mut sizes: Vec<i64>, n: usize| -> i64 {
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.iter().take(n).sum()
    };
    bytes + (largest(reductions, reductions_in_flight(workload.dtype, reduce)) + replicas + largest(gathers, 2)) as f64
}

/// Predicts one row.
pub fn predict(workload: &Workload, cluster: &Cluster, setup: &Setup) -> Result<PlanRow> {
    let requested = workload.shard_group_size.filter(|_| setup.policy.optimizer_state_sharded);
    let group = setup.policy.shard_group_size(setup.strategy, cluster.gpus, cluster.gpus_per_node(), requested)?;
    let placements = placements(workload, setup, group);
    let units: Vec<UnitInfo> =
        workload.model.units().iter().zip(&placements).map(|(spec, p)| UnitInfo::new(spec, param_offsets(spec), p.shard.padded)).collect();
    let comm_plan = setup.policy.comm_plan(setup.strategy, cluster.gpus, group, setup.offload_to_host);
    let comm_state = setup.comm.map_or(0.0, |c| comm_state(c.hook.as_ref(), workload, &units, &placements, &comm_plan, group));
    let held: MemoryAccount = placements.iter().map(|p| p.memory(workload.dtype)).sum();
    let state = MemoryAccount { comm_state, ..held };
    // The trainer's account leaves the reference's frozen copy apart (`Trainer::reference_memory`).
    let copy = reference_copy(workload, &placements);
    let copy_held: MemoryAccount = copy.iter().map(|p| p.memory(workload.dtype)).sum();
    let reference = reference_units(workload, &placements, &copy);
    let float8_gathered = float8_gathered(workload, &placements);
    let step = device_peak(workload, setup, &placements, &state, cluster, workload.batch, reference);
    let state = MemoryAccount { gathered_peak: step.gathered_peak, ..state };
    let gpu_fits = |bytes: f64| cluster.gpu_memory.is_none_or(|memory| bytes <= memory);
    // Online RL's sampling holds the policy beside the state kept between
    // steps: whole, or each stage's units gathered in turn.
    let fetched = fetched_stage_bytes(workload, &placements);
    let rollout_gather = workload.rollout.map(|r| {
        let gathers = fetched.iter().any(|&bytes| bytes > 0.0);
        let whole_fits = gpu_fits(with_margins(step.peak.total().max(step.peak.state + r.device_bytes(workload.model, workload.dtype))));
        let per_unit = gathers
            && match r.gather {
                RolloutGather::Auto => !whole_fits,
                RolloutGather::PerUnit => true,
                RolloutGather::Whole => false,
            };
        if per_unit { RolloutGather::PerUnit } else { RolloutGather::Whole }
    });
    let rollout_bytes = workload.rollout.zip(rollout_gather).map(|(r, gather)| {
        step.peak.state
            + match gather {
                RolloutGather::PerUnit => r.per_unit_device_bytes(workload.model, workload.dtype, &fetched),
                _ => r.device_bytes(workload.model, workload.dtype),
            }
    });
    let peak_allocated_bytes = step.peak.total().max(rollout_bytes.unwrap_or(0.0));
    let peak_gpu_bytes = with_margins(peak_allocated_bytes);

    // Offloaded, the step's gradient pieces sit in pinned memory, and as
    // many again stay cached by CUDA's host allocator for the next step.
    let owned = optimized_elements(&placements);
    let reduce = workload.reduce_dtype.kind(workload.dtype).elt_size_in_bytes() as f64;
    let staging = if setup.offload_to_host { 2.0 * workload.grad_accum as f64 * owned * reduce } else { 0.0 };
    let host_bytes = cluster.gpus_per_node() as f64 * (state.host + copy_held.host + staging + PROCESS_HOST_BYTES);

    let gb = |bytes: f64| bytes / 1e9;
    let host_fits = host_bytes <= cluster.host_memory;
    let exceeds = match (gpu_fits(peak_gpu_bytes), host_fits) {
        (true, true) => None,
        (false, _) => Some(format!("GPU: {:.1} GB of {:.1} GB", gb(peak_gpu_bytes), gb(cluster.gpu_memory.unwrap_or_default()))),
        (true, false) => Some(format!("host: {:.1} GB of {:.1} GB per node", gb(host_bytes), gb(cluster.host_memory))),
    };
    let fits_with = |batch: i64| {
        let step = device_peak(workload, setup, &placements, &state, cluster, batch, reference_units(workload, &placements, &copy));
        gpu_fits(with_margins(step.peak.total()))
    };
    let max_batch = match (cluster.gpu_memory, host_fits) {
        (None, _) => None,
        (Some(_), false) => Some(0),
        (Some(_), true) => Some(largest(fits_with)),
    };
    let step_time = |step: &memory::StepMemory, reference_runs: bool| {
        let units = time::StepUnits { placements: &placements, copy: &copy, info: &units, float8_gathered: &float8_gathered };
        time::step_time(workload, cluster, setup, &units, group, step, reference_runs)
    };
    let mut time = step_time(&step, reference.is_some());
    let per_unit = rollout_gather == Some(RolloutGather::PerUnit);
    time.rollout = workload.rollout.map_or(0.0, |r| r.seconds(workload.model, workload.dtype, cluster.memory_bandwidth, per_unit));
    if let (Some(r), Some(RolloutGather::PerUnit)) = (workload.rollout, rollout_gather) {
        // Each forward of the decoding (the prompts', then one a token) gathers every unit again.
        time.rollout += r.new_tokens as f64 * time::per_unit_gather_seconds(workload, cluster, setup, &placements, group) / r.steps.max(1) as f64;
    }
    let step_seconds = time.total();
    let reference = workload.reference.map(|reference| {
        let forward_seconds = match reference {
            Reference::EachStep => time.reference,
            // Once before training, through the trainer's own units: what such a forward would add to each step.
            Reference::Precomputed => {
                let own = Some(memory::ReferenceUnits { placements: &placements, copy: false });
                let own = device_peak(workload, setup, &placements, &state, cluster, workload.batch, own);
                step_time(&own, true).total() - step_seconds
            }
        };
        let precomputed = reference == Reference::Precomputed;
        ReferenceCost {
            reference,
            kind: reference.describe(workload.model).into(),
            device_bytes: copy_held.params - copy_held.host,
            host_bytes: copy_held.host,
            host_bytes_per_pair: if precomputed { PRECOMPUTED_REFERENCE_BYTES_PER_PAIR } else { 0.0 },
            forward_seconds,
            in_step: !precomputed,
        }
    });
    Ok(PlanRow {
        strategy: setup.strategy.into(),
        comm: None,
        offload: setup.offload.into(),
        activation_checkpointing: setup.activation_checkpointing,
        checkpoint_layers: setup.checkpoint_layers,
        shard_group_size: group,
        expert_parallel: (setup.expert_parallel > 1).then_some(setup.expert_parallel),
        fits: exceeds.is_none(),
        exceeds,
        peak_gpu_bytes,
        peak_allocated_bytes,
        peak: step.peak,
        rollout_bytes,
        rollout_gather,
        state,
        host_bytes,
        step_seconds,
        time,
        tokens_per_second_per_gpu: (workload.batch * workload.seq) as f64 * workload.grad_accum as f64 / step_seconds,
        max_batch,
        reference,
    })
}

/// What each stage's units take gathered whole in the compute dtype where
/// fetching them allocates (`Trainer::compute_unit`: a sharded unit, a
/// 4-bit one unpacked, experts' rows gathered), in the stages' order; 0
/// where every unit of the stage is held whole and read in place.
pub fn fetched_stage_bytes(workload: &Workload, placements: &[UnitPlacement]) -> Vec<f64> {
    let element = workload.dtype.elt_size_in_bytes() as f64;
    let specs = workload.model.units();
    let fetched = |u: usize| {
        let p = &placements[u];
        let allocates = p.params_sharded || p.packed || p.expert_rows.is_some();
        if allocates { specs[u].numel() as f64 * element } else { 0.0 }
    };
    workload.model.stages().iter().map(|stage| crate::model::stage_units(stage).into_iter().map(fetched).sum()).collect()
}

/// The largest n ≥ 1 with `fits(n)` (memory grows with n), or 0.
fn largest(fits: impl Fn(i64) -> bool) -> i64 {
    const LIMIT: i64 = 1 << 24;
    if !fits(1) {
        return 0;
    }
    let mut low = 1;
    while low < LIMIT && fits(low * 2) {
        low *= 2;
    }
    let mut high = (low * 2).min(LIMIT + 1);
    while high - low > 1 {
        let middle = (low + high) / 2;
        if fits(middle) {
            low = middle;
        } else {
            high = middle;
        }
    }
    low
}

impl Plan {
    /// Every registered strategy × offload × `checkpointing` for `workload` on `cluster`.
    pub fn new(workload: &Workload, cluster: &Cluster, registry: &Registry, checkpointing: Checkpointing) -> Result<Plan> {
        Plan::with_comms(workload, cluster, registry, checkpointing, &[])
    }

    /// `Plan::new`'s rows (each strategy with its own communication), and
    /// the same again through each of `comms` (name, hook) under every
    /// strategy the hook serves.
    pub fn with_comms(workload: &Workload, cluster: &Cluster, registry: &Registry, checkpointing: Checkpointing, comms: &[(String, PlanComm)]) -> Result<Plan> {
        if workload.batch < 1 || workload.seq < 2 || workload.grad_accum < 1 {
            bail!("plan a batch of at least 1 example of at least 2 tokens, and grad_accum of at least 1");
        }
        // Attention's position pairs of a step, counted in i64.
        let pairs = workload.batch.checked_mul(workload.seq).and_then(|tokens| tokens.checked_mul(workload.seq)?.checked_mul(i64::try_from(workload.grad_accum).ok()?));
        if pairs.is_none() {
            bail!("a batch of {} examples of {} tokens (grad_accum {}) is beyond what ft plan counts: plan a smaller one", workload.batch, workload.seq, workload.grad_accum);
        }
        let mut rows = vec![];
        for strategy in registry.strategies() {
            let made = (strategy.create)();
            let policy = made.policy();
            if let Err(why) = policy.validate(&strategy.name) {
                tracing::warn!("ft plan leaves out {why}");
                continue;
            }
            let own = made.comm_hook().map(|hook| PlanComm { hook, elements_per_second: None });
            let requested = workload.shard_group_size.filter(|_| policy.optimizer_state_sharded);
            let group = policy.shard_group_size(&strategy.name, cluster.gpus, cluster.gpus_per_node(), requested)?;
            let planned = comms.iter().map(|(name, comm)| (Some(name.as_str()), Some(comm)));
            for (name, comm) in std::iter::once((None, own.as_ref())).chain(planned) {
                for offload in registry.offloads() {
                    let to_host = (offload.create)().to_host();
                    // A planned hook's rows are where it serves the strategy.
                    let refused = |comm: &PlanComm| comm.hook.check(&policy.comm_plan(&strategy.name, cluster.gpus, group, to_host)).is_err();
                    if name.is_some() && comm.is_some_and(refused) {
                        continue;
                    }
                    for expert_parallel in expert_parallel_degrees(workload.model, cluster) {
                        for &activation_checkpointing in checkpointing.choices() {
                            let setup = Setup { strategy: &strategy.name, policy, offload: offload.name, offload_to_host: to_host, activation_checkpointing, checkpoint_layers: None, comm, expert_parallel };
                            let row = predict(workload, cluster, &setup)?;
                            let partial = match activation_checkpointing && row.fits {
                                true => fewest_recomputed_blocks(workload, cluster, &setup)?,
                                false => None,
                            };
                            rows.push(PlanRow { comm: name.map(str::to_string), ..row });
                            rows.extend(partial.map(|row| PlanRow { comm: name.map(str::to_string), ..row }));
                        }
                    }
                }
            }
        }
        let recommended = fastest(rows.iter().filter(|r| r.fits)).cloned();
        let reference_options = match (workload.reference, recommended.as_ref().or(rows.first())) {
            (Some(_), Some(row)) => Plan::reference_options(workload, cluster, registry, row)?,
            _ => vec![],
        };
        let model = workload.model;
        Ok(Plan {
            model: crate::bench::model_label(model),
            experts: ExpertParameters::of(model),
            cluster: cluster.clone(),
            batch: workload.batch,
            seq: workload.seq,
            grad_accum: workload.grad_accum,
            dtype: format!("{:?}", workload.dtype),
            float8: workload.float8.map(|layers| {
                let gathers = if workload.float8_gathers { ", sharded blocks gathered in float8" } else { "" };
                format!("float8 {} block layers{gathers}", format!("{:?}", layers.float8.recipe).to_lowercase())
            }),
            rows,
            recommended,
            reference_options,
        })
    }

    /// Each way of keeping the reference model under `row`'s configuration, and its label.
    fn reference_options(workload: &Workload, cluster: &Cluster, registry: &Registry, row: &PlanRow) -> Result<Vec<(String, ReferenceCost)>> {
        let strategy = registry.strategy(&row.strategy)?;
        let offload = (registry.offload(&row.offload)?.create)();
        let setup = Setup {
            strategy: &strategy.name,
            policy: (strategy.create)().policy(),
            offload: &row.offload,
            offload_to_host: offload.to_host(),
            activation_checkpointing: row.activation_checkpointing,
            checkpoint_layers: row.checkpoint_layers,
            comm: None,
            expert_parallel: row.expert_parallel.unwrap_or(1),
        };
        let mut options = vec![];
        for reference in Reference::ALL {
            let predicted = predict(&Workload { reference: Some(reference), ..*workload }, cluster, &setup)?;
            let label = predicted.label();
            options.extend(predicted.reference.map(|cost| (label, cost)));
        }
        Ok(options)
    }

    /// The row of one configuration.
    pub fn row(&self, strategy: &str, offload: &str, activation_checkpointing: bool, checkpoint_layers: Option<usize>) -> Option<&PlanRow> {
        self.rows.iter().find(|r| r.is(strategy, offload, activation_checkpointing, checkpoint_layers))
    }

    fn workload(&self) -> String {
        let accumulation = if self.grad_accum > 1 { format!(" x {} accumulated", self.grad_accum) } else { String::new() };
        let float8 = self.float8.as_ref().map_or(String::new(), |float8| format!(", {float8}"));
        let experts = self.experts.map_or(String::new(), |e| {
            let billions = |n: i64| n as f64 / 1e9;
            format!(" ({:.2}B parameters, {:.2}B active: {} of {} experts a token in {} layers)", billions(e.total), billions(e.active), e.per_token, e.experts, e.sparse_layers)
        });
        format!("{}{experts}, batch {} x {} tokens per GPU{accumulation}, {}{float8}", self.model, self.batch, self.seq, self.dtype)
    }

    fn hardware(&self) -> String {
        let c = &self.cluster;
        let memory = c.gpu_memory.map_or("no memory limit".into(), |m| format!("{:.1} GB", m / 1e9));
        let calibrated = c.calibration.as_ref().map_or(String::new(), |m| format!("; rates measured on {} by ft calibrate", m.device));
        format!("{} x {} ({memory}) on {} node(s), {:.0} GB host memory per node{calibrated}", c.gpus, c.gpu, c.nodes, c.host_memory / 1e9)
    }

    /// What to try when nothing fits: the configuration that allows the largest batch.
    fn largest_batch_hint(&self) -> String {
        match self.rows.iter().filter_map(|r| Some((r.max_batch?, r))).max_by_key(|(batch, _)| *batch) {
            Some((batch, row)) if batch > 0 => format!("{} fits a micro-batch of {batch} per GPU", row.label()),
            _ => "not even a micro-batch of 1 fits: more GPUs, a shorter sequence or offload would".into(),
        }
    }

    /// Writes the rows and the recommendation as JSON (`ft plan --json`).
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self)?).with_context(|| format!("cannot write {}", path.display()))
    }

    /// The console table.
    pub fn table(&self) -> String {
        let gb = |bytes: f64| format!("{:.1}", bytes / 1e9);
        let mut out = format!("ft plan: {}\n         on {}\n\n", self.workload(), self.hardware());
        out += &format!(
            "{:<24} {:<8} {:<6} {:<5} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>13} {:>10}\n",
            "strategy", "offload", "ckpt", "fits", "peak GB", "state", "acts", "other", "host GB", "step s", "tokens/s/GPU", "max batch"
        );
        for r in &self.rows {
            let other = r.peak.gathered + r.peak.loss + r.peak.transient;
            out += &format!(
                "{:<24} {:<8} {:<6} {:<5} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10.3} {:>13.0} {:>10}{}\n",
                r.comm.as_ref().map_or(r.strategy.clone(), |comm| format!("{}+{comm}", r.strategy)) + &r.expert_parallel.map_or(String::new(), |degree| format!(" ep{degree}")),
                r.offload,
                checkpointing_label(r.activation_checkpointing, r.checkpoint_layers),
                if r.fits { "yes" } else { "no" },
                gb(r.peak_gpu_bytes),
                gb(r.peak.state + r.peak.grads),
                gb(r.peak.activations),
                gb(other),
                gb(r.host_bytes),
                r.step_seconds,
                r.tokens_per_second_per_gpu,
                r.max_batch.map_or("-".into(), |b| b.to_string()),
                if self.recommended.as_ref() == Some(r) { "  <- recommended" } else { "" }
            );
        }
        out += "\npeak GB: allocated at the step's peak + 5% fragmentation + 1 GiB CUDA runtime; state: parameters, optimizer \
state and gradients held then; acts: activations; other: gathered units, loss buffers, gradients in flight. host GB: per node.\n";
        if let Some((label, _)) = self.reference_options.first() {
            out += &format!("reference model, per rank under {label}:\n");
            let planned = self.rows.first().and_then(|r| r.reference.as_ref()).map(|cost| cost.reference);
            for (_, cost) in &self.reference_options {
                let pairs = if cost.host_bytes_per_pair > 0.0 { format!(" + {:.0} bytes a pair", cost.host_bytes_per_pair) } else { String::new() };
                let when = if cost.in_step { "in each step" } else { "once before training, per step's pairs" };
                out += &format!(
                    "  {}: {} GB on the device, {} GB in host memory{pairs}; its forward {:.3} s {when}{}\n",
                    cost.kind,
                    gb(cost.device_bytes),
                    gb(cost.host_bytes),
                    cost.forward_seconds,
                    if planned == Some(cost.reference) { "  <- planned" } else { "" }
                );
            }
        }
        out += &match &self.recommended {
            Some(r) => format!(
                "recommended: {} — {:.1} GB per GPU, {:.3} s per step{}, {:.0} tokens/s per GPU{}\n",
                r.label(),
                r.peak_gpu_bytes / 1e9,
                r.step_seconds,
                if r.time.all_to_all > 0.0 { format!(" (all-to-all {:.3} s)", r.time.all_to_all) } else { String::new() },
                r.tokens_per_second_per_gpu,
                r.max_batch.map_or(String::new(), |b| format!("; micro-batches up to {b} fit"))
            ),
            None => format!("nothing fits: {}\n", self.largest_batch_hint()),
        };
        out
    }
}

/// The quickest of `rows` (the first of equals).
fn fastest<'r>(rows: impl Iterator<Item = &'r PlanRow>) -> Option<&'r PlanRow> {
    rows.fold(None, |best: Option<&PlanRow>, r| match best {
        Some(b) if b.step_seconds <= r.step_seconds => Some(b),
        _ => Some(r),
    })
}

/// Under activation checkpointing that fits, the row recomputing the
/// fewest blocks that still fit (`train.checkpoint_layers`), when fewer than
/// all do: each block kept costs memory and saves its forward (and, in a
/// mixture of experts, its exchanges) again. None when only all fit, or
/// none need to (the row without checkpointing fits).
fn fewest_recomputed_blocks(workload: &Workload, cluster: &Cluster, all: &Setup) -> Result<Option<PlanRow>> {
    let blocks = crate::model::block_count(workload.model);
    let predict_with = |layers: usize| predict(workload, cluster, &Setup { activation_checkpointing: layers > 0, checkpoint_layers: (layers > 0).then_some(layers), ..*all });
    // The blocks' activations grow as fewer are recomputed: a bisection over
    // 0..blocks, keeping the fewest's row that fits.
    let (mut fits, mut fails, mut fewest) = (blocks, 0, None);
    if predict_with(0)?.fits {
        return Ok(None);
    }
    while fits - fails > 1 {
        let middle = (fits + fails) / 2;
        let row = predict_with(middle)?;
        if row.fits {
            (fits, fewest) = (middle, Some(row));
        } else {
            fails = middle;
        }
    }
    Ok(fewest)
}

/// The plan's and `ft bench --plan-check`'s "ckpt" column: on, off, or the
/// number of blocks recomputed.
fn checkpointing_label(activation_checkpointing: bool, checkpoint_layers: Option<usize>) -> String {
    match (activation_checkpointing, checkpoint_layers) {
        (true, Some(layers)) => format!("{layers} blk"),
        (true, None) => "on".into(),
        (false, _) => "off".into(),
    }
}
