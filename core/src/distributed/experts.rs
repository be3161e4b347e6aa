//! Expert parallelism (`train.expert_parallel`): the ranks of each expert
//! group of N consecutive ranks split a mixture of experts' experts, each
//! holding E/N of every sparse layer whole (its rows of the layer's
//! experts units, `model::Stage::experts`); tokens travel to the rank
//! holding their expert and back by all-to-all through the run's
//! communication hook (`CommHook::all_to_all`), as one autograd node each
//! way (`ft_sys::exchange`), whose backward is the reverse exchange. The
//! ranks holding the same experts in the other groups are its replicas,
//! over which the experts' gradients are all-reduced (`train/reduce.rs`) —
//! or, when the strategy shards, among which the experts' parameters,
//! gradients and optimizer state are split as a unit's are over a shard
//! group: the replicas within this rank's shard group are the experts'
//! shard group (`DataParallel::groups`).

use crate::distributed::comm::{Communicator, ProcessGroup};
use crate::distributed::comm_hook::{CommHook, TokenExchange};
use crate::model::ExpertExchange;
use anyhow::{bail, Result};
use std::cell::RefCell;
use std::rc::Rc;
use tch::Tensor;

/// The run's communication hook, shared by the trainer and its token exchanges.
pub type SharedHook = Rc<RefCell<Box<dyn CommHook>>>;

/// This rank's expert group and the replicas of its experts.
pub struct ExpertGroups {
    pub group: ProcessGroup,
    /// None when one group spans the world: each expert has no other copy.
    pub replicas: Option<ProcessGroup>,
    /// The replicas in this rank's shard group, which split the experts'
    /// state; None when the strategy shards nothing or no other rank of the
    /// shard group holds these experts.
    pub shard: Option<ProcessGroup>,
}

impl ExpertGroups {
    /// Groups of `degree` consecutive ranks over `comm`'s world, and the
    /// experts' shard groups within the strategy's shard groups of
    /// `shard_size` consecutive ranks (1: nothing sharded). Collective.
    pub fn new(comm: &Communicator, degree: usize, shard_size: usize) -> Result<ExpertGroups> {
        let (group, replicas) = comm.blocks_and_strides(degree, ["expert", "expert_replica"])?;
        let replicas = (replicas.size() > 1).then_some(replicas);
        let shard = match expert_shards(comm.env().world_size, degree, shard_size)? {
            Some(partition) => Some(comm.split("expert_shard", &partition)?),
            None => None,
        };
        Ok(ExpertGroups { group, replicas, shard })
    }

    /// Where this rank sits, for placing its experts.
    pub fn seat(&self) -> ExpertSeat {
        let (shard_size, shard_rank) = self.shard.as_ref().map_or((1, 0), |shard| (shard.size(), shard.rank()));
        ExpertSeat { degree: self.group.size(), rank: self.group.rank(), shard_size, shard_rank }
    }

    /// Rows `range` of an experts unit of `experts` rows: this rank's.
    pub fn rows(&self, experts: i64) -> std::ops::Range<i64> {
        let per_rank = experts / self.group.size() as i64;
        let start = per_rank * self.group.rank() as i64;
        start..start + per_rank
    }
}

/// Where a rank sits under expert parallelism, which places its experts
/// units (`train::unit_placements`): its expert group's size and its rank
/// in it, and its experts' shard group's (1 and 0: held whole).
#[derive(Clone, Copy, Debug)]
pub struct ExpertSeat {
    pub degree: usize,
    pub rank: usize,
    pub shard_size: usize,
    pub shard_rank: usize,
}

