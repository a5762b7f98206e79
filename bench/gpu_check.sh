#!/usr/bin/env bash
# One-shot GPU check of the CUDA trainer backend (about 5 minutes on one H200):
#   1. builds with -Dcuda=enabled (nvcc, cuBLAS, NCCL);
#   2. CUDA vs CPU parity on fresh random inputs, outputs poisoned (tests/gpu/gpu_parity.c
#      states the bf16 tolerances: loss 1%, each gradient tensor 5% relative L2 (DFlash 2's
#      selector in inject mode 8%), AdamW update 25%, greedy agreement 95% (DFlash 2: 90%)),
#      including the NCCL path with one rank (bit-identical);
#   2b. the whole training loop (dflash_train_run, tests/gpu/gpu_run.c) on CPU, CUDA, and CUDA
#      over NCCL with one rank (DFLASH_NCCL=1): per-step loss within 3% of the CPU run, the
#      NCCL run bit-identical to plain CUDA;
#   3. training-step benchmarks at the Qwen3-8B and Kimi drafter shapes: tokens/s, model
#      TFLOP/s, MFU against the cuBLAS bf16 GEMM rate measured in the same run, memory;
#      each next to bench/gpu_model.py's prediction for this GPU (nvidia-smi's compute
#      capability: 9.0 H200, 10.0 B200, 10.3 B300, 12.x RTX PRO 6000), and every distinct GEMM of the step timed alone
#      (gpu_bench gemm) next to its predicted time; with Nsight Systems installed, every
#      kernel of the Qwen3-8B step measured (nsys) next to its predicted time;
#   4. the memory plan for the Kimi drafter on 8 x 80 GB next to what one GPU allocated, and
#      the model's full per-op tables (8 GPUs) for both shapes.
# Results go to $OUT (if set) or ./gpu_check_out. Exit status: non-zero if parity, the run
# loop check or a step of the check itself fails.
#
# DFLASH_GPU_CHECK_EMU=1 runs every step on the emulated device (cuda/emu) instead: a
# -Dcuda=disabled build (DFLASH_GPU_CHECK_BUILD, default build-emu; DFLASH_GPU_CHECK_NO_BUILD=1
# uses it as it is), the *_emu programs, the tiny shape. Its timings are the emulator's host
# times and mean nothing; it shows that the check runs from start to end (suite cuda-emu).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
out=${OUT:-$PWD/gpu_check_out}
mkdir -p "$out"
log() { echo "$@" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
emu=${DFLASH_GPU_CHECK_EMU:-0}
fail=0
step_failed() { log "FAILED: $*"; fail=1; }
py=$(command -v python3 || true)

if [ "$emu" = 1 ]; then
  build=${DFLASH_GPU_CHECK_BUILD:-build-emu}
  sfx=_emu
  shapes=("tiny 64 8 2")
  case "${DFLASH_EMU_ARCH:-sm_90}" in # the emulated device's arch (cuda/emu/README.md)
    sm_120) gpu=RTX-PRO-6000 ;;
    sm_100) gpu=B200 ;;
    *) gpu=H200 ;;
  esac
  log "== $(date -u +%FT%TZ) EMULATED device (cuda/emu): timings are meaningless"
else
  build=build-gpu
  sfx=
  # the paper's recipe: sequence 3072, 512 anchors, block 16; SpecForge's: 768, 256
  shapes=("qwen3-8b 3072 512 5" "qwen3-8b 768 256 5" "kimi 3072 512 3")
  # the architecture (compute capability) decides the model's row: 12.x RTX PRO 6000
  # Blackwell (99 KB of shared memory per block, PCIe), 10.3 B300, 10.0 B200, else H200;
  # the name where the driver's nvidia-smi has no compute_cap field
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  case "$cap|$name" in
    12.*|*"RTX PRO 6000"*) gpu=RTX-PRO-6000 ;;
    10.3*|*B300*) gpu=B300 ;;
    10.*|*B200*) gpu=B200 ;;
    *) gpu=H200 ;;
  esac
  log "== compute capability ${cap:-unknown} ($name): modelled as $gpu"
  log "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi
