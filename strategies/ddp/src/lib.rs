//! `ddp` (ZeRO stage 0, FSDP's NO_SHARD): every rank holds the whole model and
//! optimizer state. A unit is the all-reduce bucket: its gradient is
//! all-reduced as soon as backward completes it, while backward goes on with
//! the units before it; with gradient accumulation only the last
//! micro-batch communicates.

use ft_core::distributed::strategy::{FixedPolicy, ShardingPolicy, StrategyRegistration};

const NAME: &str = "ddp";

const POLICY: ShardingPolicy = ShardingPolicy::replicated(false);

inventory::submit! {
    StrategyRegistration {
        name: NAME,
        aliases: &["zero0", "no_shard"],
        summary: "Replicated parameters and optimizer; gradients all-reduced per unit, overlapped with backward",
        create: || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    }
}
