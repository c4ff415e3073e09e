#!/usr/bin/env bash
# Device run of session 18: decode tokens/s of Llama-3.1-8B (random weights) with and without
# `quantkit bench --compile`, bf16 baseline in each run. Reports (md + json) land in $OUT.
# FLAGS adds bench options to every run (e.g. FLAGS=--fuse: q/k/v and gate/up as one GEMM each).
set -u
B="python -m quantkit.cli bench --random-init ${MODEL:-llama-3.1-8b} --prefill ${PREFILL:-1x2048} --gemm-m 1 --iters 5 ${FLAGS:-}"
run() {  # name, bench arguments...
  local name=$1; shift
  local t=$(date +%s)
  timeout 300 $B "$@" --out /tmp/$name 2>&1 | grep -v Warn | tail -2
  echo "== $name: $(( $(date +%s) - t )) s"
  cp /tmp/$name/bench.md $OUT/$name.md 2>/dev/null && cp /tmp/$name/bench.json $OUT/$name.json
  sed -n '/Decode/,/GEMM/p' /tmp/$name/bench.md 2>/dev/null | grep "^|"
}
run eager nvfp4-w4a16,fp8-block --decode-batches 1,8
run compiled_w4a16 nvfp4-w4a16 --decode-batches 1 --compile
run compiled_fp8 fp8-block --baseline none --decode-batches 1 --compile
