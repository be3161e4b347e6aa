//! `ft bench`: training-step throughput and memory over a matrix of model
//! shapes × strategies × GPU counts × batch × sequence length, with random
//! weights of the real shapes and random tokens. The command launches its own
//! workers for each configuration (a fresh process group, so memory figures
//! are the configuration's own), collects rank 0's row, and prints one table
//! (and JSON). Exposed communication is a configuration's step time minus the
//! same model, batch and length on one GPU.

use crate::model_commands::read_config_arg;
use anyhow::{bail, Context, Result};
use clap::Args;
use ft_core::fit::ShardGroups;
use ft_core::model::Inputs;
use ft_core::flat::MemoryAccount;
use ft_core::strategy::ReduceDtype;
use ft_core::train::{lm_head_loss_and_grads, Kernels, TrainOptions, Trainer};
use ft_core::setup::{DType, DeviceSpec, Rank};
use ft_core::{AdamW, Config, Reduction, Registry};
use ft_models::{hf, init};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Dense bf16 peak of an H100/H200 SXM, the denominator of MFU.
const PEAK_FLOPS: f64 = 989e12;

#[derive(Args)]
pub struct BenchArgs {
    /// config.json, a model directory, or a hub id in the local cache; repeat for several models.
    #[arg(long = "config", required_unless_present = "from_json")]
    configs: Vec<String>,
    /// Override config keys of every model, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Strategies to compare (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "ddp")]
    strategy: Vec<String>,
    /// GPU (or, with --device cpu, process) counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    gpus: Vec<usize>,
    /// Micro-batch sizes per GPU (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    batch: Vec<i64>,
    /// Sequence lengths (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    seq: Vec<i64>,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Compute dtype (masters stay fp32).
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// cuda, cpu (Gloo), or auto (the GPU when there is one).
    #[arg(long, default_value = "cuda")]
    device: DeviceSpec,
    /// none or cpu.
    #[arg(long, default_value = "none")]
    offload: String,
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// dtype gradients are reduced in: fp32 (exact sums, FSDP2's reduce_dtype=float32) or compute.
    #[arg(long, default_value = "fp32")]
    reduce_dtype: String,
    #[arg(long)]
    activation_checkpointing: bool,
    #[arg(long, default_value_t = 1024)]
    loss_chunk_tokens: i64,
    /// On one GPU, also time the phases apart (synchronising between them):
    /// forward+backward, the LM head's loss alone, the optimizer step.
    #[arg(long)]
    breakdown: bool,
    /// Profile 3 more steps of each configuration on rank 0 with PyTorch's
    /// profiler: a Chrome trace (chrome://tracing, Perfetto) and the GPU time per
    /// kernel in this directory, and the top kernels on stderr.
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
    /// Write the rows as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a PNG chart of tokens/s and peak memory per configuration.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Run nothing: print the table and draw the chart of rows saved with --json (repeatable).
    #[arg(long, value_name = "ROWS_JSON")]
    from_json: Vec<PathBuf>,
    /// Set on the workers `ft bench` launches: where rank 0 writes its row.
    #[arg(long, hide = true)]
    result_file: Option<PathBuf>,
}

/// ft's CUDA kernels beside ATen's ops on the same random inputs: the LM
/// head (this model's vocabulary and width) and AdamW (64M parameters).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KernelCheck {
    pub head_ft_ms: f64,
    pub head_aten_ms: f64,
    /// |loss_ft − loss_aten| / |loss_aten|.
    pub head_loss_relative_diff: f64,
    /// max |g_ft − g_aten| / max |g_aten| over the hidden states' and the weight's gradients.
    pub head_grad_relative_diff: f64,
    pub adamw_ft_ms: f64,
    pub adamw_aten_ms: f64,
    /// max |p_ft − p_aten| / max |p_aten − p_before| after one step: the
    /// difference relative to the update itself.
    pub adamw_update_relative_diff: f64,
}

