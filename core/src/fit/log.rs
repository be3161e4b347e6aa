//! The run's log: each logged step's record (loss, learning rate, gradient
//! norm, time, memory, offload traffic) and each epoch's evaluation go to
//! the sinks on rank 0 (every `train.log_every` steps), and every step to
//! its progress (`crate::progress`, which decides what a person reads);
//! every rank keeps the counters the summary is made of.

use super::evaluation::Evaluation;
use super::float8_guard::{Diverged, Float8Guard};
use super::summary::{memory, EpochResult, RunTotals, Summary};
use super::StepOutcome;
use crate::config::TrainConfig;
use crate::distributed::comm::Communicator;
use crate::metrics::{MetricsSink, Record};
use crate::progress::{self, Progress};
use crate::task::StepMetrics;
use crate::train::OffloadStats;
use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Instant;

pub(crate) struct RunLog<'a> {
    sinks: Vec<Box<dyn MetricsSink>>,
    progress: Progress,
    comm: &'a Communicator,
    offload_to_host: bool,
    log_every: usize,
    /// The loss of the epoch's last logged step.
    epoch_loss: Option<f64>,
    /// Bytes this rank sent in collectives during the last step.
    last_step_sent: u64,
    /// The objective's figures of the steps since the last logged one.
    metrics: StepMetrics,
    totals: RunTotals,
    /// Under `--fp8`: the casts' amaxes, checked and summarised at each logged step.
    float8: Option<Float8Guard>,
}

