//! `ft plan`: flags → a workload and a cluster → ft_core::plan; table and JSON out.
//! `ft calibrate`: flags → ft_core::plan::calibrate → the file `--calibration` reads.

use crate::args::{parse_fp8, parse_positive, parse_reduce_dtype, parse_size, LoraArgs, Overrides};
use anyhow::{Context, Result};
use clap::Args;
use ft_core::config::Assignment;
use ft_core::device::{DType, DeviceSpec};
use ft_core::gpu::{self, GpuSpec};
use ft_core::model::Float8Layers;
use ft_core::plan::{self, CalibrateOptions, Calibration, Checkpointing, Cluster, CommTestReport, Plan, PlanComm, Workload};
use ft_core::strategy::ReduceDtype;
use ft_core::Registry;
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct PlanArgs {
    /// The model: a directory, a hub id in the local cache, or a config.json (no weights are read).
    #[arg(long)]
    model: String,
    /// Override config keys, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Plan LoRA adapters on the frozen model (and with --quantize, QLoRA's 4-bit base) as `ft train` runs them.
    #[command(flatten)]
    lora: LoraArgs,
    /// GPUs in all (the world size).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Nodes the GPUs are spread over evenly (hybrid_shard shards within one).
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// The GPU model: its memory, FLOP/s and bandwidths (default: this machine's GPU, else h100).
    #[arg(long)]
    gpu: Option<String>,
    /// Memory per GPU, e.g. 80GB or 80GiB (default: the GPU's).
    #[arg(long, value_parser = parse_size)]
    gpu_memory: Option<f64>,
    /// Host memory per node, e.g. 512GB (default: this machine's when planning for its GPU, else 225 GB per GPU).
    #[arg(long, value_parser = parse_size)]
    host_memory: Option<f64>,
    /// Examples per GPU per micro-batch.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Tokens per example.
    #[arg(long, default_value_t = 512)]
    seq: i64,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Compute dtype (masters stay fp32): bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Rows with activation checkpointing, without, or both: on, off or auto.
    #[arg(long, default_value = "auto")]
    activation_checkpointing: Checkpointing,
    /// Ranks per shard group for the strategies that shard (hybrid_shard's default: one node).
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// dtype gradients are reduced in: fp32 or compute.
    #[arg(long, default_value = "fp32", value_parser = parse_reduce_dtype)]
    reduce_dtype: ReduceDtype,
    /// Tokens per chunk of the LM head's logits.
    #[arg(long, default_value_t = 1024)]
    loss_chunk_tokens: i64,
    /// TFLOP/s one GPU achieves, as measured (default: a share of the GPU's dense peak that ft's steps reach).
    #[arg(long, value_parser = parse_positive, conflicts_with = "calibration")]
    tflops: Option<f64>,
    /// `ft calibrate`'s file: its measured GEMM, host optimizer and host
    /// link rates replace the table's (calibrate with this plan's model, batch, length and dtype).
    #[arg(long, value_name = "JSON")]
    calibration: Option<PathBuf>,
    /// NCCL bus bandwidth among a node's GPUs, GB/s (default: the GPU's).
    #[arg(long, value_parser = parse_positive)]
    bus_bandwidth: Option<f64>,
    /// `ft comm-test --json` output: its measured bus bandwidth replaces the
    /// node's (or the one between nodes, when the test spanned several).
    #[arg(long, value_name = "JSON")]
    comm_test: Option<PathBuf>,
    /// Bus bandwidth between nodes, GB/s per GPU (default 45: a 400 Gb/s NIC per GPU).
    #[arg(long, value_parser = parse_positive)]
    inter_node_bandwidth: Option<f64>,
    /// Communication plug-ins to plan beside each strategy's own collectives
    /// (comma-separated; rows for every strategy a hook serves).
    #[arg(long, value_delimiter = ',')]
    comm: Vec<String>,
    /// A hook's option, e.g. comm.powersgd.rank=4 (repeatable).
    #[arg(long = "comm-option", value_name = "comm.NAME.KEY=VALUE")]
    comm_options: Vec<String>,
    /// A hook's measured compression rate in elements per second, e.g.
    /// powersgd=2e10 (`ft bench` beside the built-in measures it; without it
    /// the hook's compute is left out of the step time).
    #[arg(long = "compress-rate", value_name = "NAME=ELEMENTS_PER_S")]
    compress_rates: Vec<String>,
    /// The task trained (`ft list`; default: the one for the model's head):
    /// one that compares with a reference model (dpo) has it planned, kept as --reference says.
    #[arg(long)]
    task: Option<String>,
    /// How the task's reference model is kept: precomputed (its
    /// log-probabilities once before training: dpo's task.precompute_ref=true,
    /// the default) or each-step (run with every micro-batch:
    /// task.precompute_ref=false; LoRA's base with --lora-r, else a frozen copy).
    #[arg(long, value_name = "precomputed|each-step", value_parser = parse_reference)]
    reference: Option<plan::Reference>,
    /// Float8 linear layers in the blocks, tensorwise or rowwise (`ft train
    /// --fp8`): their GEMMs at the float8 rates of a --calibration made by
    /// `ft calibrate --fp8`, the layers it measured no faster kept in the
    /// compute dtype as `train.fp8_calibration` keeps them (without one,
    /// those `ft train` keeps, at the compute dtype's rates).
    #[arg(long, value_name = "tensorwise|rowwise", value_parser = parse_fp8)]
    fp8: Option<ft_core::config::Fp8>,
    /// Under --fp8: auto (the layers float8 speeds up, as above) or all (train.fp8_layers).
    #[arg(long, value_name = "auto|all", value_parser = parse_fp8_layers, requires = "fp8")]
    fp8_layers: Option<ft_core::config::Fp8Layers>,
    /// Under --fp8 tensorwise with sharding, gather float8 blocks as float8 bytes (`train.fp8_gathers`; default: on under tensorwise).
    #[arg(long, value_name = "true|false", requires = "fp8")]
    fp8_gathers: Option<bool>,
    /// Write the rows and the recommendation as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_fp8_layers(text: &str) -> Result<ft_core::config::Fp8Layers, String> {
    serde_json::from_value(serde_json::Value::from(text)).map_err(|_| format!("{text:?}: expected auto or all"))
}

