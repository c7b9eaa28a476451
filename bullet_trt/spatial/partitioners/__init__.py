"""SM partitioners: give prefill and decode each their own share of the GPU's SMs.

One interface (base.py), four implementations (green.py, libsmctrl.py, mps.py, none.py),
built by factory.py:

    part = make_partitioner(cfg.serve.partitioner, device)   # in the worker process
    part.prepare("decode", part.splits())                     # once, at start-up
    ...
    with torch.cuda.stream(part.stream(prefill_sms)):        # every iteration
        run_decode_step()

`stream(prefill_sms)` returns the stream this role's work must run on while prefill
holds `prefill_sms` SMs and decode the rest. All streams are created in `prepare`;
`stream()` is a dictionary lookup. Work queued on different streams is not ordered:
when a role moves from one split's stream to another's, make the new stream wait for
the old one (`new.wait_stream(old)`) or for an event recorded on it. CUDA graphs are
bound to the SM set of the stream they were captured on (docs/partitioning.md), so
capture decode graphs once per split, each on that split's stream.

Below the implementations: mps_daemon.py (the MPS daemon, client checks and client
environment), cuda_driver.py (raw cuda.bindings calls) and native.py (ctypes bindings of
native/). pyproject.toml holds the import-linter contract that keeps this order.
"""
from __future__ import annotations

from bullet_trt.spatial.partitioners.base import Partitioner
from bullet_trt.spatial.partitioners.factory import green_available, make_partitioner

__all__ = ["Partitioner", "green_available", "make_partitioner"]
