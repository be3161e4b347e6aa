//! What every command sets up the same way: the configuration checked
//! against the registry, this rank's device, dtype and communicator from
//! `train.*` and `dist.*`, and the host's cores shared among its ranks.

use crate::config::Config;
use crate::distributed::comm::{Backend, CommOptions, Communicator};
use crate::env::{DistEnv, EnvSource};
use crate::offload::Offload;
use crate::registry::Registry;
use anyhow::{bail, Result};
use std::time::Duration;
use tch::{Device, Kind};

/// Splits this host's cores among its `local_ranks` workers (as torchrun
/// does) instead of oversubscribing them: ATen's threads when computing on
/// the CPU, the host optimizer's when `offload` keeps state off the device.
/// `OMP_NUM_THREADS`, where set, is each worker's count instead, as torch
/// takes it (the first of OpenMP's comma-separated levels).
pub fn share_host_cores(local_ranks: usize, device: Device, offload: &dyn Offload) -> Result<()> {
    let share = match std::env::var("OMP_NUM_THREADS") {
        Ok(value) => value
            .split(',')
            .next()
            .and_then(|first| first.trim().parse::<usize>().ok())
            .filter(|&threads| threads > 0)
            .ok_or_else(|| anyhow::anyhow!("environment variable OMP_NUM_THREADS={value:?} is not a number of threads (a whole number from 1): set it so, or unset it to share the host's cores among its ranks"))?,
        Err(_) => (std::thread::available_parallelism().map_or(1, |n| n.get()) / local_ranks.max(1)).max(1),
    };
    if device == Device::Cpu {
        tch::set_num_threads(share as i32);
    }
    if offload.to_host() {
        offload.use_cores(share);
    }
    Ok(())
}

/// The model config.json of the preset `config.model.source` names, once
/// its files are ready: rank 0 writes them in OUTPUT/NAME-data while the
/// others wait, then every rank points `config` at them; None when the
/// model is no preset. Collective: every rank calls it.
pub fn prepare_preset(config: &mut Config, comm: &Communicator) -> Result<Option<serde_json::Value>> {
    let Some(preset) = crate::config::preset(Some(&config.model.source)) else { return Ok(None) };
    let dir = config.output.dir.join(format!("{}-data", preset.name));
    if comm.env().rank == 0 {
        (preset.write_files)(&dir, config.train.seed)?;
    }
    comm.world().barrier()?.wait()?;
    (preset.configure)(config, &dir).map(Some)
}

/// The c10d backend for `device`: `auto` is NCCL on a GPU and Gloo on a CPU;
/// an explicit choice that cannot drive the device is refused.
pub fn backend_for(configured: Backend, device: Device) -> Result<Backend> {
    Ok(match (configured, device) {
        (Backend::Auto, Device::Cpu) => Backend::Gloo,
        (Backend::Auto, _) => Backend::Nccl,
        (Backend::Nccl, Device::Cpu) => bail!("dist.backend nccl needs a GPU, but this rank computes on the CPU (train.device)"),
        (Backend::Gloo, Device::Cuda(_)) => bail!("dist.backend gloo cannot reduce this rank's GPU tensors: use nccl or auto"),
        (backend, _) => backend,
    })
}

