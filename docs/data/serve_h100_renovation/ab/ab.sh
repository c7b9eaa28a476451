# A/B of chunked serving before (b96ad1f) and after the renovation, same machine, same seed.
# Prepared with: mkdir tmp_ab && git archive b96ad1f bullet_trt model_repository build_engines.py pyproject.toml | gzip > tmp_ab/old.tar.gz
# Run with: bash scripts/gpu_run.sh run bash tmp_ab/ab.sh (this file copied to tmp_ab/).
set -u
G="--set decode.cuda_graph_batch_sizes=[1,2,4,8,16,32,48,64,96,128,160,192,256,320,384,448,512,640,768,896,1024] --set decode.max_num_seqs=1024 --set serve.chunk_size=2048"
COMMON="--start-server --engine-dir $ENGINE --modes chunked --dataset sharegpt --rates ${RATE:-28} --duration 60 --ttft-slo-ms 1000 --tpot-slo-ms 50 --no-progress $G"
[ -f "$ENGINE/perf_model.yaml" ] || cp docs/data/perf_model_h200_llama-3.1-8b.yaml "$ENGINE/perf_model.yaml"
mkdir -p /tmp/old && tar xzf tmp_ab/old.tar.gz -C /tmp/old
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv
# the old code's engine.yaml knows no keys added since
OLD_ENGINE=/tmp/old_engine; mkdir -p $OLD_ENGINE
for f in "$ENGINE"/*; do [ "$(basename $f)" = engine.yaml ] || ln -sf "$f" $OLD_ENGINE/; done
grep -v "prefill_waits_for_split" "$ENGINE/engine.yaml" > $OLD_ENGINE/engine.yaml
(cd /tmp/old && timeout 280 python -m bullet_trt.bench.serve_bench ${COMMON/$ENGINE/$OLD_ENGINE} --label old --out $OUT/ab 2>&1 | tail -4)
timeout 280 python -m bullet_trt.tools.cli bench serve $COMMON --label new2 --out $OUT/ab 2>&1 | tail -4
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv
tar czf $OUT/ab.tar.gz -C $OUT ab && rm -rf $OUT/ab