/// One configuration's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub model: String,
    pub params: i64,
    pub strategy: String,
    pub offload: String,
    #[serde(default)]
    pub reduce_dtype: ReduceDtype,
    pub gpus: usize,
    pub batch: i64,
    pub seq: i64,
    pub step_ms: f64,
    pub tokens_per_s_per_gpu: f64,
    pub mfu: f64,
    /// The largest peak over the ranks (CUDA allocator; process RSS on CPU).
    pub peak_allocated_gb: f64,
    pub peak_reserved_gb: f64,
    /// Step time beyond the same shape on one GPU (None without that row).
    pub exposed_comm_ms: Option<f64>,
    /// What rank 0 holds between steps.
    pub state: MemoryAccount,
    pub loss: f64,
    /// forward+backward, LM head, optimizer (ms), with --breakdown on one GPU.
    pub breakdown_ms: Option<[f64; 3]>,
    /// With --breakdown on a GPU: ft's kernels against ATen's ops on the same inputs.
    #[serde(default)]
    pub kernel_check: Option<KernelCheck>,
    pub error: Option<String>,
}

pub fn run(args: BenchArgs, plugins: &[PathBuf]) -> Result<i32> {
    if let Some(result_file) = &args.result_file {
        return worker(&args, plugins, result_file);
    }
    let reduce_dtype = parse_reduce_dtype(&args.reduce_dtype)?;
    if !args.from_json.is_empty() {
        let mut rows: Vec<Row> = vec![];
        for path in &args.from_json {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            rows.extend(serde_json::from_str::<Vec<Row>>(&text).with_context(|| format!("{} is not `ft bench --json` output", path.display()))?);
        }
        return report(&args, rows);
    }
    let mut rows: Vec<Row> = vec![];
    let scratch = std::env::temp_dir().join(format!("ft-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    for config in &args.configs {
        for &batch in &args.batch {
            for &seq in &args.seq {
                for &gpus in &args.gpus {
                    for strategy in &args.strategy {
                        let result = scratch.join(format!("row-{}.json", rows.len()));
                        let row = launch_one(&args, plugins, config, strategy, gpus, batch, seq, &result)
                            .unwrap_or_else(|e| failed_row(config, strategy, &args.offload, reduce_dtype, gpus, batch, seq, format!("{e:#}")));
                        eprintln!("{}", describe(&row));
                        rows.push(row);
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    report(&args, rows)
}

/// The table, and the JSON and chart when asked for; fails when a configuration did.
fn report(args: &BenchArgs, mut rows: Vec<Row>) -> Result<i32> {
    fill_exposed_comm(&mut rows);
    print!("{}", table(&rows));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.chart {
        crate::chart::write(&rows, path)?;
    }
    Ok(if rows.iter().any(|r| r.error.is_some()) { 1 } else { 0 })
}

/// Runs one configuration in `gpus` fresh worker processes and reads rank 0's row.
#[allow(clippy::too_many_arguments)]
fn launch_one(args: &BenchArgs, plugins: &[PathBuf], config: &str, strategy: &str, gpus: usize, batch: i64, seq: i64, result: &Path) -> Result<Row> {
    let mut argv: Vec<String> = plugins.iter().flat_map(|p| ["--plugin".to_string(), p.display().to_string()]).collect();
    argv.extend(["bench", "--config", config, "--strategy", strategy].map(String::from));
    for (flag, value) in [
        ("--gpus", gpus.to_string()),
        ("--batch", batch.to_string()),
        ("--seq", seq.to_string()),
        ("--warmup", args.warmup.to_string()),
        ("--steps", args.steps.to_string()),
        ("--dtype", args.dtype.to_string()),
        ("--device", args.device.to_string()),
        ("--offload", args.offload.clone()),
        ("--loss-chunk-tokens", args.loss_chunk_tokens.to_string()),
        ("--reduce-dtype", args.reduce_dtype.clone()),
        ("--result-file", result.display().to_string()),
    ] {
        argv.extend([flag.to_string(), value]);
    }
    for set in &args.overrides {
        argv.extend(["--set".to_string(), set.clone()]);
    }
    if let Some(size) = args.shard_group_size {
        argv.extend(["--shard-group-size".to_string(), size.to_string()]);
    }
    if args.activation_checkpointing {
        argv.push("--activation-checkpointing".into());
    }
    if args.breakdown {
        argv.push("--breakdown".into());
    }
    if let Some(dir) = &args.profile {
        argv.extend(["--profile".to_string(), dir.display().to_string()]);
    }
    let code = crate::launch::spawn_local(gpus, argv)?;
    if code != 0 {
        bail!("workers exited with code {code} (their output is above)");
    }
    let text = std::fs::read_to_string(result).with_context(|| format!("rank 0 wrote no result to {}", result.display()))?;
    Ok(serde_json::from_str(&text)?)
}

#[allow(clippy::too_many_arguments)]
fn failed_row(config: &str, strategy: &str, offload: &str, reduce_dtype: ReduceDtype, gpus: usize, batch: i64, seq: i64, error: String) -> Row {
    Row {
        model: config.into(),
        params: 0,
        strategy: strategy.into(),
        offload: offload.into(),
        reduce_dtype,
        gpus,
        batch,
        seq,
        step_ms: f64::NAN,
        tokens_per_s_per_gpu: f64::NAN,
        mfu: f64::NAN,
        peak_allocated_gb: f64::NAN,
        peak_reserved_gb: f64::NAN,
        exposed_comm_ms: None,
        state: MemoryAccount::default(),
        loss: f64::NAN,
        breakdown_ms: None,
        kernel_check: None,
        error: Some(error),
    }
}

fn parse_reduce_dtype(text: &str) -> Result<ReduceDtype> {
    serde_json::from_value(serde_json::Value::from(text)).map_err(|_| anyhow::anyhow!("--reduce-dtype {text:?}: expected fp32 or compute"))
}

/// One configuration, run by each of its workers.
fn worker(args: &BenchArgs, plugins: &[PathBuf], result_file: &Path) -> Result<i32> {
    let single = |name: &str, count: usize| if count == 1 { Ok(()) } else { Err(anyhow::anyhow!("a bench worker takes one {name}")) };
    single("--config", args.configs.len())?;
    single("--strategy", args.strategy.len())?;
    single("--batch", args.batch.len())?;
    single("--seq", args.seq.len())?;
    let (batch, seq) = (args.batch[0], args.seq[0]);
    let registry = Registry::with_plugins(plugins)?;
    let strategy = (registry.strategy(&args.strategy[0])?.create)();
    let offload = (registry.offload(&args.offload)?.create)();
    // dist.* from FT_DIST__* variables, like every other command.
    let config = Config::load(None, &[("train.device", args.device.to_string().into()), ("train.dtype", args.dtype.to_string().into())])?;
    let Rank { comm, device, dtype } = Rank::start(&config, offload.to_host())?;
    let (rank, world) = (comm.env().rank, comm.env().world_size);
    let groups = ShardGroups::new(strategy.as_ref(), args.shard_group_size, &comm)?;
    let reduce_dtype = parse_reduce_dtype(&args.reduce_dtype)?;
    let parallel = groups.parallel(strategy.as_ref(), &comm, reduce_dtype, dtype);
    let config = crate::model_commands::apply_overrides(read_config_arg(&args.configs[0])?, &args.overrides)?;
    let model = hf::model_from_config(config)?;
    let params = init::init_params(model.as_ref(), 0, Kind::Float, device);
    let options = TrainOptions {
        dtype,
        adamw: AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: args.loss_chunk_tokens,
        activation_checkpointing: args.activation_checkpointing,
        seed: 0,
        offload_to_host: offload.to_host(),
        ..TrainOptions::default()
    };
    let mut trainer = Trainer::with_parallel(model.as_ref(), &params, options, parallel)?;
    drop(params);
    tch::manual_seed(1 + rank as i64);
    let vocab = model.dims().vocab;
    let batches: Vec<Tensor> = (0..4).map(|_| Tensor::randint(vocab, [batch, seq], (Kind::Int64, device))).collect();
    // Every rank's micro-batch is a share of one global batch.
    let normalizer = (batch * (seq - 1) * world as i64) as f64;
    let synchronize = || {
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
    };
    run_steps(&mut trainer, &batches, normalizer, args.warmup)?;
    synchronize();
    if let Device::Cuda(index) = device {
        ft_core::cuda_memory(index, true).map_err(anyhow::Error::msg)?;
    }
    let start = Instant::now();
    let loss = run_steps(&mut trainer, &batches, normalizer, args.steps)?;
    synchronize();
    let step_seconds = start.elapsed().as_secs_f64() / args.steps as f64;
    let (allocated, reserved) = match device {
        Device::Cuda(index) => {
            let m = ft_core::cuda_memory(index, false).map_err(anyhow::Error::msg)?;
            (m.peak_allocated as f64, m.peak_reserved as f64)
        }
        _ => ft_core::metrics::process_memory().map_or((0.0, 0.0), |(_, peak)| (peak as f64, peak as f64)),
    };
    let mut peaks = Tensor::from_slice(&[allocated, reserved]).to_device(comm.device());
    comm.world().all_reduce(&mut peaks, Reduction::Max)?.wait()?;
    let peaks = Vec::<f64>::try_from(peaks.to_device(Device::Cpu))?;
    let breakdown = (args.breakdown && world == 1).then(|| time_phases(&mut trainer, &batches[0], normalizer, &synchronize)).transpose()?;
    let kernel_check =
        (args.breakdown && trainer.kernels() == Kernels::Ft).then(|| check_kernels(&trainer, &batches[0], normalizer, &synchronize)).transpose()?;
    if let Some(dir) = &args.profile {
        let label = format!("{}-{}-{}gpu-{batch}x{seq}", model.model_type(), strategy.name(), world);
        profile_steps(dir, &label, rank == 0, device.is_cuda(), &mut |count| run_steps(&mut trainer, &batches, normalizer, count))?;
    }
    let tokens_per_s_per_gpu = (batch * seq) as f64 / step_seconds;
    if rank == 0 {
        let row = Row {
            model: format!("{} {:.1}M", model.model_type(), model.numel() as f64 / 1e6),
            params: model.numel(),
            strategy: strategy.name().into(),
            offload: offload.name().into(),
            reduce_dtype,
            gpus: world,
            batch,
            seq,
            step_ms: step_seconds * 1e3,
            tokens_per_s_per_gpu,
            mfu: model.train_flops_per_token(seq) * tokens_per_s_per_gpu / PEAK_FLOPS,
            peak_allocated_gb: peaks[0] / 1e9,
            peak_reserved_gb: peaks[1] / 1e9,
            exposed_comm_ms: None,
            state: trainer.memory(),
            loss,
            breakdown_ms: breakdown,
            kernel_check,
            error: None,
        };
        std::fs::write(result_file, serde_json::to_string(&row)?)?;
    }
    comm.world().barrier()?.wait()?;
    Ok(0)
}

/// `count` training steps over the batches in turn; the last step's loss.
fn run_steps(trainer: &mut Trainer, batches: &[Tensor], normalizer: f64, count: usize) -> Result<f64> {
    let mut last = None;
    for step in 0..count {
        let ids = &batches[step % batches.len()];
        let loss = trainer.forward_backward(&Inputs::ids(ids), ids, normalizer, true)?;
        let _grad_norm = trainer.step(1e-5)?;
        last = Some(loss);
    }
    Ok(last.map_or(f64::NAN, |l| l.double_value(&[])))
}

/// Milliseconds per call of forward+backward, of the LM head's fused loss on
/// the same shapes, and of the optimizer step, each timed between synchronisations.
fn time_phases(trainer: &mut Trainer, ids: &Tensor, normalizer: f64, synchronize: &dyn Fn()) -> Result<[f64; 3]> {
    const REPEATS: usize = 5;
    let (mut forward_backward, mut step) = (0.0, 0.0);
    for _ in 0..REPEATS {
        synchronize();
        let start = Instant::now();
        let _loss = trainer.forward_backward(&Inputs::ids(ids), ids, normalizer, true)?;
        synchronize();
        forward_backward += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let _grad_norm = trainer.step(1e-5)?;
        synchronize();
        step += start.elapsed().as_secs_f64();
    }
    let (hidden, weight) = random_head_inputs(trainer, ids);
    synchronize();
    let start = Instant::now();
    for _ in 0..REPEATS {
        let _outputs = lm_head_loss_and_grads(&hidden, &weight, ids, normalizer, trainer.loss_chunk_tokens(), None, trainer.kernels())?;
    }
    synchronize();
    let head = start.elapsed().as_secs_f64();
    let ms = |seconds: f64| seconds / REPEATS as f64 * 1e3;
    Ok([ms(forward_backward), ms(head), ms(step)])
}

/// Random hidden states and head weight of the model's shapes for `ids`, in the compute dtype.
fn random_head_inputs(trainer: &Trainer, ids: &Tensor) -> (Tensor, Tensor) {
    let dims = trainer.model().dims();
    let (batch, seq, device) = (ids.size()[0], ids.size()[1], ids.device());
    let dtype = trainer.units()[0].compute_kind();
    (Tensor::randn([batch, seq, dims.hidden], (dtype, device)), Tensor::randn([dims.vocab, dims.hidden], (dtype, device)) * 0.02)
}

/// Times ft's kernels and ATen's on the same random inputs and compares
/// their results.
fn check_kernels(trainer: &Trainer, ids: &Tensor, normalizer: f64, synchronize: &dyn Fn()) -> Result<KernelCheck> {
    const REPEATS: usize = 5;
    let timed = |run: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        run()?;
        synchronize();
        let start = Instant::now();
        for _ in 0..REPEATS {
            run()?;
        }
        synchronize();
        Ok(start.elapsed().as_secs_f64() / REPEATS as f64 * 1e3)
    };
    let relative = |a: &Tensor, b: &Tensor, scale: &Tensor| {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (a - &b).abs().max().double_value(&[]) / scale.abs().max().double_value(&[]).max(f64::MIN_POSITIVE)
    };

    let (hidden, weight) = random_head_inputs(trainer, ids);
    let device = ids.device();
    let head = |kernels| lm_head_loss_and_grads(&hidden, &weight, ids, normalizer, trainer.loss_chunk_tokens(), None, kernels);
    let head_ft_ms = timed(&mut || head(Kernels::Ft).map(drop))?;
    let head_aten_ms = timed(&mut || head(Kernels::Aten).map(drop))?;
    let ((ft_loss, ft_hidden, ft_weight), (aten_loss, aten_hidden, aten_weight)) = (head(Kernels::Ft)?, head(Kernels::Aten)?);

    let hyper = ft_core::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let numel = 64 << 20;
    let [grad, exp_avg, exp_avg_sq] = [1.0, 0.1, 0.01].map(|std| (Tensor::randn([numel], (Kind::Float, device)) * std).abs_());
    let param = Tensor::randn([numel], (Kind::Float, device));
    let (step, grad_scale) = (Tensor::from(1f32).to_device(device), Tensor::from(2f32).to_device(device));
    let fresh = || [&param, &exp_avg, &exp_avg_sq].map(Tensor::copy);
    let ft_step = |[p, m, v]: &[Tensor; 3]| ft_core::kernels::adamw_(p, &grad, m, v, hyper, &step, Some(&grad_scale), None).map_err(anyhow::Error::msg);
    // ATen writes the unscaled gradient back into `grad`: it gets its own copy.
    let aten_step = |[p, m, v]: &[Tensor; 3], grad: &Tensor| {
        ft_core::fused_adamw(&[p], &[grad], &[m], &[v], &[&step], hyper, Some(&grad_scale), None).map_err(anyhow::Error::msg)
    };
    let (ft_state, aten_state, aten_grad) = (fresh(), fresh(), grad.copy());
    let adamw_ft_ms = timed(&mut || ft_step(&ft_state))?;
    let adamw_aten_ms = timed(&mut || aten_step(&aten_state, &aten_grad))?;
    // One step each from the same state, for the comparison.
    let (ft_state, aten_state) = (fresh(), fresh());
    ft_step(&ft_state)?;
    aten_step(&aten_state, &grad.copy())?;
    let (ft_param, aten_param) = (&ft_state[0], &aten_state[0]);
    Ok(KernelCheck {
        head_ft_ms,
        head_aten_ms,
        head_loss_relative_diff: relative(&ft_loss, &aten_loss, &aten_loss),
        head_grad_relative_diff: relative(&ft_hidden, &aten_hidden, &aten_hidden).max(relative(&ft_weight, &aten_weight, &aten_weight)),
        adamw_ft_ms,
        adamw_aten_ms,
        adamw_update_relative_diff: relative(ft_param, aten_param, &(aten_param - &param)),
    })
}

/// Runs 3 steps under PyTorch's profiler (on the rank that `records`; the
/// others run the same steps so collectives match) and prints the top kernels.
fn profile_steps(dir: &Path, label: &str, records: bool, cuda: bool, steps: &mut dyn FnMut(usize) -> Result<f64>) -> Result<()> {
    const STEPS: usize = 3;
    if !records {
        steps(STEPS)?;
        return Ok(());
    }
    ft_core::profile::start(cuda)?;
    let result = steps(STEPS);
    let report = ft_core::profile::stop(dir, label, cuda, STEPS)?;
    result?;
    eprint!("{label}: {}", report.top(20));
    Ok(())
}

/// Exposed communication: step time beyond the same model/batch/length on one GPU.
fn fill_exposed_comm(rows: &mut [Row]) {
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

fn describe(row: &Row) -> String {
    match &row.error {
        Some(e) => format!("{} {} x{} batch {}x{}: FAILED: {e}", row.model, row.strategy, row.gpus, row.batch, row.seq),
        None => format!(
            "{} {} x{} batch {}x{}: {:.0} tokens/s/GPU, {:.1} ms/step, MFU {:.1}%, peak {:.1} GB{}",
            row.model,
            row.strategy,
            row.gpus,
            row.batch,
            row.seq,
            row.tokens_per_s_per_gpu,
            row.step_ms,
            row.mfu * 100.0,
            row.peak_allocated_gb,
            row.breakdown_ms.map_or(String::new(), |[fb, head, step]| format!(
                "; forward+backward {fb:.1} ms (LM head {head:.1}), optimizer {step:.1} ms"
            )) + &row.kernel_check.as_ref().map_or(String::new(), |k| format!(
                "; LM head: ft {:.2} ms vs ATen {:.2} (loss differs by {:.1e}, gradients by {:.1e}); AdamW over 64M: ft {:.2} ms vs ATen {:.2} (update differs by {:.1e})",
                k.head_ft_ms, k.head_aten_ms, k.head_loss_relative_diff, k.head_grad_relative_diff, k.adamw_ft_ms, k.adamw_aten_ms, k.adamw_update_relative_diff
            ))
        ),
    }
}

/// The matrix as a Markdown table.
fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "\n| model | strategy | offload | GPUs | batch x seq | tokens/s/GPU | step ms | MFU | peak alloc GB | peak reserved GB | comm exposed ms | held GB (params/grads/optim) |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        if let Some(e) = &r.error {
            out += &format!("| {} | {} | {} | {} | {}x{} | failed: {} |\n", r.model, r.strategy, r.offload, r.gpus, r.batch, r.seq, e.lines().next().unwrap_or(""));
            continue;
        }
        out += &format!(
            "| {} | {}{} | {} | {} | {}x{} | {:.0} | {:.1} | {:.1}% | {:.2} | {:.2} | {} | {:.2}/{:.2}/{:.2} |\n",
            r.model,
            r.strategy,
            if r.reduce_dtype == ReduceDtype::Compute { " (reduce in compute dtype)" } else { "" },
            r.offload,
            r.gpus,
            r.batch,
            r.seq,
            r.tokens_per_s_per_gpu,
            r.step_ms,
            r.mfu * 100.0,
            r.peak_allocated_gb,
            r.peak_reserved_gb,
            r.exposed_comm_ms.map_or("—".into(), |ms| format!("{ms:.1}")),
            r.state.params / 1e9,
            r.state.grads / 1e9,
            r.state.optimizer_state / 1e9
        );
    }
    out
}
