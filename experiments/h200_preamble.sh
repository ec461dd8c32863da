# Sourced by the device scripts (experiments/h200_*.sh): strict unset variables, kernels compiled
# (not interpreted), the output folder $OUT with its log, say() for a timed log line, and the
# GPU, driver and versions at the log's top.
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
LOG=$OUT/log.txt
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
# install_wheels [extra wheel ...]: the carried .whl/ wheels (and any named) into .site, importable after
ROOT=$PWD
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --target "$ROOT/.site" "$ROOT"/.whl/*.whl "$@" 2>&1 | grep -v WARNING
  export PYTHONPATH=$ROOT/.site:$ROOT PATH=$ROOT/.site/bin:$PATH
}
