//! ft's tasks, each registered beside its file: what a run trains (its
//! datasets and the loss of the model's head) and how an epoch is scored.
//! The loop in ft-core knows none of them.

pub mod causal_lm;
pub mod dpo;
pub mod extractive_qa;
pub mod grpo;
pub mod rewards;
