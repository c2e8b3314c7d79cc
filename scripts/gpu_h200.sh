#!/usr/bin/env bash
# The H200 measurements (issue 51) in one script: the GPU smoke test, the bench presets and the bf16/fp32 checks.
#
#   bash scripts/gpu_h200.sh <out folder> <step> [<step> ...]      e.g. bash scripts/gpu_h200.sh /tmp/h200 smoke xl
#
# Steps (each under its own time limit, so one that fails or hangs leaves the others' results):
#   smoke       python scripts/gpu_smoke.py (tiny models on CUDA, torchrun/NCCL, bf16 self-check, bf16 vs fp32
#               acceptance on the embedded model, compiled vs eager tokens, one bench preset)
#   smoke_fixes the smoke test's compiled check alone (rerun after a fix)
#   xl          bench=llamagen_xl_512: AR, SD, COOL-SD, SJD with CUDA-graph replays of the forwards, throughput
#               and peak memory of AR and SD at B = 1, 8, 32, 64
#   xl_jacobi   bench=llamagen_xl_512 with the Jacobi family (SJD-PAC, GSD, SCD-MC, SCD-GS) beside AR
#   xl_compiled bench=llamagen_xl_512 layouts=[column_major,compiled]: AR eager vs model.compile=true (CUDA graphs)
#   janus       bench=janus_pro_1b
#   lumina      bench=lumina_mgpt_7b
#   xl_numerics scripts/gpu_check_llamagen.py: XL forwards, bf16 vs float32 logits and guided distributions
# Everything lands in <out folder>: bench/<preset>_h200.{md,json}, smoke/, logs/, steps.tsv (step, exit code, s).
# On the device machine of this project: <out folder> = $OUT/..., then the folder is packed into one archive.
set -u
out=$1; shift
mkdir -p "$out/bench" "$out/logs"
export HF_HUB_OFFLINE=1 WANDB_SILENT=true PYTHONUNBUFFERED=1 COOLSD_CACHE="${COOLSD_CACHE:-/tmp/coolsd_cache}"
py=${PYTHON:-python3}
for step in "$@"; do
  case $step in
    smoke) limit=180; cmd=("$py" scripts/gpu_smoke.py --out "$out/smoke" --acceptance-images 128) ;;
    smoke_fixes) limit=55; cmd=("$py" scripts/gpu_smoke.py --out "$out/smoke_fixes" --checks compiled) ;;
    xl) limit=540; cmd=(bench bench=llamagen_xl_512 "decoders=[ar,sd,coolsd,sjd]" cuda_graphs=true cost.repeats=10
                        name=llamagen_xl_512_h200) ;;
    xl_jacobi) limit=150; cmd=(bench bench=llamagen_xl_512 "decoders=[ar,sjd_pac,gsd,scd_mc,scd_gs]"
                               "throughput.batch_sizes=[]" name=llamagen_xl_512_jacobi_h200) ;;
    xl_compiled) limit=200; cmd=(bench bench=llamagen_xl_512 "layouts=[column_major,compiled]" "decoders=[ar]"
                                 images=2 warmup=1 "throughput.batch_sizes=[]" name=llamagen_xl_512_h200) ;;
    janus) limit=150; cmd=(bench bench=janus_pro_1b name=janus_pro_1b_h200) ;;
    lumina) limit=200; cmd=(bench bench=lumina_mgpt_7b "decoders=[ar,coolsd]" name=lumina_mgpt_7b_h200) ;;
    xl_numerics) limit=60; cmd=("$py" scripts/gpu_check_llamagen.py --out "$out/bench/llamagen_xl_512_numerics_h200.json") ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  echo "== $step (limit ${limit} s): ${cmd[*]}"
  start=$(date +%s)
  if [ "${cmd[0]}" = bench ]; then
    timeout -k 10 "$limit" "$py" scripts/bench.py "out_dir=$out/bench" "${cmd[@]:1}" >"$out/logs/$step.log" 2>&1
  else
    timeout -k 10 "$limit" "${cmd[@]}" >"$out/logs/$step.log" 2>&1
  fi
  rc=$?
  printf '%s\t%s\t%s\n' "$step" "$rc" "$(( $(date +%s) - start ))" | tee -a "$out/steps.tsv"
  tail -n 4 "$out/logs/$step.log"
  [ -n "${PACK:-}" ] && tar -czf "$PACK" -C "$(dirname "$out")" "$(basename "$out")"
done
exit 0