/// Refuses a configuration a run of `world` ranks, `per_node` on a node,
/// cannot start with, naming the key; the names it holds (strategy,
/// offload, sinks, task) are looked up in `registry`.
pub fn validate(config: &Config, registry: &Registry, world: usize, per_node: usize) -> Result<()> {
    let t = &config.train;
    if t.epochs == 0 || t.batch_size == 0 || t.grad_accum == 0 || t.eval_batch_size == 0 {
        bail!("train.epochs, train.batch_size, train.eval_batch_size and train.grad_accum must be at least 1");
    }
    // Written to refuse NaN too.
    if t.lr.is_nan() || t.lr <= 0.0 {
        bail!("train.lr must be positive (got {})", t.lr);
    }
    if t.schedule_steps == Some(0) {
        bail!("train.schedule_steps must be at least 1: the optimizer steps the learning-rate schedule spans");
    }
    config.data.check_max_seq_len()?;
    if !config.uses_preset() && config.data.train.is_none() && config.data.mixture.is_empty() {
        bail!("set data.train (--train-file) to train {}; only a preset (`ft list`) brings its own data", config.model.source);
    }
    if t.initial_loss_scale.is_nan() || t.initial_loss_scale < 1.0 {
        bail!("train.initial_loss_scale must be at least 1 (got {})", t.initial_loss_scale);
    }
    if let Some(peak) = t.peak_tflops.filter(|p| p.is_nan() || *p <= 0.0) {
        bail!("train.peak_tflops must be positive (got {peak})");
    }
    if !(t.log_seconds >= 0.0 && t.log_seconds.is_finite()) {
        bail!("train.log_seconds must be a number of seconds, 0 or more (got {})", t.log_seconds);
    }
    if let Some(minutes) = t.save_minutes.filter(|m| m.is_nan() || *m <= 0.0) {
        bail!("train.save_minutes must be positive (got {minutes})");
    }
    crate::signals::parse(&t.save_signal)?;
    for sink in config.output.sinks()? {
        registry.sink(sink)?;
    }
    config.launch.validate()?;
    if t.max_steps == Some(0) {
        bail!("train.max_steps (--max-steps) must be at least 1: the optimizer steps the run trains");
    }
    if t.max_steps.is_some() && config.given("train.epochs") {
        bail!("train.max_steps (--max-steps) and train.epochs (--epochs) both set how long the run trains: give one");
    }
    check_given_keys(config)?;
    if t.strategy != crate::distributed::strategy::AUTO {
        let strategy = registry.strategy(&t.strategy)?;
        (strategy.create)().policy().validate(&strategy.name)?;
    }
    registry.offload(&t.offload)?;
    match t.checkpoint_layers {
        Some(_) if !t.activation_checkpointing => bail!("train.checkpoint_layers (--checkpoint-layers) needs train.activation_checkpointing (--activation-checkpointing): it says how many of the checkpointed blocks recompute"),
        Some(0) => bail!("train.checkpoint_layers (--checkpoint-layers) must be at least 1: without recomputed blocks, turn train.activation_checkpointing off"),
        _ => {}
    }
    if t.expert_parallel == 0 {
        bail!("train.expert_parallel (--expert-parallel) must be at least 1: the ranks that split a mixture of experts' experts (1: each rank holds them all)");
    }
    // The degree against the world and the model: `check_expert_parallel`; here, against the strategy's shard groups.
    if t.expert_parallel > 1 && world % t.expert_parallel == 0 && t.strategy != crate::distributed::strategy::AUTO {
        let strategy = registry.strategy(&t.strategy)?;
        let shard_size = (strategy.create)().policy().shard_group_size(&strategy.name, world, per_node, t.shard_group_size)?;
        crate::distributed::experts::expert_shard_size(t.expert_parallel, shard_size)?;
    }
    registry.check_comm(&config.comm)?;
    if let Some(name) = &config.task.name {
        let task = registry.task(Some(name), "")?;
        (task.check_options)(&serde_json::Value::Object(config.task.options.clone()), t, world)?;
    }
    if t.monitor.is_none() && (t.early_stopping_patience > 0 || t.save_best > 0) {
        bail!("train.early_stopping_patience and train.save_best need train.monitor (the score to judge epochs by, e.g. eval_f1 or eval_loss)");
    }
    check_adapters(config)?;
    if t.fp8 != crate::config::Fp8::Off && t.dtype == crate::device::DType::F16 {
        bail!("{}", crate::train::FLOAT8_WITH_FP16);
    }
    if let Some([first, last]) = t.profile_steps {
        if first == 0 || first > last {
            bail!("train.profile_steps [{first}, {last}]: steps count from 1 and the first comes before or is the last, e.g. [10, 12]");
        }
    }
    Ok(())
}

/// The ranks a run will have, and those on this node: the launcher's, or
/// the local workers `ft train` is about to start itself.
pub fn planned_ranks(config: &Config, env: &DistEnv) -> (usize, usize) {
    match env.source {
        EnvSource::SingleProcess => (config.launch.nproc_per_node, config.launch.nproc_per_node),
        _ => (env.world_size, env.local_world_size),
    }
}

