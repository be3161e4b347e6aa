//! No code: its Cargo.toml turns on, for the crates below ft-core, the
//! features ft's workspace unifies (see core/Cargo.toml).
