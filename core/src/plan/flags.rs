//! What `ft plan`'s and `ft bench --plan-check`'s flags ask of a plan,
//! made into its parts: the GPU, the cluster's measured figures, float8's
//! layers, the task's reference model and the communication hooks.

use super::{Calibration, Cluster, CommTestReport, PlanComm, Reference};
use crate::config::{Assignment, Config, Fp8, Fp8Layers, Overrides, TrainConfig};
use crate::gpu::{self, GpuSpec};
use crate::model::{Float8Layers, Model};
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tch::Kind;

impl GpuSpec {
    /// The GPU `--gpu NAME` names; an unknown name is refused with the known ones.
    pub fn named(name: &str) -> Result<&'static GpuSpec> {
        GpuSpec::find(name).with_context(|| format!("unknown --gpu {name:?}: ft knows {}", GpuSpec::keys()))
    }

    /// The GPU measured rows ran on (`ft bench --plan-check`): `--gpu`, else this machine's.
    pub fn of_rows(name: Option<&str>) -> Result<&'static GpuSpec> {
        match name {
            Some(name) => GpuSpec::named(name),
            None => gpu::local_gpu(0)
                .and_then(|(name, _)| GpuSpec::find(&name))
                .context("--plan-check needs the GPU the rows ran on: give --gpu (`ft plan --help` lists them)"),
        }
    }
}

/// The machines `ft plan`'s flags describe; each figure left out is the
/// GPU's (from ft's table, or as NVML reports this machine's) or this host's.
pub struct ClusterFlags<'a> {
    pub gpus: usize,
    pub nodes: usize,
    /// `--gpu`: another machine's GPU (default: this machine's, else an H100).
    pub gpu: Option<&'a str>,
    /// Bytes per GPU, and of host memory per node.
    pub gpu_memory: Option<f64>,
    pub host_memory: Option<f64>,
    /// TFLOP/s one GPU achieves.
    pub tflops: Option<f64>,
    /// Bus bandwidths in GB/s: among a node's GPUs, and between nodes.
    pub bus_bandwidth: Option<f64>,
    pub inter_node_bandwidth: Option<f64>,
    /// `ft comm-test --json`'s report, whose measured bus bandwidth replaces the node's (or the inter-node one).
    pub comm_test: Option<&'a Path>,
}

impl Cluster {
    /// The cluster `flags` describe, computing in `dtype`.
    pub fn from_flags(flags: &ClusterFlags, dtype: Kind) -> Result<Cluster> {
        let local = if flags.gpu.is_none() { gpu::local_gpu(0) } else { None };
        let spec = match flags.gpu {
            Some(name) => GpuSpec::named(name)?,
            None => local.as_ref().and_then(|(name, _)| GpuSpec::find(name)).unwrap_or(gpu::FALLBACK),
        };
        let mut cluster = Cluster::new(spec, flags.gpus, flags.nodes, dtype)?;
        if let Some((name, memory)) = local {
            cluster.gpu = name;
            cluster.gpu_memory = Some(memory);
        }
        if let Some(path) = flags.comm_test {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let report: CommTestReport = serde_json::from_str(&text).with_context(|| format!("{} is not `ft comm-test --json` output", path.display()))?;
            cluster.use_comm_test(&report).with_context(|| format!("reading {}", path.display()))?;
        }
        cluster.gpu_memory = flags.gpu_memory.or(cluster.gpu_memory);
        match (flags.host_memory, flags.gpu) {
            (Some(bytes), _) => cluster.host_memory = bytes,
            // Another machine's hosts are not this one's.
            (None, Some(_)) => {
                cluster.host_memory = super::ASSUMED_HOST_MEMORY_PER_GPU * cluster.gpus_per_node() as f64;
                eprintln!("ft plan: assuming {:.0} GB of host memory per node (--host-memory sets it)", cluster.host_memory / 1e9);
            }
            (None, None) => {}
        }
        cluster.flops = flags.tflops.map_or(cluster.flops, |t| t * 1e12);
        cluster.node_bus_bandwidth = flags.bus_bandwidth.map_or(cluster.node_bus_bandwidth, |b| b * 1e9);
        cluster.inter_node_bus_bandwidth = flags.inter_node_bandwidth.map_or(cluster.inter_node_bus_bandwidth, |b| b * 1e9);
        Ok(cluster)
    }
}

/// `--fp8` and the keys that go with it, as `ft train` takes them.
#[derive(Clone, Copy, Default)]
pub struct Float8Flags {
    pub fp8: Option<Fp8>,
    pub layers: Option<Fp8Layers>,
    pub gathers: Option<bool>,
}

