//! `ft bench --plan-check`: each measured row beside the plan's prediction
//! for the same model, strategy, offload, GPUs, batch and length.

use super::{predict, Calibration, Cluster, Setup, Workload};
use crate::bench::{model_label, Row};
use crate::gpu::GpuSpec;
use crate::model::Model;
use crate::registry::Registry;
use anyhow::{Context, Result};
use serde::Serialize;
use tch::Kind;

/// How close predictions must come to `ft bench`'s measurements: peak
/// allocated memory within 10%, step time within 25%.
pub const MEMORY_TOLERANCE: f64 = 0.10;
pub const TIME_TOLERANCE: f64 = 0.25;

/// One measured row and its prediction.
#[derive(Debug, Clone, Serialize)]
pub struct CheckedRow {
    pub model: String,
    pub strategy: String,
    pub expert_parallel: usize,
    pub offload: String,
    pub activation_checkpointing: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_layers: Option<usize>,
    pub gpus: usize,
    pub batch: i64,
    pub seq: i64,
    pub measured_peak_allocated_gb: f64,
    pub predicted_peak_allocated_gb: f64,
    pub measured_step_ms: f64,
    pub predicted_step_ms: f64,
}

impl CheckedRow {
    /// (predicted − measured) / measured, for memory and for time.
    pub fn errors(&self) -> (f64, f64) {
        let error = |predicted: f64, measured: f64| (predicted - measured) / measured;
        (error(self.predicted_peak_allocated_gb, self.measured_peak_allocated_gb), error(self.predicted_step_ms, self.measured_step_ms))
    }

    pub fn within_tolerance(&self) -> bool {
        let (memory, time) = self.errors();
        memory.abs() <= MEMORY_TOLERANCE && time.abs() <= TIME_TOLERANCE
    }
}

/// What `ft bench` ran every row with, besides what a row records.
pub struct BenchSettings<'a> {
    /// The GPUs, all on one node.
    pub gpu: &'a GpuSpec,
    pub dtype: Kind,
    pub loss_chunk_tokens: i64,
    pub shard_group_size: Option<usize>,
    /// `ft calibrate`'s rates in place of the table's.
    pub calibration: Option<&'a Calibration>,
    /// The blocks' float8 linear layers (`--fp8`: those `ft train` casts by default) and float8 gathers.
    pub float8: Option<ft_sys::float8::Float8>,
    pub float8_gathers: bool,
}

/// `ft bench --plan-check`'s report: [`check_rows`] as [`check_table`],
/// said to use the rates measured in the calibration file at `calibration` where given.
pub fn check_report(rows: &[Row], models: &[&dyn Model], registry: &Registry, settings: &BenchSettings, calibration: Option<&std::path::Path>) -> Result<String> {
    let checked = check_rows(rows, models, registry, settings);
    let (checked, header) = match (calibration, settings.calibration) {
        (Some(path), Some(measured)) => {
            let checked = checked.with_context(|| format!("--calibration {}", path.display()))?;
            (checked, format!("\nplan check with the rates measured on {} ({})\n", measured.device, path.display()))
        }
        _ => (checked?, String::new()),
    };
    Ok(header + &check_table(&checked))
}

/// The rows that ran beside their predictions; `models` are the
/// configurations they measured.
pub fn check_rows(rows: &[Row], models: &[&dyn Model], registry: &Registry, settings: &BenchSettings) -> Result<Vec<CheckedRow>> {
    let BenchSettings { gpu, dtype, loss_chunk_tokens, shard_group_size, calibration, float8, float8_gathers } = *settings;
    let mut checked = vec![];
    // Rows through a communication plug-in are left out: a bench row does not record the hook's options.
    for row in rows.iter().filter(|r| r.error.is_none() && r.comm == crate::distributed::comm_hook::BUILTIN) {
        let model = *models
            .iter()
            .find(|m| model_label(**m) == row.model)
            .with_context(|| format!("row of {}: give its model's configuration with --config", row.model))?;
        let strategy = registry.strategy(&row.strategy)?;
        let offload = registry.offload(&row.offload)?;
        let float8 = float8.map(|float8| crate::train::float8_layers(model, float8, None));
        let workload = Workload {
            model,
            batch: row.batch,
            seq: row.seq,
            grad_accum: 1,
            dtype,
            reduce_dtype: row.reduce_dtype,
            loss_chunk_tokens,
            shard_group_size,
            // `ft bench --task dpo` times pairs with their reference log-probabilities given: nothing of it runs in a step.
            reference: None,
            rollout: None,
            float8: float8.as_ref(),
            float8_gathers,
        };
        let mut cluster = Cluster::new(gpu, row.gpus, 1, dtype)?;
        if let Some(calibration) = calibration {
            cluster.use_calibration(calibration, &workload)?;
        }
        let setup = Setup {
            strategy: &strategy.name,
            policy: (strategy.create)().policy(),
            offload: offload.name,
            offload_to_host: (offload.create)().to_host(),
            activation_checkpointing: row.activation_checkpointing,
            checkpoint_layers: row.checkpoint_layers,
            comm: None,
            expert_parallel: row.expert_parallel,
        };
        let predicted = predict(&workload, &cluster, &setup)?;
        checked.push(CheckedRow {
            model: row.model.clone(),
            strategy: row.strategy.clone(),
            expert_parallel: row.expert_parallel,
            offload: row.offload.clone(),
            activation_checkpointing: row.activation_checkpointing,
            checkpoint_layers: row.checkpoint_layers,
            gpus: row.gpus,
            batch: row.batch,
            seq: row.seq,
            measured_peak_allocated_gb: row.peak_allocated_gb,
            predicted_peak_allocated_gb: predicted.peak_allocated_bytes / 1e9,
            measured_step_ms: row.step_ms,
            predicted_step_ms: predicted.step_seconds * 1e3,
        });
    }
    Ok(checked)
}

/// The rows as a Markdown table, and how many are within tolerance.
pub fn check_table(rows: &[CheckedRow]) -> String {
    let mut out = String::from(
        "\n| model | strategy | offload | ckpt | GPUs | batch x seq | peak alloc GB measured / predicted | error | step ms measured / predicted | error | within ±10% / ±25% |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let (memory, time) = r.errors();
        out += &format!(
            "| {} | {} | {} | {} | {} | {}x{} | {:.2} / {:.2} | {:+.1}% | {:.1} / {:.1} | {:+.1}% | {} |\n",
            r.model,
            r.strategy.clone() + &if r.expert_parallel > 1 { format!(" ep{}", r.expert_parallel) } else { String::new() },
            r.offload,
            super::checkpointing_label(r.activation_checkpointing, r.checkpoint_layers),
            r.gpus,
            r.batch,
            r.seq,
            r.measured_peak_allocated_gb,
            r.predicted_peak_allocated_gb,
            memory * 100.0,
            r.measured_step_ms,
            r.predicted_step_ms,
            time * 100.0,
            if r.within_tolerance() { "yes" } else { "no" }
        );
    }
    let within = rows.iter().filter(|r| r.within_tolerance()).count();
    out += &format!("\nplan check: {within} of {} rows within ±10% peak memory and ±25% step time\n", rows.len());
    out
}
