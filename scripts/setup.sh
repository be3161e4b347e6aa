#!/usr/bin/env bash
# Sets up everything the build needs, from the registries only:
#   - Debian's libgloo-dev: Gloo's headers (the torch wheel ships c10d's
#     headers but not Gloo's; Debian's 2022 headers match libtorch's layout),
#     fonts-dejavu-core (the text of `ft bench --chart`) and eatmydata
#     (the tests run under it: scripts/test.sh);
#   - .venv with the pinned Python packages listed below: the libtorch the
#     build links, the CUDA headers it compiles against, and the reference
#     libraries the tests compare ft with; installed by uv.
# Safe to re-run: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
CUDA_TOOLKIT_VERSION=13.0.2
TENSORBOARD_VERSION=2.21.0
TRANSFORMERS_VERSION=5.23.0
MLFLOW_VERSION=3.17.2
PEFT_VERSION=0.21.2
TORCHAO_VERSION=0.18.0
TRL_VERSION=1.16.0
BITSANDBYTES_VERSION=0.50.2
WANDB_VERSION=0.31.0
DATASETS_VERSION=5.2.0
PYARROW_VERSION=25.0.1
# The last wandb whose Python reads a run's .wandb file (wandb.sdk.internal.datastore).
WANDB_READER_VERSION=0.19.11
REFERENCE_TRANSFORMERS_VERSION=4.46.3
UV_VERSION=0.13.9

if [ ! -f /usr/include/gloo/config.h ] || [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || ! command -v eatmydata >/dev/null; then
  echo "setup: installing Gloo headers, a font and eatmydata (Debian libgloo-dev, fonts-dejavu-core, eatmydata)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libgloo-dev fonts-dejavu-core eatmydata >/dev/null
fi

# Whether .venv holds PACKAGE at VERSION (a local version such as +cu130
# aside), from its installed metadata: importing torch and the libraries
# built on it to ask took 18 s of every `make` target's set-up.
installed() {
  .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1]).split('+')[0] != sys.argv[2])" "$1" "$2" 2>/dev/null
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi

# What the build and the tests need, pinned. PyPI's torch is the libtorch
# tch 0.24 is built for (the CUDA build, ~4.6 GB with its nvidia-* wheels);
# cuda-toolkit's crt and cccl extras are the CUDA/NCCL headers
# ProcessGroupNCCL.hpp needs, at the version torch's own pin names. The
# tests check ft's outputs with the reference readers and libraries:
# TensorBoard's reader for event files, transformers for exported models,
# MLflow's client and server (the full package: mlflow-skinny has no
# server), torchao's float8 training emulated on CPU, peft for adapters,
# TRL's DPO and GRPO trainers, bitsandbytes' 4-bit quantization, datasets
# and pyarrow for Parquet and Arrow files, wandb's client.
requirements=(
  "torch==$TORCH_VERSION" "cuda-toolkit[crt,cccl]==$CUDA_TOOLKIT_VERSION"
  "tensorboard==$TENSORBOARD_VERSION" "transformers==$TRANSFORMERS_VERSION" "mlflow==$MLFLOW_VERSION"
  "torchao==$TORCHAO_VERSION" "peft==$PEFT_VERSION" "trl==$TRL_VERSION" "bitsandbytes==$BITSANDBYTES_VERSION"
  "datasets==$DATASETS_VERSION" "pyarrow==$PYARROW_VERSION" "wandb==$WANDB_VERSION"
)
missing=()
for requirement in "${requirements[@]}"; do
  package="${requirement%%==*}"
  installed "${package%%\[*}" "${requirement##*==}" || missing+=("$requirement")
done
if [ ! -d .venv/lib/python3*/site-packages/nvidia/cu13/include/crt ] && [[ " ${missing[*]} " != *" cuda-toolkit"* ]]; then
  missing+=("cuda-toolkit[crt,cccl]==$CUDA_TOOLKIT_VERSION")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]} into .venv (several GB the first time: about a minute)"
  # uv resolves once and downloads and unpacks in parallel: pip took 295 s
  # for what uv did in 36 s on a 2-core machine. pip's settings, where
  # given as PIP_* variables, are passed on as uv's.
  [ -x .venv/bin/uv ] || .venv/bin/pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  uv_settings=()
  [ -z "${PIP_INDEX_URL:-}" ] || uv_settings+=("UV_DEFAULT_INDEX=$PIP_INDEX_URL")
  [ -z "${PIP_FIND_LINKS:-}" ] || uv_settings+=("UV_FIND_LINKS=$PIP_FIND_LINKS")
  [ -z "${PIP_CERT:-}" ] || uv_settings+=("SSL_CERT_FILE=$PIP_CERT")
  [ -z "${PIP_DEFAULT_TIMEOUT:-}" ] || uv_settings+=("UV_HTTP_TIMEOUT=$PIP_DEFAULT_TIMEOUT")
  # No bytecode is compiled here (uv's --compile-bytecode): all of .venv's
  # 20,000 modules took 125 s of CPU, where the ~5,000 the tests import
  # take 26 s as scripts/test.sh's first imports write them.
  env "${uv_settings[@]}" .venv/bin/uv pip install --quiet --python .venv/bin/python "${missing[@]}"
fi
# wandb's sink test reads the offline run back with wandb's DataStore, which
# only the 0.19 wheel (kept, not installed, in .venv/reference) still has in
# Python.
if ! ls .venv/reference/wandb-"$WANDB_READER_VERSION"-*.whl >/dev/null 2>&1; then
  echo "setup: downloading wandb==$WANDB_READER_VERSION's wheel into .venv/reference (for the tests)"
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "wandb==$WANDB_READER_VERSION" -d .venv/reference
fi
# The SQuAD v2.0 evaluation test checks ft's scores with the official ones,
# which transformers 4.x ships as transformers/data/metrics/squad_metrics.py
# (5.x removed it): that version's wheel is kept, not installed, in
# .venv/reference, and the test reads the file out of it.
if ! ls .venv/reference/transformers-"$REFERENCE_TRANSFORMERS_VERSION"-*.whl >/dev/null 2>&1; then
  echo "setup: downloading transformers==$REFERENCE_TRANSFORMERS_VERSION's wheel into .venv/reference (for the tests)"
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps \
    "transformers==$REFERENCE_TRANSFORMERS_VERSION" -d .venv/reference
fi
echo "setup: done ($(du -sh .venv | cut -f1) in .venv)"
