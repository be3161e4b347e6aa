//! The ranks a trainer works with and the strategy's policy over them: the
//! world, the shard group that splits parameters, gradients and optimizer
//! state, and (hybrid sharding) the replica groups across shard groups.

use crate::distributed::comm::{Communicator, ProcessGroup};
use crate::distributed::experts::ExpertGroups;
use crate::distributed::strategy::{ReduceDtype, ShardingPolicy, ShardingStrategy};
use anyhow::Result;
use tch::Kind;

pub struct DataParallel<'c> {
    pub policy: ShardingPolicy,
    /// Every data-parallel rank (all-reduced gradients are summed over it).
    pub world: &'c ProcessGroup,
    /// Ranks per shard group (1 when the policy shards nothing).
    pub shard_size: usize,
    /// A shard group smaller than the world (the world itself is `world`).
    sub_group: Option<ProcessGroup>,
    /// Hybrid sharding: the ranks holding the same shard in other shard
    /// groups, across which reduced gradient shards are all-reduced.
    replicas: Option<ProcessGroup>,
    /// The dtype gradients travel in.
    pub reduce_dtype: Kind,
    /// Expert parallelism's groups (`train.expert_parallel` above 1).
    pub experts: Option<ExpertGroups>,
}

impl<'c> DataParallel<'c> {
    /// The groups `strategy` needs over `comm`'s world (collective: every
    /// rank calls it). `size_override` is `--shard-group-size`; `reduce` is
    /// the run's reduce dtype (the policy may fix its own) and `compute` the
    /// compute dtype it may name; `expert_parallel` the ranks of an expert group.
    pub fn new(
        comm: &'c Communicator,
        strategy: &dyn ShardingStrategy,
        size_override: Option<usize>,
        reduce: ReduceDtype,
        compute: Kind,
        expert_parallel: usize,
    ) -> Result<DataParallel<'c>> {
        let policy = strategy.policy();
        policy.validate(strategy.name())?;
        let env = comm.env();
        let world = env.world_size;
        let reduce_dtype = reduce.kind(compute);
        let size = policy.shard_group_size(strategy.name(), world, env.local_world_size, size_override)?;
        let experts = (expert_parallel > 1).then(|| ExpertGroups::new(comm, expert_parallel, size)).transpose()?;
        let mut parallel = DataParallel { policy, world: comm.world(), shard_size: 1, sub_group: None, replicas: None, reduce_dtype, experts };
        if size == 1 {
            return Ok(parallel);
        }
        parallel.shard_size = size;
        if size != world {
            let (shard, replicas) = comm.hybrid_groups(size)?;
            parallel.sub_group = Some(shard);
            parallel.replicas = Some(replicas);
        }
        Ok(parallel)
    }

    /// The ranks this rank shares its shards with (None when nothing is sharded).
    pub fn shard(&self) -> Option<&ProcessGroup> {
        match (&self.sub_group, self.shard_size) {
            (Some(group), _) => Some(group),
            (None, 1) => None,
            (None, _) => Some(self.world),
        }
    }

    pub fn replicas(&self) -> Option<&ProcessGroup> {
        self.replicas.as_ref()
    }

    /// The groups a unit's state is split and summed over: the strategy's,
    /// or for an expert-parallel unit (`experts`) its experts' holders' —
    /// split over the replicas in this rank's shard group, and summed over
    /// all replicas when whole. Hybrid sharding's replica groups serve both:
    /// an expert group within a shard group repeats in every one.
    pub fn groups(&self, experts: bool) -> UnitGroups<'_> {
        match self.experts.as_ref().filter(|_| experts) {
            Some(experts) => UnitGroups { shard: experts.shard.as_ref(), replicas: experts.shard.as_ref().and(self.replicas()), world: experts.replicas.as_ref() },
            None => UnitGroups { shard: self.shard(), replicas: self.replicas(), world: Some(self.world) },
        }
    }
}

/// The ranks a unit's state is split and summed over ([`DataParallel::groups`]).
#[derive(Clone, Copy)]
pub struct UnitGroups<'g> {
    /// The ranks splitting the unit's state (None: held whole).
    pub shard: Option<&'g ProcessGroup>,
    /// The ranks holding the same shard, over which reduced gradient shards are summed.
    pub replicas: Option<&'g ProcessGroup>,
    /// The ranks computing the unit's whole gradient, over which it is summed (None: this rank alone).
    pub world: Option<&'g ProcessGroup>,
}
