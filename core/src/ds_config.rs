//! DeepSpeed's `ds_config.json`, read as configuration overrides, so a
//! DeepSpeed user's file runs unchanged: the ZeRO stage picks the strategy,
//! offload, clipping, precision, batch sizes, AdamW and the warm-up schedule
//! map onto ft's keys. Every field ft does not act on is reported with the
//! reason, never silently dropped; fields that would change the result and
//! that ft cannot honour are errors.

use anyhow::{bail, Context, Result};
use figment::value::Value;
use serde_json::Value as Json;
use crate::config::TrainConfig;
use crate::registry::Registry;
use std::path::Path;

/// What a ds_config translates to.
#[derive(Debug, Default)]
pub struct Translation {
    /// Dotted ft config keys and their values.
    pub overrides: Vec<(&'static str, Value)>,
    /// `zero_optimization.stage`, which picks the strategy that is that stage.
    pub zero_stage: Option<u8>,
    /// DeepSpeed's `train_batch_size`, checked against ft's global batch once the world size is known.
    pub train_batch_size: Option<usize>,
    /// Fields read but not acted on, each with why.
    pub ignored: Vec<String>,
}

impl Translation {
    /// Reports (on the rank that `reports`) the fields not acted on, and
    /// refuses a `train_batch_size` that is not micro-batch × accumulation × ranks.
    pub fn check(&self, train: &TrainConfig, world: usize, reports: bool) -> Result<()> {
        if reports {
            for field in &self.ignored {
                tracing::warn!("ds_config field not used: {field}");
            }
        }
        let global = train.batch_size * train.grad_accum * world;
        match self.train_batch_size {
            Some(expected) if expected != global => bail!(
                "ds_config train_batch_size {expected} != micro-batch {} x grad_accum {} x {world} ranks = {global}",
                train.batch_size,
                train.grad_accum
            ),
            _ => Ok(()),
        }
    }
}

/// DeepSpeed lets most numbers be "auto" (filled in by the HF integration): keep ft's value.
fn given(value: &Json) -> Option<&Json> {
    (value.as_str() != Some("auto")).then_some(value)
}

fn number(value: &Json, key: &str) -> Result<f64> {
    value.as_f64().with_context(|| format!("ds_config: {key} must be a number or \"auto\" (got {value})"))
}

fn count(value: &Json, key: &str) -> Result<usize> {
    value.as_u64().map(|v| v as usize).with_context(|| format!("ds_config: {key} must be a non-negative integer or \"auto\" (got {value})"))
}

fn enabled(section: &Json) -> bool {
    section.get("enabled").and_then(|e| e.as_bool().or_else(|| e.as_str().map(|s| s == "true"))).unwrap_or(false)
}

/// Fields ft's unit-by-unit engine makes moot: it gathers, reduces and
/// prefetches one unit (a transformer block) at a time.
const PER_UNIT: [&str; 12] = [
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
    "round_robin_gradients",
];

/// Reads a ds_config; its ZeRO stage selects the registry's strategy of that stage.
pub fn read(path: &Path, registry: &Registry) -> Result<Translation> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read ds_config {}", path.display()))?;
    let json: Json = serde_json::from_str(&text).with_context(|| format!("ds_config {} is not valid JSON", path.display()))?;
    let mut t = translate(&json).with_context(|| format!("in ds_config {}", path.display()))?;
    if let Some(stage) = t.zero_stage {
        let strategy = registry.strategy_for_zero_stage(stage)?;
        t.overrides.push(("train.strategy", strategy.name.clone().into()));
    }
    Ok(t)
}

