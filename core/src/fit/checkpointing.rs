//! Checkpoints as the loop sees them: resume from `train.resume`, save
//! every `train.save_every` steps, at each epoch's end
//! (`train.save_each_epoch`), every `train.save_minutes` and at the run's
//! end with the data cursor that continues the run exactly, and keep the
//! best `train.save_best` epochs by the monitored score besides the newest
//! `train.save_total_limit` of this run's lineage (its run id). On a
//! stopping signal every rank saves the same step and the run stops. The
//! file format and the atomic save are checkpoint.rs.
//!
//! A checkpoint records the `data.range` it trained on. Resuming with the
//! same range continues mid-epoch where it stopped; with another (the next
//! slice of a file) the weights, optimizer state, step count and schedule
//! continue and the new slice starts at its first example.
//!
//! A periodic save blocks training only while it copies the rank's state
//! into host buffers kept for the run (pinned on a GPU); a thread writes the
//! files, and the save is finished — manifest, rename, pruning — at the first
//! step after every rank's file is written, or when the next save or the
//! run's end waits for it. Offloaded state is written in the foreground from
//! where it lives: a snapshot would double the host memory it fills.

use super::monitor::Monitor;
use super::summary::EpochResult;
use crate::checkpoint::{self, BestCheckpoint, Manifest, PendingSave, RankPart, Reader, UnitLayout};
use crate::config::{DataRange, TrainConfig};
use crate::distributed::comm::Communicator;
use crate::distributed::comm_hook::{Restored, WorldChange};
use crate::registry::CommRecord;
use crate::signals::{self, StopSignals};
use crate::train::Trainer;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Where checkpoints go and what they describe.
#[derive(Clone, Copy)]
pub struct CheckpointPlan<'a> {
    pub output: &'a Path,
    pub model_config: &'a serde_json::Value,
    /// Files each checkpoint keeps beside its state, by their name in it
    /// and where they are (the tokenizer, its config, the chat template):
    /// what an export needs besides the weights.
    pub model_files: &'a [(String, PathBuf)],
    /// The directory the base weights come from (a LoRA checkpoint holds only what trains).
    pub base_model: Option<&'a Path>,
}

/// Where the run is: the next global batch to train, and steps taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub epoch: usize,
    pub epoch_step: usize,
    pub step: usize,
}

pub(crate) struct Checkpointer<'a> {
    plan: CheckpointPlan<'a>,
    config: &'a TrainConfig,
    /// The training file's examples this run trains on (`data.range`; None: all).
    data_range: Option<DataRange>,
    strategy: &'a str,
    world: usize,
    /// The communication hook, as checkpoints record it.
    comm: CommRecord,
    monitor: Option<Monitor>,
    /// The best checkpoints so far, best first (the same on every rank).
    best: Vec<BestCheckpoint>,
    /// The step of the last save, so an epoch's end does not save it twice.
    last_saved: Option<usize>,
    /// A save whose files are being written.
    pending: Option<PendingSave>,
    /// Host copies of this rank's part of the state, reused by every save.
    snapshot: Vec<[Tensor; 3]>,
    /// This run's id: new, or the resumed checkpoint's (the same on every rank).
    run_id: String,
    /// The newest finished checkpoint: where the run would resume.
    latest: Option<PathBuf>,
    /// When the last save started (rank 0's clock decides timed saves).
    last_save_started: Instant,
    signals: StopSignals,
    /// `train.save_signal`'s number.
    save_signal: i32,
}

/// Why and where a run stopped on a signal, its checkpoint saved.
pub(crate) struct Stop {
    pub signal: i32,
    pub checkpoint: PathBuf,
}

