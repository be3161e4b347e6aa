//! The run's summary: every rank's counters and memory gathered, the
//! throughput and MFU they make, and the table `ft train` prints.
//!
//! Convention: tokens are the non-padding input tokens the ranks computed;
//! MFU is their model FLOPs (6·N + 12·L·d·S per token of a sequence of S
//! tokens, PaLM's formula) over the time trained, divided by the GPUs' dense
//! peak for the compute dtype (`gpu::peak_flops`, or `train.peak_tflops`).

use crate::checkpoint::BestCheckpoint;
use crate::distributed::comm::{Collective, Communicator};
use crate::distributed::flat::MemoryAccount;
use crate::metrics::process_memory;
use crate::task::Reference;
use crate::train::{OffloadStats, Trainer};
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;
use tch::Device;

/// This rank's counters over the run.
#[derive(Debug, Default)]
pub(crate) struct RunTotals {
    pub train_seconds: f64,
    pub examples: usize,
    /// Non-padding tokens, and their model FLOPs.
    pub tokens: usize,
    pub flops: f64,
    pub eval_seconds: f64,
    pub eval_examples: usize,
    /// The last logged loss (None before any step).
    pub last_loss: Option<f64>,
    /// Device memory in use after each step (allocator on a GPU, RSS on a CPU).
    pub memory_sum: f64,
    pub memory_min: Option<f64>,
    pub memory_samples: usize,
    /// Optimizer steps this process trained.
    pub steps: usize,
    /// Bytes sent in collectives during training steps, per `Collective::COUNTED`.
    pub comm_bytes: [u64; 4],
}

/// Bytes in use on `device` now and at the peak (CUDA allocator or process RSS).
pub(crate) fn memory(device: Device) -> (f64, f64) {
    match device {
        Device::Cuda(index) => {
            crate::cuda_memory(index, false).map(|m| (m.allocated as f64, m.peak_allocated as f64)).unwrap_or_default()
        }
        _ => process_memory().map(|(now, peak)| (now as f64, peak as f64)).unwrap_or_default(),
    }
}

/// Memory of one rank over the run, in bytes.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct RankMemory {
    pub peak: f64,
    pub mean: f64,
    pub min: f64,
}

/// The reference model a run compares with (`Task::reference`), and what
/// each rank holds for it, in bytes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReferenceMemory {
    /// What it is (`task::Reference::kind`).
    pub kind: String,
    /// On the compute device between steps: a frozen copy, or its shard.
    pub device_bytes_per_rank: Vec<f64>,
    /// In host memory: a frozen copy offloaded, precomputed log-probabilities.
    pub host_bytes_per_rank: Vec<f64>,
}

impl ReferenceMemory {
    /// What this rank holds for `reference`, [on the device, in host
    /// memory]: the trainer's frozen copy, if it keeps one, and the task's own.
    pub(crate) fn of_this_rank(reference: &Reference, trainer: &Trainer) -> [f64; 2] {
        let copy = trainer.reference_memory();
        [copy.params - copy.host, copy.host + reference.host_bytes]
    }

    /// Every rank's (collective).
    fn gather(comm: &Communicator, reference: Reference, trainer: &Trainer) -> Result<ReferenceMemory> {
        let held = per_rank(comm, &ReferenceMemory::of_this_rank(&reference, trainer))?;
        Ok(ReferenceMemory {
            kind: reference.kind,
            device_bytes_per_rank: held.iter().map(|bytes| bytes[0]).collect(),
            host_bytes_per_rank: held.iter().map(|bytes| bytes[1]).collect(),
        })
    }
}

/// How the log and the summary's table say what a rank holds for the
/// reference model (from a few bytes a pair to a whole model's gigabytes).
pub(crate) fn reference_held([device, host]: [f64; 2]) -> String {
    let size = |bytes: f64| match bytes {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    };
    format!("{} on the device, {} in host memory", size(device), size(host))
}

