//! Checkpoints: a directory per save, `<output>/checkpoints/step-NNNNNNNN/`,
//! holding one safetensors file per rank (`rank-00003-of-00004.safetensors`:
//! the elements of each unit's fp32 master and AdamW moments that rank
//! owns), `manifest.json` (step, data cursor and the `data.range` it walks,
//! world, strategy, shard group, each unit's parameters with their offsets
//! in its flat buffer and which element range each file holds, model
//! config) and the files an export needs besides the weights (the
//! tokenizer, its config, the chat template). Every
//! rank writes its own part in parallel — nothing is gathered — and a reader
//! of any world size and strategy reads only the ranges it owns (the
//! safetensors header gives each tensor's offset). A save is written into a
//! hidden temporary directory, fsynced, and renamed into place by rank 0
//! once every rank's part and the manifest are there, so a crash at any
//! moment leaves the last complete checkpoint as it was; readers never see
//! a partial one. Format 1 (one whole `state.safetensors`) is still read.

use crate::distributed::comm::Communicator;
use crate::distributed::flat::{param_offsets, unflatten};
use crate::model::Model;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Kind, Tensor};

pub const FORMAT_VERSION: u32 = 2;

/// The format before rank files: every unit whole in one `WHOLE_FILE`, written by rank 0.
const WHOLE_FILE_FORMAT: u32 = 1;
const WHOLE_FILE: &str = "state.safetensors";

/// What each unit stores, in the order `Trainer::checkpoint_part` gives them.
const STATE_KINDS: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// AdamW's step count, in rank 0's file (and format 1's whole file).
const ADAMW_STEP: &str = "adamw.step";
/// fp16's dynamic loss scale and its growth tracker, as two fp32 values.
const LOSS_SCALE: &str = "loss_scale";
/// The prefix of the communication hook's state in a rank's file.
const COMM_STATE: &str = "comm.";

/// Where a parameter sits in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamLayout {
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: i64,
}

/// Elements `start..start + len` of a unit's flat buffers, held by `Manifest::files[file]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardRange {
    pub file: usize,
    pub start: i64,
    pub len: i64,
}

/// A unit's name, size and layout: what a checkpoint must match to load
/// into a model; and where its state is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitLayout {
    pub name: String,
    pub numel: i64,
    /// Its parameters in flat-buffer order (format 1 did not record them).
    #[serde(default)]
    pub params: Vec<ParamLayout>,
    /// Which file holds which elements, in order, covering `0..numel` once
    /// (none for a frozen unit).
    #[serde(default)]
    pub shards: Vec<ShardRange>,
    /// Not trained (LoRA's base): its parameters are the base model's files, not here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub frozen: bool,
}

impl UnitLayout {
    /// `model`'s units, with no state placed yet.
    pub fn of(model: &dyn Model) -> Vec<UnitLayout> {
        model
            .units()
            .iter()
            .enumerate()
            .map(|(index, u)| UnitLayout {
                name: u.name.clone(),
                numel: u.numel(),
                params: param_offsets(u)
                    .into_iter()
                    .map(|(i, offset)| ParamLayout { name: u.params[i].name.clone(), shape: u.params[i].shape.clone(), offset })
                    .collect(),
                shards: vec![],
                frozen: model.frozen(index),
            })
            .collect()
    }
}

