//! Training-step throughput and memory of one configuration (a model shape,
//! strategy, offload, batch and length), with random weights and the task's
//! random data: what `ft bench` runs in each configuration's workers
//! (`run_matrix`, `run_in_workers`: each in fresh ones). With `breakdown` it
//! also times the phases apart and checks ft's kernels against ATen's
//! (`kernels.rs`); `chart.rs` draws a matrix of rows.

pub mod chart;
mod kernels;

pub use kernels::KernelCheck;

use crate::{AdamW, Reduction};
use crate::device::synchronize;
use crate::distributed::comm_hook::CommHook;
use crate::distributed::flat::MemoryAccount;
use crate::distributed::parallel::DataParallel;
use crate::distributed::strategy::{ReduceDtype, ShardingStrategy};
use crate::metrics::process_memory;
use crate::model::{self, Model};
use crate::offload::Offload;
use crate::setup::Rank;
use crate::task::{Synthetic, Task, TaskRegistration};
use crate::train::{Kernels, MicroBatch, TrainOptions, Trainer, TrainerBuilder};
use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// One configuration's settings besides the model, strategy and offload.
#[derive(Debug, Clone)]
pub struct BenchCase {
    /// Examples per rank per step, of `seq` tokens.
    pub batch: i64,
    pub seq: i64,
    pub warmup: usize,
    pub steps: usize,
    pub shard_group_size: Option<usize>,
    pub reduce_dtype: ReduceDtype,
    /// Ranks that split a mixture of experts' experts (`train.expert_parallel`; 1: each holds them all).
    pub expert_parallel: usize,
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, the blocks recomputed (`train.checkpoint_layers`; None: all).
    pub checkpoint_layers: Option<usize>,
    pub loss_chunk_tokens: i64,
    /// On one GPU, time the phases apart and check ft's kernels against ATen's.
    pub breakdown: bool,
    /// Profile 3 more steps on rank 0 into this directory.
    pub profile: Option<PathBuf>,
    /// The blocks' linear layers in float8 (`--fp8`).
    pub float8: Option<ft_sys::float8::Float8>,
    /// Under tensorwise float8 with sharding, float8 blocks gathered as float8 (`--fp8-gathers`; None: the default, on).
    pub float8_gathers: Option<bool>,
}

/// One configuration's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub model: String,
    pub params: i64,
    pub strategy: String,
    /// The communication hook (rows written before it was recorded: the built-in).
    #[serde(default = "builtin_comm")]
    pub comm: String,
    pub offload: String,
    /// Rows written before it was recorded ran without.
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, the blocks recomputed (None: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_layers: Option<usize>,
    #[serde(default)]
    pub reduce_dtype: ReduceDtype,
    /// Rows written before it was recorded ran with 1.
    #[serde(default = "one")]
    pub expert_parallel: usize,
    pub gpus: usize,
    pub batch: i64,
    pub seq: i64,
    pub step_ms: f64,
    pub tokens_per_s_per_gpu: f64,
    /// None where the GPU's peak is unknown (and on a CPU).
    pub mfu: Option<f64>,
    /// The largest peak over the ranks (CUDA allocator; process RSS on CPU).
    pub peak_allocated_gb: f64,
    pub peak_reserved_gb: f64,
    /// Step time beyond the same shape on one GPU (None without that row).
    pub exposed_comm_ms: Option<f64>,
    /// What rank 0 holds between steps.
    pub state: MemoryAccount,
    /// Bytes rank 0 sent in collectives per timed step (absent from rows written before it was counted).
    #[serde(default)]
    pub comm_bytes_per_step: f64,
    /// On one GPU with a communication hook: the milliseconds per step its
    /// reductions and gathers of every unit take beyond the built-in's
    /// (compression and decompression; `hook_cost`).
    #[serde(default)]
    pub comm_hook_ms: Option<f64>,
    pub loss: f64,
    /// forward+backward, head loss, optimizer (ms), with `breakdown` on one GPU.
    pub breakdown_ms: Option<[f64; 3]>,
    /// With `breakdown` on a GPU: ft's kernels against ATen's ops on the same inputs.
    #[serde(default)]
    pub kernel_check: Option<KernelCheck>,
    pub error: Option<String>,
}

fn one() -> usize {
    1
}

fn builtin_comm() -> String {
    crate::distributed::comm_hook::BUILTIN.into()
}