/// The block layers `--fp8` casts, as `ft train` chooses them with the same
/// `train.fp8_layers` and, as its `train.fp8_calibration`, the plan's
/// calibration when it measured float8 (None: no --fp8); and whether they
/// are gathered in float8. The flags are checked as `ft train` checks their keys.
fn float8_layers(args: &PlanArgs, model: &dyn ft_core::Model, dtype: tch::Kind, calibration: Option<&Calibration>) -> Result<(Option<Float8Layers>, bool)> {
    let mut overrides = Overrides::default();
    overrides.serialized("train.fp8", args.fp8).serialized("train.fp8_layers", args.fp8_layers).set("train.fp8_gathers", args.fp8_gathers);
    let config = ft_core::Config::load(None, &overrides.0, &[])?;
    ft_core::setup::check_given_keys(&config)?;
    let train = &config.train;
    let Some(float8) = train.float8() else { return Ok((None, false)) };
    if dtype == tch::Kind::Half {
        anyhow::bail!(ft_core::train::FLOAT8_WITH_FP16);
    }
    let measured = calibration.filter(|c| c.gemms.iter().any(|g| g.float8_flops_per_second.is_some()));
    let kept = match (train.fp8_layers, measured, &args.calibration) {
        (ft_core::config::Fp8Layers::All, _, _) => Some(Default::default()),
        (_, Some(calibration), Some(path)) => Some(calibration.float8_kept(model, args.batch * args.seq, path)?),
        _ => None,
    };
    if measured.is_none() {
        eprintln!("ft plan: --fp8 without float8 rates (a --calibration from `ft calibrate --fp8`): float8 layers are planned at the compute dtype's rate");
    }
    Ok((Some(ft_core::train::float8_layers(model, float8, kept.as_ref())), train.float8_gathers()))
}

