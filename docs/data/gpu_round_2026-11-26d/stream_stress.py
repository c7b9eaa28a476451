"""Many streams at once against a running server, each with a long fixed output: the responses
a second the client receives, the tokens a second, and the tokens a response carries, over the
middle half of the responses (the streams all in flight). Used on two CPU cores against a
tiny random engine with 256 decode rows, whose tokens come faster than one thread could send
them as responses:

    PYTHONPATH=. python -c "
    from pathlib import Path; from tests.tiny_engine import tiny_engine
    from bullet_trt.config import load_engine_config, save_engine_config
    out = tiny_engine(Path('/tmp/stress-engine'), max_model_len=1024); cfg = load_engine_config(out)
    cfg.decode.max_num_seqs = cfg.decode.max_num_batched_tokens = 256; cfg.kv.cpu_pool_mib = 512
    save_engine_config(cfg, out, header='stream stress')"
    bullet-trt serve --engine-dir /tmp/stress-engine --set serve.mode=chunked --no-openai --grpc-port 18001 &
    python docs/data/gpu_round_2026-11-26d/stream_stress.py localhost:18001 256 500
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient


def main(url: str, streams: int, tokens: int) -> None:
    lock = threading.Lock()
    received: list[tuple[float, int]] = []  # (when, tokens) of every response
    finished: set[str] = set()

    def on_response(result, error):
        now = time.perf_counter()
        if error is not None:
            print("error:", error)
            return
        response = result.get_response()
        count = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        final = response.parameters.get("triton_final_response")
        with lock:
            received.append((now, count))
            if final is not None and final.bool_param:
                finished.add(response.id)

    def tensor(name, value, datatype, dtype):
        t = grpcclient.InferInput(name, [1, 1], datatype)
        t.set_data_from_numpy(np.array([[value]], dtype=dtype))
        return t

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    start = time.perf_counter()
    for i in range(streams):
        client.async_stream_infer("bullet", [
            tensor("text_input", b"hello there, tell me a story", "BYTES", np.object_),
            tensor("max_tokens", tokens, "INT32", np.int32), tensor("min_tokens", tokens, "INT32", np.int32),
            tensor("stream", True, "BOOL", np.bool_), tensor("return_num_output_tokens", True, "BOOL", np.bool_)],
            request_id=str(i), enable_empty_final_response=True)
    while len(finished) < streams and time.perf_counter() - start < 600:
        time.sleep(0.2)
    client.stop_stream()
    times = sorted(t for t, _ in received)
    lo, hi = times[len(times) // 4], times[3 * len(times) // 4]
    window = [(t, n) for t, n in received if lo <= t <= hi]
    span = hi - lo
    print(f"{len(finished)}/{streams} finished in {time.perf_counter() - start:.1f} s; middle {span:.1f} s: "
          f"{len(window) / span:.0f} responses/s, {sum(n for _, n in window) / span:.0f} tokens/s, "
          f"{sum(n for _, n in window) / len(window):.2f} tokens a response")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
