"""Files a GPU round's results into the repository, from what `scripts/gpu_lists.sh` brought back.

    python scripts/round_collect.py docs/data/gpu_round_DATE CALL_OUT [CALL_OUT ...] \
        [--scrub '/path/on/the/gpu/machine/=./' ...]

Each CALL_OUT is one call's $OUT folder (its gpuN.tar.gz archives), in call order. Into the round's
folder go, under the GPU's short name (h200, h100; from each worker's environment.txt):

- every serving run (a result JSON in a run.sh stage's serve_*.tar.gz), xz-compressed, in a folder
  named by its label, dataset and TPOT SLO, beside its server log and, where it kept one, its
  iteration log (tagged with the call and GPU); a run whose file name is already taken (the same
  label, rate and seed on another GPU or call) is kept under a name that adds its call and GPU;
- `bench/callC_gpuG_NAME` for the other results a worker wrote (bench JSON and logs, the
  calibration's measured points);
- the first worker's environment.txt;
- calls.txt: every job each GPU took, the host line, test summaries and each run's printed line,
  below the comment lines a calls.txt there already starts with (the round's description).

Text is scrubbed of the machine's own paths (`--scrub OLD=NEW`, in order) and of its Python's install
prefix (`.../site-packages/` becomes `site-packages/`) before it is written.
`report.sh` (scripts/round_report.sh) then builds the round's summaries from the folders.
"""
from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bullet_trt.tools.bench.results import slug  # noqa: E402

# pair.log lines that calls.txt keeps: a job taken, dropped or left, the host, tests, a run's result
KEPT_LINE = re.compile(r"^(== gpu_lists|host:|.* req/s seed |=+ .*(passed|failed)|\d+ (passed|failed)|"
                       r".*not started)")
SKIPPED_FILES = {"pair.log", "native_build.log", "environment.txt", "gpu_tests.xml"}


def gpu_kind(environment: Path) -> str:
    """'h200' for a worker whose environment.txt starts 'NVIDIA H200, ...'."""
    first = environment.read_text().splitlines()[0] if environment.exists() else ""
    match = re.search(r"\b([HABL]\d{2,3})\b", first)
    return match.group(1).lower() if match else "gpu"


# a Python's install prefix, in tracebacks and warnings: where the GPU machine keeps its venv says nothing
SITE_PACKAGES = re.compile(r"/\S*?/site-packages/")


def scrubbed(text: str, scrubs: list[tuple[str, str]]) -> str:
    for old, new in scrubs:
        text = text.replace(old, new)
    return SITE_PACKAGES.sub("site-packages/", text)


def run_folder(result: dict) -> str:
    tpot = result.get("slo", {}).get("tpot_ms")
    tpot_tag = f"-tpot{tpot:g}" if isinstance(tpot, (int, float)) else ""
    return slug(f"{result['label']}__{result['dataset']}{tpot_tag}")


def unpack(archive: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Pythons from 3.10.12 / 3.11.4: no paths outside `into`
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into


def collect(round_dir: Path, calls: list[Path], scrubs: list[tuple[str, str]]) -> list[Path]:
    """Files every call's results into round_dir; returns the result files written."""
    written: list[Path] = []
    call_lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for c, call in enumerate(calls, start=1):
            call_lines += ["", f"== call {c}"]
            for archive in sorted(call.glob("gpu*.tar.gz"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
                gpu = archive.name.removesuffix(".tar.gz")
                worker = unpack(archive, Path(tmp) / f"call{c}") / gpu
                kind_dir = round_dir / gpu_kind(worker / "environment.txt")
                kind_dir.mkdir(parents=True, exist_ok=True)
                if (worker / "environment.txt").exists() and not (kind_dir / "environment.txt").exists():
                    shutil.copy(worker / "environment.txt", kind_dir / "environment.txt")
                call_lines.append(f"  -- {gpu}")
                pair = worker / "pair.log"
                if pair.exists():
                    call_lines += ["    " + scrubbed(line, scrubs)
                                   for line in pair.read_text(errors="replace").splitlines() if KEPT_LINE.match(line)]
                tag = f"call{c}_{gpu}"
                written += _file_runs(worker, kind_dir, tag, scrubs)
                _file_bench(worker, kind_dir / "bench", tag, scrubs)
    calls_txt = round_dir / "calls.txt"
    header = [line for line in calls_txt.read_text().splitlines() if line.startswith("#")] if calls_txt.exists() else []
    header = header or ["# (what this round ran, on which machines, from which commit: describe it here)"]
    calls_txt.write_text("\n".join(header + call_lines) + "\n")
    return written


def _file_runs(worker: Path, kind_dir: Path, tag: str, scrubs: list[tuple[str, str]]) -> list[Path]:
    written = []
    for stage in sorted(worker.glob("serve_*.tar.gz")):
        stage_dir = unpack(stage, worker / stage.name.removesuffix(".tar.gz"))
        folders: dict[Path, dict] = {}  # each folder this stage's runs went to, and one run's overrides
        for result_file in sorted(stage_dir.glob("serve/*.json")):
            text = scrubbed(result_file.read_text(), scrubs)
            result = json.loads(text)
            folder = kind_dir / run_folder(result)
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"{result_file.name}.xz"
            if target.exists():
                target = folder / f"{result_file.stem}_{tag}.json.xz"
            with lzma.open(target, "wt") as out:
                out.write(text)
            written.append(target)
            folders[folder] = result.get("overrides", {})
        for folder, overrides in folders.items():  # a stage's logs once per folder, however many runs
            for log in stage_dir.glob("serve/server_*.log"):
                (folder / f"{log.stem}_{tag}_{stage_dir.name}.log").write_text(
                    scrubbed(log.read_text(errors="replace"), scrubs))
            if "serve.iteration_log" in overrides:  # the worker's logs of this mode (named iterations_MODE_...)
                for it in worker.glob(f"iterations_{overrides.get('serve.mode', '')}_*.jsonl.gz"):
                    shutil.copy(it, folder / f"{it.name.removesuffix('.jsonl.gz')}_{tag}.jsonl.gz")
    return written


def _file_bench(worker: Path, bench_dir: Path, tag: str, scrubs: list[tuple[str, str]]) -> None:
    for path in sorted(worker.iterdir()):
        if not path.is_file() or path.name in SKIPPED_FILES or not path.name.endswith((".json", ".log", ".yaml")):
            continue
        bench_dir.mkdir(parents=True, exist_ok=True)
        (bench_dir / f"{tag}_{path.name}").write_text(scrubbed(path.read_text(errors="replace"), scrubs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("round_dir", type=Path)
    ap.add_argument("calls", type=Path, nargs="+", help="each call's $OUT folder, in call order")
    ap.add_argument("--scrub", action="append", default=[], metavar="OLD=NEW",
                    help="replace OLD by NEW in every text written (the GPU machine's paths)")
    args = ap.parse_args(argv)
    scrubs = []
    for pair in args.scrub:
        old, sep, new = pair.partition("=")
        if not sep or not old:
            ap.error(f"--scrub {pair!r}: expected OLD=NEW")
        scrubs.append((old, new))
    for call in args.calls:
        if not sorted(call.glob("gpu*.tar.gz")):
            ap.error(f"{call}: no gpuN.tar.gz (a call's $OUT from scripts/gpu_lists.sh)")
    written = collect(args.round_dir, args.calls, scrubs)
    print(f"{len(written)} serving runs filed into {args.round_dir}; calls.txt written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
