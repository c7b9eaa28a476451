"""scripts/job_queue.sh: the queue that several GPUs' workers take jobs from
(scripts/gpu_lists.sh --queue), run as real processes."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "job_queue.sh"


def take(queue: Path, seconds_left: int | str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "take", str(queue), str(seconds_left)],
                          capture_output=True, text=True, timeout=30)


def put(queue: Path, *job_and_note: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "put", str(queue), *job_and_note],
                          capture_output=True, text=True, timeout=30)


def drop(queue: Path, job: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "drop", str(queue), job], capture_output=True, text=True, timeout=30)


def test_a_worker_takes_the_first_job_that_fits_the_time_left(tmp_path):
    queue = tmp_path / "jobs"
    queue.write_text("# the protocol's seeds\n300 MODE=bullet SEED=100 run\n\n120 MODE=chunked RATE=34 run\n"
                     "120 MODE=chunked RATE=36 run\n")
    first = take(queue, 200)
    assert first.returncode == 0 and first.stdout == "120 MODE=chunked RATE=34 run\n"
    assert take(queue, 300).stdout == "300 MODE=bullet SEED=100 run\n"  # the first line fits now
    assert take(queue, 100).returncode == 1  # 120 s do not fit in 100
    assert take(queue, 120).stdout == "120 MODE=chunked RATE=36 run\n"
    assert take(queue, 10_000).returncode == 1
    assert "run" not in queue.read_text()  # every job taken, the comment and blank line left


def test_workers_taking_at_once_never_get_the_same_job(tmp_path):
    queue = tmp_path / "jobs"
    jobs = [f"job {i}" for i in range(40)]
    queue.write_text("".join(f"10 {j}\n" for j in jobs))

    def drain(_):
        got = []
        while (r := take(queue, 600)).returncode == 0:
            got.append(r.stdout.strip().split(" ", 1)[1])
        return got
    with ThreadPoolExecutor(4) as pool:
        taken = [job for got in pool.map(drain, range(4)) for job in got]
    assert sorted(taken) == sorted(jobs)


def test_a_malformed_queue_or_time_is_refused_by_name(tmp_path):
    queue = tmp_path / "jobs"
    queue.write_text("soon MODE=bullet run\n")
    r = take(queue, 600)
    assert r.returncode == 2 and "line 1 does not start with its seconds" in r.stderr
    r = take(queue, "ten")
    assert r.returncode == 2 and "SECONDS_LEFT must be an integer, got 'ten'" in r.stderr
    assert take(tmp_path / "none", 600).returncode == 2


def test_a_job_handed_back_keeps_its_seconds_and_a_note_the_next_take_skips(tmp_path):
    queue = tmp_path / "unstarted"  # put creates it
    job = "300 DATASET=azure-code MODE=bullet RATE=16 SEED=100 run"
    assert put(queue, job, "GPU 3 left runs of this job unstarted: needs ~160 s,\n107 s left").returncode == 0
    assert put(queue, "120 MODE=chunked RATE=36 run").returncode == 0
    assert queue.read_text() == ("# GPU 3 left runs of this job unstarted: needs ~160 s, 107 s left\n"
                                 f"{job}\n120 MODE=chunked RATE=36 run\n")
    assert take(queue, 200).stdout == "120 MODE=chunked RATE=36 run\n"
    assert take(queue, 300).stdout == job + "\n"


def test_a_job_line_without_its_seconds_is_not_handed_back(tmp_path):
    queue = tmp_path / "unstarted"
    r = put(queue, "MODE=bullet run")
    assert r.returncode == 2 and "starts with its seconds" in r.stderr and "'MODE=bullet run'" in r.stderr
    assert put(queue, "300").returncode == 2  # seconds and no command
    assert not queue.exists() or queue.read_text() == ""


def pick(gpu_name: str, *jobs_files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "pick", gpu_name, *map(str, jobs_files)],
                          capture_output=True, text=True, timeout=30)


def test_the_jobs_file_for_the_machines_gpu_is_picked_and_none_for_another(tmp_path):
    h100, h200, any_gpu = tmp_path / "jobs_h100.txt", tmp_path / "jobs_h200.txt", tmp_path / "jobs.txt"
    h100.write_text("# the H100 work\n# gpu: H100\n200 MODE=bullet run\n")
    h200.write_text("#   gpu:  H200  \n300 MODE=bullet run\n")
    any_gpu.write_text("100 MODE=chunked run\n")
    assert pick("NVIDIA H200", h100, h200).stdout == f"{h200}\n"
    assert pick("NVIDIA H100 80GB HBM3", h100, h200).stdout == f"{h100}\n"
    refused = pick("NVIDIA A100-SXM4-80GB", h100, h200)
    assert refused.returncode == 1 and "'NVIDIA A100-SXM4-80GB'" in refused.stderr
    assert pick("NVIDIA A100-SXM4-80GB", h100, any_gpu).stdout == f"{any_gpu}\n"
    assert pick("NVIDIA H200", tmp_path / "none.txt").returncode == 2


def test_the_repositorys_jobs_files_each_name_their_gpu():
    rounds = SCRIPT.parent.parent / "docs" / "data" / "gpu_round_2026-11-25"
    h100, h200 = rounds / "jobs_h100.txt", rounds / "jobs_h200.txt"
    assert pick("NVIDIA H100 80GB HBM3", h100, h200).stdout == f"{h100}\n"
    assert pick("NVIDIA H200", h100, h200).stdout == f"{h200}\n"


def test_a_decided_seed_drops_its_siblings_and_nothing_else(tmp_path):
    """One seed's run decided the rate for the protocol: the same job at the other seeds goes
    (whatever its seconds), other rates, settings and comments stay, in their order."""
    queue = tmp_path / "jobs"
    run = "bash scripts/gpu_run.sh run bash run.sh protocol"
    queue.write_text(f"# plan 1.0 at 48\n220 MODE=bullet RATE=48 SEED=101 SETS=serve.tpot_plan_fraction=1.0 {run}\n"
                     f"220 MODE=bullet RATE=48 SEED=101 SETS=serve.tpot_plan_fraction=1.3 {run}\n"
                     f"220 MODE=bullet RATE=50 SEED=101 SETS=serve.tpot_plan_fraction=1.0 {run}\n"
                     f"\n300  MODE=bullet RATE=48 SEED=102  SETS=serve.tpot_plan_fraction=1.0 {run}\n"
                     f"220 MODE=bullet RATE=48 SETS=serve.tpot_plan_fraction=1.0 {run}\n")
    r = drop(queue, f"220 MODE=bullet RATE=48 SEED=100 SETS=serve.tpot_plan_fraction=1.0 {run}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"220 MODE=bullet RATE=48 SEED=101 SETS=serve.tpot_plan_fraction=1.0 {run}",
                                     f"300  MODE=bullet RATE=48 SEED=102  SETS=serve.tpot_plan_fraction=1.0 {run}"]
    assert queue.read_text() == (f"# plan 1.0 at 48\n220 MODE=bullet RATE=48 SEED=101 SETS=serve.tpot_plan_fraction=1.3 {run}\n"
                                 f"220 MODE=bullet RATE=50 SEED=101 SETS=serve.tpot_plan_fraction=1.0 {run}\n\n"
                                 f"220 MODE=bullet RATE=48 SETS=serve.tpot_plan_fraction=1.0 {run}\n")
    # a job without a seed names no siblings: nothing goes
    before = queue.read_text()
    assert drop(queue, f"220 MODE=bullet RATE=50 SETS=serve.tpot_plan_fraction=1.0 {run}").stdout == ""
    assert queue.read_text() == before


def forget(queue: Path, done: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "forget", str(queue), str(done)],
                          capture_output=True, text=True, timeout=30)


def test_jobs_an_earlier_call_ran_are_forgotten_whatever_their_seconds(tmp_path):
    """A call that starts from the committed jobs file on a machine that already ran some of its
    jobs skips those (their command decides, not the seconds), keeps the rest and the comments."""
    queue, done = tmp_path / "queue", tmp_path / "jobs_done"
    stage = "bash scripts/gpu_run.sh run bash run.sh moe"
    sets = "SETS='prefill.piecewise_graph_tokens=[128,256] serve.tpot_plan_fraction=1.0'"
    queue.write_text(f"# the MoE edge\n300 MODE=bullet RATE=34 SEED=100 {sets} {stage}\n"
                     f"300 MODE=bullet RATE=34 SEED=101 {sets} {stage}\n\n"
                     f"150 bash scripts/gpu_run.sh tests tests/gpu -k 'graphs or matches'\n")
    assert forget(queue, done).stdout == ""  # no earlier call on this machine: nothing goes
    assert put(done, f"300 MODE=bullet RATE=34 SEED=100 {sets} {stage}").returncode == 0
    assert put(done, "100 bash scripts/gpu_run.sh tests tests/gpu -k 'graphs or matches'").returncode == 0
    r = forget(queue, done)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"300 MODE=bullet RATE=34 SEED=100 {sets} {stage}",
                                     "150 bash scripts/gpu_run.sh tests tests/gpu -k 'graphs or matches'"]
    assert queue.read_text() == f"# the MoE edge\n300 MODE=bullet RATE=34 SEED=101 {sets} {stage}\n\n"


def test_the_queue_worker_remembers_what_it_ran():
    """gpu_lists.sh lists each job it ran or dropped where the next call on the machine forgets them."""
    script = (SCRIPT.parent / "gpu_lists.sh").read_text()
    assert 'job_queue.sh forget "$queue" "$done_jobs"' in script
    assert 'job_queue.sh put "$done_jobs" "$job"' in script and 'tee -a "$done_jobs"' in script


def test_the_queue_worker_listens_for_the_sweeps_decision():
    """gpu_lists.sh drops siblings on the line bench serve prints: the two must not drift apart."""
    from bullet_trt.tools.bench.decided import DECIDED_ELSEWHERE
    assert DECIDED_ELSEWHERE in (SCRIPT.parent / "gpu_lists.sh").read_text()
