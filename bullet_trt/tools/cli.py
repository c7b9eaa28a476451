"""`bullet-trt`: serve, generate, build, demo, doctor, bench, plot.

    bullet-trt serve [--engine-dir DIR] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                     [--openai-port 9000 --api-key KEY --chat-template FILE | --no-openai]
                     [--tp N] [--set key=value ...] [-- extra tritonserver flags]
    bullet-trt generate [--engine-dir DIR] --prompt "Hello" [--max-tokens 32 --temperature 0 --tp N ...]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from bullet_trt.config import ConfigError, parse_overrides
from bullet_trt.serving.mode_choice import may_run_spatial


def parse_sets(items: list[str] | None, tp: int | None = None) -> dict[str, str]:
    """--set KEY=VALUE items; --tp N is --set parallel.tensor_parallel_size=N."""
    try:
        sets = parse_overrides(items)
    except ConfigError as e:
        raise SystemExit(str(e))
    if tp is not None:
        sets["parallel.tensor_parallel_size"] = str(tp)
    return sets


TP_HELP = ("tensor-parallel GPUs (ranks) serving the model, cuda:0..N-1 (the same as --set "
           "parallel.tensor_parallel_size=N; docs/scale-out.md)")


def default_engine(command: str) -> Path:
    """engines/default, converted from the default model's GGUF file on first use."""
    from bullet_trt.tools.build import build_default_engine
    try:
        return build_default_engine()
    except FileNotFoundError as e:  # the package that ships the model is missing
        raise SystemExit(f"bullet-trt {command}: {e}")


# -- serve ------------------------------------------------------------------------------------

def cmd_serve(args) -> int:
    from bullet_trt.config import load_engine_config
    from bullet_trt.serving.triton import server

    overrides = parse_sets(args.set, args.tp)
    engine_dir = Path(args.engine_dir) if args.engine_dir else default_engine("serve")
    # Fail here, with a readable message, rather than inside the server's model load.
    try:
        cfg = load_engine_config(engine_dir, overrides)
        if cfg.parallel.tensor_parallel_size > 1:  # whether the ranks split the model
            from bullet_trt.model.arch import ModelArch
            from bullet_trt.model.tensor_parallel import Shard
            Shard(0, cfg.parallel.tensor_parallel_size).check(ModelArch.from_checkpoint(cfg.checkpoint_path))
    except ValueError as e:  # ConfigError names the key
        raise SystemExit(f"bullet-trt serve: {e}")
    extra = list(args.tritonserver_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        cmd, env = server.prepare(engine_dir=engine_dir, overrides=overrides, model_repository=args.model_repository,
                                  http_port=args.http_port, grpc_port=args.grpc_port,
                                  metrics_port=args.metrics_port, host=args.host,
                                  log_verbose=args.log_verbose, explicit=not args.no_explicit, extra=extra)
    except server.ServerSetupError as e:
        raise SystemExit(f"bullet-trt serve: {e}")
    from bullet_trt.serving.openai.launch import launch_arguments
    openai = None if args.no_openai else launch_arguments(args, engine_dir, args.grpc_port, overrides)
    if args.dry_run:
        for key in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "BULLET_PYTHON", "BULLET_ENGINE_DIR",
                    "BULLET_OVERRIDES"):
            if key in env:
                print(f"{key}={env[key]}")
        print(" ".join(cmd))
        if openai is not None:
            from bullet_trt.serving.openai.launch import openai_command
            print(" ".join(openai_command(**openai)))
        return 0
    front = f", OpenAI API http://{args.openai_host}:{args.openai_port}/v1" if openai is not None else ""
    print(f"bullet-trt: engine {Path(engine_dir).resolve()}; HTTP {args.host}:{args.http_port}, "
          f"gRPC {args.host}:{args.grpc_port}, metrics {args.host}:{args.metrics_port}{front}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    return _serve_supervised(cmd, env, _private_mps_wanted(args.mps, cfg), openai, args.api_key)


def _private_mps_wanted(choice: str, cfg) -> bool:
    """--mps auto: a GPU and no MPS daemon answering means the spatial modes' workers could
    only time-slice it, and serve.mode=auto would fall back to chunked; start a private
    daemon then, where the driver's control binary is installed, unless the configuration
    (`cfg`) can only serve chunked: named, or auto under a TPOT SLO too tight for the split."""
    if choice != "auto":
        return choice == "on"
    if not may_run_spatial(cfg):
        return False
    import shutil

    from bullet_trt.spatial.partitioners.mps_daemon import mps_daemon_running

    if shutil.which("nvidia-cuda-mps-control") is None or mps_daemon_running():
        return False
    try:  # NVML, not CUDA: this process must not hold a GPU context before the daemon starts
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no driver, no GPU)
        return False


def _serve_supervised(cmd: list[str], env: dict[str, str], start_mps: bool, openai: dict | None,
                      api_key: str | None) -> int:
    """Runs tritonserver as a child, next to the OpenAI front end (a second child, which also
    exits by itself should this process die) and/or between starting and stopping a private
    MPS daemon, so that the spatial modes' workers are MPS clients (without MPS two processes
    only time-slice the GPU). Ends when tritonserver ends; SIGTERM or Ctrl-C ends open requests
    with an error and stops every process started here (bullet_trt/serving/supervisor.py)."""
    from bullet_trt.serving.supervisor import Supervisor
    from bullet_trt.serving.triton.process_tree import stop_engines

    sup = Supervisor()
    sup.handle_signals()
    try:
        if start_mps:
            from bullet_trt.spatial.partitioners.mps_daemon import start_mps_daemon, stop_mps_daemon
            mps_env = start_mps_daemon()
            sup.on_stop(lambda: stop_mps_daemon(mps_env["CUDA_MPS_PIPE_DIRECTORY"]))
            env = {**env, **mps_env}
            print(f"bullet-trt: MPS daemon at {mps_env['CUDA_MPS_PIPE_DIRECTORY']}", file=sys.stderr)
        sup.start("tritonserver", cmd, env=env, drain=stop_engines)
        if openai is not None:
            from bullet_trt.serving.openai import launch
            sup.adopt("openai", launch.launch(api_key=api_key, **openai), essential=False)
        return sup.wait()
    finally:
        sup.stop()


