//! Gradient reduction, started per unit while backward goes on with earlier
//! units: reduce-scattered into this rank's shard every micro-batch, or
//! accumulated and all-reduced on the last one; offloaded gradients go to the
//! host as their reduction finishes. A reduction is waited for only when its
//! result is needed.

use super::Trainer;
use crate::distributed::comm_hook::{GradReduce, Pending, ReduceStage, Wire, WireRequest};
use anyhow::Result;
use std::collections::VecDeque;
use tch::{Kind, Tensor};

/// Unit reductions alive at once, the one being started included: a new
/// one waits for the oldest first, so that its input (a gradient widened
/// for the reduction is allocated for it) never joins a full set. Enough to
/// overlap communication with the next units' backward, few enough that
/// whole gradients do not pile up — two of gradients reduced in the compute
/// dtype, one of gradients widened for the reduction (fp32 under bf16: each
/// twice the bytes, and twice the time on the wire, so one unit's backward
/// still covers it).
pub(crate) fn reductions_in_flight(compute: Kind, reduce: Kind) -> usize {
    if reduce.elt_size_in_bytes() > compute.elt_size_in_bytes() {
        1
    } else {
        2
    }
}

/// A step's gradient reductions in flight: the units' (at most `limit`,
/// oldest first) and the replica stages', waited for at the step's end.
pub(super) struct Reductions {
    pending: VecDeque<PendingReduction>,
    limit: usize,
    replicas: Vec<Pending>,
}

impl Reductions {
    pub(super) fn new(limit: usize) -> Self {
        Reductions { pending: VecDeque::new(), limit, replicas: vec![] }
    }
}

/// A gradient reduction in flight, and what to do with its result.
struct PendingReduction {
    unit: usize,
    work: Pending,
    result: Tensor,
    then: AfterReduction,
}

enum AfterReduction {
    /// A reduce-scattered micro-batch gradient: add it to the unit's shard.
    AddToShard { first_micro_batch: bool, last_micro_batch: bool },
    /// A gradient all-reduced in a narrower dtype: copy it back to fp32.
    CopyToGrad,
    /// Offloaded: (all-reduce across replicas, then) copy it to the host.
    ToHost,
    Nothing,
}

/// `grad` in the reduce dtype `kind`: bf16 widened to fp32 by ft's kernel
/// where it loads (ATen's copy between the two does not vectorise: twice
/// the time), else by ATen's cast.
fn in_reduce_dtype(grad: &Tensor, kind: Kind, kernels: super::Kernels) -> Result<Tensor> {
    if kernels == super::Kernels::Ft && grad.kind() == Kind::BFloat16 && kind == Kind::Float && grad.is_contiguous() {
        return Ok(ft_sys::kernels::widen_bf16(grad)?);
    }
    Ok(grad.to_kind(kind))
}

impl<'m> Trainer<'m> {
    /// Starts stage `stage` of unit `u`'s reduction over `group` through the
    /// communication hook: `input` in, the sum in `output`.
    fn start_reduction(&mut self, u: usize, stage: ReduceStage, input: Tensor, output: Tensor, accumulated: bool) -> Result<Pending> {
        let groups = self.groups_of(u);
        let group = match stage {
            ReduceStage::World => groups.world.expect("a world stage has ranks to reduce over"),
            ReduceStage::Shard => groups.shard.expect("sharded gradients have a shard group"),
            ReduceStage::Replica => groups.replicas.expect("a replica stage has replica groups"),
        };
        let mut hook = self.hook.borrow_mut();
        let (name, unit, step) = (hook.name().to_string(), &self.unit_info[u].name, self.steps);
        group.note_caller(|| format!("comm `{name}` reduced unit {unit} ({}, step {step})", stage.name()));
        let offset = if stage == ReduceStage::Replica { self.units[u].placement().shard.start } else { 0 };
        let (info, seed, step) = (&self.unit_info[u], self.options.seed as u64, self.steps);
        let wire = WireRequest { wire: Wire::Reduce(stage), elements: input.size()[0], dtype: input.kind(), group_size: group.size() };
        let device = input.device();
        let work = self.workspace.issue(hook.as_mut(), info, &wire, device, |hook, workspace| {
            hook.reduce(GradReduce { unit: info, stage, group, input, offset, output, accumulated, step, seed, workspace })
        });
        work.map_err(|e| e.context(format!("comm `{name}`: {} of unit {}", stage.name(), info.name)))
    }

    /// The dtype gradients are reduced in: the data-parallel policy's, else
    /// fp32 (one rank's offloaded gradient, summed on the host).
    pub(super) fn reduce_dtype(&self) -> Kind {
        self.parallel.map_or(Kind::Float, |p| p.reduce_dtype)
    }

    /// Whether a micro-batch's gradient (whole, or its reduced shard) is the
    /// step's gradient as it is, in the dtype it was computed or reduced in:
    /// with one micro-batch there is nothing to accumulate, and ft's AdamW
    /// kernel reads that dtype (the ATen path is given fp32 ones).
    fn gradient_as_it_is(&self, first: bool, last: bool) -> bool {
        first && last && self.kernels == super::Kernels::Ft
    }

