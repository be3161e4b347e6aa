//! Sharding strategies are policies over one mechanism that core owns (flat
//! per-unit buffers, gather/release, gradient reduction, optimizer over
//! shards). A strategy says *what* to do; DESIGN.md §5 tabulates the built-ins.

/// Where a unit's parameters live between uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamPlacement {
    /// Every rank keeps the full parameters (ddp, zero1).
    Replicated,
    /// Each rank keeps 1/N; gathered before use. `reshard_after_forward`
    /// frees the gathered copy after forward and gathers again for backward
    /// (full_shard) instead of keeping it until backward ends (shard_grad_op).
    Sharded { reshard_after_forward: bool },
}

/// How a unit's gradient is combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradReduction {
    AllReduce,
    ReduceScatter,
}

/// Which ranks share one copy of the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardGroup {
    World,
    /// The ranks of one node (LOCAL_WORLD_SIZE); replicas across nodes.
    Node,
    /// Groups of this many consecutive ranks; replicas across groups.
    Size(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardingPolicy {
    pub params: ParamPlacement,
    pub grads: GradReduction,
    pub optimizer_state_sharded: bool,
    pub shard_group: ShardGroup,
}

pub trait ShardingStrategy: Send + Sync {
    fn name(&self) -> &str;
    fn policy(&self) -> ShardingPolicy;
}
