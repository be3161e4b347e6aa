# Source this to build and run with plain cargo:
#   source scripts/env.sh && cargo build
# The Makefile's targets source it too. It points the build at the project's
# venv (scripts/setup.sh makes it): torch-sys finds libtorch through the venv's
# python (LIBTORCH_USE_PYTORCH=1), and every binary gets an rpath to the
# wheel's torch/lib, so nothing needs LD_LIBRARY_PATH on this machine.
# DT_RPATH (--disable-new-dtags) rather than RUNPATH: it also serves the
# libraries libtorch pulls in, and LD_LIBRARY_PATH still wins where this path
# does not exist (a binary carried to another machine).
FT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
# The venv by its physical path: a worktree whose .venv links to another
# checkout's builds with the same flags (and so reuses the same compiled
# dependencies).
export VIRTUAL_ENV="$(cd "$FT_ROOT/.venv" 2>/dev/null && pwd -P || echo "$FT_ROOT/.venv")"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
FT_TORCH_LIB="$(ls -d "$VIRTUAL_ENV"/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n1)"
if [ -z "$FT_TORCH_LIB" ]; then
  echo "scripts/env.sh: no torch in $VIRTUAL_ENV; run scripts/setup.sh first" >&2
else
  # The wheel's CUDA libraries too: NVRTC compiles ft's fused kernels at run time.
  FT_CUDA_LIB="$(cd "$FT_TORCH_LIB/../../nvidia/cu13/lib" 2>/dev/null && pwd)"
  export RUSTFLAGS="-C link-arg=-Wl,--disable-new-dtags,-rpath,$FT_TORCH_LIB${FT_CUDA_LIB:+:$FT_CUDA_LIB}"
fi