fn parse_reference(text: &str) -> Result<plan::Reference, String> {
    serde_json::from_value(serde_json::Value::from(text.replace('-', "_"))).map_err(|_| format!("{text:?}: expected precomputed or each-step"))
}

/// The reference model `--task` compares with, kept as `--reference` says
/// (None: the task compares with none; a --reference for it is refused).
fn reference_of(args: &PlanArgs, model: &dyn ft_core::Model, registry: &Registry) -> Result<Option<plan::Reference>> {
    if args.task.is_none() && args.reference.is_none() {
        return Ok(None);
    }
    let task = registry.task(args.task.as_deref(), model.head_kind())?;
    // Whether it compares with a reference, as the task itself says (over one random example).
    let synthetic = ft_core::task::Synthetic { model, examples: 1, seq: 2, seed: 0, device: tch::Device::Cpu, loss_chunk_tokens: args.loss_chunk_tokens };
    let compares = (task.synthetic)(&synthetic).with_context(|| format!("--task {}", task.name))?.compares_with_reference();
    match (compares, args.reference) {
        (true, reference) => Ok(Some(reference.unwrap_or(plan::Reference::Precomputed))),
        (false, None) => Ok(None),
        (false, Some(_)) => anyhow::bail!("--reference: task {} compares with no reference model (give --task dpo)", task.name),
    }
}

/// The hooks `--comm` names, made with their `--comm-option`s, and their `--compress-rate`s.
fn planned_comms(args: &PlanArgs, registry: &Registry) -> Result<Vec<(String, PlanComm)>> {
    let options = args.comm_options.iter().map(|o| Assignment::parse(o, "--comm-option").map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    let config = ft_core::Config::load(None, &[], &options)?;
    let mut rates = std::collections::HashMap::new();
    for text in &args.compress_rates {
        let (name, rate) = text.split_once('=').with_context(|| format!("--compress-rate {text:?} is not NAME=ELEMENTS_PER_S"))?;
        rates.insert(name.to_string(), parse_positive(rate).map_err(anyhow::Error::msg)?);
    }
    let builtin = (registry.strategy("ddp")?.create)();
    args.comm
        .iter()
        .map(|name| {
            let comm = ft_core::config::CommConfig { name: Some(name.clone()), options: config.comm.options.clone() };
            let (hook, _) = registry.comm_hook(&comm, builtin.as_ref())?;
            Ok((name.clone(), PlanComm { hook, elements_per_second: rates.get(name).copied() }))
        })
        .collect()
}

/// The GPU to plan for: `--gpu`, else this machine's (with its memory), else an H100.
fn gpu_of(args: &PlanArgs) -> Result<(&'static GpuSpec, Option<(String, f64)>)> {
    if let Some(name) = &args.gpu {
        let spec = GpuSpec::find(name).with_context(|| format!("unknown --gpu {name:?}: ft knows {}", GpuSpec::keys()))?;
        return Ok((spec, None));
    }
    let local = gpu::local_gpu(0);
    let spec = local.as_ref().and_then(|(name, _)| GpuSpec::find(name)).unwrap_or(gpu::FALLBACK);
    Ok((spec, local))
}

pub fn run(args: PlanArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let model = args.lora.run_model(hf::ModelSource::resolve(&args.model)?.set_keys(&args.overrides)?.model()?)?;
    let dtype = args.dtype.kind(tch::Device::Cuda(0));
    let (spec, local) = gpu_of(&args)?;
    let mut cluster = Cluster::new(spec, args.gpus, args.nodes, dtype)?;
    if let Some((name, memory)) = local {
        cluster.gpu = name;
        cluster.gpu_memory = Some(memory);
    }
    if let Some(path) = &args.comm_test {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let report: CommTestReport = serde_json::from_str(&text).with_context(|| format!("{} is not `ft comm-test --json` output", path.display()))?;
        cluster.use_comm_test(&report).with_context(|| format!("reading {}", path.display()))?;
    }
    let gigabytes = |value: Option<f64>| value.map(|v| v * 1e9);
    cluster.gpu_memory = args.gpu_memory.or(cluster.gpu_memory);
    cluster.host_memory = match (args.host_memory, &args.gpu) {
        (Some(bytes), _) => bytes,
        // Another machine's hosts are not this one's.
        (None, Some(_)) => {
            let assumed = plan::ASSUMED_HOST_MEMORY_PER_GPU * cluster.gpus_per_node() as f64;
            eprintln!("ft plan: assuming {:.0} GB of host memory per node (--host-memory sets it)", assumed / 1e9);
            assumed
        }
        (None, None) => cluster.host_memory,
    };
    cluster.flops = args.tflops.map_or(cluster.flops, |t| t * 1e12);
    cluster.node_bus_bandwidth = gigabytes(args.bus_bandwidth).unwrap_or(cluster.node_bus_bandwidth);
    cluster.inter_node_bus_bandwidth = gigabytes(args.inter_node_bandwidth).unwrap_or(cluster.inter_node_bus_bandwidth);
    let calibration = args.calibration.as_ref().map(|path| Calibration::load(path)).transpose()?;
    let (float8, float8_gathers) = float8_layers(&args, model.model(), dtype, calibration.as_ref())?;
    let workload = Workload {
        model: model.model(),
        batch: args.batch,
        seq: args.seq,
        grad_accum: args.grad_accum,
        dtype,
        reduce_dtype: args.reduce_dtype,
        loss_chunk_tokens: args.loss_chunk_tokens,
        shard_group_size: args.shard_group_size,
        reference: reference_of(&args, model.model(), &registry)?,
        float8: float8.as_ref(),
        float8_gathers,
    };
    if let (Some(path), Some(calibration)) = (&args.calibration, &calibration) {
        cluster.use_calibration(calibration, &workload).with_context(|| format!("--calibration {}", path.display()))?;
    }
    let comms = planned_comms(&args, &registry)?;
    let plan = Plan::with_comms(&workload, &cluster, &registry, args.activation_checkpointing, &comms)?;
    print!("{}", plan.table());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&plan)?).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(0)
}