pub fn translate(json: &Json) -> Result<Translation> {
    let top = json.as_object().context("ds_config must be a JSON object")?;
    let mut t = Translation::default();
    for (key, value) in top {
        let Some(value) = given(value) else { continue };
        match key.as_str() {
            "train_batch_size" => t.train_batch_size = Some(count(value, key)?),
            "train_micro_batch_size_per_gpu" => t.overrides.push(("train.batch_size", count(value, key)?.into())),
            "gradient_accumulation_steps" => t.overrides.push(("train.grad_accum", count(value, key)?.into())),
            "gradient_clipping" => t.overrides.push(("train.max_grad_norm", number(value, key)?.into())),
            "steps_per_print" => t.overrides.push(("train.log_every", count(value, key)?.into())),
            "bf16" => {
                if enabled(value) {
                    t.overrides.push(("train.dtype", "bf16".into()));
                }
            }
            "fp16" => {
                if enabled(value) {
                    t.overrides.push(("train.dtype", "fp16".into()));
                    if let Some(power) = value.get("initial_scale_power").and_then(given) {
                        t.overrides.push(("train.initial_loss_scale", 2f64.powf(number(power, "fp16.initial_scale_power")?).into()));
                    }
                    for field in ["loss_scale_window", "hysteresis", "min_loss_scale", "loss_scale"] {
                        if value.get(field).is_some() {
                            t.ignored.push(format!(
                                "fp16.{field}: ft's dynamic scale halves on overflow and doubles after 2000 clean steps (torch.amp's rule)"
                            ));
                        }
                    }
                }
            }
            "zero_optimization" => zero(value, &mut t)?,
            "optimizer" => optimizer(value, &mut t)?,
            "scheduler" => scheduler(value, &mut t)?,
            "wall_clock_breakdown" | "zero_allow_untested_optimizer" | "prescale_gradients" | "communication_data_type" => {
                t.ignored.push(format!("{key}: not used by ft (see `ft train --help` for its equivalents)"))
            }
            other => t.ignored.push(format!("{other}: not a DeepSpeed field ft supports")),
        }
    }
    Ok(t)
}

fn zero(section: &Json, t: &mut Translation) -> Result<()> {
    let section = section.as_object().context("zero_optimization must be an object")?;
    for (key, value) in section {
        let Some(value) = given(value) else { continue };
        match key.as_str() {
            "stage" => {
                let stage = count(value, "zero_optimization.stage")?;
                if stage > 3 {
                    bail!("zero_optimization.stage {stage} does not exist (0 to 3)");
                }
                t.zero_stage = Some(stage as u8);
            }
            "offload_optimizer" | "offload_param" => {
                let device = value.get("device").and_then(Json::as_str).unwrap_or("none");
                match device {
                    "none" => {}
                    "cpu" => t.overrides.push(("train.offload", "cpu".into())),
                    other => bail!("zero_optimization.{key}.device {other:?}: ft offloads to cpu only"),
                }
                for field in value.as_object().into_iter().flatten().map(|(k, _)| k).filter(|k| *k != "device") {
                    t.ignored.push(format!("zero_optimization.{key}.{field}: ft's offload always uses pinned memory and its own CPU AdamW"));
                }
            }
            name if PER_UNIT.contains(&name) => t.ignored.push(format!(
                "zero_optimization.{name}: ft gathers, reduces and prefetches one unit (transformer block) at a time, overlapped with compute"
            )),
            other => t.ignored.push(format!("zero_optimization.{other}: not supported by ft")),
        }
    }
    Ok(())
}

fn optimizer(section: &Json, t: &mut Translation) -> Result<()> {
    let kind = section.get("type").and_then(Json::as_str).unwrap_or("AdamW");
    if !matches!(kind.to_ascii_lowercase().as_str(), "adamw" | "adam") {
        bail!("optimizer.type {kind:?}: ft trains with AdamW only");
    }
    let Some(params) = section.get("params").and_then(Json::as_object) else { return Ok(()) };
    for (key, value) in params {
        let Some(value) = given(value) else { continue };
        match key.as_str() {
            "lr" => t.overrides.push(("train.lr", number(value, "optimizer.params.lr")?.into())),
            "eps" => t.overrides.push(("train.adam_eps", number(value, "optimizer.params.eps")?.into())),
            "weight_decay" => t.overrides.push(("train.weight_decay", number(value, "optimizer.params.weight_decay")?.into())),
            "betas" => {
                let betas = value.as_array().filter(|b| b.len() == 2).context("optimizer.params.betas must be [beta1, beta2]")?;
                t.overrides.push(("train.adam_beta1", number(&betas[0], "optimizer.params.betas[0]")?.into()));
                t.overrides.push(("train.adam_beta2", number(&betas[1], "optimizer.params.betas[1]")?.into()));
            }
            other => t.ignored.push(format!("optimizer.params.{other}: not an AdamW setting ft has")),
        }
    }
    Ok(())
}

