//! `full_shard` (FSDP's FULL_SHARD, ZeRO stage 3): each rank keeps 1/N of
//! every unit's parameters, gradients and optimizer state. A unit is
//! all-gathered before its forward and freed after it, gathered again before
//! its backward, and its gradient is reduce-scattered: the least memory, at
//! two gathers per unit per micro-batch.

use ft_core::distributed::strategy::{FixedPolicy, ShardGroup, ShardingPolicy, StrategyRegistration};

const NAME: &str = "full_shard";

const POLICY: ShardingPolicy = ShardingPolicy::sharded(true, ShardGroup::World);

inventory::submit! {
    StrategyRegistration {
        name: NAME,
        aliases: &["zero3"],
        summary: "Parameters, gradients and optimizer state sharded; units gathered for forward and again for backward",
        create: || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    }
}
