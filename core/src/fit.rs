//! The fine-tuning loop: epochs of global batches over the training set,
//! one optimizer step per global batch, evaluation after each epoch, metrics
//! to the sinks, and a summary at the end.

use crate::checkpoint;
use crate::comm::{Communicator, Reduction};
use crate::config::TrainConfig;
use crate::data::{collate, epoch_order, target_tokens, BatchLayout};
use crate::dataset::Example;
use crate::metrics::{process_memory, MetricsSink, Record};
use crate::model::{forward, lm_loss_sum, lm_outputs, Inputs, Model};
use crate::schedule::lr_at;
use crate::flat::MemoryAccount;
use crate::strategy::{ReduceDtype, ShardGroup, ShardingStrategy};
use crate::train::{Parallel, TrainOptions, Trainer};
use crate::ProcessGroup;
use anyhow::{bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Scores an epoch's model by generation (EM/F1 on question answering).
pub trait GenerationEval {
    /// Returns named scores (e.g. {"em": 41.0, "f1": 55.2}) summed over this
    /// rank's share, and how many examples that share had.
    fn evaluate(&mut self, model: &dyn Model, params: &[Vec<Tensor>], dtype: Kind, epoch: usize) -> Result<(BTreeMap<String, f64>, usize)>;
}

/// Memory of one rank over the run, in bytes.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct RankMemory {
    pub peak: f64,
    pub mean: f64,
    pub min: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EpochResult {
    pub epoch: usize,
    pub train_loss: f64,
    pub eval_loss: Option<f64>,
    pub scores: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub world_size: usize,
    pub device: String,
    pub steps_per_epoch: usize,
    pub optimizer_steps: usize,
    pub epochs: Vec<EpochResult>,
    pub final_train_loss: f64,
    pub train_seconds: f64,
    pub train_samples_per_s: f64,
    pub train_tokens_per_s: f64,
    pub eval_samples_per_s: Option<f64>,
    pub mfu: Option<f64>,
    /// What memory means here: CUDA allocator (allocated) or process RSS.
    pub memory_kind: String,
    pub memory_per_rank: Vec<RankMemory>,
    /// Rank 0's offload traffic and host optimizer time (None without offload).
    pub offload: Option<crate::train::OffloadStats>,
    /// Peak resident host memory of each rank's process (bytes).
    pub host_peak_per_rank: Vec<f64>,
    /// The strategy and what each rank held under it.
    pub strategy: String,
    pub shard_group_size: usize,
    pub state_per_rank: Vec<MemoryAccount>,
    /// Mean GPU utilisation (%) of each rank while training; None without NVML.
    pub gpu_utilisation_per_rank: Option<Vec<f64>>,
}

/// (step, total steps, record): what `Fit::on_step` receives.
pub type StepCallback<'c> = dyn FnMut(usize, usize, &Record) + 'c;

pub struct Fit<'a> {
    pub model: &'a dyn Model,
    pub comm: &'a Communicator,
    pub strategy: &'a dyn ShardingStrategy,
    pub offload: &'a dyn crate::Offload,
    pub train: &'a [Example],
    pub eval: &'a [Example],
    pub config: &'a TrainConfig,
    pub dtype: Kind,
    pub pad_id: i64,
    pub pad_to_multiple_of: usize,
    pub sinks: Vec<Box<dyn MetricsSink>>,
    pub generation_eval: Option<&'a mut dyn GenerationEval>,
    /// Called on rank 0 after each logged step: (step, total steps, record).
    pub on_step: Option<&'a mut StepCallback<'a>>,
    /// Where checkpoints go and what they describe.
    pub checkpoints: CheckpointPlan<'a>,
}

pub struct CheckpointPlan<'a> {
    pub output: &'a std::path::Path,
    pub model_config: &'a serde_json::Value,
    pub tokenizer: Option<&'a std::path::Path>,
}

