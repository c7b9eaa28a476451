"""`bullet-trt bench hf-peer`: the same workload through Hugging Face transformers' own
continuous batching, in-process: the outside peer of the serving benchmark.

    bullet-trt bench hf-peer --engine-dir engines/llama-3.1-8b --dataset sharegpt \\
        --rates 1,2,4 --num-requests 200 --out results/

It loads the engine directory's checkpoint with ``AutoModelForCausalLM`` (an engine built with
dummy weights has only ``config.json``: the model is built from the config with random weights,
directly on the device), builds the SAME requests as `bench serve` (same dataset, seed, rates,
lengths, prompts, token ids from the engine's tokenizer, arrival times) and replays them open
loop into ``model.init_continuous_batching()`` (the manager behind ``generate_batch``): a
sender thread calls ``manager.add_request`` at each arrival time, whatever the earlier
requests are doing. Results go to ``--out`` in the same JSON format, labelled ``hf-cb`` by
default, so `bench serve --compare` puts the peer in the same table and plots.

Timestamps: with ``record_timestamps`` (transformers >= 5.x) the manager stamps each token
with ``time.perf_counter()`` when the generation loop produces it, the clock this runner uses
for send times, so TTFT / TPOT / ITL are per token as for the server. Older versions without it
fall back to ``streaming=True`` and stamp each streamed output when this process receives it
(noted in the results). Either way the peer pays no network, serialization or
detokenization cost: its latencies are a lower bound on what a server built on it would see.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import threading
import time
from pathlib import Path

from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.loadgen import Progress
from bullet_trt.tools.bench.metrics import RequestRecord
from bullet_trt.spatial.gpu_monitor import TelemetrySampler
from bullet_trt.tools.bench.progress import ProgressPrinter
from bullet_trt.tools.bench.report import format_row, rebuild_report
from bullet_trt.tools.bench.results import dataset_name, write_result
from bullet_trt.tools.bench.scoring import slos_ms
from bullet_trt.tools.bench.telemetry import telemetry_fields
from bullet_trt.tools.bench.warmup import warmup_requests
from bullet_trt.tools.bench.workload_args import add_workload_args, workloads_from_args


# -- model --------------------------------------------------------------------------------------

def load_model(engine_dir: str | Path, device: str = "auto", dtype: str | None = None,
               attn_implementation: str | None = None):
    """(model, engine config): the engine's checkpoint as a transformers model on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bullet_trt.config import load_engine_config
    from bullet_trt.model.arch import ModelArch
    from bullet_trt.model.loader import resolve_dtype

    cfg = load_engine_config(engine_dir)
    dev = torch.device(cfg.resolve_device() if device == "auto" else device)
    ckpt = cfg.checkpoint_path
    arch = ModelArch.from_checkpoint(ckpt)
    torch_dtype = resolve_dtype(arch, dtype or cfg.dtype, dev)
    has_weights = any(ckpt.glob("*.safetensors")) and not cfg.dummy_weights
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if has_weights:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch_dtype, **kw)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch_dtype, **kw)
        model = model.to(dev)
    else:  # dummy weights: random, made on the device
        hf_cfg = AutoConfig.from_pretrained(str(ckpt))
        torch.manual_seed(cfg.seed)
        with torch.device(dev):
            try:
                model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch_dtype, **kw)
            except TypeError:
                model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch_dtype, **kw)
    return model.eval(), cfg


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _parse_value(text: str):
    import yaml
    return yaml.safe_load(text)


