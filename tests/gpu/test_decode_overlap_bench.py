"""`bullet-trt bench decode-overlap` on a small random checkpoint: the decode worker's plain loop
and its overlapped loop pick the same tokens step for step through the decode graphs, and the
command reports both loops' periods. Skipped without a GPU (tests/gpu/conftest.py)."""
from __future__ import annotations

import json

from bullet_trt.tools.bench.decode_overlap import main
from bullet_trt.tools.build import build_from_checkpoint


def test_the_overlapped_loop_picks_the_plain_loops_tokens(checkpoint, tmp_path):
    engine = build_from_checkpoint(checkpoint("qwen3"), tmp_path / "engine", max_model_len=256, dtype="float32")
    out = tmp_path / "bench.json"
    assert main(["--engine-dir", str(engine), "--batch", "24", "--ctx", "40", "--steps", "12",
                 "--profile-steps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True
    assert report["steps_compared"] >= 15  # 4 warm-up steps and 12 timed, less the one in flight
    assert report["plain_period_ms"] > 0 and report["overlapped_period_ms"] > 0


def test_the_overlapped_loop_launches_across_a_change_of_split(checkpoint, tmp_path):
    """Every third step decode moves between a green partition and the whole GPU, as a server's
    prefills start and end: the overlapped loop launches the next step on the new partition's
    stream behind the one in flight (no drain), its tokens fed from that step across the two
    streams, and both loops still pick the same tokens."""
    import torch

    engine = build_from_checkpoint(checkpoint("qwen3"), tmp_path / "engine", max_model_len=256, dtype="float32")
    out = tmp_path / "bench.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count - 24
    assert main(["--engine-dir", str(engine), "--batch", "24", "--ctx", "40", "--steps", "12", "--sms", str(sms),
                 "--switch-every", "3", "--profile-steps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["switch_every"] == 3 and report["same_tokens"] is True and report["steps_compared"] >= 15


def test_steps_launched_late_pick_the_plain_loops_tokens(checkpoint, tmp_path):
    """`decode.overlap_launch_late`: each step waits to be launched until shortly before the one
    in flight is due to end, across changes of split too, and still picks the plain loop's
    tokens (the gaps it opens are the bench's figures, not asserted)."""
    import torch

    engine = build_from_checkpoint(checkpoint("qwen3"), tmp_path / "engine", max_model_len=256, dtype="float32")
    out = tmp_path / "bench.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count - 24
    assert main(["--engine-dir", str(engine), "--batch", "24", "--ctx", "40", "--steps", "12", "--sms", str(sms),
                 "--switch-every", "3", "--launch-late", "--profile-steps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["launch_late"] is True and report["same_tokens"] is True and report["steps_compared"] >= 15