fn one() -> usize {
    1
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
    /// The training file's examples the cursor walks (`data.range`; None:
    /// all, and every checkpoint from before ranges).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_range: Option<crate::config::DataRange>,
    pub world_size: usize,
    /// The strategy that wrote it (any strategy and world size can read it).
    pub strategy: String,
    /// Ranks per shard group of the run that wrote it (1: nothing sharded).
    #[serde(default = "one")]
    pub shard_group_size: usize,
    /// The state files, in rank order (format 1: none listed, `WHOLE_FILE`).
    #[serde(default)]
    pub files: Vec<String>,
    pub units: Vec<UnitLayout>,
    pub model_config: serde_json::Value,
    /// A LoRA run's adapters (its frozen units come from `base_model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::config::LoraConfig>,
    /// How the frozen blocks were held in 4 bits (`Model::quantized_base`: QLoRA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantized_base: Option<crate::nf4::Quantization>,
    /// The directory the run's base weights were read from: relative to
    /// the run's output directory when inside it (`base-model`), else
    /// absolute (`base_model_dir` reads it back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<PathBuf>,
    /// The communication hook whose state the rank files hold (`comm.*` tensors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<crate::registry::CommRecord>,
    /// The run that saved it (`run_dir::new_run_id`; a resumed run keeps its
    /// checkpoint's): rotation and `latest` keep to one run's lineage. None: saved before run ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// When it was saved (seconds since the Unix epoch), which makes it the
    /// `latest` of its directory when it is the newest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_at: Option<f64>,
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

/// Complete checkpoints under `output` with their manifests, oldest saved first
/// (by `saved_at`, then step; those saved before it was recorded come first).
fn list_by_save(output: &Path) -> Result<Vec<(PathBuf, Manifest)>> {
    let mut found = list(output)?.into_iter().map(|dir| Ok((read_manifest(&dir)?, dir))).collect::<Result<Vec<_>>>()?;
    found.sort_by(|(a, _), (b, _)| a.saved_at.unwrap_or(0.0).total_cmp(&b.saved_at.unwrap_or(0.0)).then(a.step.cmp(&b.step)));
    Ok(found.into_iter().map(|(manifest, dir)| (dir, manifest)).collect())
}

/// The checkpoint saved last under `output` (the newest of the run that
/// wrote there last, which a resumed run continues), if any: what `latest`
/// means for `--resume` and `ft export --checkpoint` alike.
pub fn latest(output: &Path) -> Result<Option<PathBuf>> {
    Ok(list_by_save(output)?.pop().map(|(dir, _)| dir))
}

/// `latest` ([`latest`]) or a directory.
pub fn resolve(spec: &str, output: &Path) -> Result<PathBuf> {
    if spec == "latest" {
        return latest(output)?.with_context(|| format!("--resume latest: no complete checkpoint under {}", checkpoints_dir(output).display()));
    }
    let path = PathBuf::from(spec);
    if !path.join("manifest.json").is_file() {
        bail!("--resume {spec}: {} is not a checkpoint (no manifest.json)", path.display());
    }
    Ok(path)
}

/// The checkpoint `train.resume` (`spec`) continues from under `output`, or
/// None: `auto` where there is none yet (the run starts at step 0).
pub fn resume_from(spec: &str, output: &Path) -> Result<Option<PathBuf>> {
    match spec {
        "auto" if list(output)?.is_empty() => Ok(None),
        "auto" => resolve("latest", output).map(Some),
        spec => resolve(spec, output).map(Some),
    }
}

/// How a checkpoint records `path` of a run writing to `output`: relative
/// to `output` when inside it (so the run directory can move, and be read
/// from any working directory), else absolute.
pub(crate) fn path_in_run(path: &Path, output: &Path) -> PathBuf {
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (path, output) = (absolute(path), absolute(output));
    path.strip_prefix(&output).map_or(path.clone(), Path::to_path_buf)
}

/// The run directory of checkpoint `checkpoint` (`<run>/checkpoints/step-N`).
fn run_dir(checkpoint: &Path) -> PathBuf {
    let absolute = std::path::absolute(checkpoint).unwrap_or_else(|_| checkpoint.to_path_buf());
    absolute.parent().and_then(Path::parent).map_or(absolute.clone(), Path::to_path_buf)
}

/// The base model directory `manifest` (of checkpoint `checkpoint`) records, resolved against its run directory.
pub fn base_model_dir(manifest: &Manifest, checkpoint: &Path) -> Option<PathBuf> {
    manifest.base_model.as_ref().map(|base| run_dir(checkpoint).join(base))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("cannot sync {}", dir.display()))
}

/// A fault-injection point for crash, panic and signal tests:
/// `FT_FAULT_INJECT=<point>:<step>` aborts the process there, as a crash or
/// a kill would; `panic:<point>:<step>` panics there, as a bug in ft would;
/// `<point>:<step>:<signal>` (`SIGTERM`, `SIGUSR1`, …) sends the process
/// that signal, at a step a test can count on; with `@<rank>` after it,
/// only that rank (`RANK`) acts and the others find it gone, or learn of
/// its signal as they would of any.
pub fn fault_point(point: &str, step: usize) {
    let Ok(spec) = std::env::var("FT_FAULT_INJECT") else { return };
    let (spec, panics) = spec.strip_prefix("panic:").map_or((spec.as_str(), false), |spec| (spec, true));
    let (spec, rank) = spec.split_once('@').map_or((spec, None), |(spec, rank)| (spec, Some(rank)));
    if rank.is_some_and(|rank| std::env::var("RANK").is_ok_and(|mine| mine != rank)) {
        return;
    }
    let here = format!("{point}:{step}");
    match spec.strip_prefix(&here) {
        Some("") if panics => panic!("FT_FAULT_INJECT: a panic at {point} of step {step}"),
        Some("") => {
            eprintln!("FT_FAULT_INJECT: aborting at {point} of step {step}");
            std::process::abort();
        }
        Some(signal) => {
            let Some(number) = signal.strip_prefix(':').and_then(crate::signals::number) else { return };
            eprintln!("FT_FAULT_INJECT: raising {} at {point} of step {step}", crate::signals::name(number));
            // SAFETY: raise(3) sends this process a signal its handlers expect.
            unsafe { libc::raise(number) };
        }
        None => {}
    }
}

