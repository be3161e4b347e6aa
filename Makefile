# The README's commands. Every target sets up first (scripts/setup.sh skips
# what is already done), then builds with the venv's libtorch.
SHELL := /bin/bash
ENV := source scripts/env.sh &&

.PHONY: setup build demo test bench-build plugins

setup:
	@scripts/setup.sh

build: setup
	$(ENV) cargo build --release

# The main job on the embedded default: fine-tune a small BLOOM on generated
# question-answer data with its own tokenizer, 2 CPU ranks over Gloo. Each
# `make demo` starts afresh in ft-output/, replacing the last demo's outputs.
demo: build
	$(ENV) target/release/ft train --overwrite-output-dir

# The communication plug-ins, built as a third party's are, into
# target/plugins/lib<name>.so (load with `ft --plugin target/plugins/libNAME.so`).
PLUGINS := bf16 powersgd int8
plugins: setup
	$(ENV) cargo build --release $(foreach p,$(PLUGINS),-p ft-comm-$(p))
	mkdir -p target/plugins && $(foreach p,$(PLUGINS),cp target/release/lib$(p).so target/plugins/ &&) true

test: setup
	@scripts/test.sh