# -- generate (offline) -----------------------------------------------------------------------

def cmd_generate(args) -> int:
    from bullet_trt import LLM, SamplingParams
    from bullet_trt.engine.validation import validate_params

    overrides = parse_sets(args.set, args.tp)
    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("give at least one --prompt (or --prompt-file)")
    sampling = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, stop=list(args.stop or []), ignore_eos=args.ignore_eos)
    try:
        validate_params(sampling)
    except ValueError as e:
        raise SystemExit(f"bullet-trt generate: {e}")
    with LLM(str(args.engine_dir or default_engine("generate")), **overrides) as llm:
        for prompt, out in zip(prompts, llm.generate(prompts, sampling)):
            if len(prompts) > 1:
                print(f"--- {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
            print((prompt if args.echo else "") + out.text)
    return 0


# -- subcommands owned by other modules -------------------------------------------------------

# name -> (candidate modules, help). A module provides main(argv) -> int; the arguments after
# the subcommand go to it unchanged. Modules are imported only when their command runs.
EXTERNAL = {
    "build": (("bullet_trt.tools.build",), "build an engine directory (the default model, a checkpoint, the tiny random model, dummy weights; --profile calibrates)"),
    "bench": (("bullet_trt.tools.bench.cli",), "load generator and benchmarks against a running server"),
    "doctor": (("bullet_trt.tools.doctor",), "check the machine: GPU, MPS, SM partitioning"),
    "plot": (("bullet_trt.tools.bench.plot", "bullet_trt.tools.bench.plot_iterations"), "plot benchmark / iteration logs"),
    "demo": (("bullet_trt.tools.demo",), "serve an engine and answer a sample chat question (default: the default model)"),
    "plan": (("bullet_trt.tools.plan",), "per-GPU memory plan (weights, KV pool, decode rows) at tensor-parallel sizes"),
}


def _find_module(candidates: tuple[str, ...]) -> str | None:
    for name in candidates:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            continue
    return None


def _run_external(args) -> int:
    module = importlib.import_module(args.external_module)
    rest = list(args.rest or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if hasattr(module, "main"):
        return int(module.main(rest) or 0)
    print(f"bullet-trt {args.command}: {args.external_module} has no main(argv)", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bullet-trt", description="LLM serving for Triton Inference Server.")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start tritonserver with model_repository/bullet",
                       description="Start tritonserver (from the nvidia-pytriton wheel) serving model_repository/. "
                                   "Arguments after -- go to tritonserver unchanged.")
    s.add_argument("--engine-dir", help="engine directory (default: engines/default, the default model, "
                                        "built on first use)")
    s.add_argument("--model-repository", default=None, help="model repository (default: the project's)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address tritonserver's HTTP, gRPC and metrics endpoints listen on (default "
                        "127.0.0.1: this machine only; 0.0.0.0: every interface). --openai-host is the "
                        "OpenAI API's")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="engine configuration override, e.g. serve.mode=chunked or kv.cpu_pool_mib=256")
    s.add_argument("--tp", type=int, metavar="N", help=TP_HELP)
    s.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    s.add_argument("--no-explicit", action="store_true",
                   help="do not use --model-control-mode=explicit (the model then cannot unload itself "
                        "when its engine dies)")
    s.add_argument("--dry-run", action="store_true", help="print the environment and command, do not start")
    s.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="a private MPS daemon for the spatial modes' workers, stopped on exit: auto "
                        "(default) starts one on a GPU where none answers, so serve.mode=auto runs bullet")
    s.add_argument("--start-mps", dest="mps", action="store_const", const="on", help="the same as --mps on")
    from bullet_trt.serving.openai.launch import add_cli_arguments
    add_cli_arguments(s)
    s.add_argument("tritonserver_args", nargs=argparse.REMAINDER, help="-- then extra tritonserver flags")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate offline from an engine directory (no server)")
    g.add_argument("--engine-dir", help="engine directory (default: engines/default, the default model, "
                                        "built on first use)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--prompt-file", help="one prompt per line")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop word (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="engine configuration override")
    g.add_argument("--tp", type=int, metavar="N", help=TP_HELP)
    g.set_defaults(func=cmd_generate)

    for name, (candidates, help_text) in EXTERNAL.items():
        module = _find_module(candidates)
        p = sub.add_parser(name, help=help_text if module else f"{help_text} (not available in this version)",
                           add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        if module:
            p.set_defaults(func=_run_external, external_module=module)
        else:
            p.set_defaults(func=lambda args, n=name: _missing(n))
    return ap


def _missing(name: str) -> int:
    print(f"bullet-trt {name}: not available in this version", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTERNAL:  # everything after the name belongs to that command
        module = _find_module(EXTERNAL[argv[0]][0])
        if module is None:
            return _missing(argv[0])
        return _run_external(argparse.Namespace(command=argv[0], external_module=module, rest=argv[1:]))
    args = build_parser().parse_args(argv)
    if getattr(args, "model_repository", "unset") is None:
        from bullet_trt.serving.triton.server import DEFAULT_MODEL_REPOSITORY
        args.model_repository = DEFAULT_MODEL_REPOSITORY
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
