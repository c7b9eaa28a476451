"""How long a full garbage collection takes in a serving process that holds the model, the
compiled kernels and the decode graphs, before and after gc.freeze (workers/gc_freeze.py).

    python scripts/gpu_gc_check.py /tmp/engines/llama-3.1-8b
"""
import gc, time, sys
from bullet_trt.config import load_engine_config
from bullet_trt.engine.core import create_engine
cfg = load_engine_config(sys.argv[1], {"serve.mode": "chunked", "decode.max_num_seqs": 256,
      "decode.cuda_graph_batch_sizes": [1,2,4,8,16,32,48,64,96,128,160,192,256]})
core = create_engine(cfg)
n = len(gc.get_objects())
t = time.perf_counter(); gc.collect(); full = time.perf_counter() - t
t = time.perf_counter(); gc.collect(); again = time.perf_counter() - t
gc.freeze()
t = time.perf_counter(); gc.collect(); frozen = time.perf_counter() - t
print(f"gc check: {n} tracked objects in the chunked engine process; full collection {full*1e3:.0f} ms, again {again*1e3:.0f} ms, after freeze {frozen*1e3:.1f} ms", flush=True)