/// Rank `rank`'s state file among `world`.
pub fn file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// One rank's part of a save, on the host: per unit where its range of the
/// flat buffer starts and [master, exp_avg, exp_avg_sq] over it
/// (`Trainer::checkpoint_part`), AdamW's step count and fp16's loss scaler.
/// Owned, so a background thread can write it.
pub struct RankPart {
    pub units: Vec<(i64, [Tensor; 3])>,
    pub adamw_step: Tensor,
    /// fp16's loss scaler (`Trainer::loss_scaler_state`), None otherwise.
    pub loss_scale: Option<Tensor>,
    /// The communication hook's state on this rank, fp32 on the host.
    pub comm_state: Vec<(String, Tensor)>,
}

/// Every rank's `outcome` on every rank (collective), or, when any rank
/// failed, an error on all of them naming it — so no rank waits forever
/// for one that gave up.
fn agree<T: Serialize + DeserializeOwned>(comm: &Communicator, outcome: Result<T>) -> Result<Vec<T>> {
    let own = outcome.as_ref().err().map(|e| format!("{e:#}"));
    let shared: std::result::Result<&T, String> = outcome.as_ref().map_err(|e| format!("{e:#}"));
    let all = comm.all_gather_bytes(&serde_json::to_vec(&shared)?)?;
    let all: Vec<std::result::Result<T, String>> =
        all.iter().map(|bytes| serde_json::from_slice(bytes)).collect::<std::result::Result<_, _>>()?;
    if let Some(error) = own {
        bail!(error);
    }
    all.into_iter().enumerate().map(|(rank, r)| r.map_err(|e| anyhow::anyhow!("rank {rank} failed: {e}"))).collect()
}

/// A host tensor as the safetensors writer sees it: its bytes borrowed
/// from the tensor's own memory, so a save copies nothing before the kernel does.
struct Borrowed<'a> {
    shape: Vec<usize>,
    bytes: &'a [u8],
}

