#!/bin/bash
# One device call for the sm90 fp8-block GEMM (run from the repo root after `source .dsl/prelude.sh`):
# the GPU correctness tests, then benchmarks/gemm_fp8_block.py with the large rows tuned over
# LARGE_CANDIDATES; logs and JSON under $OUT. Extra arguments go to the benchmark.
set -o pipefail
SECONDS=0
python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_sm90_fp8_block.py 2>&1 | tail -25 | tee "$OUT/pytest.log"
echo "pytest took ${SECONDS}s"
python benchmarks/gemm_fp8_block.py --tune-rows 4096 --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
echo "total ${SECONDS}s"
