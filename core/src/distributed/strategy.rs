//! Sharding strategies: a policy over one mechanism that core owns (flat
//! per-unit buffers, gather/release, gradient reduction, optimizer over
//! shards: `flat.rs` and `train/`), and the communication behaviour the
//! strategy brings (`comm_hook.rs`; the built-in collectives unless it says
//! otherwise). The policy table in docs/ARCHITECTURE.md lists the
//! built-ins, each a crate under `strategies/`; docs/PLUGINS.md says how
//! to write one.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::Kind;

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
    /// Every rank ends with the whole summed gradient (over all ranks).
    AllReduce,
    /// Each rank ends with the sum of its shard (inside the shard group,
    /// then all-reduced across replica groups).
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

/// The dtype core reduces gradients in (`train.reduce_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    /// Exact sums whatever the compute dtype (FSDP2's `reduce_dtype=float32`).
    #[default]
    Fp32,
    /// The compute dtype: half the bytes under bf16/fp16, rounded sums.
    Compute,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardingPolicy {
    pub params: ParamPlacement,
    pub grads: GradReduction,
    pub optimizer_state_sharded: bool,
    pub shard_group: ShardGroup,
}

impl ReduceDtype {
    /// The dtype it names when computing in `compute`.
    pub fn kind(self, compute: Kind) -> Kind {
        match self {
            ReduceDtype::Fp32 => Kind::Float,
            ReduceDtype::Compute => compute,
        }
    }
}

impl ShardingPolicy {
    /// Whole parameters on every rank, gradients all-reduced; optimizer
    /// state whole (ddp) or sharded over the world (zero1).
    pub const fn replicated(optimizer_state_sharded: bool) -> ShardingPolicy {
        ShardingPolicy {
            params: ParamPlacement::Replicated,
            grads: GradReduction::AllReduce,
            optimizer_state_sharded,
            shard_group: ShardGroup::World,
        }
    }

    /// Parameters, gradients (reduce-scattered) and optimizer state sharded
    /// over `shard_group`.
    pub const fn sharded(reshard_after_forward: bool, shard_group: ShardGroup) -> ShardingPolicy {
        ShardingPolicy {
            params: ParamPlacement::Sharded { reshard_after_forward },
            grads: GradReduction::ReduceScatter,
            optimizer_state_sharded: true,
            shard_group,
        }
    }

    /// The DeepSpeed ZeRO stage this policy is, if it is one: over the whole
    /// world, stage 0 replicates everything, 1
    /// shards optimizer state, 2 gradients too (FSDP's SHARD_GRAD_OP), 3
    /// parameters between uses too (FULL_SHARD).
    pub fn zero_stage(&self) -> Option<u8> {
        if self.shard_group != ShardGroup::World {
            return None;
        }
        match (self.params, self.grads, self.optimizer_state_sharded) {
            (ParamPlacement::Replicated, GradReduction::AllReduce, false) => Some(0),
            (ParamPlacement::Replicated, GradReduction::AllReduce, true) => Some(1),
            (ParamPlacement::Replicated | ParamPlacement::Sharded { reshard_after_forward: false }, GradReduction::ReduceScatter, true) => Some(2),
            (ParamPlacement::Sharded { reshard_after_forward: true }, GradReduction::ReduceScatter, true) => Some(3),
            _ => None,
        }
    }

    /// Ranks per shard group in a world of `world` ranks with `local_world`
    /// per node: `requested` (`--shard-group-size`) when given, else the
    /// policy's own; 1 when the policy shards nothing. `strategy` names it
    /// in errors.
    pub fn shard_group_size(&self, strategy: &str, world: usize, local_world: usize, requested: Option<usize>) -> Result<usize> {
        if !self.optimizer_state_sharded {
            if let Some(size) = requested {
                bail!("--shard-group-size {size}: strategy `{strategy}` shards nothing");
            }
            return Ok(1);
        }
        let size = requested.unwrap_or(match self.shard_group {
            ShardGroup::World => world,
            ShardGroup::Node => local_world,
            ShardGroup::Size(n) => n,
        });
        if size == 0 || world % size != 0 {
            bail!("shard group size {size} must divide the world size {world} (strategy `{strategy}`)");
        }
        Ok(size)
    }