fn scheduler(section: &Json, t: &mut Translation) -> Result<()> {
    let kind = section.get("type").and_then(Json::as_str).unwrap_or("");
    let schedule = match kind {
        "WarmupLR" => "constant",
        "WarmupDecayLR" => "linear",
        "WarmupCosineLR" => "cosine",
        other => bail!("scheduler.type {other:?}: ft has WarmupLR, WarmupDecayLR and WarmupCosineLR (warm-up then constant, linear or cosine)"),
    };
    t.overrides.push(("train.schedule", schedule.into()));
    let Some(params) = section.get("params").and_then(Json::as_object) else { return Ok(()) };
    for (key, value) in params {
        let Some(value) = given(value) else { continue };
        match key.as_str() {
            "warmup_num_steps" => t.overrides.push(("train.warmup_steps", count(value, "scheduler.params.warmup_num_steps")?.into())),
            "warmup_max_lr" => t.overrides.push(("train.lr", number(value, "scheduler.params.warmup_max_lr")?.into())),
            "total_num_steps" => t.ignored.push("scheduler.params.total_num_steps: ft derives it from epochs and the data".into()),
            other => t.ignored.push(format!("scheduler.params.{other}: not supported by ft (warm-up is linear from 0)")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(t: &Translation) -> Vec<(String, String)> {
        t.overrides.iter().map(|(k, v)| (k.to_string(), format!("{v:?}"))).collect()
    }

    #[test]
    fn a_typical_zero3_offload_config_maps_and_reports_the_rest() {
        let json = serde_json::json!({
            "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
            "gradient_clipping": 1.0, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                                   "overlap_comm": true, "stage3_prefetch_bucket_size": 5e7},
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
            "flops_profiler": {"enabled": false}
        });
        let t = translate(&json).unwrap();
        let keys = keys(&t);
        let has = |k: &str| keys.iter().any(|(key, _)| key == k);
        for k in ["train.batch_size", "train.max_grad_norm", "train.dtype", "train.offload", "train.lr", "train.adam_beta2", "train.weight_decay", "train.schedule", "train.warmup_steps"] {
            assert!(has(k), "{k} missing from {keys:?}");
        }
        assert!(!has("train.grad_accum"), "\"auto\" keeps ft's value");
        assert_eq!(t.zero_stage, Some(3));
        assert_eq!(t.train_batch_size, Some(32));
        let ignored = t.ignored.join("\n");
        for field in ["zero_optimization.offload_optimizer.pin_memory", "zero_optimization.overlap_comm", "zero_optimization.stage3_prefetch_bucket_size", "scheduler.params.total_num_steps", "flops_profiler"] {
            assert!(ignored.contains(field), "{field} not reported in:\n{ignored}");
        }
    }

    #[test]
    fn settings_ft_cannot_honour_are_errors() {
        let err = |json: Json| format!("{:#}", translate(&json).unwrap_err());
        assert!(err(serde_json::json!({"zero_optimization": {"stage": 4}})).contains("stage 4 does not exist"));
        assert!(err(serde_json::json!({"optimizer": {"type": "Lamb"}})).contains("AdamW only"));
        assert!(err(serde_json::json!({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})).contains("cpu only"));
        assert!(err(serde_json::json!({"train_micro_batch_size_per_gpu": "four"})).contains("non-negative integer"));
    }
}
