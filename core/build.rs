//! Records what a plug-in must share with the ft that loads it (abi.rs):
//! the compiler's version (a plug-in is a separately compiled cdylib
//! sharing Rust types with ft, so it must come from the same rustc), and
//! the versions of the crates whose types cross between them, as the
//! workspace pins them.

use std::path::Path;

/// The crates whose types or allocations cross between ft and a plug-in
/// (`Tensor`, `anyhow::Error`, `serde_json::Map`): each must be pinned
/// (`=VERSION`) in the workspace's `[workspace.dependencies]`.
const SHARED_CRATES: [&str; 3] = ["tch", "anyhow", "serde_json"];

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FT_RUSTC_VERSION={version}");

    // ft-core's workspace (the one its `.workspace = true` dependencies come
    // from), wherever the crate depending on it is built. Read when the
    // script runs, not when it was compiled: a build directory moved with
    // its compiled script still finds the workspace it now builds.
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for build scripts");
    let manifest = Path::new(&dir).join("../Cargo.toml");
    println!("cargo:rerun-if-changed={}", manifest.display());
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("cannot read {}: {e}", manifest.display()));
    let pinned = SHARED_CRATES.map(|name| match pinned_version(&text, name) {
        Some(version) => format!("{name} {version}"),
        None => panic!("{}: [workspace.dependencies] must pin {name} exactly (`{name} = \"=VERSION\"`): its types cross to plug-ins", manifest.display()),
    });
    println!("cargo:rustc-env=FT_SHARED_CRATES={}", pinned.join(", "));
}

/// The exact version `name` is pinned to in `manifest`'s
/// `[workspace.dependencies]` (`name = "=1.2.3"` or `name = { version =
/// "=1.2.3", … }`). Read by hand: a TOML crate here would be built with
/// its own features of serde and friends, rebuilding much of ft's graph.
fn pinned_version(manifest: &str, name: &str) -> Option<String> {
    let table = manifest.split("[workspace.dependencies]").nth(1)?;
    let table = table.split("\n[").next()?;
    let line = table.lines().find(|l| l.split('=').next().is_some_and(|key| key.trim() == name))?;
    let value = line.split_once('=')?.1;
    let requirement = match value.split_once("version") {
        Some((_, rest)) if value.trim_start().starts_with('{') => rest.split('"').nth(1)?,
        _ => value.split('"').nth(1)?,
    };
    requirement.strip_prefix('=').map(|v| v.trim().to_string())
}