impl<'a> Borrowed<'a> {
    /// `tensor` (named `name`), which must be fp32 — all a checkpoint holds, and all its reader takes.
    fn new(name: &str, tensor: &'a Tensor) -> Result<Borrowed<'a>> {
        if tensor.kind() != Kind::Float {
            bail!("checkpoint tensor {name} is {:?}; checkpoints hold fp32 state", tensor.kind());
        }
        let bytes = ft_sys::host_bytes::host_bytes(tensor).map_err(anyhow::Error::msg).with_context(|| format!("checkpoint tensor {name}"))?;
        Ok(Borrowed { shape: tensor.size().iter().map(|&d| d as usize).collect(), bytes })
    }
}

impl safetensors::View for &Borrowed<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// `tensor` where the writer can borrow its bytes: itself when it is a
/// contiguous host tensor (a background save's snapshot), else a host copy
/// (a foreground save of state on a GPU).
fn on_host(tensor: &Tensor) -> Tensor {
    match tensor.device() == tch::Device::Cpu && tensor.is_contiguous() {
        true => tensor.shallow_clone(),
        false => tensor.to_device(tch::Device::Cpu).contiguous(),
    }
}

/// Writes this rank's `part` into `file`, fsynced; rank 0's also holds
/// AdamW's step and fp16's loss scale. Each tensor's bytes go to the file
/// straight from the host snapshot, one write each (tch's writer would
/// first copy them all into one buffer, on one thread, at a fraction of
/// the disk's rate). Returns the bytes and seconds it took.
fn write_part(file: &Path, part: &RankPart, rank: usize) -> Result<(f64, f64)> {
    let started = Instant::now();
    let mut tensors: Vec<(String, Tensor)> = vec![];
    for (index, (_, unit)) in part.units.iter().enumerate().filter(|(_, (_, unit))| unit[0].size()[0] > 0) {
        for (kind, tensor) in STATE_KINDS.iter().zip(unit) {
            tensors.push((format!("unit{index}.{kind}"), on_host(tensor)));
        }
    }
    if rank == 0 {
        tensors.push((ADAMW_STEP.into(), on_host(&part.adamw_step)));
        tensors.extend(part.loss_scale.as_ref().map(|state| (LOSS_SCALE.to_string(), on_host(state))));
    }
    tensors.extend(part.comm_state.iter().map(|(name, state)| (format!("{COMM_STATE}{name}"), on_host(state))));
    let borrowed = tensors.iter().map(|(name, tensor)| Ok((name.as_str(), Borrowed::new(name, tensor)?))).collect::<Result<Vec<_>>>()?;
    let bytes = borrowed.iter().map(|(_, b)| b.bytes.len() as f64).sum();
    safetensors::serialize_to_file(borrowed.iter().map(|(name, b)| (*name, b)), &None, file).with_context(|| format!("cannot write {}", file.display()))?;
    File::open(file).and_then(|f| f.sync_all()).with_context(|| format!("cannot sync {}", file.display()))?;
    Ok((bytes, started.elapsed().as_secs_f64()))
}

/// A checkpoint whose rank files are being written on a background thread
/// (`start_save`); `finish` makes it exist. Until then the last finished
/// checkpoint is the latest: a crash loses this one, never that one.
pub struct PendingSave {
    writer: std::thread::JoinHandle<Result<(f64, f64)>>,
    dir: PathBuf,
    temporary: PathBuf,
    final_path: PathBuf,
    manifest: Manifest,
    ranges: Vec<Vec<(i64, i64)>>,
    started: Instant,
    /// Seconds training waited for this save while its files were written
    /// in the background (its snapshot); None when it waits for all of it.
    pub blocked_seconds: Option<f64>,
}

/// Starts checkpoint `manifest.step` under `output`: rank 0 makes its hidden
/// directory, the ranks exchange their ranges, and a thread writes this
/// rank's `part` (which nothing may change until `finish`). Collective:
/// every rank calls it.
pub fn start_save(output: &Path, part: RankPart, manifest: Manifest, comm: &Communicator) -> Result<PendingSave> {
    let started = Instant::now();
    let (rank, world) = (comm.env().rank, comm.env().world_size);
    let dir = checkpoints_dir(output);
    let final_path = dir.join(name_of(manifest.step));
    // One name every rank knows; a crashed save's leftover is replaced.
    let temporary = dir.join(format!(".{}.tmp", name_of(manifest.step)));
    let prepared = if rank == 0 {
        (|| -> Result<()> {
            if temporary.exists() {
                std::fs::remove_dir_all(&temporary)?;
            }
            std::fs::create_dir_all(&temporary)?;
            Ok(())
        })()
        .with_context(|| format!("cannot create {}", temporary.display()))
    } else {
        Ok(())
    };
    let ranges: Vec<(i64, i64)> = part.units.iter().map(|(start, state)| (*start, state[0].size()[0])).collect();
    // Also the barrier that keeps the others from writing before the directory exists.
    let ranges = agree(comm, prepared.map(|()| ranges))?;
    let file = temporary.join(file_name(rank, world));
    let writer = std::thread::Builder::new().name("ft-checkpoint".into()).spawn(move || write_part(&file, &part, rank))?;
    Ok(PendingSave { writer, dir, temporary, final_path, manifest, ranges, started, blocked_seconds: None })
}

impl PendingSave {
    /// Whether this rank's file is written (or its writer failed).
    pub fn written(&self) -> bool {
        self.writer.is_finished()
    }

