"""The OpenAI front end's process: `python -m bullet_trt.serving.openai` (what `bullet-trt
serve` and `bullet-trt demo` start next to tritonserver). The API key comes from the
environment ($BULLET_OPENAI_API_KEY), not the command line, which other users can read."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from bullet_trt.config import ConfigError, parse_overrides

API_KEY_ENV = "BULLET_OPENAI_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9000


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bullet_trt.serving.openai",
                                 description="OpenAI-compatible HTTP API in front of a running tritonserver.")
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    ap.add_argument("--model", default="bullet", help="the Triton model, also the OpenAI model id")
    ap.add_argument("--engine-dir", required=True, help="the engine directory the Triton model serves")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="the engine overrides the server runs with")
    ap.add_argument("--host", default=DEFAULT_HOST)
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--chat-template", help="a Jinja chat template (or a tokenizer_config.json) to use instead "
                                            "of the checkpoint's")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the one that started us) dies")
    ap.add_argument("--log-level", default="warning")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid:
        from bullet_trt.serving.openai.parent_death import exit_with_parent
        exit_with_parent(args.parent_pid)
    import uvicorn

    from bullet_trt.serving.openai.app import create_app
    from bullet_trt.serving.openai.served_model import ServedModel
    from bullet_trt.serving.openai.triton_stream import TritonStreams

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s openai %(levelname)s: %(message)s")
    try:
        model = ServedModel.load(args.engine_dir, args.model, parse_overrides(args.set), args.chat_template)
    except (ConfigError, OSError, ValueError) as e:
        print(f"openai front end: {e}", file=sys.stderr)
        return 2
    app = create_app(model, TritonStreams(args.grpc_url, args.model), api_key=os.environ.get(API_KEY_ENV) or None)
    # Open streams get a few seconds to finish on SIGTERM; then their Triton requests are cancelled.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
