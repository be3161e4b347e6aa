//! Checkpoints: a directory per save, `<output>/checkpoints/step-NNNNNNNN/`,
//! holding `state.safetensors` (each unit's fp32 master, AdamW moments),
//! `manifest.json` (step, data cursor, unit layout, world, model config) and
//! the tokenizer. A save is written into a hidden temporary directory,
//! fsynced, then renamed into place, so a crash at any moment leaves the last
//! complete checkpoint as it was; readers never see a partial one.

use crate::flat::unflatten;
use crate::model::Model;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use tch::Tensor;

pub const FORMAT_VERSION: u32 = 1;

/// What each unit stores, in `State::units` order.
const STATE_KINDS: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// A unit's name and size: what a checkpoint must match to load into a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitLayout {
    pub name: String,
    pub numel: i64,
}

impl UnitLayout {
    pub fn of(model: &dyn Model) -> Vec<UnitLayout> {
        model.units().iter().map(|u| UnitLayout { name: u.name.clone(), numel: u.numel() }).collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub ft_version: String,
    /// Optimizer steps taken.
    pub step: usize,
    /// The data cursor: the epoch, and global batches done in it.
    pub epoch: usize,
    pub epoch_step: usize,
    pub micro_steps: i64,
    pub world_size: usize,
    /// The strategy that wrote it (the state itself is whole, whatever the strategy).
    pub strategy: String,
    pub units: Vec<UnitLayout>,
    pub model_config: serde_json::Value,
}

pub fn checkpoints_dir(output: &Path) -> PathBuf {
    output.join("checkpoints")
}

/// A checkpoint directory's name.
pub fn name_of(step: usize) -> String {
    format!("step-{step:08}")
}

/// Complete checkpoints under `output`, oldest first (temporary ones are not listed).
pub fn list(output: &Path) -> Result<Vec<PathBuf>> {
    let dir = checkpoints_dir(output);
    if !dir.exists() {
        return Ok(vec![]);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("step-")))
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    found.sort();
    Ok(found)
}

/// `latest` (the newest complete checkpoint under `output`) or a directory.
pub fn resolve(spec: &str, output: &Path) -> Result<PathBuf> {
    if spec == "latest" {
        return list(output)?
            .pop()
            .with_context(|| format!("--resume latest: no complete checkpoint under {}", checkpoints_dir(output).display()));
    }
    let path = PathBuf::from(spec);
    if !path.join("manifest.json").is_file() {
        bail!("--resume {spec}: {} is not a checkpoint (no manifest.json)", path.display());
    }
    Ok(path)
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("cannot sync {}", dir.display()))
}

/// A fault-injection point for crash tests: `FT_FAULT_INJECT=<point>:<step>`
/// aborts the process there, as a crash or a kill would.
pub fn fault_point(point: &str, step: usize) {
    if let Ok(spec) = std::env::var("FT_FAULT_INJECT") {
        if spec == format!("{point}:{step}") {
            eprintln!("FT_FAULT_INJECT: aborting at {point} of step {step}");
            std::process::abort();
        }
    }
}

/// The state a checkpoint holds: per unit the whole fp32 [master, exp_avg,
/// exp_avg_sq] (`Trainer::whole_state`), and AdamW's step count. Whole, so
/// a run resumes under any strategy and world size.
pub struct State<'a> {
    pub units: &'a [[Tensor; 3]],
    pub adamw_step: &'a Tensor,
}

/// Writes `state` as checkpoint `manifest.step` under `output`.
pub fn save(output: &Path, state: &State, manifest: &Manifest, tokenizer: Option<&Path>) -> Result<PathBuf> {
    let dir = checkpoints_dir(output);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let final_path = dir.join(name_of(manifest.step));
    let temporary = dir.join(format!(".{}.tmp-{}", name_of(manifest.step), std::process::id()));
    if temporary.exists() {
        std::fs::remove_dir_all(&temporary)?;
    }
    std::fs::create_dir_all(&temporary)?;
    let mut tensors: Vec<(String, Tensor)> = vec![];
    for (index, unit) in state.units.iter().enumerate() {
        for (kind, tensor) in STATE_KINDS.iter().zip(unit) {
            tensors.push((format!("unit{index}.{kind}"), tensor.to_device(tch::Device::Cpu)));
        }
    }
    tensors.push(("adamw.step".into(), state.adamw_step.to_device(tch::Device::Cpu)));
    let state = temporary.join("state.safetensors");
    Tensor::write_safetensors(&tensors, &state).with_context(|| format!("cannot write {}", state.display()))?;
    std::fs::write(temporary.join("manifest.json"), serde_json::to_string_pretty(manifest)?)?;
    if let Some(tokenizer) = tokenizer {
        std::fs::copy(tokenizer, temporary.join("tokenizer.json"))?;
    }
    for file in std::fs::read_dir(&temporary)?.flatten() {
        File::open(file.path())?.sync_all()?;
    }
    sync_dir(&temporary)?;
    fault_point("checkpoint-before-rename", manifest.step);
    if final_path.exists() {
        std::fs::remove_dir_all(&final_path)?;
    }
    std::fs::rename(&temporary, &final_path)
        .with_context(|| format!("cannot move {} to {}", temporary.display(), final_path.display()))?;
    sync_dir(&dir)?;
    Ok(final_path)
}

