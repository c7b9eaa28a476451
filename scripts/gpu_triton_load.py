"""A small concurrent load over Triton's HTTP generate endpoint (standard library only, for
machines without tritonclient): N requests from T threads, varied prompt and output lengths.

    python scripts/gpu_triton_load.py --url http://127.0.0.1:8000 --requests 48 --threads 16
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import time
import urllib.error
import urllib.request

WORDS = ("the quick brown fox jumps over a lazy dog while prefill and decode share one GPU "
         "each on its own partition of streaming multiprocessors").split()


def one(url: str, i: int, rng_seed: int) -> dict:
    rng = random.Random(rng_seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 1500)))
    body = {"text_input": prompt, "max_tokens": rng.randint(32, 160), "seed": i, "temperature": 0.8,
            "return_num_output_tokens": True}
    t0 = time.monotonic()
    req = urllib.request.Request(f"{url}/v2/models/bullet/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return {"ok": True, "s": time.monotonic() - t0, "tokens": int(out.get("num_output_tokens", 0))}
    except urllib.error.HTTPError as e:
        return {"ok": False, "s": time.monotonic() - t0, "error": f"{e.code}: {e.read()[:300]!r}"}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"ok": False, "s": time.monotonic() - t0, "error": str(e)[:200]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(args.threads) as pool:
        results = list(pool.map(lambda i: one(args.url, i, 1000 + i), range(args.requests)))
    ok = [r for r in results if r["ok"]]
    print(json.dumps({"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
                      "output_tokens": sum(r["tokens"] for r in ok),
                      "elapsed_s": round(time.monotonic() - t0, 2),
                      "errors": [r["error"] for r in results if not r["ok"]][:3]}))


if __name__ == "__main__":
    main()