#[derive(Debug, Clone, Serialize)]
pub struct EpochResult {
    pub epoch: usize,
    /// The loss of the epoch's last logged step (None if it trained none).
    pub train_loss: Option<f64>,
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
    pub final_train_loss: Option<f64>,
    pub train_seconds: f64,
    pub train_samples_per_s: f64,
    pub train_tokens_per_s: f64,
    /// What the token counts count.
    pub tokens_counted: String,
    pub eval_samples_per_s: Option<f64>,
    pub mfu: Option<f64>,
    /// The per-GPU dense peak (FLOP/s) MFU divides by; None where unknown.
    pub peak_flops_per_gpu: Option<f64>,
    /// What memory means here: CUDA allocator (allocated) or process RSS.
    pub memory_kind: String,
    pub memory_per_rank: Vec<RankMemory>,
    /// Rank 0's offload traffic and host optimizer time (None without offload).
    pub offload: Option<OffloadStats>,
    /// Peak resident host memory of each rank's process (bytes).
    pub host_peak_per_rank: Vec<f64>,
    /// The strategy and what each rank held under it.
    pub strategy: String,
    pub shard_group_size: usize,
    pub state_per_rank: Vec<MemoryAccount>,
    /// Parameters trained (with a gradient and optimizer state) and frozen (LoRA's base model).
    pub trainable_params: i64,
    pub frozen_params: i64,
    /// The reference model training compared with (a preference task's), if any.
    pub reference: Option<ReferenceMemory>,
    /// Mean GPU utilisation (%) of each rank while training; None without NVML.
    pub gpu_utilisation_per_rank: Option<Vec<f64>>,
    /// The epoch after which early stopping ended the run.
    pub stopped_early_after_epoch: Option<usize>,
    /// The best checkpoint kept by `train.save_best`.
    pub best_checkpoint: Option<BestCheckpoint>,
    /// The run's id (a resumed run keeps its checkpoint's), as its checkpoints and metrics record it.
    pub run_id: String,
    /// The newest checkpoint: where `--resume latest` continues.
    pub last_checkpoint: Option<std::path::PathBuf>,
    /// Bytes rank 0 sent per optimizer step, by collective kind and in
    /// total, averaged over the steps trained (ring algorithms' counts:
    /// `Collective`).
    pub comm_bytes_per_step: BTreeMap<String, f64>,
}

/// Rank 0's bytes per step by kind and in total (every rank gets rank 0's).
fn comm_bytes_per_step(comm: &Communicator, totals: &RunTotals) -> Result<BTreeMap<String, f64>> {
    let steps = totals.steps.max(1) as f64;
    let mine: Vec<f64> = totals.comm_bytes.iter().map(|b| *b as f64 / steps).collect();
    let rank0 = per_rank(comm, &mine)?.swap_remove(0);
    let mut bytes: BTreeMap<String, f64> = Collective::COUNTED.iter().zip(&rank0).map(|(k, b)| (k.name().to_string(), *b)).collect();
    bytes.insert("total".into(), rank0.iter().sum());
    Ok(bytes)
}

/// `count` over `seconds`, 0 where that is no finite number (no time
/// measured, a peak of 0 set by hand): a summary never shows NaN or inf.
fn per_second(count: f64, seconds: f64) -> f64 {
    let rate = count / seconds;
    if rate.is_finite() {
        rate
    } else {
        0.0
    }
}

/// A figure for the table: "n/a" for none, and for a loss or score that is
/// not a number (a diverged run) rather than "NaN".
fn figure(value: Option<f64>, decimals: usize) -> String {
    match value {
        Some(value) if value.is_finite() => format!("{value:.decimals$}"),
        Some(_) => "n/a (not finite)".into(),
        None => "n/a".into(),
    }
}

/// Rank r's `mine` at row r of a [world, mine.len()] table, on every rank.
fn per_rank(comm: &Communicator, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
    let (rank, world, width) = (comm.env().rank, comm.env().world_size, mine.len());
    let mut table = vec![0.0; width * world];
    table[rank * width..(rank + 1) * width].copy_from_slice(mine);
    Ok(comm.sum_over_ranks(&table)?.chunks(width).map(<[f64]>::to_vec).collect())
}

