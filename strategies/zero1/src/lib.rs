//! `zero1` (ZeRO stage 1): parameters and gradients whole on every rank, as
//! in ddp, but each rank keeps the fp32 master and AdamW moments of only its
//! 1/N slice of every unit, updates that slice, and all-gathers the updated
//! slices into everyone's parameters after the step.

use ft_core::distributed::strategy::{FixedPolicy, ShardingPolicy, StrategyRegistration};

const NAME: &str = "zero1";

const POLICY: ShardingPolicy = ShardingPolicy::replicated(true);

inventory::submit! {
    StrategyRegistration {
        name: NAME,
        aliases: &[],
        summary: "Replicated parameters and gradients, optimizer state sharded; parameters all-gathered after the step",
        create: || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    }
}