/// Bytes in use on this rank now and at the peak (CUDA allocator or process RSS).
fn memory(device: Device) -> (f64, f64) {
    match device {
        Device::Cuda(index) => {
            crate::cuda_memory(index, false).map(|m| (m.allocated as f64, m.peak_allocated as f64)).unwrap_or_default()
        }
        _ => process_memory().map(|(now, peak)| (now as f64, peak as f64)).unwrap_or_default(),
    }
}

/// Ends rank 0's profiler recording of steps `first..=last` and logs the top kernels.
fn finish_profile(dir: &std::path::Path, first: usize, last: usize, cuda: bool) -> Result<()> {
    let report = crate::profile::stop(dir, &format!("steps-{first}-{last}"), cuda, last + 1 - first)?;
    tracing::info!("profile of steps {first}-{last}: {}", report.top(15));
    Ok(())
}

/// Sums `values` over every rank.
fn sum_over_ranks(comm: &Communicator, values: &[f64]) -> Result<Vec<f64>> {
    let mut t = Tensor::from_slice(values).to_device(comm.device());
    comm.world().all_reduce(&mut t, Reduction::Sum)?.wait()?;
    Ok(Vec::<f64>::try_from(t.to_device(Device::Cpu))?)
}

/// What evaluation needs besides the weights.
pub struct EvalSet<'a> {
    pub examples: &'a [Example],
    pub batch_size: usize,
    pub pad_id: i64,
    pub pad_to_multiple_of: usize,
    pub dtype: Kind,
    pub loss_chunk_tokens: i64,
}

/// Mean loss over the eval set (each rank its share), with `params`.
pub fn eval_loss(model: &dyn Model, params: &[Vec<Tensor>], set: &EvalSet, comm: &Communicator) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let (rank, world) = (comm.env().rank, comm.env().world_size);
    let mine: Vec<&Example> = set.examples.iter().skip(rank).step_by(world).collect();
    let (mut sum, mut count) = (0.0, 0.0);
    for batch in mine.chunks(set.batch_size) {
        let (ids, labels) = collate(batch, set.pad_id, set.pad_to_multiple_of, comm.device());
        let inputs = Inputs::ids(&ids);
        let ctx = model.context(&inputs, 0, set.dtype, false)?;
        let (hidden, weight) = lm_outputs(forward(model, params, &inputs, &ctx, None))?;
        let (s, c) = lm_loss_sum(&hidden, &weight, &labels, set.loss_chunk_tokens)?;
        sum += s.double_value(&[]);
        count += c.double_value(&[]);
    }
    let totals = sum_over_ranks(comm, &[sum, count])?;
    Ok(totals[0] / totals[1].max(1.0))
}

/// Runs a generation evaluator on every rank and averages its scores over all examples.
pub fn generation_scores(
    evaluator: &mut dyn GenerationEval,
    model: &dyn Model,
    params: &[Vec<Tensor>],
    dtype: Kind,
    epoch: usize,
    comm: &Communicator,
) -> Result<(BTreeMap<String, f64>, usize)> {
    let (sums, count) = evaluator.evaluate(model, params, dtype, epoch)?;
    let keys: Vec<String> = sums.keys().cloned().collect();
    let mut values: Vec<f64> = keys.iter().map(|k| sums[k]).collect();
    values.push(count as f64);
    let totals = sum_over_ranks(comm, &values)?;
    let examples = totals[keys.len()].max(1.0);
    Ok((keys.into_iter().zip(totals).map(|(k, total)| (k, total / examples)).collect(), examples as usize))
}