/// Checks an expert-parallel `degree` (`train.expert_parallel`) against the
/// run's `world` and the model it trains (`RunModel::model`): a degree above
/// 1 must divide both the world size and the experts of a mixture of
/// experts; over a 4-bit base (QLoRA) each rank's experts of each fused
/// expert tensor must hold whole 4-bit blocks of the whole tensor, which a
/// rank holds as bitsandbytes blocks it (`PackedLayout::expert_part`).
pub fn check_expert_parallel(degree: usize, world: usize, model: &dyn crate::Model) -> Result<()> {
    if degree <= 1 {
        return Ok(());
    }
    let flag = format!("train.expert_parallel (--expert-parallel) {degree}");
    let Some(experts) = model.experts().map(|experts| experts.count) else {
        bail!("{flag}: model_type {} is not a mixture of experts, so it has no experts to split over ranks (leave it at 1)", model.model_type());
    };
    if world % degree != 0 {
        bail!("{flag} must divide the world size ({world} ranks) into groups that each hold every expert once");
    }
    if experts as usize % degree != 0 {
        bail!("{flag} must divide the model's {experts} experts, so that each rank of a group holds as many");
    }
    if let Some(quantization) = model.quantized_base() {
        let units = model.units();
        let split = crate::train::expert_units(model).into_iter().flat_map(|unit| &units[unit].params).filter(|param| model.held_in_4bit(param));
        for param in split {
            let blocksize = quantization.blocksize;
            if !crate::nf4::rows_hold_whole_blocks(&param.shape, degree as i64, blocksize) {
                let per_rank = param.numel() / degree as i64;
                bail!(
                    "{flag} with model.quantize (--quantize) {}: a rank's share of {} {:?} ({} of its {experts} experts) is {per_rank} values, not a whole number of 4-bit blocks of {blocksize} (model.quant_blocksize), so a block of the whole tensor would straddle two ranks; choose a degree or block size that divides it",
                    quantization.quant_type.name(),
                    param.hf_name,
                    param.shape,
                    experts as usize / degree
                );
            }
        }
    }
    Ok(())
}

/// The local workers a command started by no launcher starts itself
/// (`launch.nproc_per_node` above 1), becoming their launcher; None: this
/// process is the run's only rank, or one of a launcher's.
pub fn local_workers(config: &Config, env: &DistEnv) -> Option<usize> {
    (env.source == EnvSource::SingleProcess && config.launch.nproc_per_node > 1).then_some(config.launch.nproc_per_node)
}

/// Refuses `train.fp8` where this node's ranks would compute without float8
/// GEMMs (a CPU, a GPU before compute capability 8.9), before any rank
/// starts: the local workers `ft train` is about to start, or this rank.
pub fn check_float8_devices(config: &Config, env: &DistEnv) -> Result<()> {
    let Some(float8) = config.train.float8() else { return Ok(()) };
    let local_ranks = match env.source {
        EnvSource::SingleProcess => 0..config.launch.nproc_per_node,
        _ => env.local_rank..env.local_rank + 1,
    };
    for local_rank in local_ranks {
        crate::train::float8_serves(float8, config.train.device.device(local_rank)?)?;
    }
    Ok(())
}

/// Each key given that only acts with another (`REQUIRES`) has it.
pub fn check_given_keys(config: &Config) -> Result<()> {
    for (key, needs, what) in REQUIRES {
        if config.given(key) && !needs(config) {
            bail!("{key} is given, but {what}");
        }
    }
    Ok(())
}

/// LoRA's settings (`train.lora.*`) and the 4-bit base's (`model.quantize`,
/// which needs adapters): what `ft train` checks, and `ft plan` and `ft
/// bench --plan-check` before they predict for them.
pub fn check_adapters(config: &Config) -> Result<()> {
    let lora = &config.train.lora;
    if lora.enabled() || config.given("train.lora.r") {
        lora.validate()?;
    }
    if config.model.quantize != crate::config::Quantize::None {
        if !lora.enabled() {
            bail!("model.quantize (--quantize) holds a LoRA run's frozen base in 4 bits: set train.lora.r (--lora-r) to train adapters on it (a fully fine-tuned model cannot train in 4 bits)");
        }
        if !crate::nf4::BLOCKSIZES.contains(&config.model.quant_blocksize) {
            bail!("model.quant_blocksize is {}: bitsandbytes' 4-bit blocks hold one of {:?} values", config.model.quant_blocksize, crate::nf4::BLOCKSIZES);
        }
    }
    Ok(())
}

/// `base` as LoRA's keys given as `flags` make it (`train.lora.*`,
/// `model.quantize`), checked as `ft train` checks them: what `ft plan` and
/// `ft bench --plan-check` predict for.
pub fn run_model(base: Box<dyn crate::Model>, flags: &crate::config::Overrides) -> Result<crate::lora::RunModel> {
    let config = Config::load(None, &flags.0, &[])?;
    check_given_keys(&config)?;
    check_adapters(&config)?;
    crate::lora::RunModel::new(base, &config.train.lora, config.model.quantization())
}

