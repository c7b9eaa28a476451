"""`bullet-trt demo`: serve an engine with the real tritonserver and answer a sample question.

Starts tritonserver on the engine (the default model, SmolLM2-135M-Instruct, unless
--engine-dir) and the OpenAI-compatible API next to it (port 9000 unless --no-openai), waits
until the model is ready, streams one chat question over gRPC, framed by the model's own chat
template (a model without one gets the question as plain text), and prints each piece as it
arrives; then prints the curl commands for the same request over Triton's HTTP API and the
OpenAI API, and keeps serving until Ctrl-C (or stops at once with --exit).
"""
from __future__ import annotations

import argparse
import json
import queue
import shlex
from pathlib import Path

import numpy as np

QUESTION = "Why is the sky blue?"


def ensure_engine(engine_dir: str | None) -> Path:
    if engine_dir:
        return Path(engine_dir)
    from bullet_trt.tools.build import build_default_engine
    try:
        return build_default_engine()
    except FileNotFoundError as e:  # the package that ships the default model is missing
        raise SystemExit(f"demo: {e}")


def chat_prompt(engine: Path, question: str, overrides: dict[str, str],
                template_file: str | None = None) -> str | None:
    """The question framed by the model's chat template (or `template_file`), as
    /v1/chat/completions frames it, or None for a model without a template."""
    from bullet_trt.serving.openai.served_model import ServedModel

    model = ServedModel.load(engine, overrides=overrides, chat_template_file=template_file)
    if model.chat_template is None:
        return None
    return model.chat_prompt([{"role": "user", "content": question}])


def stream_request(grpc_url: str, prompt: str, max_tokens: int) -> str:
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        arr = np.array([[value]], dtype=object if dtype == "BYTES" else None)
        if dtype != "BYTES":
            arr = arr.astype({"INT32": np.int32, "BOOL": bool, "UINT64": np.uint64}[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = [tensor("text_input", prompt.encode(), "BYTES"), tensor("max_tokens", max_tokens, "INT32"),
              tensor("stream", True, "BOOL"), tensor("seed", 7, "UINT64")]
    client.async_stream_infer("bullet", inputs, request_id="demo", enable_empty_final_response=True)
    text = ""
    print(f"prompt: {prompt!r}\nanswer (streamed): ", end="", flush=True)
    while True:
        result, error = responses.get(timeout=300)
        if error is not None:
            raise SystemExit(f"\ndemo: the server answered with an error: {error}")
        out = result.as_numpy("text_output")
        if out is not None and out.size:
            piece = out.reshape(-1)[0].decode("utf-8", "replace")
            text += piece
            print(piece, end="", flush=True)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    print()
    return text


def main(argv: list[str] | None = None) -> int:
    from bullet_trt.serving.supervisor import Supervisor
    from bullet_trt.serving.triton import server
    from bullet_trt.serving.triton.process_tree import stop_engines
    ap = argparse.ArgumentParser(prog="bullet-trt demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address tritonserver listens on (default 127.0.0.1: this machine only)")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt", default=QUESTION,
                    help="the question, sent through the model's chat template when it has one")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--exit", action="store_true", help="stop the server after the sample request")
    from bullet_trt.serving.openai import launch as openai_launch
    openai_launch.add_cli_arguments(ap)
    args = ap.parse_args(argv)
    engine = ensure_engine(args.engine_dir)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    chat = chat_prompt(engine, args.prompt, overrides, args.chat_template)
    text_input = args.prompt if chat is None else chat
    log = Path(engine) / "tritonserver.log"
    address = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    # SIGTERM as Ctrl-C: whatever the demo is doing, open requests end with an error and every
    # process it started stops (bullet_trt/serving/supervisor.py).
    sup = Supervisor()
    sup.handle_signals(interrupt=True)
    front = None
    try:
        cmd, env = server.prepare(engine_dir=engine, overrides=overrides, http_port=args.http_port,
                                  grpc_port=args.grpc_port, metrics_port=args.metrics_port, host=args.host)
        proc = sup.start("tritonserver", cmd, env=env, cwd=server.PROJECT_ROOT, log_file=log, drain=stop_engines)
        print(f"demo: tritonserver pid {proc.pid} starting (log {log})", flush=True)
        if not args.no_openai:
            front_log = Path(engine) / "openai.log"
            front = sup.adopt("openai", openai_launch.launch(
                api_key=args.api_key, log_file=front_log,
                **openai_launch.launch_arguments(args, engine, args.grpc_port, overrides)), essential=False)
            print(f"demo: OpenAI API pid {front.pid} starting (log {front_log})", flush=True)
        try:
            server.wait_until_ready(proc, f"{address}:{args.grpc_port}", timeout_s=600,
                                    http_url=f"{address}:{args.http_port}")
            if front is not None:
                openai_launch.wait_until_ready(front, f"http://{args.openai_host}:{args.openai_port}")
        except (server.ServerNotReady, RuntimeError) as e:
            raise SystemExit(f"demo: {e}\n(logs in {engine})")
        stream_request(f"{address}:{args.grpc_port}", text_input, args.max_tokens)
        body = json.dumps({"text_input": text_input, "max_tokens": args.max_tokens, "seed": 7})
        print(f"\nthe same over HTTP:\n  curl -s -X POST localhost:{args.http_port}/v2/models/bullet/generate "
              f"-d {shlex.quote(body)}\nmetrics: curl -s localhost:{args.metrics_port}/metrics | grep bullet_",
              flush=True)
        if front is not None:
            # greedy, as the request above
            if chat is None:
                endpoint, request = "completions", {"prompt": args.prompt, "max_tokens": args.max_tokens}
            else:
                endpoint, request = "chat/completions", {"messages": [{"role": "user", "content": args.prompt}],
                                                         "max_completion_tokens": args.max_tokens}
            body = json.dumps({"model": "bullet", **request, "temperature": 0})
            auth = " -H 'Authorization: Bearer $BULLET_OPENAI_API_KEY'" if args.api_key else ""
            print(f"the same over the OpenAI API:\n  curl -s localhost:{args.openai_port}/v1/{endpoint}{auth} "
                  f"-H 'Content-Type: application/json' -d {shlex.quote(body)}", flush=True)
        if args.exit:
            return 0
        print("\ndemo: serving; Ctrl-C stops the server", flush=True)
        return sup.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        sup.stop()


if __name__ == "__main__":
    raise SystemExit(main())
