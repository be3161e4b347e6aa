#!/usr/bin/env bash
# Sets up everything the build needs, from the registries only:
#   - Debian's libgloo-dev: Gloo's headers (the torch wheel ships c10d's
#     headers but not Gloo's; Debian's 2022 headers match libtorch's layout),
#     and fonts-dejavu-core (the text of `ft bench --chart`);
#   - .venv with PyPI's torch==2.11.0 (the libtorch that tch 0.24 is built
#     for; the CUDA build, ~4.6 GB with its nvidia-* wheels) and the CUDA/NCCL
#     headers ProcessGroupNCCL.hpp needs (cuda-toolkit's crt and cccl extras,
#     at the versions torch's own cuda-toolkit pin names), and the readers
#     the tests check ft's files with (tensorboard, transformers, mlflow, peft, trl, wandb,
#     datasets and pyarrow; torchao, whose float8 functions the float8 tests match;
#     bitsandbytes, whose 4-bit quantization the QLoRA tests match).
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

if [ ! -f /usr/include/gloo/config.h ] || [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
  echo "setup: installing Gloo headers and a font (Debian libgloo-dev, fonts-dejavu-core)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libgloo-dev fonts-dejavu-core >/dev/null
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
if ! installed torch "$TORCH_VERSION" \
   || [ ! -d .venv/lib/python3*/site-packages/nvidia/cu13/include/crt ]; then
  echo "setup: installing torch==$TORCH_VERSION and CUDA headers into .venv (several GB, a few minutes)"
  .venv/bin/pip install --quiet --disable-pip-version-check \
    "torch==$TORCH_VERSION" "cuda-toolkit[crt,cccl]==$CUDA_TOOLKIT_VERSION"
fi
# The tests check ft's outputs with the reference readers: TensorBoard's for
# event files, transformers' for exported models.
if ! installed tensorboard "$TENSORBOARD_VERSION" || ! installed transformers "$TRANSFORMERS_VERSION"; then
  echo "setup: installing tensorboard and transformers into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check \
    "tensorboard==$TENSORBOARD_VERSION" "transformers==$TRANSFORMERS_VERSION"
fi
# The MLflow sink's tests read ft's runs with MLflow's own client, from its
# mlruns/ and from a tracking server they start: the full `mlflow` package
# (mlflow-skinny, the client alone, has no server).
if ! installed mlflow "$MLFLOW_VERSION"; then
  echo "setup: installing mlflow==$MLFLOW_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "mlflow==$MLFLOW_VERSION"
fi
# The float8 tests compare ft's casts, scales, linear layers and a model's
# step with torchao's float8 training, emulated on CPU.
if ! installed torchao "$TORCHAO_VERSION"; then
  echo "setup: installing torchao==$TORCHAO_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "torchao==$TORCHAO_VERSION"
fi
# The LoRA tests load ft's adapters with peft and compare.
if ! installed peft "$PEFT_VERSION"; then
  echo "setup: installing peft==$PEFT_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "peft==$PEFT_VERSION"
fi
# The DPO tests train with TRL's DPOTrainer and compare losses and figures.
if ! installed trl "$TRL_VERSION"; then
  echo "setup: installing trl==$TRL_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "trl==$TRL_VERSION"
fi
# The QLoRA tests compare ft's 4-bit quantization (NF4, FP4) and the state
# dicts it reads and writes with bitsandbytes', on CPU.
if ! installed bitsandbytes "$BITSANDBYTES_VERSION"; then
  echo "setup: installing bitsandbytes==$BITSANDBYTES_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "bitsandbytes==$BITSANDBYTES_VERSION"
fi
# The data readers' tests write Parquet and Arrow files with Hugging Face's
# `datasets` (to_parquet, save_to_disk) and pyarrow, and compare.
if ! installed datasets "$DATASETS_VERSION" || ! installed pyarrow "$PYARROW_VERSION"; then
  echo "setup: installing datasets==$DATASETS_VERSION and pyarrow==$PYARROW_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "datasets==$DATASETS_VERSION" "pyarrow==$PYARROW_VERSION"
fi
# The wandb sink drives W&B's own client; its test reads the offline run back
# with wandb's DataStore, which only the 0.19 wheel (kept, not installed, in
# .venv/reference) still has in Python.
if ! installed wandb "$WANDB_VERSION"; then
  echo "setup: installing wandb==$WANDB_VERSION into .venv (for the tests)"
  .venv/bin/pip install --quiet --disable-pip-version-check "wandb==$WANDB_VERSION"
fi
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