log "== git $(git rev-parse --short HEAD 2>/dev/null); predictions for $gpu (bench/gpu_model.py)"

# 1. build (only the CUDA sm of this GPU would be faster, but check all of them build)
if [ "$emu" = 1 ] && [ "${DFLASH_GPU_CHECK_NO_BUILD:-0}" = 1 ]; then
  log "build: using $build as it is"
else
  cuda=enabled; [ "$emu" = 1 ] && cuda=disabled
  if [ -f "$build/build.ninja" ]; then meson setup --reconfigure "$build" -Dcuda=$cuda -Dtests=enabled -Dpython=disabled >"$out/setup.log" 2>&1
  else meson setup "$build" -Dcuda=$cuda -Dtests=enabled -Dpython=disabled -Dbuildtype=release >"$out/setup.log" 2>&1; fi \
    || { log "meson setup failed (see setup.log)"; exit 2; }
  grep -E "nccl|Cuda compiler|emulated" "$out/setup.log" | tee -a "$out/summary.txt"
  targets=()
  [ "$emu" = 1 ] && targets=(tests/gpu/gpu_parity_emu tests/gpu/gpu_run_emu tests/gpu/gpu_bench_emu tools/dflash/dflash)
  timeout 300 ninja -C "$build" ${targets[@]+"${targets[@]}"} >"$out/build.log" 2>&1 || { log "build failed (see build.log)"; tail -20 "$out/build.log"; exit 2; }
fi
for p in gpu_parity gpu_run gpu_bench; do
  [ -x "$build/tests/gpu/$p$sfx" ] || { log "missing $build/tests/gpu/$p$sfx"; exit 2; }
done
log "build ok"
# The test programs link libdflash's internal archive, not libdflash.so: tell them where the
# CUDA backend module is (src/train/cuda/cuda_module.c; libdflash.so finds it beside itself).
if [ -f "$build/libdflash-cuda.so" ]; then export DFLASH_CUDA_MODULE="$PWD/$build/libdflash-cuda.so"; fi

# 2. parity (fresh seed each run; DFLASH_GPU_SEED=N reproduces one)
# On a GPU the parity cases take seconds; on the emulated device under a sanitizer, minutes
# (ASan: 133 s for the seven cases on a loaded 2-core machine), so its limit is wider there.
ptime=120; [ "$emu" = 1 ] && ptime=900
timeout "$ptime" "$build/tests/gpu/gpu_parity$sfx" 2>&1 | tee "$out/parity.txt"
parity=${PIPESTATUS[0]}
log "parity exit status $parity"
# 2b. dflash_train_run on CUDA, plain and through NCCL with one rank
timeout 180 "$build/tests/gpu/gpu_run$sfx" 2>&1 | tee "$out/run.txt"
run_rc=${PIPESTATUS[0]}
grep -E "worst per-step|FAIL|fail" "$out/run.txt" >>"$out/summary.txt"
log "train run loop (CPU / CUDA / NCCL 1 rank) exit status $run_rc"
# the CPU unit suite on this machine too (quick; includes 2-rank CPU data-parallel runs)
if [ "${DFLASH_GPU_CHECK_NO_BUILD:-0}" = 1 ]; then
  log "train unit suite: not run here (it is its own test in this build)"
else
  DFLASH_SKIP_ABI=1 timeout 120 meson test -C "$build" --suite train --print-errorlogs >"$out/unit.txt" 2>&1
  log "train unit suite exit status $?"
fi

# 3. benchmarks, each next to the model's prediction (one GPU, the backend's schedule)
[ -n "$py" ] || step_failed "python3 not found: no predictions"
: > "$out/bench.txt"
for args in "${shapes[@]}"; do
  set -- $args
  timeout 150 "$build/tests/gpu/gpu_bench$sfx" "$@" 2>&1 | tee -a "$out/bench.txt" "$out/summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || step_failed "gpu_bench $args"