impl Row {
    /// The row of a configuration that did not run.
    pub fn failed(model: &str, strategy: &str, comm: &str, offload: &str, case: &BenchCase, gpus: usize, error: String) -> Row {
        Row {
            model: model.into(),
            params: 0,
            strategy: strategy.into(),
            comm: comm.into(),
            offload: offload.into(),
            activation_checkpointing: case.activation_checkpointing,
            checkpoint_layers: case.checkpoint_layers,
            reduce_dtype: case.reduce_dtype,
            expert_parallel: case.expert_parallel,
            gpus,
            batch: case.batch,
            seq: case.seq,
            step_ms: f64::NAN,
            tokens_per_s_per_gpu: f64::NAN,
            mfu: None,
            peak_allocated_gb: f64::NAN,
            peak_reserved_gb: f64::NAN,
            exposed_comm_ms: None,
            state: MemoryAccount::default(),
            comm_bytes_per_step: f64::NAN,
            comm_hook_ms: None,
            loss: f64::NAN,
            breakdown_ms: None,
            kernel_check: None,
            error: Some(error),
        }
    }
}

impl Row {
    /// One line for the log as the row comes in.
    pub fn describe(&self) -> String {
        let row = self;
        match &row.error {
            Some(e) => format!("{} {} x{} batch {}x{}: FAILED: {e}", row.model, row.strategy, row.gpus, row.batch, row.seq),
            None => format!(
                "{} {} x{} batch {}x{}: {:.0} tokens/s/GPU, {:.1} ms/step, MFU {}, peak {:.1} GB{}",
                row.model,
                row.strategy,
                row.gpus,
                row.batch,
                row.seq,
                row.tokens_per_s_per_gpu,
                row.step_ms,
                row.mfu.map_or("n/a".into(), |m| format!("{:.1}%", m * 100.0)),
                row.peak_allocated_gb,
                row.breakdown_ms.map_or(String::new(), |[fb, head, step]| format!(
                    "; forward+backward {fb:.1} ms (head loss {head:.1}), optimizer {step:.1} ms"
                )) + &row.comm_hook_ms.map_or(String::new(), |ms| format!(
                    "; comm {} costs {ms:.2} ms per step beyond the built-in ({:.1}% of the step)", row.comm, 100.0 * ms / row.step_ms
                )) + &row.kernel_check.as_ref().map_or(String::new(), KernelCheck::describe)
            ),
        }
    }
}

/// The matrix as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "\n| model | strategy | offload | GPUs | batch x seq | tokens/s/GPU | step ms | MFU | peak alloc GB | peak reserved GB | comm exposed ms | sent MB/step | held GB (params/grads/optim) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        if let Some(e) = &r.error {
            out += &format!("| {} | {} | {} | {} | {}x{} | failed: {} |\n", r.model, r.strategy, r.offload, r.gpus, r.batch, r.seq, e.lines().next().unwrap_or(""));
            continue;
        }
        out += &format!(
            "| {} | {}{}{} | {} | {} | {}x{} | {:.0} | {:.1} | {} | {:.2} | {:.2} | {} | {:.1} | {:.2}/{:.2}/{:.2} |\n",
            r.model,
            r.strategy,
            if r.comm == crate::distributed::comm_hook::BUILTIN { String::new() } else { format!(" + {}", r.comm) },
            if r.reduce_dtype == ReduceDtype::Compute { " (reduce in compute dtype)" } else { "" },
            r.offload,
            r.gpus,
            r.batch,
            r.seq,
            r.tokens_per_s_per_gpu,
            r.step_ms,
            r.mfu.map_or("n/a".into(), |m| format!("{:.1}%", m * 100.0)),
            r.peak_allocated_gb,
            r.peak_reserved_gb,
            r.exposed_comm_ms.map_or("—".into(), |ms| format!("{ms:.1}")),
            r.comm_bytes_per_step / 1e6,
            r.state.params / 1e9,
            r.state.grads / 1e9,
            r.state.optimizer_state / 1e9
        );
    }
    out
}

/// How rows name a model: "opt 1315.8M".
pub fn model_label(model: &dyn Model) -> String {
    format!("{} {:.1}M", model.model_type(), model.numel() as f64 / 1e6)
}

/// `count` training steps over the task's batches in turn; the last step's loss.
fn run_steps(trainer: &mut Trainer, task: &dyn Task, batches: &[crate::dataset::Batch], normalizer: f64, count: usize) -> Result<f64> {
    let mut last = None;
    for step in 0..count {
        let loss = trainer.forward_backward(&batches[step % batches.len()], task.objective(), normalizer, MicroBatch::ONLY)?;
        let _grad_norm = trainer.step(1e-5)?;
        last = Some(loss);
    }
    Ok(last.map_or(f64::NAN, |l| l.double_value(&[])))
}

