# Sourced on the GPU machine: run a binary built elsewhere against that
# machine's own PyTorch (its torch/lib and nvidia/*/lib), and keep NVLink
# multicast off (the shared host's rule).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE="$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
LD_LIBRARY_PATH="$SITE/torch/lib:$(ls -d "$SITE"/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
FT="${FT:-.device/ft}"
# `ft bench --chart` text: matplotlib's copy of DejaVu Sans where the system has none.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || export FT_CHART_FONT="$SITE/matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf"