impl<'a> Checkpointer<'a> {
    pub fn new(
        plan: CheckpointPlan<'a>,
        config: &'a TrainConfig,
        data_range: Option<DataRange>,
        strategy: &'a str,
        world: usize,
        comm: CommRecord,
        monitor: Option<Monitor>,
    ) -> Result<Checkpointer<'a>> {
        // A resumed run goes on ranking against the checkpoints it kept.
        let best = if config.save_best > 0 && config.resume.is_some() { checkpoint::read_best(plan.output)? } else { vec![] };
        let save_signal = signals::parse(&config.save_signal)?;
        Ok(Checkpointer {
            plan,
            config,
            data_range,
            strategy,
            world,
            comm,
            monitor,
            best,
            last_saved: None,
            pending: None,
            snapshot: vec![],
            run_id: String::new(),
            latest: None,
            last_save_started: Instant::now(),
            signals: StopSignals::install(save_signal)?,
            save_signal,
        })
    }

    /// This run's id (after `resume`).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The newest finished checkpoint, if any.
    pub fn latest(&self) -> Option<&Path> {
        self.latest.as_deref()
    }

    /// Whether this run saves checkpoints at all.
    fn saves(&self) -> bool {
        self.config.save_every > 0 || self.config.save_each_epoch || self.config.save_minutes.is_some()
    }

    /// Settles the run's id on every rank as rank 0 has it: `resumed`'s
    /// (its lineage continues), else a new one (collective).
    fn settle_run_id(&mut self, resumed: Option<&str>, comm: &Communicator) -> Result<()> {
        let own = resumed.map_or_else(crate::run_dir::new_run_id, str::to_string);
        let all = comm.all_gather_bytes(own.as_bytes())?;
        self.run_id = String::from_utf8(all[0].clone()).context("rank 0's run id is not text")?;
        Ok(())
    }

    /// The best checkpoint kept so far.
    pub fn best(&self) -> Option<&BestCheckpoint> {
        self.best.first()
    }

    /// Restores `trainer` from `train.resume` when set (`auto`, a requeued
    /// job's habit: the latest checkpoint if there is one) and settles the
    /// run's id; where the run continues: the checkpoint's data cursor when
    /// it trained the same `data.range`, else the first example of this
    /// run's range (collective).
    pub fn resume(&mut self, trainer: &mut Trainer, comm: &Communicator) -> Result<Cursor> {
        let rank = comm.env().rank;
        let from = self.config.resume.as_deref().map(|spec| checkpoint::resume_from(spec, self.plan.output)).transpose()?.flatten();
        let Some(dir) = from else {
            self.settle_run_id(None, comm)?;
            return Ok(Cursor::default());
        };
        let started = std::time::Instant::now();
        let mut reader = Reader::open(&dir, trainer.model())?;
        let (saved, now) = (reader.manifest().quantized_base, trainer.model().quantized_base());
        if saved != now {
            let described = |q: Option<crate::nf4::Quantization>| q.map_or("in the compute dtype".to_string(), |q| format!("{q:?}"));
            anyhow::bail!(
                "{} trained adapters over a base held {}, and this run holds it {}: resume with the same model.quantize (--quantize), model.quant_blocksize and model.double_quant",
                dir.display(),
                described(saved),
                described(now)
            );
        }
        let (adamw_step, micro_steps, loss_scale) = (reader.adamw_step()?, reader.manifest().micro_steps, reader.loss_scale()?);
        let steps = reader.manifest().step;
        trainer.restore(|unit, start, len| reader.unit_state(unit, start, len), &adamw_step, steps, micro_steps, loss_scale.as_ref())?;
        self.resume_comm_state(&mut reader, trainer, rank)?;
        self.settle_run_id(reader.manifest().run_id.as_deref(), comm)?;
        self.latest = Some(dir.clone());
        let manifest = reader.manifest();
        let same_slice = manifest.data_range == self.data_range;
        let cursor = match same_slice {
            true => Cursor { epoch: manifest.epoch, epoch_step: manifest.epoch_step, step: manifest.step },
            false => Cursor { epoch: 0, epoch_step: 0, step: manifest.step },
        };
        if rank == 0 {
            let (gb, seconds) = (reader.read_bytes() as f64 / 1e9, started.elapsed().as_secs_f64());
            tracing::info!(
                "resumed from {} at step {} (epoch {}, batch {}); rank 0 read {gb:.3} GB from {} state file(s) in {seconds:.2} s ({:.2} GB/s)",
                dir.display(),
                manifest.step,
                manifest.epoch + 1,
                manifest.epoch_step,
                manifest.files.len(),
                gb / seconds.max(1e-9)
            );
            if !same_slice {
                let range = |range: Option<DataRange>| range.map_or("the whole file".to_string(), |r| r.to_string());
                tracing::info!(
                    "this run trains another slice than the checkpoint (data.range {} after {}): it starts at the slice's first example, \
                     epoch 1, and continues the weights, optimizer state, step count and learning-rate schedule from step {}",
                    range(self.data_range),
                    range(manifest.data_range),
                    manifest.step
                );
            }
        }
        Ok(cursor)
    }

    /// Gives the communication hook the state this rank saved, when the
    /// checkpoint was written by the same hook with the same (resolved)
    /// options; at another world size the hook decides what of it still
    /// holds (`CommHook::reshard_state`); with another hook or options it
    /// starts afresh. Rank 0 says which, as the hook reported it.
    fn resume_comm_state(&self, reader: &mut Reader, trainer: &mut Trainer, rank: usize) -> Result<()> {
        let (saved, saved_world) = (reader.manifest().comm.clone(), reader.manifest().world_size);
        let Some(saved) = saved else { return Ok(()) };
        if saved != self.comm {
            if rank == 0 && !reader.comm_state(0)?.is_empty() {
                tracing::warn!(
                    "the checkpoint holds the state of comm `{}` (options {}); this run uses comm `{}` with options {}: that state starts afresh",
                    saved.name,
                    saved.options,
                    self.comm.name,
                    self.comm.options
                );
            }
            return Ok(());
        }
        let change = WorldChange { saved_world, world: self.world, rank, saved_rank: rank % saved_world };
        let state = reader.comm_state(change.saved_rank)?;
        if state.is_empty() {
            return Ok(());
        }
        let tensors = state.len();
        let (restored, how) = match saved_world == self.world {
            true => (trainer.restore_comm_state(state)?, format!("the checkpoint holds {tensors} state tensors on rank 0")),
            false => (trainer.reshard_comm_state(change, state)?, format!("its state was saved at {saved_world} ranks, this run has {}", self.world)),
        };
        if rank == 0 {
            match restored {
                Restored::Afresh => tracing::warn!("comm `{}`: {how}: its hook kept none of it, so it starts afresh", saved.name),
                Restored::Kept(what) if saved_world == self.world => tracing::info!("comm `{}`: restored its state: {what}", saved.name),
                Restored::Kept(what) => tracing::info!("comm `{}`: {how}: re-sharded, kept {what}", saved.name),
            }
        }
        Ok(())
    }

    /// Saves the run's last step (`end`) when checkpoints are on and it is
    /// not saved yet, as Hugging Face's Trainer does, so that the next run
    /// (more epochs, the next slice of the file) resumes where this one
    /// ended; then finishes every save (collective).
    pub fn after_run(&mut self, trainer: &Trainer, end: Cursor, comm: &Communicator) -> Result<()> {
        if self.saves() {
            self.save(trainer, end, comm, true)?;
        }
        self.finish(comm)
    }

    /// After each optimizer step, every rank learns in one small reduction
    /// what all must do alike: finish the save in flight once every rank's
    /// file is written, save when `next.step` is due or rank 0's clock says
    /// `train.save_minutes` passed, and, when any rank got a stopping
    /// signal before the run is over (`run_over`: the loop's own predicate,
    /// `StepPlan::finished`), save `next.step` (then requeue the Slurm job
    /// when asked) and stop: the returned `Stop`.
    pub fn after_step(&mut self, trainer: &Trainer, next: Cursor, run_over: bool, comm: &Communicator) -> Result<Option<Stop>> {
        let received = self.signals.received();
        let timed = comm.env().rank == 0 && self.config.save_minutes.is_some_and(|minutes| self.last_save_started.elapsed().as_secs_f64() >= minutes * 60.0);
        // Which of the stopping signals, in order of precedence: the save signal first.
        let candidates = signals::caught(self.save_signal);
        let mut flags = vec![f64::from(self.pending.as_ref().is_some_and(|p| !p.written())), f64::from(timed)];
        flags.extend(candidates.iter().map(|&signal| f64::from(received == Some(signal))));
        if comm.env().world_size > 1 {
            flags = comm.sum_over_ranks(&flags)?;
        }
        if self.pending.is_some() && flags[0] == 0.0 {
            self.finish(comm)?;
        }
        let signalled = candidates.into_iter().zip(&flags[2..]).find(|(_, count)| **count > 0.0).map(|(signal, _)| signal);
        // After the run's last step only its evaluation, last save and final/ are left: the run ends as it would.
        if let Some(signal) = signalled.filter(|_| !run_over) {
            let checkpoint = self.save(trainer, next, comm, true)?;
            if signal == self.save_signal && self.config.requeue {
                if comm.env().rank == 0 {
                    requeue();
                }
                // No rank leaves before the job is requeued (srun may stop the job when one does).
                comm.world().barrier()?.wait()?;
            }
            return Ok(Some(Stop { signal, checkpoint }));
        }
        if let (Some(signal), 0) = (signalled, comm.env().rank) {
            tracing::warn!("{} after the run's last step: the run ends as it would, with its evaluation, last checkpoint and final/", signals::name(signal));
        }
        let every = self.config.save_every;
        if flags[1] > 0.0 || (every > 0 && next.step % every == 0) {
            self.save(trainer, next, comm, false)?;
        }
        Ok(None)
    }

    /// Waits for the save in flight, if any, and finishes it (collective).
    pub fn finish(&mut self, comm: &Communicator) -> Result<()> {
        if let Some(pending) = self.pending.take() {
            self.latest = Some(pending.finish(self.plan.model_files, comm)?);
            self.prune(comm)?;
        }
        Ok(())
    }

    /// Saves the epoch's end (`train.save_each_epoch`), and keeps it when
    /// its monitored score is among the best `train.save_best`.
    pub fn after_epoch(&mut self, trainer: &Trainer, next: Cursor, epoch: &EpochResult, comm: &Communicator) -> Result<()> {
        self.keep_if_best(trainer, next, epoch, comm)?;
        if self.config.save_each_epoch {
            self.save(trainer, next, comm, false)?;
        }
        Ok(())
    }

    /// Keeps the epoch's checkpoint when its monitored score is among the
    /// best `train.save_best` (every rank decides the same: the scores are).
    fn keep_if_best(&mut self, trainer: &Trainer, next: Cursor, epoch: &EpochResult, comm: &Communicator) -> Result<()> {
        let (Some(monitor), keep) = (self.monitor.clone(), self.config.save_best) else { return Ok(()) };
        if keep == 0 {
            return Ok(());
        }
        let score = monitor.value(epoch)?;
        let qualifies = self.best.len() < keep || self.best.last().is_some_and(|worst| monitor.improves(score, worst.score, 0.0));
        if !qualifies {
            return Ok(());
        }
        let dir = self.save(trainer, next, comm, true)?;
        let entry = BestCheckpoint { step: next.step, epoch: epoch.epoch, monitor: monitor.name.clone(), score, dir };
        self.best.retain(|b| b.step != entry.step);
        let position = self.best.iter().position(|b| monitor.improves(score, b.score, 0.0)).unwrap_or(self.best.len());
        self.best.insert(position, entry);
        self.best.truncate(keep);
        if comm.env().rank == 0 {
            checkpoint::write_best(self.plan.output, &self.best)?;
            tracing::info!("epoch {}: {} {score:.4} is among the best {keep}; kept {}", epoch.epoch, monitor.name, self.best[position.min(keep - 1)].dir.display());
        }
        self.prune(comm)
    }

    /// Deletes checkpoints neither among the newest `save_total_limit` nor the best (rank 0).
    fn prune(&self, comm: &Communicator) -> Result<()> {
        if comm.env().rank == 0 {
            let best: Vec<usize> = self.best.iter().map(|b| b.step).collect();
            checkpoint::prune(self.plan.output, self.config.save_total_limit, &best, &self.run_id)?;
        }
        Ok(())
    }

    /// Saves checkpoint `next.step` unless it exists (collective: every
    /// rank writes the state it owns; rank 0 the manifest), after the save
    /// in flight; in the background unless `wait` or offloaded.
    fn save(&mut self, trainer: &Trainer, next: Cursor, comm: &Communicator, wait: bool) -> Result<std::path::PathBuf> {
        let dir = checkpoint::checkpoints_dir(self.plan.output).join(checkpoint::name_of(next.step));
        self.finish(comm)?;
        if self.last_saved == Some(next.step) {
            return Ok(dir);
        }
        let blocked = std::time::Instant::now();
        self.last_save_started = blocked;
        let manifest = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            ft_version: env!("CARGO_PKG_VERSION").into(),
            step: next.step,
            epoch: next.epoch,
            epoch_step: next.epoch_step,
            micro_steps: trainer.micro_steps(),
            data_range: self.data_range,
            world_size: self.world,
            strategy: self.strategy.into(),
            shard_group_size: trainer.shard_group_size(),
            files: vec![],
            units: UnitLayout::of(trainer.model()),
            model_config: self.plan.model_config.clone(),
            lora: self.config.lora.enabled().then(|| self.config.lora.clone()),
            quantized_base: trainer.model().quantized_base(),
            base_model: self.plan.base_model.map(|dir| checkpoint::path_in_run(dir, self.plan.output)),
            comm: Some(self.comm.clone()),
            run_id: Some(self.run_id.clone()),
            saved_at: Some(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64()),
        };
        let background = !wait && !trainer.offloaded();
        let views = trainer.checkpoint_part();
        let units = if background { self.snapshot(views)? } else { views };
        let adamw_step = trainer.adamw_step().to_device(Device::Cpu);
        // Owned host copies: the writer thread reads them while training goes
        // on (converting a host fp32 tensor would hand it the live one).
        let owned = |t: Tensor| match (t.device(), t.kind()) {
            (Device::Cpu, Kind::Float) => t.copy(),
            _ => t.to_kind(Kind::Float).to_device(Device::Cpu),
        };
        let comm_state = trainer.comm_state().into_iter().map(|(name, t)| (name, owned(t))).collect();
        let part = RankPart { units, adamw_step, loss_scale: trainer.loss_scaler_state(), comm_state };
        let mut pending = checkpoint::start_save(self.plan.output, part, manifest, comm)?;
        self.last_saved = Some(next.step);
        if background {
            pending.blocked_seconds = Some(blocked.elapsed().as_secs_f64());
        }
        self.pending = Some(pending);
        if !background {
            self.finish(comm)?;
        }
        Ok(dir)
    }

    /// Copies `views` of the rank's state into the host buffers kept for
    /// every save (allocated by the first, pinned on a GPU so the copies
    /// run at full speed), and returns them.
    fn snapshot(&mut self, views: Vec<(i64, [Tensor; 3])>) -> Result<Vec<(i64, [Tensor; 3])>> {
        let device = views.iter().map(|(_, v)| v[0].device()).find(|d| d.is_cuda()).unwrap_or(Device::Cpu);
        if self.snapshot.is_empty() {
            let buffer = |view: &Tensor| {
                let host = Tensor::zeros(view.size(), (Kind::Float, Device::Cpu));
                if device.is_cuda() { ft_sys::pin_memory_exact(&host) } else { Ok(host) }
            };
            self.snapshot = views.iter().map(|(_, v)| Ok([buffer(&v[0])?, buffer(&v[1])?, buffer(&v[2])?])).collect::<Result<_>>()?;
        }
        for ((_, view), buffers) in views.iter().zip(&self.snapshot) {
            for (from, to) in view.iter().zip(buffers) {
                ft_sys::copy_async(to, from)?;
            }
        }
        if let Device::Cuda(index) = device {
            ft_sys::cuda_stream_synchronize(index)?;
        }
        Ok(views.iter().zip(&self.snapshot).map(|((start, _), buffers)| (*start, buffers.each_ref().map(Tensor::shallow_clone))).collect())
    }
}

/// Requeues this Slurm job (`scontrol requeue $SLURM_JOB_ID`), as
/// `train.requeue` asks after the save on `train.save_signal`; says what
/// happened rather than failing: the checkpoint is saved either way.
fn requeue() {
    let Ok(job) = std::env::var("SLURM_JOB_ID") else {
        tracing::warn!("train.requeue is set but SLURM_JOB_ID is not: there is no Slurm job to requeue");
        return;
    };
    match std::process::Command::new("scontrol").args(["requeue", &job]).status() {
        Ok(status) if status.success() => tracing::info!("requeued Slurm job {job} (train.requeue): it continues from this checkpoint with --resume auto"),
        Ok(status) => tracing::warn!("`scontrol requeue {job}` {status}: the job is not requeued"),
        Err(error) => tracing::warn!("cannot run `scontrol requeue {job}`: {error}; the job is not requeued"),
    }
}