/// Runs `case` on this rank (collective: every rank of the configuration
/// calls it); rank 0 gets the row. libtorch's errors (a batch too large
/// for memory, above all) are errors.
pub fn run_case(
    rank: &Rank,
    model: &dyn Model,
    task: &TaskRegistration,
    strategy: &dyn ShardingStrategy,
    hook: Box<dyn CommHook>,
    offload: &dyn Offload,
    case: &BenchCase,
) -> Result<Option<Row>> {
    for (flag, value) in [("--batch", case.batch), ("--seq", case.seq), ("--loss-chunk-tokens", case.loss_chunk_tokens)] {
        ensure!(value >= 1, "{flag} {value}: it must be at least 1");
    }
    crate::panic::libtorch_errors("the benchmark", || measure(rank, model, task, strategy, hook, offload, case))?
}

fn measure(
    rank: &Rank,
    model: &dyn Model,
    task: &TaskRegistration,
    strategy: &dyn ShardingStrategy,
    hook: Box<dyn CommHook>,
    offload: &dyn Offload,
    case: &BenchCase,
) -> Result<Option<Row>> {
    let (comm, device, dtype) = (&rank.comm, rank.device, rank.dtype);
    let world = rank.world_size();
    crate::setup::check_expert_parallel(case.expert_parallel, world, model)?;
    let parallel = DataParallel::new(comm, strategy, case.shard_group_size, case.reduce_dtype, dtype, case.expert_parallel)?;
    // On one rank nothing is communicated, so there is nothing to refuse.
    if world > 1 {
        hook.check(&parallel.policy.comm_plan(strategy.name(), world, parallel.shard_size, offload.to_host()))
            .map_err(|e| anyhow::anyhow!("comm `{}` cannot serve this configuration: {e:#}", hook.name()))?;
    }
    let comm_name = hook.name().to_string();
    // One rank reduces nothing, so time the hook's work on every unit apart.
    let mut hook = hook;
    let comm_hook_ms = (world == 1 && comm_name != crate::distributed::comm_hook::BUILTIN)
        .then(|| hook_cost(hook.as_mut(), comm.world(), model, dtype, case.reduce_dtype.kind(dtype), device))
        .transpose()?;
    let options = TrainOptions {
        dtype,
        adamw: AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
        max_grad_norm: Some(1.0),
        activation_checkpointing: case.activation_checkpointing,
        checkpoint_layers: case.checkpoint_layers,
        seed: 0,
        float8: case.float8,
        float8_gathers: case.float8_gathers,
        ..TrainOptions::default()
    };
    // Made a unit at a time as the trainer places them (a 70B model's fp32 weights fit no GPU whole).
    let units = model.units();
    tch::manual_seed(0);
    let params = |unit: usize| Ok(units[unit].params.iter().map(|spec| spec.initial(Kind::Float, device)).collect());
    let mut trainer = TrainerBuilder::new(model, options).data_parallel(&parallel).comm(hook).offload(offload).build(params)?;
    // Four micro-batches of random data per rank, each rank its own.
    let synthetic = Synthetic {
        model,
        examples: 4 * case.batch as usize,
        seq: case.seq,
        seed: 1 + rank.rank() as i64,
        device,
        loss_chunk_tokens: case.loss_chunk_tokens,
    };
    let task = (task.synthetic)(&synthetic)?;
    let data = task.train_set();
    let chunks: Vec<Vec<usize>> = (0..data.len()).collect::<Vec<_>>().chunks(case.batch as usize).map(<[usize]>::to_vec).collect();
    let batches = chunks.iter().map(|indices| data.collate(indices, device)).collect::<Result<Vec<_>>>()?;
    // Every rank's micro-batch is a share of one global batch.
    let normalizer = (chunks[0].iter().map(|&i| data.loss_weight(i)).sum::<usize>() * world) as f64;

    run_steps(&mut trainer, task.as_ref(), &batches, normalizer, case.warmup)?;
    synchronize(device);
    if let Device::Cuda(index) = device {
        crate::cuda_memory(index, true).map_err(anyhow::Error::msg)?;
    }
    let (start, sent_before) = (Instant::now(), comm.bytes_sent());
    let loss = run_steps(&mut trainer, task.as_ref(), &batches, normalizer, case.steps)?;
    synchronize(device);
    let step_seconds = start.elapsed().as_secs_f64() / case.steps.max(1) as f64;
    let sent: u64 = comm.bytes_sent().iter().zip(sent_before).map(|(after, before)| after - before).sum();
    let (allocated, reserved) = match device {
        Device::Cuda(index) => {
            let m = crate::cuda_memory(index, false).map_err(anyhow::Error::msg)?;
            (m.peak_allocated as f64, m.peak_reserved as f64)
        }
        _ => process_memory().map_or((0.0, 0.0), |(_, peak)| (peak as f64, peak as f64)),
    };
    let mut peaks = Tensor::from_slice(&[allocated, reserved]).to_device(comm.device());
    comm.world().all_reduce(&mut peaks, Reduction::Max)?.wait()?;
    let peaks = Vec::<f64>::try_from(peaks.to_device(Device::Cpu))?;
    let breakdown = (case.breakdown && world == 1).then(|| time_phases(&mut trainer, task.as_ref(), &batches[0], normalizer)).transpose()?;
    let kernel_check = (case.breakdown && trainer.kernels() == Kernels::Ft && model.head_kind() == model::head::CAUSAL_LM)
        .then(|| kernels::check(&trainer, &batches[0], normalizer, case.loss_chunk_tokens))
        .transpose()?;
    if let Some(dir) = &case.profile {
        let label = format!("{}-{}-{}gpu-{}x{}", model.model_type(), strategy.name(), world, case.batch, case.seq);
        let mut steps = |count| run_steps(&mut trainer, task.as_ref(), &batches, normalizer, count);
        profile_steps(dir, &label, rank.rank() == 0, device.is_cuda(), &mut steps)?;
    }
    let tokens_per_s_per_gpu = (case.batch * case.seq) as f64 / step_seconds;
    let peak_flops = match device {
        Device::Cuda(index) => crate::gpu::peak_flops(index, dtype),
        _ => None,
    };
    let row = Row {
        model: model_label(model),
        params: model.numel(),
        strategy: strategy.name().into(),
        comm: comm_name,
        offload: offload.name().into(),
        activation_checkpointing: case.activation_checkpointing,
        checkpoint_layers: case.checkpoint_layers,
        reduce_dtype: case.reduce_dtype,
        expert_parallel: case.expert_parallel,
        gpus: world,
        batch: case.batch,
        seq: case.seq,
        step_ms: step_seconds * 1e3,
        tokens_per_s_per_gpu,
        mfu: peak_flops.map(|peak| model.train_flops_per_token(case.seq) * tokens_per_s_per_gpu / peak),
        peak_allocated_gb: peaks[0] / 1e9,
        peak_reserved_gb: peaks[1] / 1e9,
        exposed_comm_ms: None,
        state: trainer.memory(),
        comm_bytes_per_step: sent as f64 / case.steps.max(1) as f64,
        comm_hook_ms,
        loss,
        breakdown_ms: breakdown,
        kernel_check,
        error: None,
    };
    comm.world().barrier()?.wait()?;
    Ok((rank.rank() == 0).then_some(row))
}