done
for args in "${shapes[@]}"; do
  [ -n "$py" ] || break
  set -- $args
  tag="$1_$2_$3"
  "$py" bench/gpu_model.py "$1" --seq-len "$2" --anchors "$3" --gemms > "$out/gemms_$tag.txt" \
    || step_failed "gpu_model.py --gemms $args"
  timeout 120 "$build/tests/gpu/gpu_bench$sfx" gemm < "$out/gemms_$tag.txt" > "$out/bench_gemm_$tag.txt" 2>&1 \
    || step_failed "gpu_bench gemm ($args)"
  cat "$out/bench.txt" "$out/bench_gemm_$tag.txt" > "$out/measured_$tag.txt"
  "$py" bench/gpu_model.py "$1" --gpu "$gpu" --seq-len "$2" --anchors "$3" --world 1 \
    --compare "$out/measured_$tag.txt" 2>&1 | tee -a "$out/summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || step_failed "gpu_model.py --compare $args"
done

# 3b. per kernel: one run of the paper's shape under Nsight Systems, when it is installed
rep="$out/nsys_qwen3-8b"
if [ "$emu" != 1 ] && command -v nsys >/dev/null && [ -n "$py" ]; then
  if DFLASH_BENCH_NO_PEAK=1 timeout 300 nsys profile -t cuda -o "$rep" --force-overwrite true \
       "$build/tests/gpu/gpu_bench" qwen3-8b 3072 512 2 >"$out/nsys.log" 2>&1 &&
     { nsys stats -q --report cuda_gpu_kern_sum --format csv "$rep.nsys-rep" ||
       nsys stats -q --report gpukernsum --format csv "$rep.nsys-rep"; } >"$out/kernels_qwen3-8b.csv" 2>>"$out/nsys.log"; then
    # 3 steps profiled: the warm-up and 2 timed (trainer creation's uploads are in it too)
    "$py" bench/gpu_model.py qwen3-8b --gpu "$gpu" --seq-len 3072 --anchors 512 --world 1 \
      --compare-kernels "$out/kernels_qwen3-8b.csv" --runs 3 2>&1 | tee -a "$out/summary.txt"
  else
    log "per-kernel profile failed (see nsys.log)"
  fi
else
  log "per-kernel times: skipped ($([ "$emu" = 1 ] && echo "emulated device" || echo "nsys not installed"))"
fi

# 4. the plan next to the measurement, and the model's tables for an 8-GPU node
cat > "$out/kimi.json" <<'JSON'
{"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 6, "num_attention_heads": 64,
 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 163840, "num_target_layers": 61, "block_size": 16,
 "rope_theta": 50000, "max_position_embeddings": 262144,
 "rope_scaling": {"rope_type": "yarn", "factor": 64, "original_max_position_embeddings": 4096,
 "attention_factor": 1.0}, "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]}}
JSON
"$build/tools/dflash/dflash" train --plan --config "$out/kimi.json" --world 8 --gpu-gb 80 | tee -a "$out/summary.txt"
# The plan for this GPU as it reports itself (no --gpu: memory, shared memory per block, and
# the sequences per step the trainer picks for 8 of it); exit 1 only means it does not fit.
"$build/tools/dflash/dflash" train --plan --config "$out/kimi.json" --world 8 2>&1 | tee -a "$out/summary.txt"
"$build/tools/dflash/dflash" train --plan --config "$out/kimi.json" --world 1 --gpu-gb 141 --vocab-chunk 16384 2>&1 | tee -a "$out/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || step_failed "dflash train --plan (Kimi, one GPU)"
for shape in qwen3-8b kimi; do
  [ -n "$py" ] || break
  "$py" bench/gpu_model.py "$shape" --gpu "$gpu" --world 8 > "$out/model_$shape.txt" 2>&1 \
    || step_failed "gpu_model.py $shape"
  grep "^==\|^--" "$out/model_$shape.txt" | tee -a "$out/summary.txt"
done
log "== done; parity $([ "$parity" = 0 ] && echo passed || echo FAILED), run loop $([ "$run_rc" = 0 ] && echo passed || echo FAILED), check steps $([ "$fail" = 0 ] && echo passed || echo FAILED)"
[ "$parity" = 0 ] && [ "$run_rc" = 0 ] && [ "$fail" = 0 ]