/// Keys that only act with another: each, when given, needs its rule to
/// hold, else it would do nothing in silence.
#[allow(clippy::type_complexity)]
const REQUIRES: [(&str, fn(&Config) -> bool, &str); 12] = [
    ("model.quant_blocksize", |c| c.model.quantize != crate::config::Quantize::None, "model.quantize is none: set it (--quantize nf4|fp4) to hold the frozen base in 4 bits"),
    ("model.double_quant", |c| c.model.quantize != crate::config::Quantize::None, "model.quantize is none: set it (--quantize nf4|fp4) to hold the frozen base in 4 bits"),
    ("train.lora.alpha", |c| c.train.lora.enabled(), "LoRA is off: set train.lora.r (--lora-r) to train adapters"),
    ("train.lora.dropout", |c| c.train.lora.enabled(), "LoRA is off: set train.lora.r (--lora-r) to train adapters"),
    ("train.lora.targets", |c| c.train.lora.enabled(), "LoRA is off: set train.lora.r (--lora-r) to train adapters"),
    ("train.monitor_mode", |c| c.train.monitor.is_some(), "there is no train.monitor (the score it says the direction of)"),
    ("train.early_stopping_min_delta", |c| c.train.early_stopping_patience > 0, "train.early_stopping_patience is 0 (early stopping is off)"),
    ("train.warmup_ratio", |c| c.train.warmup_steps == 0, "train.warmup_steps is set too, and it takes precedence: give one"),
    ("train.fp8_emulate", |c| c.train.fp8 != crate::config::Fp8::Off, "float8 is off: set train.fp8 (--fp8 tensorwise|rowwise) to train with float8 linear layers"),
    ("train.fp8_gathers", |c| c.train.fp8 == crate::config::Fp8::Tensorwise, "float8 gathers cast each weight with one scale, which serves train.fp8=tensorwise (--fp8 tensorwise), and float8 is off or rowwise"),
    ("train.fp8_layers", |c| c.train.fp8 != crate::config::Fp8::Off, "float8 is off: set train.fp8 (--fp8 tensorwise|rowwise) to train with float8 linear layers"),
    (
        "train.fp8_calibration",
        |c| c.train.fp8 != crate::config::Fp8::Off && c.train.fp8_layers == crate::config::Fp8Layers::Auto,
        "it chooses float8's layers under train.fp8 (--fp8) with train.fp8_layers=auto, and float8 is off or train.fp8_layers=all casts every layer",
    ),
];

/// Makes the run's communication hook and asks it whether it serves a run
/// of `world` ranks, `per_node` on a node, as the run itself will (`ft
/// train --dry-run`); the line saying so. With `--strategy auto` the plan
/// picks the strategy from the model, so the run asks at its start.
pub fn check_comm_hook(config: &Config, registry: &Registry, world: usize, per_node: usize) -> Result<String> {
    let t = &config.train;
    if t.strategy == crate::distributed::strategy::AUTO {
        return Ok("communication: the hook is asked whether it serves the run when it starts (--strategy auto picks the strategy from the model)".into());
    }
    let strategy = (registry.strategy(&t.strategy)?.create)();
    let (hook, _) = registry.comm_hook(&config.comm, strategy.as_ref())?;
    let policy = strategy.policy();
    let shard_size = policy.shard_group_size(strategy.name(), world, per_node, t.shard_group_size)?;
    let offload = (registry.offload(&t.offload)?.create)().to_host();
    crate::distributed::comm_hook::check_serves(hook.as_ref(), &policy.comm_plan(strategy.name(), world, shard_size, offload))?;
    Ok(format!("communication: comm `{}` serves this run (its check accepts it)", hook.name()))
}

/// Readies CUDA, first thing in `main` (after the log, before any libtorch
/// call): has the caching allocator grow expandable segments unless the
/// user set PYTORCH_CUDA_ALLOC_CONF (variable-length batches fragment its
/// fixed ones; the ranks a command starts inherit it), then opens CUDA if
/// the host has GPUs. GPUs whose CUDA does not open are a warning: the
/// process goes on without them, and a run that asks for one is refused
/// with the reason.
pub fn prepare_cuda() {
    if std::env::var_os("PYTORCH_CUDA_ALLOC_CONF").is_none() {
        std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
    }
    if let Err(failed @ ft_sys::cuda::Unavailable::Failed(_)) = ft_sys::cuda::init() {
        tracing::warn!("{failed}; going on without the GPUs");
    }
}