pub fn run(mut fit: Fit, params: Vec<Vec<Tensor>>) -> Result<(Summary, Vec<Vec<Tensor>>)> {
    let config = fit.config;
    let (rank, world) = (fit.comm.env().rank, fit.comm.env().world_size);
    let device = fit.comm.device();
    let layout = BatchLayout { micro_batch: config.batch_size, accumulation: config.grad_accum, world };
    let steps_per_epoch = layout.steps_per_epoch(fit.train.len());
    if steps_per_epoch == 0 {
        bail!(
            "{} training examples do not fill one global batch of {} (batch_size {} x grad_accum {} x {world} ranks)",
            fit.train.len(),
            layout.global_batch(),
            config.batch_size,
            config.grad_accum
        );
    }
    let total_steps = steps_per_epoch * config.epochs;
    let warmup = if config.warmup_steps > 0 {
        config.warmup_steps
    } else {
        (config.warmup_ratio * total_steps as f64).ceil() as usize
    };
    let options = TrainOptions {
        dtype: fit.dtype,
        adamw: crate::AdamW {
            lr: config.lr,
            beta1: config.adam_beta1,
            beta2: config.adam_beta2,
            weight_decay: config.weight_decay,
            eps: config.adam_eps,
        },
        max_grad_norm: (config.max_grad_norm > 0.0).then_some(config.max_grad_norm),
        loss_chunk_tokens: config.loss_chunk_tokens,
        activation_checkpointing: config.activation_checkpointing,
        seed: config.seed as i64,
        initial_loss_scale: config.initial_loss_scale,
        offload_to_host: fit.offload.to_host(),
    };
    let groups = ShardGroups::new(fit.strategy, config.shard_group_size, fit.comm)?;
    let parallel = groups.parallel(fit.strategy, fit.comm, config.reduce_dtype, fit.dtype);
    let mut trainer = Trainer::with_parallel(fit.model, &params, options, parallel)?;
    drop(params);
    let (mut first_epoch, mut first_epoch_step, mut step) = (0, 0, 0);
    if let Some(spec) = &config.resume {
        let dir = checkpoint::resolve(spec, fit.checkpoints.output)?;
        let manifest = checkpoint::load_into(&dir, &mut trainer)?;
        (first_epoch, first_epoch_step, step) = (manifest.epoch, manifest.epoch_step, manifest.step);
        if rank == 0 {
            tracing::info!("resumed from {} at step {step} (epoch {}, batch {})", dir.display(), first_epoch + 1, first_epoch_step);
        }
    }

    let sampler = match device {
        Device::Cuda(index) => crate::gpu::UtilizationSampler::start(index),
        _ => None,
    };
    let (mut memory_sum, mut memory_min, mut memory_samples) = (0.0, f64::INFINITY, 0usize);
    let (mut train_seconds, mut train_tokens, mut train_samples) = (0.0, 0usize, 0usize);
    let (mut eval_seconds, mut eval_examples) = (0.0, 0usize);
    let mut epochs = vec![];
    let mut last_loss = f64::NAN;
    // The first step of rank 0's profiler recording while it runs.
    let mut profiling: Option<usize> = None;
    let profile_dir = fit.checkpoints.output.join("profile");
    for epoch in first_epoch..config.epochs {
        let order = epoch_order(fit.train.len(), epoch as u64, config.seed, true);
        let mut epoch_loss = 0.0;
        let start = if epoch == first_epoch { first_epoch_step } else { 0 };
        for epoch_step in start..steps_per_epoch {
            let started = Instant::now();
            if rank == 0 && config.profile_steps.is_some_and(|[first, _]| step + 1 == first) {
                crate::profile::start(device.is_cuda())?;
                profiling = Some(step + 1);
            }
            // Dropout's masks follow from (seed, step), so a resumed run repeats them.
            tch::manual_seed((config.seed as i64).wrapping_mul(1_000_003).wrapping_add(step as i64));
            let global: Vec<&Example> = layout.global(&order, epoch_step).iter().map(|&i| &fit.train[i]).collect();
            // Every rank knows the whole global batch, so the exact normaliser needs no communication.
            let normalizer = target_tokens(global.iter().copied()).max(1) as f64;
            let mut loss = Tensor::zeros([], (Kind::Float, device));
            let offloaded_before = trainer.offload_stats();
            for micro in 0..config.grad_accum {
                let batch: Vec<&Example> = layout.micro(&order, epoch_step, rank, micro).iter().map(|&i| &fit.train[i]).collect();
                let (ids, labels) = collate(&batch, fit.pad_id, fit.pad_to_multiple_of, device);
                train_tokens += ids.numel();
                loss += trainer.forward_backward(&Inputs::ids(&ids), &labels, normalizer, micro + 1 == config.grad_accum)?;
            }
            let lr = lr_at(config.schedule, config.lr, step, total_steps, warmup);
            let grad_norm = trainer.step(lr)?;
            let offloaded = trainer.offload_stats();
            step += 1;
            if let (Some(first), Some([_, last])) = (profiling, config.profile_steps) {
                if step == last {
                    finish_profile(&profile_dir, first, last, device.is_cuda())?;
                    profiling = None;
                }
            }
            train_samples += layout.global_batch();
            let (in_use, _) = memory(device);
            memory_sum += in_use;
            memory_min = memory_min.min(in_use);
            memory_samples += 1;
            if step % config.log_every.max(1) == 0 || epoch_step + 1 == steps_per_epoch {
                let global_loss = sum_over_ranks(fit.comm, &[loss.double_value(&[])])?[0];
                last_loss = global_loss;
                epoch_loss = global_loss;
                train_seconds += started.elapsed().as_secs_f64();
                let mut record = Record {
                    step: step as u64,
                    values: BTreeMap::from([
                        ("epoch".to_string(), epoch as f64 + (epoch_step + 1) as f64 / steps_per_epoch as f64),
                        ("loss".to_string(), global_loss),
                        ("lr".to_string(), lr),
                        ("grad_norm".to_string(), grad_norm.double_value(&[])),
                        ("step_seconds".to_string(), started.elapsed().as_secs_f64()),
                        ("memory_bytes".to_string(), in_use),
                    ]),
                };
                if fit.offload.to_host() {
                    // What this step moved between device and host, and its host optimizer time.
                    record.values.extend([
                        ("offload_wait_seconds".to_string(), offloaded.wait_seconds - offloaded_before.wait_seconds),
                        ("offload_cpu_step_seconds".to_string(), offloaded.cpu_step_seconds - offloaded_before.cpu_step_seconds),
                        ("offload_d2h_bytes".to_string(), offloaded.device_to_host_bytes - offloaded_before.device_to_host_bytes),
                        ("offload_h2d_bytes".to_string(), offloaded.host_to_device_bytes - offloaded_before.host_to_device_bytes),
                    ]);
                }
                if rank == 0 {
                    for sink in &mut fit.sinks {
                        sink.record(&record)?;
                    }
                    if let Some(on_step) = fit.on_step.as_mut() {
                        on_step(step, total_steps, &record);
                    }
                }
            } else {
                train_seconds += started.elapsed().as_secs_f64();
            }
            if config.save_every > 0 && step % config.save_every == 0 {
                let (next_epoch, next_step) =
                    if epoch_step + 1 == steps_per_epoch { (epoch + 1, 0) } else { (epoch, epoch_step + 1) };
                let manifest = checkpoint::Manifest {
                    format_version: checkpoint::FORMAT_VERSION,
                    ft_version: env!("CARGO_PKG_VERSION").into(),
                    step,
                    epoch: next_epoch,
                    epoch_step: next_step,
                    micro_steps: trainer.micro_steps(),
                    world_size: world,
                    strategy: fit.strategy.name().into(),
                    units: trainer.layout(),
                    model_config: fit.checkpoints.model_config.clone(),
                };
                // Every rank helps gather the whole state; rank 0 writes it, the others wait.
                let units = trainer.whole_state()?;
                if rank == 0 {
                    let state = checkpoint::State { units: &units, adamw_step: trainer.adamw_step() };
                    checkpoint::save(fit.checkpoints.output, &state, &manifest, fit.checkpoints.tokenizer, config.save_total_limit)?;
                }
                drop(units);
                fit.comm.world().barrier()?.wait()?;
            }
            checkpoint::fault_point("after-step", step);
        }
        // The epoch ended inside the profiled steps: stop before evaluation.
        if let Some(first) = profiling.take() {
            finish_profile(&profile_dir, first, step, device.is_cuda())?;
        }
        let eval_started = Instant::now();
        let params = trainer.compute_params()?;
        let set = EvalSet {
            examples: fit.eval,
            batch_size: config.batch_size,
            pad_id: fit.pad_id,
            pad_to_multiple_of: fit.pad_to_multiple_of,
            dtype: fit.dtype,
            loss_chunk_tokens: config.loss_chunk_tokens,
        };
        let eval_loss = if fit.eval.is_empty() { None } else { Some(eval_loss(fit.model, &params, &set, fit.comm)?) };
        let mut scores = BTreeMap::new();
        if let Some(evaluator) = fit.generation_eval.as_mut() {
            let (averages, examples) = generation_scores(*evaluator, fit.model, &params, fit.dtype, epoch, fit.comm)?;
            eval_examples += examples;
            scores = averages;
        }
        drop(params);
        eval_seconds += eval_started.elapsed().as_secs_f64();
        let result = EpochResult { epoch: epoch + 1, train_loss: epoch_loss, eval_loss, scores };
        if rank == 0 {
            let mut values = BTreeMap::from([("epoch".to_string(), (epoch + 1) as f64)]);
            values.extend(result.eval_loss.map(|l| ("eval_loss".to_string(), l)));
            values.extend(result.scores.iter().map(|(k, v)| (format!("eval_{k}"), *v)));
            for sink in &mut fit.sinks {
                sink.record(&Record { step: step as u64, values: values.clone() })?;
            }
        }
        epochs.push(result);
    }
    for sink in &mut fit.sinks {
        sink.finish()?;
    }

    // Every rank's utilisation (-1 where NVML was absent), then memory as a [world, 3] table.
    let utilisation = sampler.and_then(|s| s.finish()).unwrap_or(-1.0);
    let mut per_rank = vec![0.0; world];
    per_rank[rank] = utilisation + 1.0;
    let per_rank: Vec<f64> = sum_over_ranks(fit.comm, &per_rank)?.into_iter().map(|u| u - 1.0).collect();
    let gpu_utilisation_per_rank = per_rank.iter().all(|u| *u >= 0.0).then_some(per_rank);
    let mine = [memory(device).1, memory_sum / memory_samples.max(1) as f64, memory_min];
    let mut table = vec![0.0; 3 * world];
    table[3 * rank..3 * rank + 3].copy_from_slice(&mine);
    let table = sum_over_ranks(fit.comm, &table)?;
    let memory_per_rank = table.chunks(3).map(|m| RankMemory { peak: m[0], mean: m[1], min: m[2] }).collect();
    let mut host = vec![0.0; world];
    host[rank] = process_memory().map_or(0.0, |(_, peak)| peak as f64);
    let host_peak_per_rank = sum_over_ranks(fit.comm, &host)?;
    let held = trainer.memory();
    let mut table = vec![0.0; 5 * world];
    table[5 * rank..5 * rank + 5].copy_from_slice(&[held.params, held.grads, held.optimizer_state, held.gathered_peak, held.host]);
    let state_per_rank = sum_over_ranks(fit.comm, &table)?
        .chunks(5)
        .map(|m| MemoryAccount { params: m[0], grads: m[1], optimizer_state: m[2], gathered_peak: m[3], host: m[4] })
        .collect();
    let seconds = sum_over_ranks(fit.comm, &[train_seconds])?[0] / world as f64;
    let tokens = sum_over_ranks(fit.comm, &[train_tokens as f64])?[0];
    let tokens_per_s = tokens / seconds;
    let mfu = matches!(device, Device::Cuda(_)).then(|| {
        let seq = fit.train.iter().map(|e| e.input_ids.len()).sum::<usize>() as f64 / fit.train.len() as f64;
        fit.model.train_flops_per_token(seq as i64) * tokens_per_s / world as f64 / 989e12
    });
    let summary = Summary {
        world_size: world,
        device: format!("{device:?}"),
        steps_per_epoch,
        optimizer_steps: step,
        epochs,
        final_train_loss: last_loss,
        train_seconds: seconds,
        train_samples_per_s: train_samples as f64 / seconds,
        train_tokens_per_s: tokens_per_s,
        eval_samples_per_s: (eval_examples > 0).then(|| eval_examples as f64 / eval_seconds),
        mfu,
        memory_kind: if matches!(device, Device::Cuda(_)) { "CUDA allocated" } else { "process RSS" }.into(),
        memory_per_rank,
        offload: fit.offload.to_host().then(|| trainer.offload_stats()),
        host_peak_per_rank,
        strategy: fit.strategy.name().into(),
        shard_group_size: groups.shard_size,
        state_per_rank,
        gpu_utilisation_per_rank,
    };
    Ok((summary, trainer.params()?))
}

