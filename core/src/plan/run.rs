//! What `ft train` takes from the plan: `--strategy auto`'s configuration,
//! and an out-of-memory failure explained with the prediction and the
//! fastest configuration predicted to need less.

use super::{fastest, Checkpointing, Cluster, Plan, PlanRow, Workload};
use crate::config::{Config, RolloutGather};
use crate::distributed::comm::{Communicator, Reduction};
use crate::distributed::strategy::AUTO;
use crate::gpu::{self, GpuSpec};
use crate::model::Model;
use crate::offload::{NoOffload, Offload};
use crate::registry::Registry;
use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

impl Cluster {
    /// This job's ranks: its world and nodes, the GPU each computes on, and
    /// each limit the smallest over the ranks, so that every rank reaches the
    /// same plan. Ranks on CPUs have no GPU memory limit, and the figures
    /// only order the rows. Collective: every rank calls it.
    pub fn of_job(comm: &Communicator, dtype: Kind) -> Result<Cluster> {
        let env = comm.env();
        let (gpus, nodes) = (env.world_size, env.num_nodes());
        let mut cluster;
        let mut gpu_memory = None;
        match comm.device() {
            Device::Cuda(index) => {
                let local = gpu::local_gpu(index);
                let name = local.as_ref().map_or("an unknown GPU", |(name, _)| name.as_str());
                let spec = GpuSpec::find(name).unwrap_or_else(|| {
                    tracing::warn!("ft plan: {name} is not in ft's GPU table; predicting its speed as an {}'s", gpu::FALLBACK.key);
                    gpu::FALLBACK
                });
                cluster = Cluster::new(spec, gpus, nodes, dtype)?;
                cluster.gpu = name.into();
                gpu_memory = local.map(|(_, memory)| memory);
            }
            _ => cluster = Cluster { gpu: "cpu".into(), ..Cluster::new(gpu::FALLBACK, gpus, nodes, Kind::BFloat16)? },
        }
        // Negated for a Max reduction; a rank that could not read its GPU's
        // memory sends +1, and the job then plans without a GPU limit.
        let mut limits = Tensor::from_slice(&[-gpu_memory.unwrap_or(-1.0), -cluster.host_memory]).to_device(comm.device());
        comm.world().all_reduce(&mut limits, Reduction::Max)?.wait()?;
        let limits = Vec::<f64>::try_from(limits.to_device(Device::Cpu))?;
        cluster.gpu_memory = (limits[0] < 0.0).then_some(-limits[0]);
        cluster.host_memory = -limits[1];
        Ok(cluster)
    }
}

/// The plan of a run of `config` on this job's ranks, where the run needs
/// one: with `--strategy auto` its recommendation becomes the run's
/// strategy, offload and activation checkpointing; on GPUs it explains an
/// out-of-memory failure ([`explain_out_of_memory`]), and a run that did
/// not ask for it goes on without it when it cannot be made. `reference`:
/// the task's reference model (`Task::reference`), planned as it is kept;
/// `rollout`: online RL's sampling (`RolloutShape::of_run`). Collective.
pub fn for_run(comm: &Communicator, model: &dyn Model, config: &mut Config, dtype: Kind, registry: &Registry, reference: Option<&crate::task::Reference>, rollout: Option<super::RolloutShape>) -> Result<Option<Plan>> {
    let plan = plan_for_run(comm, model, config, dtype, registry, reference, rollout)?;
    if rollout.is_some() {
        settle_rollout_gather(config, plan.as_ref(), comm.env().rank == 0);
    }
    Ok(plan)
}

/// Settles `train.rollout_gather=auto` as the plan's row of the run's
/// configuration does (`PlanRow::rollout_gather`), or `whole` without a
/// plan, and says on rank 0 how the rollouts hold the policy and why.
fn settle_rollout_gather(config: &mut Config, plan: Option<&Plan>, lead: bool) {
    let train = &config.train;
    let row = plan.and_then(|plan| plan.row(&train.strategy, &train.offload, train.activation_checkpointing, train.checkpoint_layers));
    let why = match (train.rollout_gather, row.and_then(|row| Some((row, row.rollout_gather?, row.rollout_bytes?)))) {
        (RolloutGather::Auto, Some((row, gather, bytes))) => {
            config.train.rollout_gather = gather;
            let memory = plan.and_then(|plan| plan.cluster.gpu_memory).map_or("no memory limit".into(), |m| format!("{:.1} GB", m / 1e9));
            let whole = match (gather, row.fits) {
                (RolloutGather::Whole, true) => "fit",
                (RolloutGather::Whole, false) => "do not fit, and no unit is sharded to gather a stage at a time,",
                _ => "do not fit",
            };
            let (bytes, peak, label) = (bytes / 1e9, row.peak_gpu_bytes / 1e9, row.label());
            format!("train.rollout_gather=auto: the policy whole and its KV cache {whole} under {label}; ft plan: {bytes:.1} GB allocated while sampling, {peak:.1} GB at the peak, of {memory}")
        }
        (RolloutGather::Auto, None) => {
            config.train.rollout_gather = RolloutGather::Whole;
            "train.rollout_gather=auto without ft plan's prediction, which a run makes on GPUs or under --strategy auto".into()
        }
        (given, _) => format!("train.rollout_gather={given}"),
    };
    if lead {
        let how = match config.train.rollout_gather {
            RolloutGather::PerUnit => "gathered a unit at a time",
            _ => "gathered whole",
        };
        tracing::info!("rollouts: sampled from the policy {how} ({why})");
    }
}