    /// What a run of this policy asks of its communication hook, in a world
    /// of `world` ranks with shard groups of `shard_size` (1: nothing sharded).
    pub fn comm_plan(&self, strategy: &str, world: usize, shard_size: usize, offload: bool) -> crate::distributed::comm_hook::CommPlan {
        use crate::distributed::comm_hook::ReduceStage;
        let sharded = shard_size > 1;
        let grads_sharded = sharded && self.grads == GradReduction::ReduceScatter;
        let mut stages = vec![];
        if world > 1 {
            stages.push(if grads_sharded { ReduceStage::Shard } else { ReduceStage::World });
            if grads_sharded && shard_size < world {
                stages.push(ReduceStage::Replica);
            }
        }
        let gathers = sharded && matches!(self.params, ParamPlacement::Sharded { .. });
        crate::distributed::comm_hook::CommPlan { strategy: strategy.to_string(), stages, gathers, world_size: world, offload }
    }

    /// Refuses combinations the mechanism cannot run, saying why.
    pub fn validate(&self, strategy: &str) -> Result<()> {
        let sharded_params = matches!(self.params, ParamPlacement::Sharded { .. });
        if sharded_params && self.grads == GradReduction::AllReduce {
            bail!("strategy `{strategy}`: sharded parameters need reduce-scattered gradients (each rank updates only its shard)");
        }
        if (sharded_params || self.grads == GradReduction::ReduceScatter) && !self.optimizer_state_sharded {
            bail!("strategy `{strategy}`: with sharded parameters or gradients the optimizer state must be sharded too (a rank only has its shard's gradient)");
        }
        Ok(())
    }
}

/// The strategy name (`--strategy auto`) that lets `ft plan`'s prediction
/// choose the strategy, offload and activation checkpointing of a run.
pub const AUTO: &str = "auto";

/// A strategy crate's registration: `inventory::submit! { StrategyRegistration { … } }`.
pub struct StrategyRegistration {
    pub name: &'static str,
    /// Other names that select it (e.g. `zero3` for `full_shard`).
    pub aliases: &'static [&'static str],
    pub summary: &'static str,
    pub create: fn() -> Box<dyn ShardingStrategy>,
}
inventory::collect!(StrategyRegistration);

pub trait ShardingStrategy: Send + Sync {
    fn name(&self) -> &str;
    fn policy(&self) -> ShardingPolicy;

    /// The communication behaviour the strategy brings (`--comm` chooses
    /// another); None: the built-in collectives.
    fn comm_hook(&self) -> Option<Box<dyn crate::distributed::comm_hook::CommHook>> {
        None
    }
}

/// A strategy that is a named, fixed policy — every built-in one is.
pub struct FixedPolicy {
    pub name: &'static str,
    pub policy: ShardingPolicy,
}

impl ShardingStrategy for FixedPolicy {
    fn name(&self) -> &str {
        self.name
    }

    fn policy(&self) -> ShardingPolicy {
        self.policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_policies_are_refused_with_the_reason() {
        let policy = ShardingPolicy {
            params: ParamPlacement::Sharded { reshard_after_forward: true },
            grads: GradReduction::AllReduce,
            optimizer_state_sharded: true,
            shard_group: ShardGroup::World,
        };
        let err = policy.validate("odd").unwrap_err().to_string();
        assert!(err.contains("`odd`: sharded parameters need reduce-scattered gradients"), "{err}");
        let policy = ShardingPolicy { grads: GradReduction::ReduceScatter, optimizer_state_sharded: false, ..policy };
        assert!(policy.validate("odd").unwrap_err().to_string().contains("optimizer state must be sharded"));
        let zero3 = ShardingPolicy { optimizer_state_sharded: true, ..policy };
        zero3.validate("zero3").unwrap();
    }

    #[test]
    fn zero_stages_follow_deepspeed() {
        assert_eq!(ShardingPolicy::replicated(false).zero_stage(), Some(0));
        assert_eq!(ShardingPolicy::replicated(true).zero_stage(), Some(1));
        assert_eq!(ShardingPolicy::sharded(false, ShardGroup::World).zero_stage(), Some(2));
        assert_eq!(ShardingPolicy::sharded(true, ShardGroup::World).zero_stage(), Some(3));
        assert_eq!(ShardingPolicy::sharded(true, ShardGroup::Node).zero_stage(), None, "hybrid is no ZeRO stage");
    }
}