impl Summary {
    /// Gathers every rank's figures (collective: every rank calls it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gather(
        comm: &Communicator,
        trainer: &Trainer,
        totals: &RunTotals,
        utilisation: Option<f64>,
        epochs: Vec<EpochResult>,
        steps_per_epoch: usize,
        optimizer_steps: usize,
        strategy: &str,
        shard_group_size: usize,
        offload_to_host: bool,
        peak_flops_override: Option<f64>,
        reference: Option<Reference>,
    ) -> Result<Summary> {
        let (world, device) = (comm.env().world_size, comm.device());
        // -1 marks a rank without NVML.
        let utilisation = per_rank(comm, &[utilisation.unwrap_or(-1.0)])?.concat();
        let gpu_utilisation_per_rank = utilisation.iter().all(|u| *u >= 0.0).then_some(utilisation);
        let mean = totals.memory_sum / totals.memory_samples.max(1) as f64;
        let memory_per_rank = per_rank(comm, &[memory(device).1, mean, totals.memory_min.unwrap_or(0.0)])?
            .into_iter()
            .map(|m| RankMemory { peak: m[0], mean: m[1], min: m[2] })
            .collect();
        let host_peak_per_rank = per_rank(comm, &[process_memory().map_or(0.0, |(_, peak)| peak as f64)])?.concat();
        let held = trainer.memory();
        let state_per_rank = per_rank(comm, &[held.params, held.grads, held.optimizer_state, held.gathered_peak, held.host, held.frozen, held.comm_state])?
            .into_iter()
            .map(|m| MemoryAccount { params: m[0], grads: m[1], optimizer_state: m[2], gathered_peak: m[3], host: m[4], frozen: m[5], comm_state: m[6] })
            .collect();
        let reference = reference.map(|reference| ReferenceMemory::gather(comm, reference, trainer)).transpose()?;
        let model = trainer.model();
        let frozen_params = model.frozen_numel();
        let sums = comm.sum_over_ranks(&[totals.train_seconds, totals.examples as f64, totals.tokens as f64, totals.flops])?;
        let [seconds, examples, tokens, flops] = [sums[0] / world as f64, sums[1], sums[2], sums[3]];
        let peak_flops_per_gpu = match device {
            Device::Cuda(index) => peak_flops_override.or_else(|| crate::gpu::peak_flops(index, trainer.units()[0].compute_kind())),
            _ => None,
        };
        Ok(Summary {
            world_size: world,
            device: format!("{device:?}"),
            steps_per_epoch,
            optimizer_steps,
            epochs,
            final_train_loss: totals.last_loss,
            train_seconds: seconds,
            train_samples_per_s: per_second(examples, seconds),
            train_tokens_per_s: per_second(tokens, seconds),
            tokens_counted: "non-padding input tokens".into(),
            eval_samples_per_s: (totals.eval_examples > 0 && totals.eval_seconds > 0.0)
                .then(|| per_second(totals.eval_examples as f64, totals.eval_seconds)),
            mfu: peak_flops_per_gpu.filter(|_| seconds > 0.0).map(|peak| per_second(flops, seconds * world as f64 * peak)),
            peak_flops_per_gpu,
            memory_kind: if device.is_cuda() { "CUDA allocated" } else { "process RSS" }.into(),
            memory_per_rank,
            offload: offload_to_host.then(|| trainer.offload_stats()),
            host_peak_per_rank,
            strategy: strategy.into(),
            shard_group_size,
            state_per_rank,
            trainable_params: model.numel() - frozen_params,
            frozen_params,
            reference,
            gpu_utilisation_per_rank,
            comm_bytes_per_step: comm_bytes_per_step(comm, totals)?,
            stopped_early_after_epoch: None,
            best_checkpoint: None,
            run_id: String::new(),
            last_checkpoint: None,
        })
    }

    /// The table `ft train` prints.
    pub fn table(&self) -> String {
        let mut out = String::from("\n== ft train summary ==\n");
        let row = |name: &str, value: String| format!("{name:<28} {value}\n");
        let loss = |l: Option<f64>| figure(l, 4);
        out += &row("ranks / device", format!("{} / {}", self.world_size, self.device));
        out += &row("strategy", format!("{} (shard group of {})", self.strategy, self.shard_group_size));
        out += &row("final train loss", loss(self.final_train_loss));
        for e in &self.epochs {
            let scores: Vec<String> = e.scores.iter().map(|(k, v)| format!("{k} {}", figure(Some(*v), 1))).collect();
            let scores = if scores.is_empty() { String::new() } else { format!(", {}", scores.join(", ")) };
            out += &row(&format!("epoch {}", e.epoch), format!("train loss {}, eval loss {}{scores}", loss(e.train_loss), loss(e.eval_loss)));
        }
        if let Some(epoch) = self.stopped_early_after_epoch {
            out += &row("early stopping", format!("after epoch {epoch}"));
        }
        if let Some(best) = &self.best_checkpoint {
            out += &row("best checkpoint", format!("{} {} at epoch {}: {}", best.monitor, figure(Some(best.score), 4), best.epoch, best.dir.display()));
        }
        out += &row("steps per epoch", self.steps_per_epoch.to_string());
        out += &row("train samples/s", format!("{:.1}", self.train_samples_per_s));
        out += &row("train tokens/s", format!("{:.0} ({})", self.train_tokens_per_s, self.tokens_counted));
        out += &row("eval samples/s", figure(self.eval_samples_per_s, 1));
        out += &row(
            "MFU",
            match (self.mfu, self.peak_flops_per_gpu) {
                (Some(mfu), Some(peak)) => format!("{:.1}% of {:.0} TFLOP/s per GPU", mfu * 100.0, peak / 1e12),
                _ if self.device.starts_with("Cuda") => "n/a (this GPU's peak is not in ft's table: set train.peak_tflops)".into(),
                _ => "n/a (CPU)".into(),
            },
        );
        out += &row(
            "GPU utilisation",
            self.gpu_utilisation_per_rank.as_ref().map_or("n/a (no NVML or no GPU)".into(), |u| {
                u.iter().enumerate().map(|(r, u)| format!("rank {r} {u:.0}%")).collect::<Vec<_>>().join(", ")
            }),
        );
        for (rank, m) in self.memory_per_rank.iter().enumerate() {
            out += &row(
                &format!("memory rank {rank} ({})", self.memory_kind),
                format!("peak {:.2} GB, mean {:.2} GB, min {:.2} GB", m.peak / 1e9, m.mean / 1e9, m.min / 1e9),
            );
        }
        if let Some(o) = &self.offload {
            out += &row(
                "offload (rank 0)",
                format!(
                    "waited {:.2} s for the device, host optimizer {:.2} s, moved {:.2} GB to host and {:.2} GB to device",
                    o.wait_seconds,
                    o.cpu_step_seconds,
                    o.device_to_host_bytes / 1e9,
                    o.host_to_device_bytes / 1e9
                ),
            );
        }
        if self.frozen_params > 0 {
            out += &row(
                "parameters",
                format!("{:.2}M trained, {:.2}M frozen", self.trainable_params as f64 / 1e6, self.frozen_params as f64 / 1e6),
            );
        }
        if let Some(reference) = &self.reference {
            out += &row("reference model", reference.kind.clone());
            for (rank, held) in reference.device_bytes_per_rank.iter().zip(&reference.host_bytes_per_rank).enumerate() {
                out += &row(&format!("reference held rank {rank}"), reference_held([*held.0, *held.1]));
            }
        }
        for (rank, m) in self.state_per_rank.iter().enumerate() {
            out += &row(
                &format!("state held rank {rank}"),
                format!(
                    "params {:.1} MB (frozen {:.1} MB), grads {:.1} MB, optimizer {:.1} MB, gathered peak {:.1} MB, of which in host memory {:.1} MB",
                    m.params / 1e6,
                    m.frozen / 1e6,
                    m.grads / 1e6,
                    m.optimizer_state / 1e6,
                    m.gathered_peak / 1e6,
                    m.host / 1e6
                ),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_figures_are_never_nan_or_inf() {
        assert_eq!(per_second(10.0, 4.0), 2.5);
        assert_eq!((per_second(0.0, 0.0), per_second(10.0, 0.0), per_second(10.0, 5e-324)), (0.0, 0.0, 0.0));
        assert_eq!((figure(Some(1.23456), 4), figure(None, 4)), ("1.2346".to_string(), "n/a".to_string()));
        assert_eq!((figure(Some(f64::NAN), 1), figure(Some(f64::INFINITY), 1)), ("n/a (not finite)".into(), "n/a (not finite)".into()));
    }
}