impl<'a> RunLog<'a> {
    /// A log for a run that ends at optimizer step `last_step` (where its progress ends).
    pub fn new(sinks: Vec<Box<dyn MetricsSink>>, comm: &'a Communicator, offload_to_host: bool, last_step: usize, config: &TrainConfig) -> RunLog<'a> {
        let progress = Progress::new(comm.env().rank, last_step, std::time::Duration::from_secs_f64(config.log_seconds));
        RunLog { sinks, progress, comm, offload_to_host, log_every: config.log_every.max(1), epoch_loss: None, last_step_sent: 0, metrics: StepMetrics::default(), totals: RunTotals::default(), float8: None }
    }

    /// Guards the float8 casts' numerics (`float8_guard`) from the next step on.
    pub fn guard_float8(&mut self, guard: Float8Guard) {
        self.float8 = Some(guard);
    }

    /// Before a training step: what other forwards recorded is not the step's.
    pub fn before_step(&mut self) {
        if let Some(guard) = &mut self.float8 {
            guard.before_step();
        }
    }

    /// Gives the sinks the run's resolved configuration, before any record.
    pub fn params(&mut self, params: &BTreeMap<String, String>) -> Result<()> {
        for sink in &mut self.sinks {
            sink.params(params)?;
        }
        Ok(())
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        for sink in &mut self.sinks {
            sink.record(record)?;
        }
        Ok(())
    }

    /// Counts what a training step sent (`Communicator::bytes_sent` before and after it).
    pub fn count_sent(&mut self, before: [u64; 4], after: [u64; 4]) {
        for (total, (b, a)) in self.totals.comm_bytes.iter_mut().zip(before.iter().zip(after)) {
            *total += a - b;
        }
        self.last_step_sent = after.iter().sum::<u64>() - before.iter().sum::<u64>();
    }

    /// Counts optimizer step `step`, shows it in the progress, and logs it
    /// every `log_every` steps and at the end of an epoch (reading the loss
    /// synchronises with the device).
    #[allow(clippy::too_many_arguments)]
    pub fn after_step(
        &mut self,
        step: usize,
        epoch_progress: f64,
        last_of_epoch: bool,
        lr: f64,
        outcome: &StepOutcome,
        started: Instant,
        offloaded_before: OffloadStats,
        offloaded: OffloadStats,
    ) -> Result<()> {
        let (in_use, _) = memory(self.comm.device());
        let t = &mut self.totals;
        t.memory_sum += in_use;
        t.memory_min = Some(t.memory_min.map_or(in_use, |m| m.min(in_use)));
        t.memory_samples += 1;
        t.examples += outcome.examples;
        t.tokens += outcome.tokens;
        t.flops += outcome.flops;
        t.steps += 1;
        self.metrics.add(outcome.metrics.clone());
        if let Some(guard) = &mut self.float8 {
            guard.after_step(step);
        }
        let mut shown = progress::Step { step, epoch: epoch_progress, loss: None, lr, tokens: outcome.tokens, seconds: 0.0, memory: in_use, epoch_end: last_of_epoch };
        if step % self.log_every != 0 && !last_of_epoch {
            shown.seconds = started.elapsed().as_secs_f64();
            self.totals.train_seconds += shown.seconds;
            self.progress.after_step(shown);
            return Ok(());
        }
        // The step's loss, its non-padding tokens and the objective's figures over every rank, in one reduction.
        let metrics = std::mem::take(&mut self.metrics);
        let mut local = vec![outcome.loss.double_value(&[]), outcome.tokens as f64, metrics.count];
        local.extend(metrics.sums.values());
        local.extend(metrics.counts.values());
        // The model's auxiliary loss (a router's load balancing), when it adds one: every rank's share.
        let auxiliary = outcome.auxiliary.as_ref().map(|(share, _)| share.double_value(&[]));
        local.extend(auxiliary);
        // Under --fp8, whether this rank saw a non-finite amax, last: every rank stops together.
        let (diverged, float8_values) = self.float8.as_mut().map(Float8Guard::check).transpose()?.unwrap_or_default();
        if self.float8.is_some() {
            local.push(diverged.is_some() as u8 as f64);
        }
        let summed = self.comm.sum_over_ranks(&local)?;
        let (loss, tokens, count) = (summed[0], summed[1], summed[2]);
        if self.float8.is_some() {
            if let Some(problem) = diverged {
                return Err(Diverged(problem).into());
            }
            let ranks = summed[summed.len() - 1];
            if ranks > 0.0 {
                let problem = format!("float8 numerics guard: {ranks} other rank(s) found a NaN or infinite amax by step {step} (their errors name the layer); the run stops before saving this step");
                return Err(Diverged(problem).into());
            }
            if !loss.is_finite() {
                let problem = format!("float8 numerics guard: the loss at step {step} is {loss} while every float8 cast's amax was finite: the loss or the layers outside float8 (the LM head, norms) diverged; the run stops before saving this step");
                return Err(Diverged(problem).into());
            }
        }
        self.totals.train_seconds += started.elapsed().as_secs_f64();
        (self.totals.last_loss, self.epoch_loss) = (Some(loss), Some(loss));
        let mut values = BTreeMap::from([
            ("epoch".to_string(), epoch_progress),
            ("loss".to_string(), loss),
            ("lr".to_string(), lr),
            ("grad_norm".to_string(), outcome.grad_norm.double_value(&[])),
            ("step_seconds".to_string(), started.elapsed().as_secs_f64()),
            ("tokens".to_string(), tokens),
            ("memory_bytes".to_string(), in_use),
        ]);
        // Averaged over the examples of every step since the last logged one, as TRL averages its logging window.
        // A figure with its own count is logged only where something was counted.
        let counts: BTreeMap<&String, f64> = metrics.counts.keys().zip(&summed[3 + metrics.sums.len()..]).map(|(name, &count)| (name, count)).collect();
        for (name, sum) in metrics.sums.keys().zip(&summed[3..]) {
            match counts.get(name) {
                Some(&own) if own > 0.0 => values.insert(name.clone(), sum / own),
                Some(_) => None,
                None => values.insert(name.clone(), sum / count.max(1.0)),
            };
        }
        if let Some((_, figures)) = &outcome.auxiliary {
            // Of the logged step: `loss` includes it times the model's coefficient (router_aux_loss_coef).
            values.insert("aux_loss".to_string(), summed[3 + metrics.sums.len() + metrics.counts.len()]);
            // Already over every rank (the statistics were summed before they weighed anything).
            values.extend(figures.iter().map(|(name, value)| (name.clone(), value.double_value(&[]))));
        }
        values.extend(float8_values);
        if let Some(seconds) = outcome.rollout_seconds {
            // Online RL: the step's sampling, and its share of the step.
            values.insert("rollout/seconds".to_string(), seconds);
            values.insert("rollout/share".to_string(), seconds / started.elapsed().as_secs_f64());
        }
        if self.comm.env().world_size > 1 {
            values.insert("comm_bytes".to_string(), self.last_step_sent as f64);
        }
        if self.offload_to_host {
            // What this step moved between device and host, and its host optimizer time.
            values.extend([
                ("offload_wait_seconds".to_string(), offloaded.wait_seconds - offloaded_before.wait_seconds),
                ("offload_cpu_step_seconds".to_string(), offloaded.cpu_step_seconds - offloaded_before.cpu_step_seconds),
                ("offload_d2h_bytes".to_string(), offloaded.device_to_host_bytes - offloaded_before.device_to_host_bytes),
                ("offload_h2d_bytes".to_string(), offloaded.host_to_device_bytes - offloaded_before.host_to_device_bytes),
            ]);
        }
        if self.comm.env().rank == 0 {
            self.record(&Record { step: step as u64, values })?;
        }
        (shown.loss, shown.seconds) = (Some(loss), started.elapsed().as_secs_f64());
        self.progress.after_step(shown);
        Ok(())
    }

    /// Logs an evaluation after optimizer step `step`, `epoch_progress` epochs into the run.
    pub fn after_eval(&mut self, epoch_progress: f64, step: usize, evaluation: &Evaluation) -> Result<()> {
        self.totals.eval_seconds += evaluation.seconds;
        self.totals.eval_examples += evaluation.examples;
        if self.comm.env().rank == 0 {
            let mut values = BTreeMap::from([("epoch".to_string(), epoch_progress), ("eval_samples".to_string(), evaluation.examples as f64)]);
            values.extend(evaluation.loss.map(|l| ("eval_loss".to_string(), l)));
            values.extend(evaluation.scores.values.iter().map(|(k, v)| (format!("eval_{k}"), *v)));
            self.record(&Record { step: step as u64, values })?;
        }
        Ok(())
    }

    /// Logs epoch `epoch`'s evaluation (after optimizer step `step`, at
    /// `epoch_progress`: less than `epoch` when `train.max_steps` ended it early).
    pub fn after_epoch(&mut self, epoch: usize, epoch_progress: f64, step: usize, evaluation: &Evaluation) -> Result<EpochResult> {
        self.after_eval(epoch_progress, step, evaluation)?;
        Ok(EpochResult {
            epoch,
            train_loss: self.epoch_loss.take(),
            eval_loss: evaluation.loss,
            scores: evaluation.scores.values.clone(),
        })
    }

    /// This rank's counters over the run.
    pub fn totals(&self) -> &RunTotals {
        &self.totals
    }

    /// Gives the sinks the run's summary and flushes them.
    pub fn finish(mut self, summary: &Summary) -> Result<()> {
        self.progress.finish();
        let summary = serde_json::to_value(summary)?;
        for sink in &mut self.sinks {
            sink.summary(&summary)?;
            sink.finish()?;
        }
        Ok(())
    }
}