/// Milliseconds per step that `hook` spends beyond the built-in
/// collectives on `model`'s gradients (one reduction per unit, in
/// `reduce` dtype) and parameters (one gather per unit, in `dtype`) over
/// `group`: on one rank, its compression and decompression. Each is timed
/// after warm-up (a hook's state is made on first use) as the median of 5.
pub fn hook_cost(hook: &mut dyn CommHook, group: &crate::ProcessGroup, model: &dyn Model, dtype: Kind, reduce: Kind, device: Device) -> Result<f64> {
    use crate::distributed::comm_hook::{Builtin, GatherPhase, GradReduce, ParamGather, ReduceStage, UnitInfo, Wire, WireRequest, Workspace};
    let _no_grad = tch::no_grad_guard();
    let units: Vec<UnitInfo> = model.units().iter().map(|spec| UnitInfo::new(spec, crate::distributed::flat::param_offsets(spec), spec.numel())).collect();
    let grads: Vec<Tensor> = units.iter().map(|u| Tensor::randn([u.padded], (reduce, device))).collect();
    let shards: Vec<Tensor> = units.iter().map(|u| Tensor::randn([u.padded], (dtype, device))).collect();
    // Past any warm-up the hook keeps exact (PowerSGD's start_iter).
    let step = usize::MAX / 2;
    let one_step = |hook: &mut dyn CommHook| -> Result<f64> {
        synchronize(device);
        let start = Instant::now();
        let workspace = Workspace::default();
        for ((unit, grad), shard) in units.iter().zip(&grads).zip(&shards) {
            let (input, output) = (grad.copy(), shard.empty_like());
            workspace
                .issue(hook, unit, &WireRequest { wire: Wire::Reduce(ReduceStage::World), elements: unit.padded, dtype: reduce, group_size: group.size() }, device, |hook, workspace| {
                    let (stage, offset, accumulated, seed) = (ReduceStage::World, 0, true, 0);
                    hook.reduce(GradReduce { unit, stage, group, input: input.shallow_clone(), offset, output: input, accumulated, step, seed, workspace })
                })?
                .wait()?;
            workspace
                .issue(hook, unit, &WireRequest { wire: Wire::Gather, elements: unit.padded, dtype, group_size: group.size() }, device, |hook, workspace| {
                    let shard = shard.shallow_clone();
                    hook.gather(ParamGather { unit, phase: GatherPhase::Forward, group, shard, output, step, seed: 0, workspace })
                })?
                .wait()?;
        }
        synchronize(device);
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let median = |hook: &mut dyn CommHook| -> Result<f64> {
        one_step(hook)?;
        let mut times = (0..5).map(|_| one_step(hook)).collect::<Result<Vec<f64>>>()?;
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    };
    let hooked = median(hook)?;
    let builtin = median(&mut Builtin)?;
    Ok((hooked - builtin).max(0.0))
}

/// Milliseconds per call of forward+backward, of the objective's loss and
/// gradients alone on the same batch's head outputs, and of the optimizer
/// step, each timed between synchronisations.
fn time_phases(trainer: &mut Trainer, task: &dyn Task, batch: &crate::dataset::Batch, normalizer: f64) -> Result<[f64; 3]> {
    const REPEATS: usize = 5;
    let device = batch.inputs.input_ids.device();
    let (mut forward_backward, mut step) = (0.0, 0.0);
    for _ in 0..REPEATS {
        synchronize(device);
        let start = Instant::now();
        let _loss = trainer.forward_backward(batch, task.objective(), normalizer, MicroBatch::ONLY)?;
        synchronize(device);
        forward_backward += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let _grad_norm = trainer.step(1e-5)?;
        synchronize(device);
        step += start.elapsed().as_secs_f64();
    }
    let model = trainer.model();
    let params = trainer.compute_params()?;
    let outputs = tch::no_grad(|| -> Result<Vec<Tensor>> {
        let ctx = model.context(&batch.inputs, 0, trainer.units()[0].compute_kind(), false)?;
        Ok(model::forward(model, &params, &batch.inputs, &ctx, None))
    })?;
    synchronize(device);
    let start = Instant::now();
    for _ in 0..REPEATS {
        let _loss_and_grads = task.objective().loss_and_grads(&outputs, batch, normalizer, None)?;
    }
    synchronize(device);
    let head = start.elapsed().as_secs_f64();
    let ms = |seconds: f64| seconds / REPEATS as f64 * 1e3;
    Ok([ms(forward_backward), ms(head), ms(step)])
}

/// Runs 3 steps under PyTorch's profiler (on the rank that `records`; the
/// others run the same steps so collectives match) and prints the top kernels.
fn profile_steps(dir: &std::path::Path, label: &str, records: bool, cuda: bool, steps: &mut dyn FnMut(usize) -> Result<f64>) -> Result<()> {
    const STEPS: usize = 3;
    if !records {
        steps(STEPS)?;
        return Ok(());
    }
    crate::profile::start(cuda)?;
    let result = steps(STEPS);
    let report = crate::profile::stop(dir, label, cuda, STEPS)?;
    result?;
    eprint!("{label}: {}", report.top(20));
    Ok(())
}

/// One configuration of `ft bench`'s matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Configuration {
    pub model: String,
    pub strategy: String,
    /// The communication hook; None: the strategy's own collectives.
    pub comm: Option<String>,
    pub gpus: usize,
    /// Examples per micro-batch, of `seq` tokens.
    pub batch: i64,
    pub seq: i64,
}

