# The README's commands. Every target sets up first (scripts/setup.sh skips
# what is already done), then builds with the venv's libtorch.
SHELL := /bin/bash
ENV := source scripts/env.sh &&

.PHONY: setup build demo test bench-build

setup:
	@scripts/setup.sh

build: setup
	$(ENV) cargo build --release

# The main job on an embedded default: 2 CPU ranks over Gloo.
demo: build
	$(ENV) target/release/ft launch --nproc-per-node 2 -- comm-test --backend gloo --min-bytes 1M --max-bytes 16M --dtype f32,bf16 --group-size 1

test: setup
	$(ENV) cargo test --workspace --all-targets