/// [`for_run`]'s plan.
fn plan_for_run(comm: &Communicator, model: &dyn Model, config: &mut Config, dtype: Kind, registry: &Registry, reference: Option<&crate::task::Reference>, rollout: Option<super::RolloutShape>) -> Result<Option<Plan>> {
    let auto = config.train.strategy == AUTO;
    if !auto && !comm.device().is_cuda() {
        return Ok(None);
    }
    let lead = comm.env().rank == 0;
    let planned = Cluster::of_job(comm, dtype).and_then(|cluster| {
        // The run's float8 layers, as its trainer will choose them.
        let float8 = config.train.float8().map(|float8| anyhow::Ok(crate::train::float8_layers(model, float8, float8_kept(model, config)?.as_ref()))).transpose()?;
        let reference = reference.map(|reference| if reference.each_step { super::Reference::EachStep } else { super::Reference::Precomputed });
        let workload = Workload { float8: float8.as_ref(), float8_gathers: config.train.float8_gathers(), reference, rollout, ..Workload::of_run(model, config, dtype) };
        Plan::new(&workload, &cluster, registry, Checkpointing::Auto)
    });
    let plan = match planned {
        Ok(plan) => plan,
        Err(error) if !auto => {
            if lead {
                tracing::warn!("ft plan: no prediction to explain running out of memory with: {error:#}");
            }
            return Ok(None);
        }
        Err(error) => return Err(error.context("--strategy auto needs ft plan's prediction")),
    };
    if auto {
        let chosen = plan.choose_for_run(&config.train.offload, config.train.activation_checkpointing, config.train.expert_parallel)?;
        if lead {
            let reference = chosen.reference.as_ref().map(|cost| format!("; its reference model: {}", cost.kind)).unwrap_or_default();
            tracing::info!("--strategy auto: {} (ft plan: {:.1} GB per GPU, {:.3} s per step{reference})", chosen.label(), chosen.peak_gpu_bytes / 1e9, chosen.step_seconds);
        }
        config.train.strategy = chosen.strategy.clone();
        config.train.offload = chosen.offload.clone();
        config.train.activation_checkpointing = chosen.activation_checkpointing;
        // A count the run gave is kept (the plan's rows recompute all blocks or the fewest that fit).
        if !config.given("train.checkpoint_layers") {
            config.train.checkpoint_layers = chosen.checkpoint_layers;
        }
        config.train.expert_parallel = chosen.expert_parallel.unwrap_or(1);
    }
    Ok(Some(plan))
}

impl Plan {
    /// The row `ft train --strategy auto` runs: the fastest that fits,
    /// keeping activation checkpointing when the run turned it on, an
    /// offload when it chose one and an expert-parallel degree above 1 when it set one.
    pub fn choose_for_run(&self, offload: &str, activation_checkpointing: bool, expert_parallel: usize) -> Result<&PlanRow> {
        let degree_kept = |r: &PlanRow| expert_parallel == 1 || r.expert_parallel == Some(expert_parallel);
        let allowed = |r: &&PlanRow| (offload == NoOffload.name() || r.offload == offload) && (r.activation_checkpointing || !activation_checkpointing) && degree_kept(r);
        fastest(self.rows.iter().filter(allowed).filter(|r| r.fits)).with_context(|| {
            format!("--strategy auto: no configuration fits {} on {}; {}", self.workload(), self.hardware(), self.largest_batch_hint())
        })
    }
}

/// `error` with the plan's prediction when it is the GPU running out of
/// memory (libtorch's message says "out of memory"): what the run's
/// configuration was predicted to need, and the fastest configuration that
/// fits with less.
pub fn explain_out_of_memory(error: anyhow::Error, plan: &Plan, strategy: &str, offload: &str, train: &crate::config::TrainConfig) -> anyhow::Error {
    if !format!("{error:#}").contains("out of memory") {
        return error;
    }
    let memory = plan.cluster.gpu_memory.map_or("this GPU's".into(), |m| format!("{:.0} GB", m / 1e9));
    let gb = |bytes: f64| format!("{:.0} GB", bytes / 1e9);
    let failed = plan.row(strategy, offload, train.activation_checkpointing, train.checkpoint_layers);
    let predicted = match failed {
        Some(row) => format!("ft plan predicted {} needs {} of {memory}", row.label(), gb(row.peak_gpu_bytes)),
        None => format!("ft plan has no row for {strategy} with {offload} offload"),
    };
    let smaller = |r: &&PlanRow| r.fits && failed.is_none_or(|f| r.peak_gpu_bytes < f.peak_gpu_bytes);
    let next = match fastest(plan.rows.iter().filter(smaller)) {
        Some(row) => format!("{} would need {} of {memory}", row.label(), gb(row.peak_gpu_bytes)),
        None => plan.largest_batch_hint(),
    };
    error.context(format!("out of GPU memory at {}: {predicted}; {next} (`ft plan` lists every configuration)", plan.workload()))
}

/// Under `train.fp8`, the block weight shapes that stay in the compute
/// dtype: none with `train.fp8_layers=all`; with `train.fp8_calibration`,
/// those that file measured float8 no faster for at this run's tokens per
/// micro-batch; None otherwise, where the trainer keeps its default
/// (`train::float8_slow_shapes`).
pub fn float8_kept(model: &dyn Model, config: &Config) -> Result<Option<std::collections::BTreeSet<[i64; 2]>>> {
    if config.train.float8().is_none() {
        return Ok(None);
    }
    if config.train.fp8_layers == crate::config::Fp8Layers::All {
        return Ok(Some(Default::default()));
    }
    let Some(path) = config.train.fp8_calibration.as_deref() else {
        return Ok(None);
    };
    let calibration = super::Calibration::load(path).context("train.fp8_calibration")?;
    let tokens = (config.train.batch_size * config.data.max_seq_len) as i64;
    calibration.float8_kept(model, tokens, path).map(Some)
}