/// Every configuration of models × batches × lengths × GPU counts ×
/// strategies × hooks (none given: each strategy's own collectives), in that order.
pub fn matrix(models: &[String], batches: &[i64], seqs: &[i64], gpus: &[usize], strategies: &[String], comms: &[String]) -> Vec<Configuration> {
    let comms: Vec<Option<String>> = if comms.is_empty() { vec![None] } else { comms.iter().cloned().map(Some).collect() };
    let mut configurations = vec![];
    for model in models {
        for &batch in batches {
            for &seq in seqs {
                for &gpus in gpus {
                    for strategy in strategies {
                        for comm in &comms {
                            configurations.push(Configuration { model: model.clone(), strategy: strategy.clone(), comm: comm.clone(), gpus, batch, seq });
                        }
                    }
                }
            }
        }
    }
    configurations
}

/// Runs each configuration with `run`, given the file its row goes to (in
/// a scratch directory removed after), each row reported on stderr as it
/// comes; a configuration that fails becomes a failed row (its settings from
/// `case`), so one failure does not lose the others' rows.
pub fn run_matrix(configurations: &[Configuration], offload: &str, case: impl Fn(&Configuration) -> BenchCase, mut run: impl FnMut(&Configuration, &Path) -> Result<Row>) -> Result<Vec<Row>> {
    let mut rows: Vec<Row> = vec![];
    let scratch = std::env::temp_dir().join(format!("ft-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    for one in configurations {
        let result = scratch.join(format!("row-{}.json", rows.len()));
        let row = run(one, &result).unwrap_or_else(|e| {
            let comm = one.comm.as_deref().unwrap_or(crate::distributed::comm_hook::BUILTIN);
            Row::failed(&one.model, &one.strategy, comm, offload, &case(one), one.gpus, format!("{e:#}"))
        });
        eprintln!("{}", row.describe());
        rows.push(row);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(rows)
}

/// Runs one configuration in `gpus` fresh local workers (`ft bench
/// --worker FILE`, with `plugins`), so its memory figures are its own:
/// `arguments` go to them as JSON in a file beside `result`, where their
/// rank 0 writes its row, read back here.
pub fn run_in_workers(arguments: &impl Serialize, gpus: usize, plugins: &[PathBuf], result: &Path) -> Result<Row> {
    let file = result.with_extension("args.json");
    std::fs::write(&file, serde_json::to_string(arguments)?).with_context(|| format!("cannot write {}", file.display()))?;
    let mut argv: Vec<String> = plugins.iter().flat_map(|p| ["--plugin".to_string(), p.display().to_string()]).collect();
    argv.extend(["bench".into(), "--worker".into(), file.display().to_string()]);
    // New processes, not forks: each worker's memory figures are its own.
    let program = std::env::current_exe().context("cannot find the ft executable")?;
    let code = crate::distributed::launch::spawn_local(gpus, crate::distributed::launch::Work::Exec { program, arguments: argv })?;
    ensure!(code == 0, "workers exited with code {code} (their output is above)");
    let text = std::fs::read_to_string(result).with_context(|| format!("rank 0 wrote no result to {}", result.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// A worker's arguments, as [`run_in_workers`] wrote them to `file`.
pub fn worker_arguments<T: serde::de::DeserializeOwned>(file: &Path) -> Result<T> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Writes `rows` as JSON to `json` (what [`read_rows`] reads back) and
/// their chart to `chart`, each where given.
pub fn save(rows: &[Row], json: Option<&std::path::Path>, chart: Option<&std::path::Path>) -> Result<()> {
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(rows)?).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = chart {
        chart::write(rows, path)?;
    }
    Ok(())
}

/// The rows saved by `ft bench --json` in `paths`, in order.
pub fn read_rows(paths: &[PathBuf]) -> Result<Vec<Row>> {
    let mut rows = vec![];
    for path in paths {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        rows.extend(serde_json::from_str::<Vec<Row>>(&text).with_context(|| format!("{} is not `ft bench --json` output", path.display()))?);
    }
    Ok(rows)
}

/// Exposed communication: step time beyond the same model/batch/length on one GPU.
pub fn fill_exposed_comm(rows: &mut [Row]) {
    let single: Vec<(String, i64, i64, String, f64)> = rows
        .iter()
        .filter(|r| r.gpus == 1 && r.error.is_none())
        .map(|r| (r.model.clone(), r.batch, r.seq, r.offload.clone(), r.step_ms))
        .collect();
    for row in rows.iter_mut().filter(|r| r.gpus > 1 && r.error.is_none()) {
        row.exposed_comm_ms = single
            .iter()
            .find(|(m, b, s, o, _)| *m == row.model && *b == row.batch && *s == row.seq && *o == row.offload)
            .map(|(.., one)| (row.step_ms - one).max(0.0));
    }
}