/// Deletes every checkpoint under `output` but the newest `keep_latest`
/// (0 keeps all) and the steps in `keep` (the best ones).
pub fn prune(output: &Path, keep_latest: usize, keep: &[usize]) -> Result<()> {
    if keep_latest == 0 {
        return Ok(());
    }
    let all = list(output)?;
    let kept: Vec<PathBuf> = keep.iter().map(|&step| checkpoints_dir(output).join(name_of(step))).collect();
    for old in all[..all.len().saturating_sub(keep_latest)].iter().filter(|p| !kept.contains(p)) {
        std::fs::remove_dir_all(old).with_context(|| format!("cannot remove old checkpoint {}", old.display()))?;
    }
    Ok(())
}

/// A checkpoint kept for its monitored score (`train.save_best`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BestCheckpoint {
    pub step: usize,
    pub epoch: usize,
    pub monitor: String,
    pub score: f64,
    pub dir: PathBuf,
}

fn best_file(output: &Path) -> PathBuf {
    checkpoints_dir(output).join("best.json")
}

/// The best checkpoints recorded under `output`, best first (none yet: empty).
pub fn read_best(output: &Path) -> Result<Vec<BestCheckpoint>> {
    let path = best_file(output);
    if !path.exists() {
        return Ok(vec![]);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not ft's list of best checkpoints", path.display()))
}

/// Records the best checkpoints, replacing the file atomically.
pub fn write_best(output: &Path, best: &[BestCheckpoint]) -> Result<()> {
    let path = best_file(output);
    let temporary = path.with_extension("json.tmp");
    std::fs::write(&temporary, serde_json::to_string_pretty(best)?).with_context(|| format!("cannot write {}", temporary.display()))?;
    File::open(&temporary)?.sync_all()?;
    std::fs::rename(&temporary, &path).with_context(|| format!("cannot move {} to {}", temporary.display(), path.display()))
}

pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let manifest: Manifest = serde_json::from_str(&text).with_context(|| format!("{} is not a valid ft manifest", path.display()))?;
    if manifest.format_version != FORMAT_VERSION {
        bail!("{} has checkpoint format {}, this ft reads {FORMAT_VERSION}", path.display(), manifest.format_version);
    }
    Ok(manifest)
}

/// Checks that a checkpoint was made for this model's unit layout.
pub fn check_layout(manifest: &Manifest, expected: &[UnitLayout], dir: &Path) -> Result<()> {
    if manifest.units != expected {
        let describe = |u: &[UnitLayout]| u.iter().map(|l| format!("{} ({})", l.name, l.numel)).collect::<Vec<_>>().join(", ");
        bail!(
            "checkpoint {} was written for another model: its units are [{}], this model's are [{}]",
            dir.display(),
            describe(&manifest.units),
            describe(expected)
        );
    }
    Ok(())
}

/// What a checkpoint restores: per unit the whole fp32 [master, exp_avg,
/// exp_avg_sq] as `State` saved them, and AdamW's step count.
pub struct SavedState {
    pub units: Vec<Vec<Tensor>>,
    pub adamw_step: Tensor,
}

/// Reads checkpoint `dir` (written by `save`) for `model`.
pub fn read_state(dir: &Path, model: &dyn Model) -> Result<(Manifest, SavedState)> {
    let manifest = read_manifest(dir)?;
    check_layout(&manifest, &UnitLayout::of(model), dir)?;
    let path = dir.join("state.safetensors");
    let mut tensors: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
        .with_context(|| format!("cannot read {} (truncated or corrupt?)", path.display()))?
        .into_iter()
        .collect();
    let mut take = |name: &str| tensors.remove(name).with_context(|| format!("{} has no tensor {name}", path.display()));
    let units = (0..model.units().len())
        .map(|index| STATE_KINDS.iter().map(|kind| take(&format!("unit{index}.{kind}"))).collect::<Result<Vec<_>>>())
        .collect::<Result<Vec<_>>>()?;
    let adamw_step = take("adamw.step")?;
    Ok((manifest, SavedState { units, adamw_step }))
}

/// The model parameters (fp32, shaped per `model`'s units) stored in checkpoint `dir`.
pub fn load_params(dir: &Path, model: &dyn Model) -> Result<Vec<Vec<Tensor>>> {
    let manifest = read_manifest(dir)?;
    check_layout(&manifest, &UnitLayout::of(model), dir)?;
    let path = dir.join("state.safetensors");
    let mut tensors: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
        .with_context(|| format!("cannot read {} (truncated or corrupt?)", path.display()))?
        .into_iter()
        .collect();
    model
        .units()
        .iter()
        .enumerate()
        .map(|(index, spec)| {
            let name = format!("unit{index}.master");
            let flat = tensors.remove(&name).with_context(|| format!("{} has no tensor {name}", path.display()))?;
            Ok(unflatten(spec, &flat))
        })
        .collect()
}
