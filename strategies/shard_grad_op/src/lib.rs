//! `shard_grad_op` (FSDP's SHARD_GRAD_OP, ZeRO stage 2 with sharded
//! parameters): each rank keeps 1/N of every unit's parameters, gradients and
//! optimizer state. A unit is all-gathered before its forward and kept until
//! its backward is done (one gather per micro-batch), and its gradient is
//! reduce-scattered.

use ft_core::distributed::strategy::{FixedPolicy, ShardGroup, ShardingPolicy, StrategyRegistration};

const NAME: &str = "shard_grad_op";

const POLICY: ShardingPolicy = ShardingPolicy::sharded(false, ShardGroup::World);

inventory::submit! {
    StrategyRegistration {
        name: NAME,
        aliases: &["zero2"],
        summary: "Parameters, gradients and optimizer state sharded; gathered once per step (kept from forward through backward)",
        create: || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    }
}
