//! `ft plan`: flags → a workload and a cluster → ft_core::plan; table and JSON out.
//! `ft calibrate`: flags → ft_core::plan::calibrate → the file `--calibration` reads.

use crate::args::{LoraArgs, StepShape};
use ft_core::config::{parse_comm_option, parse_named, Assignment, Fp8, Fp8Layers};
use ft_core::units::{parse_positive, parse_size};
use anyhow::{Context, Result};
use clap::Args;
use ft_core::device::DeviceSpec;
use ft_core::distributed::strategy::ReduceDtype;
use ft_core::plan::{self, CalibrateOptions, Calibration, Checkpointing, Cluster, ClusterFlags, Float8Flags, Plan, Workload};
use ft_core::Registry;
use ft_models::hf;
use std::path::PathBuf;

#[derive(Args)]
pub struct PlanArgs {
    /// The model: a directory, a hub id in the local cache, or a config.json (no weights are read).
    #[arg(long)]
    model: String,
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
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Rows with activation checkpointing, without, or both: on, off or auto.
    #[arg(long, default_value = "auto")]
    activation_checkpointing: Checkpointing,
    /// Ranks per shard group for the strategies that shard (hybrid_shard's default: one node).
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// dtype gradients are reduced in: fp32 or compute.
    #[arg(long, default_value = "fp32", value_parser = parse_named::<ReduceDtype>)]
    reduce_dtype: ReduceDtype,
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
    #[arg(long = "comm-option", value_name = "comm.NAME.KEY=VALUE", value_parser = parse_comm_option)]
    comm_options: Vec<Assignment>,
    /// A hook's measured compression rate in elements per second, e.g.
    /// powersgd=2e10 (`ft bench` beside the built-in measures it; without it
    /// the hook's compute is left out of the step time).
    #[arg(long = "compress-rate", value_name = "NAME=ELEMENTS_PER_S", value_parser = plan::parse_compress_rate)]
    compress_rates: Vec<(String, f64)>,
    /// The task trained (`ft list`; default: the one for the model's head):
    /// one that compares with a reference model (dpo) has it planned, kept as --reference says.
    #[arg(long)]
    task: Option<String>,
    /// How the task's reference model is kept: precomputed (its
    /// log-probabilities once before training: dpo's task.precompute_ref=true,
    /// the default) or each-step (run with every micro-batch:
    /// task.precompute_ref=false; LoRA's base with --lora-r, else a frozen copy).
    #[arg(long, value_name = "precomputed|each-step", value_parser = plan::Reference::parse)]
    reference: Option<plan::Reference>,
    /// Float8 linear layers in the blocks, tensorwise or rowwise (`ft train
    /// --fp8`): their GEMMs at the float8 rates of a --calibration made by
    /// `ft calibrate --fp8`, the layers it measured no faster kept in the
    /// compute dtype as `train.fp8_calibration` keeps them (without one,
    /// those `ft train` keeps, at the compute dtype's rates).
    #[arg(long, value_name = "tensorwise|rowwise", value_parser = parse_named::<Fp8>)]
    fp8: Option<Fp8>,
    /// Under --fp8: auto (the layers float8 speeds up, as above) or all (train.fp8_layers).
    #[arg(long, value_name = "auto|all", value_parser = parse_named::<Fp8Layers>, requires = "fp8")]
    fp8_layers: Option<Fp8Layers>,
    /// Under --fp8 tensorwise with sharding, gather float8 blocks as float8 bytes (`train.fp8_gathers`; default: on under tensorwise).
    #[arg(long, value_name = "true|false", requires = "fp8")]
    fp8_gathers: Option<bool>,
    /// Write the rows and the recommendation as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    shape: StepShape,
}

pub fn run(args: PlanArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let model = args.lora.run_model(hf::ModelSource::resolve(&args.model)?.set_keys(&args.shape.overrides)?.model()?)?;
    let dtype = args.shape.dtype.kind(tch::Device::Cuda(0));
    let mut cluster = Cluster::from_flags(
        &ClusterFlags {
            gpus: args.gpus,
            nodes: args.nodes,
            gpu: args.gpu.as_deref(),
            gpu_memory: args.gpu_memory,
            host_memory: args.host_memory,
            tflops: args.tflops,
            bus_bandwidth: args.bus_bandwidth,
            inter_node_bandwidth: args.inter_node_bandwidth,
            comm_test: args.comm_test.as_deref(),
        },
        dtype,
    )?;
    let calibration = args.calibration.as_ref().map(|path| Calibration::load(path).map(|c| (c, path.as_path()))).transpose()?;
    let fp8 = Float8Flags { fp8: args.fp8, layers: args.fp8_layers, gathers: args.fp8_gathers };
    let measured = calibration.as_ref().map(|(c, path)| (c, *path));
    let (float8, float8_gathers) = plan::float8_planned(fp8, model.model(), dtype, args.shape.batch * args.shape.seq, measured)?;
    let workload = Workload {
        model: model.model(),
        batch: args.shape.batch,
        seq: args.shape.seq,
        grad_accum: args.grad_accum,
        dtype,
        reduce_dtype: args.reduce_dtype,
        loss_chunk_tokens: args.shape.loss_chunk_tokens,
        shard_group_size: args.shard_group_size,
        reference: plan::reference_planned(args.task.as_deref(), args.reference, model.model(), &registry, args.shape.loss_chunk_tokens)?,
        float8: float8.as_ref(),
        float8_gathers,
        rollout: None,
    };
    if let Some((calibration, path)) = &calibration {
        cluster.use_calibration(calibration, &workload).with_context(|| format!("--calibration {}", path.display()))?;
    }
    let comms = plan::planned_comms(&args.comm, &args.comm_options, &args.compress_rates.iter().cloned().collect(), &registry)?;
    let plan = Plan::with_comms(&workload, &cluster, &registry, args.activation_checkpointing, &comms)?;
    print!("{}", plan.table());
    if let Some(path) = &args.json {
        plan.save(path)?;
    }
    Ok(0)
}

#[derive(Args)]
pub struct CalibrateArgs {
    /// The models whose GEMM shapes are timed: config.json, a model directory or a hub id (repeatable).
    #[arg(long = "config", required = true)]
    configs: Vec<String>,
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
    #[command(flatten)]
    shape: StepShape,
}

pub fn calibrate(args: CalibrateArgs, plugins: &[PathBuf]) -> Result<i32> {
    let registry = Registry::with_plugins(plugins)?;
    let models = args.configs.iter().map(|config| hf::ModelSource::resolve(config)?.set_keys(&args.shape.overrides)?.model()).collect::<Result<Vec<_>>>()?;
    let models: Vec<&dyn ft_core::Model> = models.iter().map(|m| m.as_ref()).collect();
    let device = args.device.device(0)?;
    let options = CalibrateOptions {
        models: &models,
        tokens: args.shape.batch.checked_mul(args.shape.seq).with_context(|| format!("--batch {} x --seq {}: too many tokens to count", args.shape.batch, args.shape.seq))?,
        loss_chunk_tokens: args.shape.loss_chunk_tokens,
        dtype: args.shape.dtype.kind(device),
        device,
        host_elements: args.host_elements,
        float8: args.fp8,
    };
    let calibration = plan::calibrate(&options, &registry)?;
    calibration.save(&args.out)?;
    print!("{}", calibration.summary());
    Ok(0)
}