    /// Waits for this rank's file; once every rank's is written, rank 0
    /// writes the manifest (whose `files` and units' `shards` this fills
    /// in) and copies `files` (name in the checkpoint, where it is), fsynced,
    /// and renames the directory into place. Collective: every rank calls it.
    pub fn finish(self, files: &[(String, PathBuf)], comm: &Communicator) -> Result<PathBuf> {
        let PendingSave { writer, dir, temporary, final_path, mut manifest, ranges, started, blocked_seconds } = self;
        let (rank, world) = (comm.env().rank, comm.env().world_size);
        let written = writer.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the checkpoint writer thread panicked")));
        let written = agree(comm, written)?;
        let finished = if rank == 0 {
            manifest.files = (0..world).map(|r| file_name(r, world)).collect();
            for (index, unit) in manifest.units.iter_mut().enumerate() {
                unit.shards = ranges
                    .iter()
                    .enumerate()
                    .map(|(file, ranges)| ShardRange { file, start: ranges[index].0, len: ranges[index].1 })
                    .filter(|shard| shard.len > 0)
                    .collect();
                unit.shards.sort_by_key(|shard| shard.start);
            }
            check_shards(&manifest, &temporary).and_then(|()| publish(&dir, &temporary, &final_path, &manifest, files))
        } else {
            Ok(())
        };
        agree(comm, finished)?;
        if rank == 0 {
            let bytes: f64 = written.iter().map(|(bytes, _)| bytes).sum();
            let writing = written.iter().map(|(_, seconds)| *seconds).fold(0.0, f64::max);
            let blocked = match blocked_seconds {
                Some(seconds) => format!("training blocked {seconds:.2} s (the copy to host), the rest in the background"),
                None => "in the foreground".to_string(),
            };
            tracing::info!(
                "saved checkpoint {}: {:.3} GB from {world} rank(s), written in {writing:.2} s ({:.2} GB/s), {blocked}; {:.2} s from start to finish",
                final_path.display(),
                bytes / 1e9,
                bytes / 1e9 / writing.max(1e-9),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(final_path)
    }
}

/// Rank 0, once every rank's file is written: the manifest and `files`,
/// fsynced, then the rename that makes the checkpoint exist.
fn publish(dir: &Path, temporary: &Path, final_path: &Path, manifest: &Manifest, files: &[(String, PathBuf)]) -> Result<()> {
    let manifest_path = temporary.join("manifest.json");
    std::fs::write(&manifest_path, serde_json::to_string_pretty(manifest)?).with_context(|| format!("cannot write {}", manifest_path.display()))?;
    File::open(&manifest_path)?.sync_all()?;
    for (name, from) in files {
        let copy = temporary.join(name);
        std::fs::copy(from, &copy).with_context(|| format!("cannot copy {} into the checkpoint", from.display()))?;
        File::open(&copy)?.sync_all()?;
    }
    sync_dir(temporary)?;
    fault_point("checkpoint-before-rename", manifest.step);
    if final_path.exists() {
        std::fs::remove_dir_all(final_path)?;
    }
    std::fs::rename(temporary, final_path)
        .with_context(|| format!("cannot move {} to {}", temporary.display(), final_path.display()))?;
    sync_dir(dir)
}

/// Deletes run `run_id`'s checkpoints under `output` but the newest
/// `keep_latest` saved (0 keeps all) and the steps in `keep` (the best
/// ones); other runs' checkpoints are not this run's to delete.
pub fn prune(output: &Path, keep_latest: usize, keep: &[usize], run_id: &str) -> Result<()> {
    if keep_latest == 0 {
        return Ok(());
    }
    let ours: Vec<(PathBuf, Manifest)> = list_by_save(output)?.into_iter().filter(|(_, m)| m.run_id.as_deref() == Some(run_id)).collect();
    for (old, manifest) in &ours[..ours.len().saturating_sub(keep_latest)] {
        if !keep.contains(&manifest.step) {
            std::fs::remove_dir_all(old).with_context(|| format!("cannot remove old checkpoint {}", old.display()))?;
        }
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
    let mut manifest: Manifest = serde_json::from_str(&text).with_context(|| format!("{} is not a valid ft manifest", path.display()))?;
    match manifest.format_version {
        FORMAT_VERSION => {}
        // The whole file is one shard of every unit.
        WHOLE_FILE_FORMAT => {
            manifest.files = vec![WHOLE_FILE.into()];
            for unit in &mut manifest.units {
                unit.shards = vec![ShardRange { file: 0, start: 0, len: unit.numel }];
            }
        }
        other => bail!("{} has checkpoint format {other}, this ft reads {WHOLE_FILE_FORMAT} and {FORMAT_VERSION}", path.display()),
    }
    Ok(manifest)
}

/// Checks that a checkpoint was made for this model's unit layout.
pub fn check_layout(manifest: &Manifest, expected: &[UnitLayout], dir: &Path) -> Result<()> {
    let describe = |u: &[UnitLayout]| u.iter().map(|l| format!("{} ({}{})", l.name, l.numel, if l.frozen { ", frozen" } else { "" })).collect::<Vec<_>>().join(", ");
    let same_units = manifest.units.len() == expected.len()
        && manifest.units.iter().zip(expected).all(|(a, b)| a.name == b.name && a.numel == b.numel && a.frozen == b.frozen);
    if !same_units {
        bail!(
            "checkpoint {} was written for another model: its units are [{}], this model's are [{}]",
            dir.display(),
            describe(&manifest.units),
            describe(expected)
        );
    }
    // Format 1 recorded no parameters: names and sizes are all it can check.
    for (saved, wanted) in manifest.units.iter().zip(expected).filter(|(saved, _)| !saved.params.is_empty()) {
        if saved.params != wanted.params {
            let describe = |p: &[ParamLayout]| p.iter().map(|p| format!("{} {:?} at {}", p.name, p.shape, p.offset)).collect::<Vec<_>>().join(", ");
            bail!(
                "checkpoint {} was written for another model: unit {} holds [{}], this model's holds [{}]",
                dir.display(),
                saved.name,
                describe(&saved.params),
                describe(&wanted.params)
            );
        }
    }
    Ok(())
}

/// Checks that each trained unit's shards name listed files and cover its elements once, in order.
fn check_shards(manifest: &Manifest, dir: &Path) -> Result<()> {
    for unit in manifest.units.iter().filter(|u| !u.frozen) {
        let mut next = 0;
        for shard in &unit.shards {
            if shard.file >= manifest.files.len() || shard.start != next || shard.len <= 0 {
                bail!(
                    "{}: unit {}'s shards {:?} do not cover its {} elements once, in order, from the {} files listed",
                    dir.join("manifest.json").display(),
                    unit.name,
                    unit.shards,
                    unit.numel,
                    manifest.files.len()
                );
            }
            next += shard.len;
        }
        if next != unit.numel {
            bail!("{}: unit {}'s shards hold {next} of its {} elements", dir.join("manifest.json").display(), unit.name, unit.numel);
        }
    }
    Ok(())
}

/// One tensor's entry in a safetensors header.
#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [u64; 2],
}

/// A safetensors file, its header parsed; tensors are read by element range on demand.
struct StateFile {
    path: PathBuf,
    file: File,
    /// Per tensor: its elements and where its bytes start in the file.
    tensors: HashMap<String, (i64, u64)>,
    /// Per tensor: its shape.
    shapes: HashMap<String, Vec<i64>>,
}

impl StateFile {
    /// Reads the header: 8 bytes of little-endian length, then JSON naming each tensor's dtype, shape and byte range after it.
    fn open(path: &Path) -> Result<StateFile> {
        let corrupt = || format!("{} is truncated or not a safetensors file", path.display());
        let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let size = file.metadata()?.len();
        let mut length = [0u8; 8];
        file.read_exact(&mut length).with_context(corrupt)?;
        let length = u64::from_le_bytes(length);
        if length > size - 8 {
            bail!(corrupt());
        }
        let mut header = vec![0u8; length as usize];
        file.read_exact(&mut header).with_context(corrupt)?;
        let header: HashMap<String, serde_json::Value> = serde_json::from_slice(&header).with_context(corrupt)?;
        let data_start = 8 + length;
        let (mut tensors, mut shapes) = (HashMap::new(), HashMap::new());
        for (name, entry) in header.into_iter().filter(|(name, _)| name != "__metadata__") {
            let entry: HeaderEntry = serde_json::from_value(entry).with_context(corrupt)?;
            let numel: i64 = entry.shape.iter().product();
            let [begin, end] = entry.data_offsets;
            if entry.dtype != "F32" || end < begin || end - begin != numel as u64 * 4 || data_start + end > size {
                bail!("{}: tensor {name} ({} {:?}, bytes {begin}..{end}) is not the fp32 state ft writes, or the file is truncated", path.display(), entry.dtype, entry.shape);
            }
            tensors.insert(name.clone(), (numel, data_start + begin));
            shapes.insert(name, entry.shape);
        }
        Ok(StateFile { path: path.to_path_buf(), file, tensors, shapes })
    }

    /// Elements `offset..offset + len` of fp32 tensor `name`: one seek and one read.
    fn read(&mut self, name: &str, offset: i64, len: i64) -> Result<Tensor> {
        let &(numel, start) = self.tensors.get(name).with_context(|| format!("{} has no tensor {name}", self.path.display()))?;
        if offset < 0 || len < 0 || offset + len > numel {
            bail!("{}: tensor {name} holds {numel} elements, the manifest says it holds {}..{}", self.path.display(), offset, offset + len);
        }
        let mut bytes = vec![0u8; len as usize * 4];
        self.file
            .seek(SeekFrom::Start(start + offset as u64 * 4))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .with_context(|| format!("cannot read {name} from {}", self.path.display()))?;
        Ok(Tensor::from_data_size(&bytes, &[len], Kind::Float))
    }
}

/// A checkpoint opened for reading: its manifest, checked against the
/// model, and its state files, from which only the ranges asked for are read.
pub struct Reader {
    manifest: Manifest,
    files: Vec<StateFile>,
    /// Bytes of state read so far.
    read_bytes: u64,
}

impl Reader {
    /// Opens checkpoint `dir` (any format this ft reads) for `model`.
    pub fn open(dir: &Path, model: &dyn Model) -> Result<Reader> {
        let manifest = read_manifest(dir)?;
        check_layout(&manifest, &UnitLayout::of(model), dir)?;
        check_shards(&manifest, dir)?;
        let files = manifest
            .files
            .iter()
            .map(|name| {
                let path = dir.join(name);
                if !path.is_file() {
                    bail!("checkpoint {} is incomplete: {name} is missing, and the state it holds is in no other file", dir.display());
                }
                StateFile::open(&path)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Reader { manifest, files, read_bytes: 0 })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Bytes of state read so far.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// Elements `start..start + len` of unit `unit`'s flat `kind` buffer,
    /// fp32, from the files holding them (zero past the parameters: padding).
    fn range(&mut self, unit: usize, kind: &str, start: i64, len: i64) -> Result<Tensor> {
        let name = format!("unit{unit}.{kind}");
        let end = start + len;
        let mut pieces = vec![];
        for shard in &self.manifest.units[unit].shards {
            let (from, to) = (start.max(shard.start), end.min(shard.start + shard.len));
            if from < to {
                pieces.push(self.files[shard.file].read(&name, from - shard.start, to - from)?);
                self.read_bytes += (to - from) as u64 * 4;
            }
        }
        let padding = end - end.min(self.manifest.units[unit].numel).max(start);
        if padding > 0 || pieces.is_empty() {
            pieces.push(Tensor::zeros([padding], (Kind::Float, tch::Device::Cpu)));
        }
        Ok(if pieces.len() == 1 { pieces.pop().expect("one piece") } else { Tensor::cat(&pieces, 0) })
    }

    /// [master, exp_avg, exp_avg_sq] over elements `start..start + len` of unit `unit`'s padded flat buffer.
    pub fn unit_state(&mut self, unit: usize, start: i64, len: i64) -> Result<[Tensor; 3]> {
        Ok([self.range(unit, STATE_KINDS[0], start, len)?, self.range(unit, STATE_KINDS[1], start, len)?, self.range(unit, STATE_KINDS[2], start, len)?])
    }

    /// AdamW's step count (a scalar).
    pub fn adamw_step(&mut self) -> Result<Tensor> {
        Ok(self.files[0].read(ADAMW_STEP, 0, 1)?.reshape([] as [i64; 0]))
    }

    /// fp16's loss scaler state, when the run that saved it had one.
    pub fn loss_scale(&mut self) -> Result<Option<Tensor>> {
        match self.files[0].tensors.contains_key(LOSS_SCALE) {
            true => Ok(Some(self.files[0].read(LOSS_SCALE, 0, 2)?)),
            false => Ok(None),
        }
    }

    /// The communication hook's state in rank `rank`'s file (shaped, fp32),
    /// by the names the hook gave it.
    pub fn comm_state(&mut self, rank: usize) -> Result<Vec<(String, Tensor)>> {
        if self.manifest.format_version == WHOLE_FILE_FORMAT {
            return Ok(vec![]); // written before hooks had state
        }
        let files = self.files.len();
        let file = self.files.get_mut(rank).with_context(|| format!("the checkpoint lists {files} state file(s), none for rank {rank}"))?;
        let mut names: Vec<String> = file.tensors.keys().filter(|n| n.starts_with(COMM_STATE)).cloned().collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let (numel, shape) = (file.tensors[&name].0, file.shapes[&name].clone());
                let tensor = file.read(&name, 0, numel)?.reshape(shape.as_slice());
                self.read_bytes += numel as u64 * 4;
                Ok((name[COMM_STATE.len()..].to_string(), tensor))
            })
            .collect()
    }

    /// Unit `unit`'s parameters (fp32, shaped per `model`), whole.
    pub fn unit_params(&mut self, model: &dyn Model, unit: usize) -> Result<Vec<Tensor>> {
        let spec = &model.units()[unit];
        Ok(unflatten(spec, &self.range(unit, STATE_KINDS[0], 0, spec.numel())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn random(len: i64) -> Tensor {
        Tensor::randn([len], (Kind::Float, Device::Cpu))
    }

    /// Two units with state and one frozen (empty), AdamW's step, fp16's scaler and a hook's state.
    fn part() -> RankPart {
        let empty = || Tensor::empty([0], (Kind::Float, Device::Cpu));
        RankPart {
            units: vec![(0, [random(1000), random(1000), random(1000)]), (0, [empty(), empty(), empty()]), (64, [random(77), random(77), random(77)])],
            adamw_step: Tensor::from_slice(&[12.0f32]),
            loss_scale: Some(Tensor::from_slice(&[65536.0f32, 3.0])),
            comm_state: vec![("powersgd.q".into(), random(96).reshape([8, 12]))],
        }
    }

    #[test]
    fn rank_files_read_back_bit_identical() {
        let dir = tempfile::tempdir().unwrap();
        let part = part();
        let file = dir.path().join(file_name(0, 2));
        let (bytes, _) = write_part(&file, &part, 0).unwrap();
        let expected: Vec<(String, &Tensor)> = vec![
            ("unit0.master".into(), &part.units[0].1[0]),
            ("unit0.exp_avg".into(), &part.units[0].1[1]),
            ("unit0.exp_avg_sq".into(), &part.units[0].1[2]),
            ("unit2.master".into(), &part.units[2].1[0]),
            ("unit2.exp_avg".into(), &part.units[2].1[1]),
            ("unit2.exp_avg_sq".into(), &part.units[2].1[2]),
            (ADAMW_STEP.into(), &part.adamw_step),
            (LOSS_SCALE.into(), part.loss_scale.as_ref().unwrap()),
            ("comm.powersgd.q".into(), &part.comm_state[0].1),
        ];
        assert_eq!(bytes, expected.iter().map(|(_, t)| 4.0 * t.numel() as f64).sum::<f64>());
        // ft's own reader, a range at a time …
        let mut state = StateFile::open(&file).unwrap();
        for (name, tensor) in &expected {
            let flat = tensor.flatten(0, -1);
            assert!(state.read(name, 0, flat.numel() as i64).unwrap().equal(&flat), "{name}");
        }
        assert!(state.read("unit0.master", 100, 10).unwrap().equal(&part.units[0].1[0].narrow(0, 100, 10)));
        // … and tch's, which also checks the shapes, and that nothing else is there.
        let read: HashMap<String, Tensor> = Tensor::read_safetensors(&file).unwrap().into_iter().collect();
        assert_eq!(read.len(), expected.len());
        for (name, tensor) in &expected {
            assert!(read[name].equal(tensor), "{name}");
        }
        // Other ranks' files hold their units and hook state alone.
        write_part(&file, &part, 1).unwrap();
        let read: HashMap<String, Tensor> = Tensor::read_safetensors(&file).unwrap().into_iter().collect();
        assert!(read.len() == expected.len() - 2 && !read.contains_key(ADAMW_STEP) && !read.contains_key(LOSS_SCALE));
    }

    #[test]
    fn state_off_the_host_or_strided_is_written_from_a_host_copy() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(file_name(0, 1));
        let strided = random(200).reshape([10, 20]).tr();
        let mut part = part();
        part.comm_state = vec![("strided".into(), strided.shallow_clone())];
        write_part(&file, &part, 0).unwrap();
        let read: HashMap<String, Tensor> = Tensor::read_safetensors(&file).unwrap().into_iter().collect();
        assert!(read["comm.strided"].equal(&strided));
    }

    #[test]
    fn a_write_that_fails_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory that cannot exist, whoever runs the test: its parent is a file.
        let blocker = dir.path().join("not-a-directory");
        std::fs::write(&blocker, b"").unwrap();
        let file = blocker.join(file_name(0, 1));
        let error = format!("{:#}", write_part(&file, &part(), 0).unwrap_err());
        assert!(error.contains(&format!("cannot write {}", file.display())), "{error}");
        let mut part = part();
        part.comm_state = vec![("counts".into(), Tensor::from_slice(&[1i64, 2]))];
        let error = format!("{:#}", write_part(&dir.path().join("x.safetensors"), &part, 0).unwrap_err());
        assert!(error.contains("comm.counts is Int64; checkpoints hold fp32 state"), "{error}");
    }
}