/// Ends the process with `code` once everything of a command is dropped
/// (files written and closed, sinks and ranks finished): its output
/// flushed, without what `exit` would still do, libtorch's teardown —
/// unregistering its thousands of operators, finalizing the CUDA libraries
/// — a third of `ft list`'s CPU time on a CPU-only host, paid again by
/// every rank and launcher. The kernel frees it all at once.
pub fn exit_without_teardown(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: flushing C's streams (what libtorch may print) takes no
    // pointer but the null one meaning all; `_exit` ends the process.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

/// One worker process of a job: who it is, where it computes, in which
/// dtype, and its communicator.
pub struct Rank {
    pub comm: Communicator,
    pub device: Device,
    pub dtype: Kind,
}

impl Rank {
    /// Joins the job described by the launcher's environment, with the
    /// device, dtype and `dist.*` settings of `config`; `offload` gets its
    /// share of the cores for its host optimizer.
    pub fn start(config: &Config, offload: &dyn Offload) -> Result<Rank> {
        let env = DistEnv::from_env()?;
        let device = config.train.device.device(env.local_rank)?;
        share_host_cores(env.local_world_size, device, offload)?;
        let options = CommOptions {
            backend: backend_for(config.dist.backend, device)?,
            timeout: Duration::from_secs(config.dist.timeout_secs),
            verify_collectives: config.dist.verify_collectives,
            shared_memory: config.dist.shared_memory,
        };
        let comm = Communicator::init(env, &options)?;
        Ok(Rank { comm, device, dtype: config.train.dtype.kind(device) })
    }

    pub fn rank(&self) -> usize {
        self.comm.env().rank
    }

    /// Gives `offload`, when the plan chose it (`--strategy auto`) over the
    /// `configured` one, its host optimizer's share of the cores, as
    /// [`Rank::start`] gives an offloaded run.
    pub fn share_cores_with(&self, offload: &dyn Offload, configured: &dyn Offload) -> Result<()> {
        if offload.to_host() && !configured.to_host() {
            share_host_cores(self.comm.env().local_world_size, self.device, offload)?;
        }
        Ok(())
    }

    /// Rank 0 logs what the run trains: [`Rank::describe_run`], and a LoRA
    /// run's adapters and the 4-bit base they train on (a rank's share of
    /// the experts under `expert_parallel`).
    pub fn log_run(&self, task: &dyn crate::task::Task, run_model: &crate::lora::RunModel, expert_parallel: usize) {
        if self.rank() != 0 {
            return;
        }
        tracing::info!("{}", self.describe_run(task, run_model.model()));
        if let Some(lora) = run_model.lora() {
            tracing::info!("{}", lora.describe());
            if let Some(quantized) = lora.describe_quantized_base(self.dtype, expert_parallel) {
                tracing::info!("{quantized}");
            }
        }
    }

    /// A line saying what this job trains: the task, the model, the examples, the ranks, device and dtype.
    pub fn describe_run(&self, task: &dyn crate::task::Task, model: &dyn crate::Model) -> String {
        // On the CPU, ATen's threads a rank too: the host's cores shared, or OMP_NUM_THREADS.
        let threads = match self.device {
            Device::Cpu => format!(" ({} thread(s) a rank)", tch::get_num_threads()),
            _ => String::new(),
        };
        format!(
            "{}: a {:.1}M-parameter {} on {} examples, {} rank(s), {:?}{threads}, {:?}",
            task.name(),
            model.numel() as f64 / 1e6,
            model.model_type(),
            task.train_set().len(),
            self.world_size(),
            self.device,
            self.dtype
        )
    }

    pub fn world_size(&self) -> usize {
        self.comm.env().world_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_follow_the_device() {
        assert_eq!(backend_for(Backend::Auto, Device::Cpu).unwrap(), Backend::Gloo);
        assert_eq!(backend_for(Backend::Auto, Device::Cuda(0)).unwrap(), Backend::Nccl);
        assert!(backend_for(Backend::Nccl, Device::Cpu).unwrap_err().to_string().contains("needs a GPU"));
    }
}
