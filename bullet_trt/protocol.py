"""Everything that crosses a process boundary, as typed messages.

Two conversations run over `multiprocessing` queues:

    serving (Triton stub)  <->  engine process        AddRequest, AbortRequest, Shutdown
                                                      EngineReady, StepOutputs, StatsUpdate, EngineFailed,
                                                      EngineStopped
    spatial orchestrator   <->  session workers       WorkerSetup, RunBatch, DecodeUpdate, StopWorker
                                                      WorkerReady, BatchDone, BatchFailed, WorkerFatal,
                                                      DecodeStep, DecodeStepFailed, RowsLeft
    spatial orchestrator   ->   its rank followers    WorkerPlan (tensor parallelism)

Under tensor parallelism rank 0 also tells its followers each step and the KV blocks it gave
out (engine/tp_messages.py: the chunked engine, in the layer below, sends them too), and a
rank-0 worker hands the messages it takes to the same worker of every other rank
(spatial/rank_mirror.py).

Receivers dispatch on the message's type (`match`), so a new message is a new dataclass here,
never a new string. Messages stay small: ids, token ids, block tables, counters and an
`SmSplit`; the weights and the KV pool cross once, inside `WorkerSetup`, as shared-memory or
CUDA IPC handles.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bullet_trt.engine.request import EngineStats, NewRequest, RequestOutput
from bullet_trt.engine.session import BatchItem, SampleResult


# -- the SM split ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SmSplit:
    """How a GPU's SMs are shared at one moment: prefill holds `prefill` of `total` and decode
    the rest. `prefill=None` means no split: a phase running alone has the whole GPU."""

    total: int
    prefill: int | None = None

    def __post_init__(self) -> None:
        # A split that leaves one phase nothing is no split at all.
        if self.prefill is not None and not 0 < self.prefill < self.total:
            object.__setattr__(self, "prefill", None)

    @classmethod
    def whole(cls, total: int) -> "SmSplit":
        return cls(total, None)

    @property
    def is_whole(self) -> bool:
        return self.prefill is None

    @property
    def prefill_sms(self) -> int:
        return self.total if self.prefill is None else self.prefill

    @property
    def decode_sms(self) -> int:
        return self.total if self.prefill is None else self.total - self.prefill

    def sms_of(self, role: str) -> int:
        return self.prefill_sms if role == "prefill" else self.decode_sms


# -- serving <-> engine process ----------------------------------------------------------------

@dataclass
class AddRequest:
    request: NewRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class EngineInfo:
    pid: int
    pgid: int
    max_model_len: int
    max_prompt_len: int
    eos_token_ids: list[int]
    stats: EngineStats


@dataclass
class EngineReady:
    info: EngineInfo


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass
class StatsUpdate:
    stats: EngineStats


@dataclass
class EngineFailed:
    """The engine process cannot go on (start-up failed, or its loop raised); it exits."""

    trace: str


@dataclass
class EngineStopped:
    """The engine process was told to stop (SIGTERM: the server is shutting down); it has
    ended every request it held with `reason` and exits."""

    reason: str


# -- spatial orchestrator <-> session workers --------------------------------------------------

@dataclass
class WorkerSetup:
    """The first message a worker gets: what to attach and which partitions to prepare."""

    state: Any  # engine.shared_state.SharedEngineState: tensors travel as IPC handles
    profile: Any  # config.ProfileConfig
    threads: int | None
    partitioner: str
    splits: list[int]  # prefill SM counts the worker may be asked to run at
    # tensor parallelism: (engine.tp_group.Rendezvous of this role's workers, this rank)
    tp: Any = None
    # stamp every step with the GPU's clock (engine/step_clock.py), for the iteration log
    gpu_clock: bool = False


@dataclass
class WorkerPlan:
    """Rank 0's orchestrator to each rank follower: the workers to start on that rank's GPU,
    as its own (the same partitioner, splits and environment), and where each role's
    workers of all ranks meet."""

    partitioner: str
    splits: list[int]
    envs: dict[str, dict]  # role -> environment
    rendezvous: dict[str, Any]  # role -> engine.tp_group.Rendezvous


@dataclass
class RunBatch:
    """One step over these items on the partition the split gives this worker's role. With
    `after_decode_epoch` the worker first waits until the decode worker runs at that split
    epoch (DecodeUpdate.epoch), so that the two partitions never overlap."""

    items: list[BatchItem]
    split: SmSplit
    after_decode_epoch: int = 0


@dataclass
class DecodeUpdate:
    """What changed in the decode worker's own batch since the last update."""

    joins: list[tuple[int, BatchItem]] = field(default_factory=list)  # row id, its first decode item
    leaves: list[int] = field(default_factory=list)
    grants: list[tuple[int, list[int]]] = field(default_factory=list)  # row id, blocks to append
    split: SmSplit | None = None  # None: unchanged
    epoch: int = 0  # with a new split: its number, published by the worker once it runs there
    prompts: list[BatchItem] = field(default_factory=list)  # to prefill within the next step

    def __bool__(self) -> bool:
        return bool(self.joins or self.leaves or self.grants or self.split is not None or self.prompts)


@dataclass
class StopWorker:
    pass


@dataclass
class WorkerReady:
    role: str
    pid: int
    partitions: dict
    fused_groups: int
    # token bucket -> on how many partitions (streams) its prefill pieces are ready
    piecewise: dict[int, int] = field(default_factory=dict)


@dataclass
class BatchDone:
    role: str
    results: list[SampleResult | None]
    measured_ms: float
    start: float = 0.0  # time.monotonic() when the step began, after any wait for the split
    waited_ms: float = 0.0  # for the decode worker to reach the split (RunBatch.after_decode_epoch)
    gpu_window_ns: tuple[int, int] | None = None  # the step on the GPU's clock (WorkerSetup.gpu_clock)


@dataclass
class BatchFailed:
    """A RunBatch raised with the device still sound; the worker takes the next one."""

    role: str
    trace: str


@dataclass
class WorkerFatal:
    """The worker could not start, or its device context broke; it exits."""

    role: str
    trace: str


@dataclass
class DecodeStep:
    """One step of the decode worker's batch: the tokens of the rows that ran, and the leaves
    it applied before running them (their blocks may now be reused)."""

    row_ids: list[int]
    token_ids: list[int]
    logprobs: list[float | None]
    left: list[int]
    split: SmSplit  # the split it ran at
    total_ctx: int
    start: float  # time.monotonic(), comparable across processes
    measured_ms: float
    idle_ms: float | None  # since the worker's previous step ended (None: first step)
    # one result per prompt the step carried, in the order they were sent; None: it carried none
    prompt_results: list[SampleResult] | None = None
    prompt_tokens: int = 0
    role: str = "decode"
    gpu_window_ns: tuple[int, int] | None = None  # the step on the GPU's clock (WorkerSetup.gpu_clock)
    rows_without_block: int = 0  # rows held out of this step, waiting for a block grant
    # launched ahead (decode.overlap_steps): the host time of its launch; near the step's own
    # time, the launch waited for the device and nothing overlapped
    launch_ms: float | None = None


@dataclass
class DecodeStepFailed:
    """A decode step raised: its rows were dropped from the worker's batch."""

    trace: str
    rows: list[int]
    carried_prompts: bool
    role: str = "decode"


@dataclass
class RowsLeft:
    """Leaves applied while no row could step: their blocks may now be reused."""

    rows: list[int]
    role: str = "decode"
