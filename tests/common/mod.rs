//! What the integration tests share: the `ft` binary, started with an
//! environment that does not look like a launcher's worker, and its output.
// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

pub const FT: &str = env!("CARGO_BIN_EXE_ft");

/// Removes what would make a process think a launcher started it (a test
/// may itself run under one), and any fault injection.
pub fn without_launcher_env(command: &mut Command) -> &mut Command {
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "FT_FAULT_INJECT"] {
        command.env_remove(var);
    }
    command
}

/// `ft`, not a launcher's worker.
pub fn ft() -> Command {
    let mut command = Command::new(FT);
    without_launcher_env(&mut command);
    command
}

/// A finished command's stdout and stderr together.
pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}
