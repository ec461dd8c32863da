#!/usr/bin/env bash
# One device call (< 600 s) for reuse=steps' buffers in one launch a layer (2026-12-07, not run yet):
# keep_selection (a selecting step keeps each layer's A, count and scores: 4 torch launches before) and
# append_newest_block writing the buffers (between selections, in place under between=last: 1 launch, 3
# before). Their GPU tests and the reuse GPU tests; then whole runs of reuse=steps (every 2 and 4) beside
# serial DSA for quest at 32K, block 64, K = 8, here and, where carried, in the tree before (.xfer/before):
# before, every 2 ran 1.004x serial and every 4 0.979x (a selecting step +2.8% over serial).
# The steps are experiments/h100_append_newest.sh's, with both kernels' tests and without its per-call bench.
#   usage on the device: OUT=... bash experiments/h100_reuse_keep.sh
KERNEL_TESTS="tests/test_kernels_keep_selection.py tests/test_kernels_append_newest.py" BENCH=0 TESTS_S=${TESTS_S:-120} \
  exec bash "$(dirname "$0")/h100_append_newest.sh"