def make_manager(model, max_new_tokens: int, max_prompt_len: int, num_requests: int, temperature: float,
                 cb_settings: dict, seed: int):
    """``model.init_continuous_batching(...)`` with what this transformers version accepts."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                           temperature=temperature if temperature > 0 else 1.0, eos_token_id=-1,
                           pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
    kwargs: dict = {"generation_config": gen}
    init = model.init_continuous_batching
    cb_cfg = None
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        cb_cfg = ContinuousBatchingConfig()
        if hasattr(cb_cfg, "seed"):
            cb_cfg.seed = seed
    except ImportError:
        pass
    for key, value in cb_settings.items():
        if cb_cfg is not None and hasattr(cb_cfg, key):
            setattr(cb_cfg, key, value)
        elif hasattr(gen, key):  # older transformers kept these on GenerationConfig
            setattr(gen, key, value)
        else:
            raise SystemExit(f"--cb {key}: neither ContinuousBatchingConfig nor GenerationConfig has it in "
                             f"this transformers")
    if cb_cfg is not None and _accepts(init, "continuous_batching_config"):
        kwargs["continuous_batching_config"] = cb_cfg
    if _accepts(init, "workload_hints"):
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max_prompt_len,
                                                     max_generated_length=max_new_tokens,
                                                     num_requests=num_requests)
        except ImportError:
            pass
    return init(**kwargs)


# -- replay -------------------------------------------------------------------------------------

class PeerRunner:
    """Replays workloads into one running continuous-batching manager."""

    def __init__(self, manager, eos_disabled: bool = True):
        self.manager = manager
        self.add_kwargs: dict = {}
        self.timestamps = _accepts(manager.add_request, "record_timestamps")
        if self.timestamps:
            self.add_kwargs["record_timestamps"] = True
        else:
            self.add_kwargs["streaming"] = True
        if eos_disabled and _accepts(manager.add_request, "eos_token_id"):
            self.add_kwargs["eos_token_id"] = -1

    @property
    def timing_note(self) -> str:
        if self.timestamps:
            return ("transformers continuous batching in-process: per-token timestamps recorded by its "
                    "generation loop (record_timestamps); no network or detokenization cost")
        return ("transformers continuous batching in-process: this transformers has no record_timestamps; "
                "tokens are stamped when the streamed output reaches the runner's thread")

    def run(self, requests: list[ds.BenchRequest], on_progress=None, timeout_s: float = 3600.0,
            drain_timeout_s: float = 600.0, prefix: str = "b") -> tuple[list[RequestRecord], str | None]:
        mgr = self.manager
        rids = [f"{prefix}{r.index}" for r in requests]
        records = {rid: RequestRecord(r.index, r.arrival_s, r.input_tokens, r.output_tokens)
                   for rid, r in zip(rids, requests)}
        for rid, r in zip(rids, requests):
            records[rid].num_input_tokens = len(r.prompt_ids or [])
        done: set[str] = set()
        seen_tokens: dict[str, int] = {}
        ttfts: list[float] = []
        stop = threading.Event()
        lock = threading.Lock()
        t0 = time.perf_counter()

        def send():
            for rid, r in zip(rids, requests):
                while not stop.is_set():
                    delay = r.arrival_s - (time.perf_counter() - t0)
                    if delay <= 0:
                        break
                    if delay > 0.002:
                        stop.wait(delay - 0.001)
                if stop.is_set():
                    return
                rec = records[rid]
                with lock:
                    rec.sent_s = time.perf_counter() - t0
                try:
                    got = mgr.add_request(list(r.prompt_ids), request_id=rid, max_new_tokens=r.output_tokens,
                                          **self.add_kwargs)
                    if got is None and hasattr(mgr, "is_tp_driver") and mgr.is_tp_driver:
                        raise RuntimeError("the manager did not accept the request")
                except Exception as e:
                    with lock:
                        rec.error = f"add_request failed: {e}"
                        rec.end_s = time.perf_counter() - t0
                        done.add(rid)

        sender = threading.Thread(target=send, name="hf-peer-sender", daemon=True)
        sender.start()
        last_arrival = requests[-1].arrival_s if requests else 0.0
        stopped = None
        next_progress = 0.0
        try:
            while True:
                with lock:
                    if len(done) == len(records) and not sender.is_alive():
                        break
                out = mgr.get_result(timeout=0.05)
                now = time.perf_counter() - t0
                if out is not None and out.request_id in records:
                    rid = out.request_id
                    rec = records[rid]
                    finished = out.is_finished() if hasattr(out, "is_finished") else False
                    with lock:
                        if rid not in done:
                            n = len(out.generated_tokens)
                            if not self.timestamps and n > seen_tokens.get(rid, 0):
                                if seen_tokens.get(rid, 0) == 0:
                                    ttfts.append(now - rec.sent_s)
                                rec.chunk_times.append(now)
                                rec.chunk_tokens.append(n - seen_tokens.get(rid, 0))
                                seen_tokens[rid] = n
                            if finished:
                                err = getattr(out, "error", None)
                                if err:
                                    rec.error = str(err)
                                elif self.timestamps:
                                    ts = list(out.timestamps or [])[:n]
                                    if len(ts) < n:  # not expected; keep what we know
                                        ts += [time.perf_counter()] * (n - len(ts))
                                    rec.chunk_times = [t - t0 for t in ts]
                                    rec.chunk_tokens = [1] * n
                                    if n:
                                        ttfts.append(rec.chunk_times[0] - rec.sent_s)
                                rec.end_s = (rec.chunk_times[-1] if rec.chunk_times and self.timestamps
                                             else now)
                                rec.finished = rec.error is None
                                done.add(rid)
                if on_progress and now >= next_progress:
                    next_progress = now + 1.0
                    on_progress(self._progress(now, records, done, ttfts))
                if now > timeout_s:
                    stopped = f"run exceeded timeout_s={timeout_s:g}"
                    break
                if not sender.is_alive() and now > last_arrival + drain_timeout_s:
                    stopped = f"still running {drain_timeout_s:g} s after the last send (drain_timeout_s)"
                    break
                if hasattr(mgr, "is_running") and not mgr.is_running():
                    stopped = "the transformers generation loop stopped"
                    break
        except KeyboardInterrupt:
            stopped = "interrupted"
        finally:
            stop.set()
            sender.join(timeout=5)
        if on_progress:
            on_progress(self._progress(time.perf_counter() - t0, records, done, ttfts))
        for rid, rec in records.items():
            if rid in done:
                continue
            rec.error = f"not sent ({stopped})" if rec.sent_s is None else f"no final output ({stopped})"
            if rec.sent_s is not None and hasattr(mgr, "cancel_request"):
                try:
                    mgr.cancel_request(rid)
                except Exception:
                    pass
        return [records[rid] for rid in rids], stopped

    @staticmethod
    def _progress(now, records, done, ttfts) -> Progress:
        import numpy as np
        sent = sum(1 for r in records.values() if r.sent_s is not None)
        finished = sum(1 for rid in done if records[rid].finished)
        failed = len(done) - finished
        return Progress(now, len(records), sent, finished, failed, sent - finished - failed,
                        float(np.median(ttfts)) if ttfts else None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bullet-trt bench hf-peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="hf-cb", help="name in the results (default hf-cb)")
    add_workload_args(ap)
    p = ap.add_argument_group("transformers")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: the engine's)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the engine's rule)")
    p.add_argument("--attn-implementation", default=None,
                   help="e.g. sdpa, paged|sdpa, flash_attention_2 (default: transformers' choice)")
    p.add_argument("--cb", action="append", metavar="KEY=VALUE", default=[],
                   help="ContinuousBatchingConfig field (e.g. num_blocks=4096, max_batch_tokens=8192, "
                        "use_cuda_graph=true); repeatable")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--warmup", type=int, default=8,
                   help="requests before measuring, shaped like the workload's first ones (default 8)")
    p.add_argument("--drain-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=0.0, help="bound on one run (default: last arrival + drain + 60)")
    p.add_argument("--no-plots", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.engine_dir:
        raise SystemExit("bullet-trt bench hf-peer: --engine-dir is required (its checkpoint and tokenizer)")
    cb_settings = {}
    for item in args.cb:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--cb expects key=value, got {item!r}")
        cb_settings[key.strip()] = _parse_value(value.strip())
    try:
        tok = ds.load_tokenizer(args.engine_dir, args.tokenizer)
        max_len = args.max_model_len or ds.engine_max_model_len(args.engine_dir)
        workloads = workloads_from_args(args, tok, max_len)
    except (ds.TraceError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"bullet-trt bench hf-peer: {e}")
    ttft_slo, tpot_slo = slos_ms(args.ttft_slo_ms, args.tpot_slo_ms)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import transformers
    print(f"loading {args.engine_dir} with transformers {transformers.__version__}", file=sys.stderr, flush=True)
    model, cfg = load_model(args.engine_dir, args.device, args.dtype, args.attn_implementation)
    max_new = max(r.output_tokens for w in workloads for r in w.requests)
    max_prompt = max(r.input_tokens for w in workloads for r in w.requests)
    n_max = max(len(w.requests) for w in workloads)
    manager = make_manager(model, max_new, max_prompt, n_max, args.temperature, cb_settings, args.seed)
    if hasattr(manager, "warmup"):
        try:
            manager.warmup()
        except Exception as e:  # warm-up is an optimization; the run still works without it
            print(f"hf-peer: manager.warmup() failed ({e}); continuing without it", file=sys.stderr)
    manager.start()
    runner = PeerRunner(manager)
    info = {"transformers": transformers.__version__, "device": str(model.device), "dtype": str(model.dtype),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "engine_dir": args.engine_dir, "cb_settings": cb_settings, "timestamps": runner.timestamps}
    print(f"hf-peer: {info}", file=sys.stderr, flush=True)
    try:
        if args.warmup > 0:
            warm = warmup_requests(workloads[0], args.warmup, tok)
            recs, _ = runner.run(warm, timeout_s=600, drain_timeout_s=600, prefix="warm")
            bad = [r.error for r in recs if not r.ok]
            if bad:
                raise SystemExit(f"hf-peer: warm-up requests failed: {bad[0]}")
        for w in workloads:
            printer = ProgressPrinter(f"[{args.label} {dataset_name(w.dataset)} {w.rate:g} req/s]",
                                      enabled=not args.no_progress)
            sampler = TelemetrySampler((model.device.index or 0) if model.device.type == "cuda" else None).start()
            try:
                records, stopped = runner.run(w.requests, on_progress=printer,
                                              timeout_s=args.timeout_s or (w.duration_s + args.drain_timeout_s + 60),
                                              drain_timeout_s=args.drain_timeout_s)
            finally:
                sampler.stop()
            printer.done()
            _, doc = write_result(
                out_dir, label=args.label, dataset=w.dataset, rate=w.rate, seed=w.seed,
                backend="transformers-continuous-batching", records=records, workload=w,
                ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo,
                extra={"peer": info, **telemetry_fields(sampler, w.duration_s)},
                notes=[runner.timing_note], stopped_early=stopped, token_times=args.token_times)
            print(format_row(doc), flush=True)
            rebuild_report(out_dir, plots=not args.no_plots)
            if stopped == "interrupted":
                return 130
    finally:
        try:
            manager.stop(block=True, timeout=30)
        except Exception:
            pass
    print(f"results: {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
