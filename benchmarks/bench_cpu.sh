#!/usr/bin/env bash
# Issue 25's figures on the CPU at hand (`make bench-cpu`), one benchmark at a time: two torch
# processes at once on 2 cores slow each other several-fold. The results go to
# benchmarks/results/cpu-<kind>/ (avx2, avx512, avx512-bf16, amx-bf16; with ATEN_CPU_CAPABILITY
# set, the cap is part of the name), and each file names the CPU kind inside too.
set -euo pipefail
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
kind=$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from common import cpu_kind; print(cpu_kind())')
name=$(echo "$kind" | sed -E 's/, capped to ([a-z0-9]+).*/-capped-\1/' | tr 'A-Z' 'a-z')
out=benchmarks/results/cpu-$name
mkdir -p "$out"
echo "CPU kind: $kind; results in $out"

$PY -m blockformer info --peak | tee "$out/peak.txt"
# batch 1 and 16, every fp32 variant and the quantized ones, Hugging Face in the same run
$PY benchmarks/bench_decode.py --threads 2 --dtype fp32 --skip nocache speculative --out "$out/decode-fp32.md"
$PY benchmarks/bench_decode.py --threads 2 --dtype fp32 --batch 16 --skip nocache compiled-python speculative \
    --out "$out/decode-fp32-batch16.md"
# served, 16 in flight: the model as it is, then weight-only int8 and int4
for q in none int8 int4; do
    if [ "$q" = none ]; then args=""; else args="--quantize $q"; fi
    $PY benchmarks/bench_serve.py --server blockformer --model gpt2-small --rates inf --num-requests 32 \
        --concurrency 16 --blockformer-args="$args" --out "$out/serve-gpt2-small-$q.md"
done
# one request's decode attention, its slots split over both threads against one (a minute)
$PY benchmarks/bench_paged_attention.py --threads 2 --one-row --pool-dtypes bf16,int8 --out "$out/paged-attention-one-row.md"
# training at nanoGPT's CPU shape against a plain PyTorch loop, their windows taking turns; translation in its 15 minutes
$PY benchmarks/bench_tinyshakespeare.py --threads 2 --precisions fp32 --out "$out/tinyshakespeare"
# the fp32 training kernels (attention, GELU) against torch's inside the trainer's own split loop
$PY benchmarks/bench_training_kernels.py --threads 2 --trainer --presets char-lm-tiny --windows 40 \
    --out "$out/training-kernels-trainer.md"
# rows split over the two threads (train.batch_threads, what "auto" does there) against whole, alternated
$PY benchmarks/bench_batch_threads.py --threads 2 --precision auto --steps 600 --out "$out/batch-threads"
# (without bf16 units, or capped below them, `precision = "auto"` trains in fp32: its preset is translate-small-fp32)
case "$name" in *bf16*capped* | *avx2* | avx512) preset=translate-small-fp32 ;; *) preset=translate-small ;; esac
$PY benchmarks/bench_translate.py --threads 2 --preset "$preset" --max-minutes 15 --set train.progress=false \
    --out "$out/translate-15min-$preset.md"
# the demo as a new user runs it
{ time make demo; } > "$out/demo.txt" 2>&1
tail -5 "$out/demo.txt"