/// How many ranks of a shard group of `shard_size` hold the same experts
/// at expert-parallel `degree`, and so split their state: every
/// `degree`-th, when the degree divides the shard group; 1 when the shard
/// group lies within one expert group (or nothing is sharded).
pub fn expert_shard_size(degree: usize, shard_size: usize) -> Result<usize> {
    match (shard_size % degree, degree % shard_size) {
        (0, _) => Ok(shard_size / degree),
        (_, 0) => Ok(1),
        _ => bail!(
            "train.expert_parallel (--expert-parallel) {degree} with a shard group of {shard_size} ranks: one must divide the other, so that the ranks of a shard group holding the same experts split their state evenly (choose the degree or --shard-group-size so)"
        ),
    }
}

/// The experts' shard groups in a world of `world` ranks: in each shard
/// group of `shard_size` consecutive ranks, the ranks holding the same
/// experts (every `degree`-th). None where each holds its experts alone (a
/// shard group within one expert group, or nothing sharded).
fn expert_shards(world: usize, degree: usize, shard_size: usize) -> Result<Option<Vec<Vec<usize>>>> {
    if expert_shard_size(degree, shard_size)? == 1 {
        return Ok(None);
    }
    let groups = (0..world).step_by(shard_size).flat_map(|start| (start..start + degree).map(move |first| (first..start + shard_size).step_by(degree).collect()));
    Ok(Some(groups.collect()))
}

/// A block's token exchanges over an expert group, through the hook.
pub struct TokenExchanger {
    pub group: ProcessGroup,
    pub hook: SharedHook,
}

impl ExpertExchange for TokenExchanger {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn exchange(&self, rows: &Tensor, sent: &[i64], received: &[i64]) -> Result<Tensor> {
        let exchange = Exchange { group: self.group.clone(), hook: self.hook.clone(), sent: sent.to_vec(), received: received.to_vec() };
        ft_sys::exchange(rows, Box::new(exchange)).map_err(|e| anyhow::anyhow!(e.0))
    }
}

/// One exchange's splits, for its forward and its backward.
struct Exchange {
    group: ProcessGroup,
    hook: SharedHook,
    sent: Vec<i64>,
    received: Vec<i64>,
}

impl ft_sys::Exchanger for Exchange {
    fn exchange(&self, input: &Tensor, reverse: bool) -> Result<Tensor, String> {
        let (input_splits, output_splits) = match reverse {
            false => (self.sent.clone(), self.received.clone()),
            true => (self.received.clone(), self.sent.clone()),
        };
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum();
        // Memory can run out here, at a step's peak: an error, not a panic.
        let output = Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).map_err(|e| format!("an expert-parallel token exchange: {e}"))?;
        let request = TokenExchange { group: &self.group, input: input.contiguous(), output: output.shallow_clone(), input_splits, output_splits };
        // The trainer holds no borrow of the hook while a block computes or backward runs.
        let mut hook = self.hook.try_borrow_mut().map_err(|_| "the communication hook is busy elsewhere during a token exchange".to_string())?;
        let name = hook.name().to_string();
        hook.all_to_all(request).and_then(|pending| pending.wait()).map_err(|e| format!("comm `{name}`: an expert-parallel token exchange: {e:#}"))?;
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::expert_shards;

    #[test]
    fn experts_shard_over_their_replicas_within_each_shard_group() {
        // full_shard over 8 ranks at degree 2: ranks 0,2,4,6 hold experts 0..E/2.
        assert_eq!(expert_shards(8, 2, 8).unwrap(), Some(vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]));
        // hybrid_shard, nodes of 4: the replicas within a node.
        assert_eq!(expert_shards(8, 2, 4).unwrap(), Some(vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]));
        // An expert group as large as a shard group or larger, or nothing sharded: experts held whole.
        for (degree, shard_size) in [(4, 4), (4, 2), (2, 1), (8, 8)] {
            assert_eq!(expert_shards(8, degree, shard_size).unwrap(), None, "{degree} {shard_size}");
        }
        let refused = expert_shards(12, 4, 6).unwrap_err().to_string();
        assert!(refused.starts_with("train.expert_parallel (--expert-parallel) 4 with a shard group of 6 ranks: one must divide the other"), "{refused}");
    }
}