    /// Hands unit `u`'s complete micro-batch gradient to the reduction the
    /// policy asks for: reduce-scatter it now, or accumulate it and
    /// all-reduce the sum on the last micro-batch.
    pub(super) fn reduce(&mut self, u: usize, first: bool, last: bool, reductions: &mut Reductions) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        // One micro-batch on one rank (or experts no other rank holds): the whole gradient, which AdamW reads in the compute dtype.
        let reduced_over = self.groups_of(u).world;
        let whole = reduced_over.is_none() && self.gradient_as_it_is(first, last);
        let reduce_dtype = self.reduce_dtype();
        let unit = &mut self.units[u];
        let fresh = unit.take_compute_grad()?;
        let placement = *unit.placement();
        if placement.grads_sharded || placement.offload {
            // Reduced every micro-batch: into this rank's shard, or (offloaded)
            // on to the host, where micro-batches are summed, so no fp32
            // gradient stays on the device.
            self.make_room(reductions)?;
            let unit = &mut self.units[u];
            let input = if fresh.defined() {
                in_reduce_dtype(&fresh, reduce_dtype, self.kernels)?
            } else {
                Tensor::zeros([placement.shard.padded], (reduce_dtype, unit.device()))
            };
            let then = if placement.offload {
                AfterReduction::ToHost
            } else {
                AfterReduction::AddToShard { first_micro_batch: first, last_micro_batch: last }
            };
            let stage = match placement.grads_sharded {
                true => Some(ReduceStage::Shard),
                false => reduced_over.map(|_| ReduceStage::World),
            };
            let Some(stage) = stage else {
                // No other rank computes it (one rank, or experts only this rank holds): straight to the host.
                self.offload_stats.device_to_host_bytes += unit.send_to_host(&input)? as f64;
                return Ok(());
            };
            let result = match stage {
                ReduceStage::Shard => Tensor::empty([placement.shard.len], (reduce_dtype, input.device())),
                _ => input.shallow_clone(),
            };
            let work = self.start_reduction(u, stage, input, result.shallow_clone(), first && last)?;
            reductions.pending.push_back(PendingReduction { unit: u, work, result, then });
            return Ok(());
        }
        unit.accumulate_grad(&fresh, first, whole);
        if reduced_over.is_some() && last {
            self.make_room(reductions)?;
            let unit = &self.units[u];
            // fp32: in place in the gradient; else through a narrower copy.
            let (result, then) = match reduce_dtype {
                Kind::Float => (unit.grad.shallow_clone(), AfterReduction::Nothing),
                narrower => (unit.grad.to_kind(narrower), AfterReduction::CopyToGrad),
            };
            let work = self.start_reduction(u, ReduceStage::World, result.shallow_clone(), result.shallow_clone(), true)?;
            reductions.pending.push_back(PendingReduction { unit: u, work, result, then });
        }
        Ok(())
    }

    /// Finishes the oldest reductions until a new one may start.
    fn make_room(&mut self, reductions: &mut Reductions) -> Result<()> {
        while reductions.pending.len() >= reductions.limit {
            let oldest = reductions.pending.pop_front().expect("a full set is not empty");
            self.finish_reduction(oldest, &mut reductions.replicas)?;
        }
        Ok(())
    }

    /// Finishes every reduction of the step.
    pub(super) fn finish_reductions(&mut self, mut reductions: Reductions) -> Result<()> {
        while let Some(oldest) = reductions.pending.pop_front() {
            self.finish_reduction(oldest, &mut reductions.replicas)?;
        }
        for work in reductions.replicas {
            work.wait()?;
        }
        Ok(())
    }

    /// Waits for one reduction and files its result; a gradient shard complete
    /// on the last micro-batch is then all-reduced across replica groups.
    fn finish_reduction(&mut self, reduction: PendingReduction, replica_reductions: &mut Vec<Pending>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        reduction.work.wait()?;
        let u = reduction.unit;
        let has_replicas = self.groups_of(u).replicas.is_some();
        match reduction.then {
            AfterReduction::AddToShard { first_micro_batch, last_micro_batch } => {
                // One micro-batch: the reduced shard is the step's gradient, in the
                // reduce dtype, with no fp32 copy — 2 bytes an element less and a pass over the shard.
                let whole = self.gradient_as_it_is(first_micro_batch, last_micro_batch);
                self.units[u].accumulate_grad(&reduction.result, first_micro_batch, whole);
                if has_replicas && last_micro_batch {
                    let grad = self.units[u].grad.shallow_clone();
                    replica_reductions.push(self.start_reduction(u, ReduceStage::Replica, grad.shallow_clone(), grad, true)?);
                }
            }
            AfterReduction::CopyToGrad => {
                self.units[u].grad.copy_(&reduction.result);
            }
            AfterReduction::ToHost => {
                // Accumulation happens on the host, so replicas sum every micro-batch.
                let result = reduction.result;
                if has_replicas && self.units[u].placement().grads_sharded {
                    self.start_reduction(u, ReduceStage::Replica, result.shallow_clone(), result.shallow_clone(), false)?.wait()?;
                }
                self.offload_stats.device_to_host_bytes += self.units[u].send_to_host(&result)? as f64;
            }
            AfterReduction::Nothing => {}
        }
        Ok(())
    }
}
