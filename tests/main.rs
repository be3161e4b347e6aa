//! ft's integration tests, one module per file beside this one, built as
//! one test binary: it links libtorch once rather than once a file, and
//! libtest schedules every file's tests on the same threads, so no file's
//! slowest test leaves a core idle while the next file waits. One file's
//! tests run alone as `cargo test --test integration <file>::`.

mod common;

mod bench;
mod bert;
mod chat;
mod comm_plugins;
mod config_fuzz;
mod data_sources;
mod demo;
mod dpo;
mod engine;
mod extractive_qa;
mod float8;
mod grpo;
mod inputs;
mod launch_and_collectives;
mod lora;
mod mlflow;
mod models;
mod plan;
mod progress;
mod qlora;
mod runs;
mod sampling;
mod slurm;
mod strategies;
mod train;
mod wandb;
