#!/usr/bin/env bash
# Builds this plug-in for the ft whose ft-core Cargo.toml points at:
#   ./build.sh              a debug build: target/debug/lib<name>.so
#   ./build.sh --release    the build you deploy: target/release/lib<name>.so
# It sources that ft's scripts/env.sh (libtorch from ft's venv, found as ft
# itself was built), then runs cargo with the Cargo.lock beside this file
# (the versions ft pins). Other arguments go to `cargo build`.
set -eo pipefail
cd "$(dirname "$0")"
core=$(sed -n 's|^ft-core *= *{ *path *= *"\(.*\)" *}.*|\1|p' Cargo.toml)
if [ -z "$core" ] || [ ! -f "$core/../scripts/env.sh" ]; then
  echo "build.sh: Cargo.toml's ft-core = { path = \"…/core\" } must point at the core/ of an ft checkout (found: '${core}')" >&2
  exit 1
fi
source "$core/../scripts/env.sh"
cargo build "$@"
