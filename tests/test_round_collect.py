"""scripts/round_collect.py files a GPU round's archives (as scripts/gpu_lists.sh packs them) into
the repository: serving runs by label, dataset and SLO, the rest under bench/, calls.txt from the
workers' logs, with the machine's paths scrubbed."""
from __future__ import annotations

import gzip
import io
import json
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEL = "moe-bullet-2048-overlap_steps=true-bullet"
RESULT_LINE = f"{LABEL} sharegpt 50 req/s seed 100: 6015/6015 done, SLO attainment 74.5%"


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def worker_archive(call_dir: Path, gpu: int, attainment: float) -> None:
    result = {"label": LABEL, "dataset": "sharegpt", "rate": 50.0, "seed": 100, "slo": {"ttft_ms": 1000.0, "tpot_ms": 50.0},
              "overrides": {"serve.mode": "bullet", "serve.iteration_log": "/machine/out/iterations_bullet_7.jsonl"},
              "summary": {"slo_attainment": attainment}}
    stage = tar_of({f"serve/{LABEL.replace('=', '-')}__sharegpt__rate50__seed100.json": json.dumps(result).encode(),
                    f"serve/server_{LABEL.replace('=', '-')}.log": b"started in /machine/repo/engines\n"})
    pair = "\n".join(["== gpu_lists: GPU 0 takes, 538 s before DEADLINE: MODE=bullet RATE=50 bash scripts/gpu_run.sh run",
                      "host: Intel(R) Xeon(R) Processor, 64 cores, python pace 111.2 ns/item",
                      "some progress line the round does not keep", RESULT_LINE, "2 passed in 8.06s"]) + "\n"
    worker = tar_of({f"gpu{gpu}/environment.txt": b"NVIDIA H200, 580.159.04, 143771 MiB, Default\n",
                     f"gpu{gpu}/pair.log": pair.encode(),
                     f"gpu{gpu}/serve_moe.tar.gz": stage,
                     f"gpu{gpu}/iterations_bullet_7.jsonl.gz": gzip.compress(b'{"phase": "decode"}\n'),
                     f"gpu{gpu}/iterations_chunked_8.jsonl.gz": gzip.compress(b'{"phase": "mixed"}\n'),
                     f"gpu{gpu}/bench_moe-tune.json": b'{"written": "/machine/out/x.json"}',
                     f"gpu{gpu}/bench_mixed-step.log": b"/machine/py/lib/python3.12/site-packages/torch/x.py:1: Warn\n"})
    call_dir.mkdir(parents=True, exist_ok=True)
    (call_dir / f"gpu{gpu}.tar.gz").write_bytes(worker)


def test_a_rounds_archives_are_filed_by_run_with_the_machines_paths_scrubbed(tmp_path):
    worker_archive(tmp_path / "out1", 0, 0.745)
    worker_archive(tmp_path / "out2", 0, 0.702)  # the same label, rate and seed on another call
    round_dir = tmp_path / "round"
    round_dir.mkdir()
    (round_dir / "calls.txt").write_text("# what this round ran\n# and where\nstale body\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/round_collect.py"), str(round_dir),
                           str(tmp_path / "out1"), str(tmp_path / "out2"),
                           "--scrub", "/machine/out/=$OUT/", "--scrub", "/machine/repo/=./"],
                          capture_output=True, text=True, check=True)
    assert "2 serving runs filed" in done.stdout

    runs = round_dir / "h200" / "moe-bullet-2048-overlap_steps-true-bullet__sharegpt-tpot50"
    first = runs / "moe-bullet-2048-overlap_steps-true-bullet__sharegpt__rate50__seed100.json.xz"
    second = runs / "moe-bullet-2048-overlap_steps-true-bullet__sharegpt__rate50__seed100_call2_gpu0.json.xz"
    assert json.loads(lzma.open(first).read())["summary"]["slo_attainment"] == 0.745
    kept = json.loads(lzma.open(second).read())
    assert kept["summary"]["slo_attainment"] == 0.702
    assert kept["overrides"]["serve.iteration_log"] == "$OUT/iterations_bullet_7.jsonl"
    log = runs / "server_moe-bullet-2048-overlap_steps-true-bullet_call1_gpu0_serve_moe.log"
    assert log.read_text() == "started in ./engines\n"
    assert sorted(p.name for p in runs.glob("iterations_*")) == [
        "iterations_bullet_7_call1_gpu0.jsonl.gz", "iterations_bullet_7_call2_gpu0.jsonl.gz"]  # its mode's only
    assert (round_dir / "h200/bench/call2_gpu0_bench_moe-tune.json").read_text() == '{"written": "$OUT/x.json"}'
    assert (round_dir / "h200/environment.txt").read_text().startswith("NVIDIA H200")
    assert (round_dir / "h200/bench/call1_gpu0_bench_mixed-step.log").read_text() == "site-packages/torch/x.py:1: Warn\n"

    calls = (round_dir / "calls.txt").read_text().splitlines()
    assert calls[:2] == ["# what this round ran", "# and where"] and "stale body" not in calls
    assert calls.count("== call 1") == 1 and calls.count("== call 2") == 1
    assert calls.count("    " + RESULT_LINE) == 2 and calls.count("    2 passed in 8.06s") == 2
    assert not any("progress line" in line for line in calls)


def test_a_folder_without_archives_is_refused_by_name(tmp_path):
    empty = tmp_path / "not-a-call"
    empty.mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "scripts/round_collect.py"), str(tmp_path / "round"), str(empty)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and f"{empty}: no gpuN.tar.gz" in done.stderr