#[derive(Args)]
pub struct CalibrateArgs {
    /// The models whose GEMM shapes are timed: config.json, a model directory or a hub id (repeatable).
    #[arg(long = "config", required = true)]
    configs: Vec<String>,
    /// Override config keys of every model, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Examples per GPU per micro-batch, as the plan will have.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Tokens per example.
    #[arg(long, default_value_t = 512)]
    seq: i64,
    /// Compute dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Tokens per chunk of the LM head's logits.
    #[arg(long, default_value_t = 1024)]
    loss_chunk_tokens: i64,
    /// cuda, cpu, or auto (the GPU when there is one).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// Elements of each host optimizer buffer timed (four buffers of fp32).
    #[arg(long, default_value_t = 64 << 20)]
    host_elements: i64,
    /// Also time each block layer's shape in float8 (`--fp8 tensorwise`:
    /// its GEMMs and casts) against the compute dtype, on a GPU of compute
    /// capability 8.9+; `ft train --set train.fp8_calibration=F` keeps the
    /// shapes float8 does not speed up in the compute dtype.
    #[arg(long)]
    fp8: bool,
    /// Where to write the calibration.
    #[arg(long, value_name = "JSON")]
    out: PathBuf,
}

pub fn calibrate(args: CalibrateArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let models = args.configs.iter().map(|config| hf::ModelSource::resolve(config)?.set_keys(&args.overrides)?.model()).collect::<Result<Vec<_>>>()?;
    let models: Vec<&dyn ft_core::Model> = models.iter().map(|m| m.as_ref()).collect();
    let device = args.device.device(0)?;
    let options = CalibrateOptions {
        models: &models,
        tokens: args.batch.checked_mul(args.seq).with_context(|| format!("--batch {} x --seq {}: too many tokens to count", args.batch, args.seq))?,
        loss_chunk_tokens: args.loss_chunk_tokens,
        dtype: args.dtype.kind(device),
        device,
        host_elements: args.host_elements,
        float8: args.fp8,
    };
    let calibration = plan::calibrate(&options, &registry)?;
    calibration.save(&args.out)?;
    print!("{}", calibration.summary());
    Ok(0)
}
