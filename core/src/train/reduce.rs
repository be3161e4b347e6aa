//! Gradient reduction, started per unit while backward goes on with earlier
//! units: reduce-scattered into this rank's shard every micro-batch, or
//! accumulated and all-reduced on the last one; offloaded gradients go to the
//! host as their reduction finishes. A reduction is waited for only when its
//! result is needed.

use super::{DataParallel, Trainer};
use crate::comm::{Reduction, Work};
use anyhow::Result;
use std::collections::VecDeque;
use tch::{Kind, Tensor};

/// Reduce-scatters allowed in flight before backward waits for the oldest:
/// enough to overlap communication with the next units' backward, few
/// enough that whole gradients do not pile up.
pub(crate) const REDUCTIONS_IN_FLIGHT: usize = 2;

/// A gradient reduction in flight, and what to do with its result.
pub(super) struct PendingReduction {
    unit: usize,
    work: Work,
    result: Tensor,
    then: AfterReduction,
}

pub(super) enum AfterReduction {
    /// A reduce-scattered micro-batch gradient: add it to the unit's shard.
    AddToShard { first_micro_batch: bool, last_micro_batch: bool },
    /// A gradient all-reduced in a narrower dtype: copy it back to fp32.
    CopyToGrad,
    /// Offloaded: (all-reduce across replicas, then) copy it to the host.
    ToHost,
    Nothing,
}

impl Trainer<'_> {
    /// Hands unit `u`'s complete micro-batch gradient to the reduction the
    /// policy asks for: reduce-scatter it now, or accumulate it and
    /// all-reduce the sum on the last micro-batch.
    pub(super) fn reduce(&mut self, u: usize, first: bool, last: bool, pending: &mut VecDeque<PendingReduction>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let unit = &mut self.units[u];
        let fresh = unit.take_compute_grad()?;
        let reduce_dtype = self.parallel.map_or(Kind::Float, |p| p.reduce_dtype);
        let placement = *unit.placement();
        if placement.grads_sharded || placement.offload {
            // Reduced every micro-batch: into this rank's shard, or (offloaded)
            // on to the host, where micro-batches are summed, so no fp32
            // gradient stays on the device.
            let mut input = if fresh.defined() {
                fresh.to_kind(reduce_dtype)
            } else {
                Tensor::zeros([placement.shard.padded], (reduce_dtype, unit.device()))
            };
            let then = if placement.offload {
                AfterReduction::ToHost
            } else {
                AfterReduction::AddToShard { first_micro_batch: first, last_micro_batch: last }
            };
            let (work, result) = match (&self.parallel, placement.grads_sharded) {
                (Some(parallel), true) => {
                    let group = parallel.shard().expect("sharded gradients have a shard group");
                    let mut result = Tensor::empty([placement.shard.len], (reduce_dtype, input.device()));
                    (group.reduce_scatter_tensor(&mut result, &input, Reduction::Sum)?, result)
                }
                (Some(parallel), false) => (parallel.world.all_reduce(&mut input, Reduction::Sum)?, input),
                (None, _) => {
                    self.offload_stats.device_to_host_bytes += unit.send_to_host(&input)? as f64;
                    return Ok(());
                }
            };
            pending.push_back(PendingReduction { unit: u, work, result, then });
            return Ok(());
        }
        unit.accumulate_grad(&fresh, first);
        if let (Some(parallel), true) = (&self.parallel, last) {
            if reduce_dtype == Kind::Float {
                let work = parallel.world.all_reduce(&mut unit.grad, Reduction::Sum)?;
                pending.push_back(PendingReduction { unit: u, work, result: unit.grad.shallow_clone(), then: AfterReduction::Nothing });
            } else {
                let mut result = unit.grad.to_kind(reduce_dtype);
                let work = parallel.world.all_reduce(&mut result, Reduction::Sum)?;
                pending.push_back(PendingReduction { unit: u, work, result, then: AfterReduction::CopyToGrad });
            }
        }
        Ok(())
    }

    /// Waits for one reduction and files its result; a gradient shard complete
    /// on the last micro-batch is then all-reduced across replica groups.
    pub(super) fn finish_reduction(&mut self, reduction: PendingReduction, replica_reductions: &mut Vec<Work>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        reduction.work.wait()?;
        let unit = &mut self.units[reduction.unit];
        match reduction.then {
            AfterReduction::AddToShard { first_micro_batch, last_micro_batch } => {
                unit.accumulate_grad(&reduction.result, first_micro_batch);
                let replicas = self.parallel.and_then(DataParallel::replicas);
                if let (Some(replicas), true) = (replicas, last_micro_batch) {
                    replica_reductions.push(replicas.all_reduce(&mut unit.grad, Reduction::Sum)?);
                }
            }
            AfterReduction::CopyToGrad => {
                unit.grad.copy_(&reduction.result);
            }
            AfterReduction::ToHost => {
                // Accumulation happens on the host, so replicas sum every micro-batch.
                let mut result = reduction.result;
                let replicas = self.parallel.and_then(DataParallel::replicas);
                if let (Some(replicas), true) = (replicas, unit.placement().grads_sharded) {
                    replicas.all_reduce(&mut result, Reduction::Sum)?.wait()?;
                }
                self.offload_stats.device_to_host_bytes += unit.send_to_host(&result)? as f64;
            }
            AfterReduction::Nothing => {}
        }
        Ok(())
    }

}