/// The sub-groups a strategy needs: its shard group (None when it shards
/// nothing, or when it is the whole world, which the communicator already
/// has) and, for hybrid sharding, the replica groups across shard groups.
pub struct ShardGroups {
    pub shard_size: usize,
    sub_group: Option<ProcessGroup>,
    replicas: Option<ProcessGroup>,
}

impl ShardGroups {
    /// Builds the strategy's groups (collective: every rank calls it);
    /// `size_override` is `--shard-group-size`.
    pub fn new(strategy: &dyn ShardingStrategy, size_override: Option<usize>, comm: &Communicator) -> Result<ShardGroups> {
        let policy = strategy.policy();
        policy.validate(strategy.name())?;
        let env = comm.env();
        let world = env.world_size;
        if !policy.optimizer_state_sharded {
            if let Some(size) = size_override {
                bail!("--shard-group-size {size}: strategy `{}` shards nothing", strategy.name());
            }
            return Ok(ShardGroups { shard_size: 1, sub_group: None, replicas: None });
        }
        let size = size_override.unwrap_or(match policy.shard_group {
            ShardGroup::World => world,
            ShardGroup::Node => env.local_world_size,
            ShardGroup::Size(n) => n,
        });
        if size == 0 || world % size != 0 {
            bail!("shard group size {size} must divide the world size {world} (strategy `{}`)", strategy.name());
        }
        if size == world || size == 1 {
            return Ok(ShardGroups { shard_size: size, sub_group: None, replicas: None });
        }
        let (shard, replicas) = comm.hybrid_groups(size)?;
        Ok(ShardGroups { shard_size: size, sub_group: Some(shard), replicas: Some(replicas) })
    }

    /// What a trainer needs to run `strategy` over these groups (None on one rank).
    pub fn parallel<'c>(&'c self, strategy: &dyn ShardingStrategy, comm: &'c Communicator, reduce: ReduceDtype, dtype: Kind) -> Option<Parallel<'c>> {
        (comm.env().world_size > 1).then(|| Parallel {
            policy: strategy.policy(),
            world: comm.world(),
            shard: self.shard(comm),
            replicas: self.replicas.as_ref(),
            reduce_dtype: match strategy.policy().reduce_dtype.unwrap_or(reduce) {
                ReduceDtype::Fp32 => Kind::Float,
                ReduceDtype::Compute => dtype,
            },
        })
    }

    fn shard<'c>(&'c self, comm: &'c Communicator) -> Option<&'c ProcessGroup> {
        match (&self.sub_group, self.shard_size) {
            (Some(group), _) => Some(group),
            (None, 1) => None,
            (None, _) => Some(comm.world()),
        }
    }
}