impl Float8Flags {
    /// The float8 recipe the flags ask for, and whether its sharded blocks
    /// are gathered in float8, as `ft train` reads the keys.
    pub fn recipe(&self) -> (Option<ft_sys::float8::Float8>, bool) {
        let train = TrainConfig { fp8: self.fp8.unwrap_or_default(), fp8_gathers: self.gathers, ..TrainConfig::default() };
        (train.float8(), train.float8_gathers())
    }
}

/// The block layers `--fp8` casts, as `ft train` chooses them with the
/// same `train.fp8_layers` and, as its `train.fp8_calibration`, the
/// calibration (read from `path`) when it measured float8 (None: no
/// --fp8); and whether they are gathered in float8. The flags are checked
/// as `ft train` checks their keys.
pub fn float8_planned(flags: Float8Flags, model: &dyn Model, dtype: Kind, tokens: i64, calibration: Option<(&Calibration, &Path)>) -> Result<(Option<Float8Layers>, bool)> {
    let mut given = Overrides::default();
    given.serialized("train.fp8", flags.fp8).serialized("train.fp8_layers", flags.layers).set("train.fp8_gathers", flags.gathers);
    let config = Config::load(None, &given.0, &[])?;
    crate::setup::check_given_keys(&config)?;
    let train = &config.train;
    let Some(float8) = train.float8() else { return Ok((None, false)) };
    if dtype == Kind::Half {
        bail!(crate::train::FLOAT8_WITH_FP16);
    }
    let measured = calibration.filter(|(c, _)| c.gemms.iter().any(|g| g.float8_flops_per_second.is_some()));
    let kept = match (train.fp8_layers, measured) {
        (Fp8Layers::All, _) => Some(Default::default()),
        (_, Some((calibration, path))) => Some(calibration.float8_kept(model, tokens, path)?),
        _ => None,
    };
    if measured.is_none() {
        eprintln!("ft plan: --fp8 without float8 rates (a --calibration from `ft calibrate --fp8`): float8 layers are planned at the compute dtype's rate");
    }
    Ok((Some(crate::train::float8_layers(model, float8, kept.as_ref())), train.float8_gathers()))
}

/// The reference model the task (`--task`; default: the one for the
/// model's head) compares with, kept as `reference` says (None: the task
/// compares with none, and a `--reference` for it is refused).
pub fn reference_planned(task: Option<&str>, reference: Option<Reference>, model: &dyn Model, registry: &Registry, loss_chunk_tokens: i64) -> Result<Option<Reference>> {
    if task.is_none() && reference.is_none() {
        return Ok(None);
    }
    let task = registry.task(task, model.head_kind())?;
    // Whether it compares with a reference, as the task itself says (over one random example).
    let synthetic = crate::task::Synthetic { model, examples: 1, seq: 2, seed: 0, device: tch::Device::Cpu, loss_chunk_tokens };
    let compares = (task.synthetic)(&synthetic).with_context(|| format!("--task {}", task.name))?.compares_with_reference();
    match (compares, reference) {
        (true, reference) => Ok(Some(reference.unwrap_or(Reference::Precomputed))),
        (false, None) => Ok(None),
        (false, Some(_)) => bail!("--reference: task {} compares with no reference model (give --task dpo)", task.name),
    }
}

/// `--compress-rate NAME=ELEMENTS_PER_S`: a hook's measured compression rate.
pub fn parse_compress_rate(text: &str) -> Result<(String, f64), String> {
    let (name, rate) = text.split_once('=').ok_or_else(|| format!("{text:?} is not NAME=ELEMENTS_PER_S"))?;
    Ok((name.to_string(), crate::units::parse_positive(rate)?))
}

/// The hooks `names` (`--comm`), made with their `options`
/// (`--comm-option`), each with its measured compression rate where `rates` has one.
pub fn planned_comms(names: &[String], options: &[Assignment], rates: &BTreeMap<String, f64>, registry: &Registry) -> Result<Vec<(String, PlanComm)>> {
    let config = Config::load(None, &[], options)?;
    let builtin = (registry.strategy("ddp")?.create)();
    names
        .iter()
        .map(|name| {
            let comm = crate::config::CommConfig { name: Some(name.clone()), options: config.comm.options.clone() };
            let (hook, _) = registry.comm_hook(&comm, builtin.as_ref())?;
            Ok((name.clone(), PlanComm { hook, elements_per_second: rates.get(name).copied() }))
        })
        .collect()
}
