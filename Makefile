# The README's commands. Every target sets up first (scripts/setup.sh skips
# what is already done), then builds with the venv's libtorch.
SHELL := /bin/bash
ENV := source scripts/env.sh &&

.PHONY: setup build demo test bench-build

setup:
	@scripts/setup.sh

build: setup
	$(ENV) cargo build --release

# The main job on the embedded default: fine-tune a small BLOOM on generated
# question-answer data with its own tokenizer, 2 CPU ranks over Gloo.
demo: build
	$(ENV) target/release/ft train

test: setup
	@scripts/test.sh
