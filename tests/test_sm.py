"""SM partitioners, MPS control, native helpers and the doctor.

CPU tests check the interface, every start-up error, the MPS scripts (against a fake
nvidia-cuda-mps-control), the native build and the doctor's verdicts. GPU tests (`-m gpu`,
run by scripts/gpu_run.sh) check green-split disjointness: in one process with the
SM-id probe, across two MPS clients with GEMM throughput (%smid is renumbered per MPS
client, so SM ids prove nothing there), and MPS client detection.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from bullet_trt.spatial.partitioners import Partitioner, cuda_driver, make_partitioner, mps, mps_daemon, native
from bullet_trt.spatial.partitioners.green import GreenPartitioner
from bullet_trt.spatial.partitioners.libsmctrl import LibsmctrlPartitioner
from bullet_trt.spatial.partitioners.none import NonePartitioner
from bullet_trt.tools import doctor
from bullet_trt.tools.doctor import compare, main as doctor_main, run_doctor, summarize, throughput_verdict

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for d in sorted(Path("/usr/local").glob("cuda*")):
        if (d / "bin" / "nvcc").exists():
            return str(d / "bin" / "nvcc")
    return None


@pytest.fixture(scope="session")
def native_build():
    """Runs `make -C native` once; returns its CompletedProcess."""
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    return subprocess.run(["make", "-C", str(ROOT / "native")], capture_output=True, text=True, timeout=600)


def _fake_green(total=132, granularity=8) -> GreenPartitioner:
    """A GreenPartitioner whose device queries are skipped (validation runs before CUDA)."""
    p = GreenPartitioner.__new__(GreenPartitioner)
    Partitioner.__init__(p)
    p.total_sms, p.granularity, p.index, p.require_mps = total, granularity, 0, False
    p._splits, p._full, p.create_ms = {}, None, 0.0
    return p


# ----------------------------------------------------------------------------- interface
def test_none_and_auto_on_cpu():
    for kind in ("none", "auto"):
        p = make_partitioner(kind, "cpu")
        assert isinstance(p, NonePartitioner) and p.name == "none"
        p.prepare("decode")
        assert p.splits() == [] and p.stream(None) is None and p.stream(64) is None
        assert p.describe()["name"] == "none"
        assert p.worker_env("prefill", 64) == {}


def test_unknown_kind_names_setting():
    with pytest.raises(ValueError, match=r"serve\.partitioner must be one of auto, green, libsmctrl, mps, none"):
        make_partitioner("mig", "cpu")


def test_bad_role():
    with pytest.raises(ValueError, match="prefill' or 'decode"):
        make_partitioner("none", "cpu").prepare("encode")


def test_green_splits_and_bad_splits():
    p = _fake_green()
    assert p.splits() == list(range(8, 121, 8))
    with pytest.raises(ValueError, match=r"serve\.partitioner: prefill SM count 66 is not a multiple of 8"):
        p.prepare("prefill", [64, 66])
    with pytest.raises(ValueError, match=r"must be > 0 and < the GPU's 132 SMs"):
        p.prepare("prefill", [136])
    with pytest.raises(ValueError, match=r"must be > 0 and < the GPU's 132 SMs"):
        p.prepare("decode", [132])
    with pytest.raises(ValueError, match=r"must be > 0"):
        p.validate_splits([0])
    assert p.validate_splits([64, 8, 64]) == [8, 64]
    with pytest.raises(RuntimeError, match="before prepare"):
        p.stream(64)


def test_green_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"serve\.partitioner=green needs a CUDA device"):
        make_partitioner("green", "cpu")
    if not _cuda():
        with pytest.raises(RuntimeError, match=r"serve\.partitioner=green: green contexts are unavailable"):
            make_partitioner("green", "cuda")


def test_mps_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"serve\.partitioner=mps needs a CUDA"):
        make_partitioner("mps", "cpu")


class _FakeRes:
    def __init__(self, n):
        self.sm = SimpleNamespace(smCount=n, minSmPartitionSize=8, smCoscheduledAlignment=8)


class _FakeDriver:
    """Just enough of cuda.bindings.driver to run GreenPartitioner on CPU."""

    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, total=132):
        self.total, self.splits, self.stream_sms, self.destroyed = total, [], {}, 0

    def cuInit(self, flags):
        return (0,)

    def cuDriverGetVersion(self):
        return (0, 13000)

    def cuDeviceGet(self, index):
        return (0, index)

    def cuDeviceGetDevResource(self, dev, kind):
        return (0, _FakeRes(self.total))

    def cuDevSmResourceSplitByCount(self, nb, res, flags, min_count):
        g = -(-min_count // 8) * 8  # asking 66 gives 72
        self.splits.append(min_count)
        return (0, [_FakeRes(g)], 1, _FakeRes(res.sm.smCount - g))

    def cuDevResourceGenerateDesc(self, resources, n):
        return (0, resources[0].sm.smCount)

    def cuGreenCtxCreate(self, desc, dev, flags):
        return (0, ("ctx", desc))

    def cuGreenCtxStreamCreate(self, ctx, flags, priority):
        handle = 1000 + len(self.stream_sms)
        self.stream_sms[handle] = ctx[1]
        return (0, handle)

    def cuStreamDestroy(self, stream):
        self.destroyed += 1
        return (0,)

    def cuGreenCtxDestroy(self, ctx):
        return (0,)


class _FakeStream(tuple):
    def synchronize(self):
        pass


@pytest.fixture
def fake_green(monkeypatch):
    import torch

    from bullet_trt.spatial.partitioners import green

    drv = _FakeDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: drv)
    monkeypatch.setattr(green, "_AVAILABLE", {})
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_stream_from_external", lambda ptr, device=None: _FakeStream(("green", ptr)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(("full", device)))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    return drv


def test_green_one_split_call_per_count(fake_green):
    pre, dec = GreenPartitioner("cuda"), GreenPartitioner("cuda")
    fake_green.splits.clear()
    pre.prepare("prefill", [64, 8, 120])
    dec.prepare("decode", [64])
    assert fake_green.splits == [8, 64, 120, 64]  # one split call per count and role
    assert fake_green.stream_sms[pre.stream(64)[1]] == 64  # prefill: the group
    assert fake_green.stream_sms[dec.stream(64)[1]] == 68  # decode: the remainder
    assert fake_green.stream_sms[pre.stream(120)[1]] == 120 and pre.actual_sms(120) == (120, 12)
    assert pre.stream(None)[0] == "full" and pre.stream(132)[0] == "full" and pre.stream(0)[0] == "full"
    assert pre.stream(64) is pre.stream(64)  # created once, looked up afterwards
    assert [s["requested"] for s in pre.describe()["splits"]] == [8, 64, 120]
    with pytest.raises(ValueError, match="not prepared"):
        dec.stream(8)
    with pytest.raises(RuntimeError, match="already prepared for 'prefill'"):
        pre.prepare("decode", [64])
    pre.close()
    assert fake_green.destroyed >= 3 and pre.prepared == []


def test_green_refuses_mps_percentage(fake_green, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    with pytest.raises(RuntimeError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 is set"):
        GreenPartitioner("cuda")


@pytest.fixture
def fake_mps_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mps, "_device_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: ("default", device))
    for k in (mps_daemon.ENV_PCT, mps_daemon.ENV_TOTAL, mps_daemon.ENV_PREFILL):
        monkeypatch.delenv(k, raising=False)


def test_mps_partitioner_static_split(fake_mps_device, monkeypatch):
    p = mps.MpsPartitioner(0, prefill_sms=64)
    assert p.splits() == [64] and p.total_sms == 132
    with pytest.raises(RuntimeError, match="worker_env"):
        p.prepare("prefill", [64])  # the spawner did not set the percentage
    for k, v in p.worker_env("prefill").items():
        monkeypatch.setenv(k, v)
    worker = mps.MpsPartitioner(0)  # in the worker: total and split come from the environment
    assert worker.prefill_sms == 64 and worker.total_sms == 132
    worker.prepare("prefill", [64])
    assert worker.stream(64)[0] == "default" and worker.stream(None)[0] == "default"
    with pytest.raises(ValueError, match="static split"):
        worker.stream(32)
    with pytest.raises(ValueError, match="static split"):
        worker.prepare("prefill", [32])
    assert worker.describe()["percentages"] == {"prefill": 49, "decode": 52}


def test_mps_partitioner_bad_split(fake_mps_device):
    with pytest.raises(ValueError, match=r"serve\.static_prefill_sms: prefill SM count 65 is not a multiple of 2"):
        mps.MpsPartitioner(0, prefill_sms=65)
    with pytest.raises(ValueError, match=r"serve\.static_prefill_sms: prefill SM count 140"):
        mps.MpsPartitioner(0, prefill_sms=140)
    assert mps.MpsPartitioner(0).prefill_sms == 64  # default: half, on the 8-SM grid


# ----------------------------------------------------------------------------- libsmctrl
def test_libsmctrl_needs_a_path(monkeypatch):
    monkeypatch.delenv("LIBSMCTRL_PATH", raising=False)
    with pytest.raises(ValueError, match=r"serve\.libsmctrl_path"):
        make_partitioner("libsmctrl", "cuda")


def test_libsmctrl_missing_path(monkeypatch, tmp_path):
    missing = tmp_path / "libsmctrl.so"
    with pytest.raises(ValueError, match=r"serve\.libsmctrl_path=.*no such file"):
        make_partitioner("libsmctrl", "cuda", libsmctrl_path=str(missing))
    monkeypatch.setenv("LIBSMCTRL_PATH", str(missing))  # the environment variable is used too
    with pytest.raises(ValueError, match="no such file"):
        make_partitioner("libsmctrl", "cuda")


def test_libsmctrl_not_a_library(native_build, tmp_path):
    if not (native.native_dir() / native.SMCTRL_LIB).exists():
        pytest.skip("libbullet_smctrl.so not built (no C compiler)")
    bogus = tmp_path / "libsmctrl.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(RuntimeError, match=r"serve\.libsmctrl_path=.*does not load"):
        make_partitioner("libsmctrl", "cuda", libsmctrl_path=str(bogus))


def test_libsmctrl_refuses_unsupported_driver(native_build, tmp_path):
    """A library exporting the setter loads; then the driver check refuses (no driver here,
    or CUDA 13 on the GPU machines)."""
    if not (native.native_dir() / native.SMCTRL_LIB).exists() or shutil.which("cc") is None:
        pytest.skip("needs cc and libbullet_smctrl.so")
    src = tmp_path / "fake.c"
    src.write_text("#include <stdint.h>\nvoid libsmctrl_set_stream_mask(void* s, uint64_t m) { (void)s; (void)m; }\n")
    lib = tmp_path / "libfakesmctrl.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    from bullet_trt.spatial.partitioners import native as n

    version = n.smctrl_lib().bullet_smctrl_driver_version()
    if 12000 <= version <= 12080:
        pytest.skip(f"driver CUDA {version} is inside libsmctrl's range")
    with pytest.raises(RuntimeError, match=r"serve\.partitioner=libsmctrl: .*(libcuda|outside)"):
        make_partitioner("libsmctrl", "cuda", libsmctrl_path=str(lib))


FAKE_LIBSMCTRL = r"""
#include <stdint.h>
static void* g_stream; static uint64_t g_lo, g_hi; static int g_calls_ext, g_calls_64;
void libsmctrl_set_stream_mask(void* s, uint64_t m) { g_stream = s; g_lo = m; g_hi = ~0ull; g_calls_64++; }
void libsmctrl_set_stream_mask_ext(void* s, __uint128_t m) {
    g_stream = s; g_lo = (uint64_t)m; g_hi = (uint64_t)(m >> 64); g_calls_ext++; }
void* fake_stream(void) { return g_stream; }
uint64_t fake_lo(void) { return g_lo; }
uint64_t fake_hi(void) { return g_hi; }
int fake_calls_ext(void) { return g_calls_ext; }
"""
FAKE_LIBCUDA = "int cuDriverGetVersion(int* v) { *v = VERSION; return 0; }\n"
SHIM_CHILD = r"""
import ctypes, sys
from bullet_trt.spatial.partitioners import native
shim = native.smctrl_lib()
err = ctypes.create_string_buffer(256)
rc = shim.bullet_smctrl_open(sys.argv[1].encode(), err, 256)
print("open", rc, err.value.decode())
if rc == 0:
    fake = ctypes.CDLL(sys.argv[1])
    for f in ("fake_lo", "fake_hi"):
        getattr(fake, f).restype = ctypes.c_uint64
    fake.fake_stream.restype = ctypes.c_void_p
    print("set", shim.bullet_smctrl_set_tpc_range(ctypes.c_void_p(0x1234), 32, 34, 66))
    print("null", shim.bullet_smctrl_set_tpc_range(None, 0, 32, 66))
    print("mask", fake.fake_stream(), fake.fake_lo(), fake.fake_hi(), fake.fake_calls_ext())
"""


def test_smctrl_shim_end_to_end(native_build, tmp_path):
    """Shim + a fake libsmctrl + a fake libcuda.so.1: driver check, 128-bit mask ABI, error codes."""
    if not (native.native_dir() / native.SMCTRL_LIB).exists() or shutil.which("cc") is None:
        pytest.skip("needs cc and libbullet_smctrl.so")
    (tmp_path / "s.c").write_text(FAKE_LIBSMCTRL)
    lib = tmp_path / "libsmctrl.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "s.c")], check=True)
    for version in (12040, 13000):
        d = tmp_path / str(version)
        d.mkdir()
        (d / "c.c").write_text(FAKE_LIBCUDA.replace("VERSION", str(version)))
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "c.c")], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=str(d), PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-c", SHIM_CHILD, str(lib)], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
        if version == 13000:
            assert lines["open"].startswith("-3 driver CUDA version 13.0 is outside")
            continue
        assert lines["open"].strip() == "0"
        assert lines["set"] == "0" and lines["null"] == "-6"
        stream, lo, hi, ext_calls = (int(x) for x in lines["mask"].split())
        mask = native.tpc_disable_mask(32, 34, 66)
        assert stream == 0x1234 and ext_calls == 1
        assert (hi << 64) | lo == mask


def test_libsmctrl_tpc_ranges():
    p = LibsmctrlPartitioner.__new__(LibsmctrlPartitioner)
    p.total_sms, p.total_tpcs = 132, 66
    assert p.tpc_range("prefill", 64) == (0, 32)
    assert p.tpc_range("decode", 64) == (32, 34)


def test_tpc_masks(native_build):
    assert native.tpc_disable_mask(0, 32, 66) == ((1 << 128) - 1) ^ ((1 << 32) - 1)
    assert native.tpc_disable_mask(32, 34, 66) == ((1 << 128) - 1) ^ (((1 << 34) - 1) << 32)
    with pytest.raises(ValueError):
        native.tpc_disable_mask(60, 10, 66)
    if not (native.native_dir() / native.SMCTRL_LIB).exists():
        pytest.skip("libbullet_smctrl.so not built")
    for first, num, total in [(0, 32, 66), (32, 34, 66), (0, 1, 1), (10, 100, 128), (64, 64, 128), (0, 64, 64)]:
        assert native.smctrl_compute_mask(first, num, total) == native.tpc_disable_mask(first, num, total)
    for bad in [(0, 0, 66), (60, 10, 66), (0, 1, 129), (-1, 2, 66)]:
        with pytest.raises(ValueError):
            native.smctrl_compute_mask(*bad)


# ----------------------------------------------------------------------------- native
def test_make_native_exits_zero(native_build):
    assert native_build.returncode == 0, native_build.stdout + native_build.stderr
    if _nvcc():
        assert (ROOT / "native" / native.SMID_LIB).exists()
    else:
        assert "skipping libbullet_smid.so" in native_build.stdout
    if shutil.which("cc"):
        assert (ROOT / "native" / native.SMCTRL_LIB).exists()


def test_make_native_skips_without_nvcc(native_build):
    r = subprocess.run(["make", "-C", str(ROOT / "native"), "NVCC="], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvcc not found" in r.stdout and "skipping libbullet_smid.so" in r.stdout


def test_native_missing_names_make(monkeypatch, tmp_path):
    monkeypatch.setenv("BULLET_NATIVE_DIR", str(tmp_path))
    native.smid_lib.cache_clear()
    native.smctrl_lib.cache_clear()
    try:
        with pytest.raises(native.NativeLibraryMissing, match=r"make -C native"):
            native.smid_lib()
        with pytest.raises(native.NativeLibraryMissing, match=r"make -C native"):
            native.smctrl_lib()
    finally:
        native.smid_lib.cache_clear()
        native.smctrl_lib.cache_clear()


# ----------------------------------------------------------------------------- MPS
def test_mps_scripts_parse():
    for name in ("start_mps.sh", "kill_mps.sh", "gpu_run.sh"):
        r = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr}"


def test_mps_worker_env():
    d = mps_daemon
    assert d.mps_percentages(64, 132) == (49, 52)
    env = d.worker_env("prefill", 64, 132)
    assert env[d.ENV_PCT] == "49" and env[d.ENV_TOTAL] == "132" and env[d.ENV_PREFILL] == "64"
    assert d.worker_env("decode", 64, 132)[d.ENV_PCT] == "52"
    assert d.worker_env("decode", None, 132)[d.ENV_PCT] == "100"
    with pytest.raises(ValueError):
        d.worker_env("both", 64, 132)


FAKE_MPS = textwrap.dedent("""\
    #!/usr/bin/env bash
    # fake nvidia-cuda-mps-control: a state file stands for the daemon
    state="$CUDA_MPS_PIPE_DIRECTORY/.fake_daemon"
    if [ "${1:-}" = "-d" ]; then
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
      [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ] || mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
      touch "$state"; echo started >> "$CUDA_MPS_PIPE_DIRECTORY/.starts"; exit 0
    fi
    read -r cmd
    [ -f "$state" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
    case "$cmd" in
      get_server_list) echo 4242 ;;
      get_client_list*) echo 111; echo 222 ;;
      quit) rm -f "$state" ;;
    esac
    """)


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS)
    exe.chmod(0o755)
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", str(log))
    return pipe


def _script(name: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / name)], capture_output=True, text=True, timeout=60)


def test_mps_scripts_idempotent(fake_mps):
    assert not mps_daemon.mps_daemon_running(str(fake_mps))
    r = _script("start_mps.sh")
    assert r.returncode == 0, r.stderr
    assert "MPS daemon started" in r.stderr
    assert f"export CUDA_MPS_PIPE_DIRECTORY={fake_mps}" in r.stdout
    r = _script("start_mps.sh")
    assert r.returncode == 0 and "already running" in r.stderr
    assert (fake_mps / ".starts").read_text().count("started") == 1
    assert mps_daemon.mps_daemon_running() and mps_daemon.mps_daemon_running(str(fake_mps))
    assert mps_daemon.mps_server_pids() == [4242] and mps_daemon.mps_client_pids() == [111, 222]
    r = _script("kill_mps.sh")
    assert r.returncode == 0 and "stopped" in r.stderr, r.stderr
    r = _script("kill_mps.sh")
    assert r.returncode == 0 and "no MPS daemon running" in r.stderr
    assert not mps_daemon.mps_daemon_running()


def test_mps_python_wrappers(fake_mps):
    env = mps_daemon.start_mps_daemon(str(fake_mps), str(fake_mps.parent / "log"))
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(fake_mps)
    assert mps_daemon.mps_daemon_running(str(fake_mps))
    mps_daemon.stop_mps_daemon(str(fake_mps))
    assert not mps_daemon.mps_daemon_running(str(fake_mps))


def test_mps_scripts_without_binary(tmp_path):
    env = {"PATH": str(tmp_path), "USER": "t", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "p")}
    for name in ("start_mps.sh", "kill_mps.sh"):
        r = subprocess.run([shutil.which("bash") or "/bin/bash", str(SCRIPTS / name)], capture_output=True,
                           text=True, env=env, timeout=30)
        assert r.returncode == 2 and "nvidia-cuda-mps-control not found" in r.stderr


def test_mps_daemon_running_without_pipe(tmp_path):
    assert not mps_daemon.mps_daemon_running(str(tmp_path))


def test_require_mps_client_message(monkeypatch, tmp_path):
    monkeypatch.setattr(mps_daemon, "is_mps_client", lambda device=0: False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"serve\.partitioner=green needs the MPS daemon: start it with "
                                           r"scripts/start_mps.sh or `bullet-trt serve --mps on`; without "
                                           r"MPS two processes only time-slice"):
        mps_daemon.require_mps_client("decode")


# ----------------------------------------------------------------------------- doctor
def _records(smids, start, end, iters, gap=0, max_gap=100):
    return [[s, start, end, iters, max_gap, gap, s] for s in smids]


def test_doctor_verdicts():
    ms = 1_000_000
    alone_a = summarize(_records(range(0, 64), 0, 100 * ms, 1000))
    alone_b = summarize(_records(range(64, 132), 0, 100 * ms, 1000))
    a = summarize(_records(range(0, 64), 5 * ms, 105 * ms, 990))
    b = summarize(_records(range(64, 132), 6 * ms, 106 * ms, 995))
    v = compare(a, b, alone_a, alone_b, 64, 68)
    assert v["disjoint"] and v["concurrent"] and v["prefill_within_partition"]
    # time slicing: same windows, but each side descheduled half the time and half the work
    a = summarize(_records(range(0, 64), 5 * ms, 105 * ms, 500, gap=50 * ms, max_gap=2 * ms))
    b = summarize(_records(range(64, 132), 5 * ms, 105 * ms, 500, gap=50 * ms, max_gap=2 * ms))
    v = compare(a, b, alone_a, alone_b, 64, 68)
    assert v["disjoint"] and not v["concurrent"]
    # group + group: shared SMs
    b = summarize(_records(range(0, 64), 5 * ms, 105 * ms, 1000))
    v = compare(summarize(_records(range(0, 64), 5 * ms, 105 * ms, 1000)), b, alone_a, alone_b, 64, 68)
    assert not v["disjoint"] and v["shared_sm_ids"] == list(range(64))


def test_throughput_verdict():
    # H200 2026-11-21, 8192^3 bf16 GEMM loops in two MPS clients (docs/partitioning.md)
    v = throughput_verdict(384.5, 402.7, 276.9, 300.4, 197.4, 196.6)
    assert v["disjoint"] and v["concurrent"], v
    assert v["together_it_s"] == 577.3 and v["control_it_s"] == 394.0
    assert v["together_vs_control"] == pytest.approx(1.465, abs=1e-3)
    # shared SMs: together no better than the control
    v = throughput_verdict(384.5, 402.7, 200.0, 198.0, 197.4, 196.6)
    assert not v["disjoint"] and not v["concurrent"]
    # time slicing (no MPS): each side half of alone, sum = one side alone
    v = throughput_verdict(384.5, 402.7, 190.0, 200.0, 190.0, 195.0)
    assert not v["disjoint"] and not v["concurrent"]
    # one side starved although the sum is high
    v = throughput_verdict(384.5, 402.7, 150.0, 400.0, 197.4, 196.6)
    assert not v["disjoint"] and v["concurrent"]
    # the timed windows did not overlap: numbers are not "together"
    v = throughput_verdict(384.5, 402.7, 380.0, 400.0, 197.4, 196.6, window_overlap=0.1)
    assert not v["disjoint"] and not v["concurrent"]
    assert not throughput_verdict(0, 0, 0, 0, 0, 0)["disjoint"]


def _gemm_rec(rate, start=100.0, seconds=2.0):
    return {"iters": int(rate * seconds), "seconds": seconds, "it_per_s": rate, "tflops": round(rate * 0.137, 1),
            "start": start, "end": start + seconds}


def test_cross_process_report_format():
    """A cross-process result shaped like measure_cross_process's: verdict from throughput,
    overlapping SM ids only noted."""
    ms = 1_000_000
    pf = {"role": "prefill", "partition_sms": 64, "mps_client": True,
          "alone": summarize(_records(range(0, 64), 0, 100 * ms, 1000)),
          "both": summarize(_records(range(0, 64), 5 * ms, 105 * ms, 990)),
          "gemm": {"group_alone": _gemm_rec(2600.0, 10.0), "split": _gemm_rec(1900.0, 20.0),
                   "control": _gemm_rec(1330.0, 30.0)}}
    dc = {"role": "decode", "partition_sms": 68, "mps_client": True,
          "alone": summarize(_records(range(0, 68), 0, 100 * ms, 1000)),
          "both": summarize(_records(range(0, 68), 5 * ms, 105 * ms, 995)),
          "gemm": {"remainder_alone": _gemm_rec(2750.0, 15.0), "split": _gemm_rec(2000.0, 20.01),
                   "control": _gemm_rec(1320.0, 30.02)}}
    t = doctor.cross_throughput(pf, dc, 4096, 2.0)
    v = t["verdict"]
    assert v["disjoint"] and v["concurrent"] and v["window_overlap_fraction"] > 0.98, v
    assert t["it_per_s"]["split"] == {"prefill_group": 1900.0, "decode_remainder": 2000.0}
    sv = compare(pf["both"], dc["both"], pf["alone"], dc["alone"], 64, 68)
    assert not sv["disjoint"]  # what MPS's renumbered %smid shows
    m = {"mode": "two processes (MPS clients)", "split": {"prefill_sms": 64, "decode_sms": 68},
         "children": {"prefill": pf, "decode": dc}, "mps_clients": {"prefill": True, "decode": True},
         "smid_verdict": dict(sv, note=doctor.SMID_XP_NOTE), "throughput": t,
         "verdict": dict(v, probe_concurrent=sv["concurrent"])}
    text = "\n".join(doctor._measurement_lines(m))
    print(text)
    assert "1900.0 + 2000.0 = 3900.0" in text and "1330.0 + 1320.0 = 2650.0" in text
    assert "verdict (throughput): disjoint=True  concurrent=True" in text
    assert "renumbers" in text and "shared [0-63]" in text


def test_gemm_loop_on_cpu(monkeypatch):
    """The GEMM loop's start, stop and in-flight bookkeeping, with CPU tensors, fake CUDA events
    and a fake clock that only the GEMMs and the start wait move, so nothing here depends on
    how fast this machine is."""
    import contextlib

    import torch

    class Clock:
        def __init__(self, now):
            self.now, self.sleeps = now, 0

        def time(self):
            return self.now

        perf_counter = time

        def sleep(self, s):
            self.sleeps += 1
            self.now += s

    clock, log = Clock(100.0), []

    class Ev:
        made = 0

        def __init__(self):
            self.id, Ev.made = Ev.made, Ev.made + 1

        def record(self, stream=None):
            log.append(("record", self.id, clock.now))

        def synchronize(self):
            log.append(("sync", self.id))

    real_mm = torch.mm

    def mm(a, b, out=None):
        log.append(("mm", clock.now))
        clock.now += 1 / 64  # what one GEMM costs on the fake clock
        return real_mm(a, b, out=out)

    monkeypatch.setattr(doctor, "time", clock)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    ops = tuple(torch.ones((32, 32), dtype=torch.bfloat16) for _ in range(3))
    start_at, seconds, batch = 100.01, 0.5, 4
    r = doctor.gemm_loop(None, ops, seconds, start_at=start_at, batch=batch)

    # it waited for the common start, and no GEMM was queued before it
    mm_times = [e[1] for e in log if e[0] == "mm"]
    assert clock.sleeps > 0 and r["start"] >= start_at and min(mm_times) >= start_at
    # every queued GEMM is counted, in whole batches, and the GEMMs really ran
    records = [e for e in log if e[0] == "record"]
    n = len(records)
    assert len(mm_times) == r["iters"] == batch * n and n > 3
    assert float(ops[2][0, 0]) == 32.0
    # it stopped at the first batch queued once `seconds` had passed, not before or after
    assert records[-1][2] - r["start"] >= seconds > records[-2][2] - r["start"]
    # at most 3 batches wait in flight; each is synchronized once, oldest first, before it returns
    expected = []
    for k in range(n):
        expected.append(("record", k))
        if k >= 3:
            expected.append(("sync", k - 3))
    expected += [("sync", k) for k in range(n - 3, n)]
    assert [e[:2] for e in log if e[0] != "mm"] == expected
    # the report is the fake clock's span over the counted GEMMs
    span = clock.now - r["start"]
    assert r["seconds"] == round(span, 4) and r["it_per_s"] == round(r["iters"] / span, 1)
    assert r["end"] == r["start"] + span


def test_doctor_on_cpu(tmp_path, capsys):
    r = run_doctor("cpu")
    assert r["ok"] and r["gpu"] is None and r["partitioner_selected"] == "none"
    assert r["partitioners"]["none"]["available"] and not r["partitioners"]["green"]["available"]
    out = tmp_path / "doctor.json"
    assert doctor_main(["--device", "cpu", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["partitioner_selected"] == "none"
    assert "doctor: OK" in capsys.readouterr().out


# ----------------------------------------------------------------------------- GPU
@pytest.fixture
def green_parts():
    """green_parts() -> a GreenPartitioner closed after the test (MPS limits contexts)."""
    made = []

    def make():
        made.append(GreenPartitioner("cuda"))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _probe():
    from bullet_trt.tools.doctor import Probe

    try:
        return Probe("auto")
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@gpu
def test_green_split_counts(green_parts):
    pre, dec = green_parts(), green_parts()
    pre.prepare("prefill")
    dec.prepare("decode", [64])
    d = pre.describe()
    print(json.dumps(d))
    for s in d["splits"]:
        assert s["prefill_sms"] >= s["requested"] and s["prefill_sms"] + s["decode_sms"] == pre.total_sms
    assert dec.actual_sms(64) == pre.actual_sms(64)
    assert pre.stream(None) is not None and pre.stream(64) is not pre.stream(None)
    with pytest.raises(ValueError, match="not prepared"):
        dec.stream(32)


@pytest.mark.gpu
@gpu
def test_green_split_disjoint_in_one_process(green_parts):
    from bullet_trt.tools.doctor import measure_in_process

    pre, dec = green_parts(), green_parts()
    pre.prepare("prefill", [64])
    dec.prepare("decode", [64])
    m = measure_in_process(_probe(), pre, dec, 64, 50_000)
    print(json.dumps({k: v for k, v in m.items() if k not in ("prefill", "decode")}, default=str))
    v = m["verdict"]
    assert m["full_device_sms_seen"] > 0.9 * pre.total_sms
    assert v["disjoint"], v
    assert v["prefill_within_partition"] and v["decode_within_partition"], v
    assert m["prefill"]["n_sms"] > 0.5 * m["split"]["prefill_sms"]
    assert m["decode"]["n_sms"] > 0.5 * m["split"]["decode_sms"]
    assert v["concurrent"], v  # from the probe's own records (gaps, work), not wall time


@pytest.mark.gpu
@gpu
def test_native_smid_plain_api(green_parts):
    if not (native.native_dir() / native.SMID_LIB).exists():
        pytest.skip("libbullet_smid.so not built")
    import torch

    pre = green_parts()
    pre.prepare("prefill", [32])
    ids = native.smid_ids(pre.stream(32), 64, 1000)
    assert len(ids) == 64 and len(set(ids)) <= pre.actual_sms(32)[0]
    full = native.smid_ids(torch.cuda.current_stream(), 2 * pre.total_sms, 1000)
    assert max(full) < pre.total_sms * 2  # SM ids are small integers


@pytest.mark.gpu
@gpu
def test_triton_kernel_on_green_stream(green_parts):
    """Project kernels are Triton: they must run on a green-context stream."""
    triton = pytest.importorskip("triton")
    import torch
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    pre = green_parts()
    pre.prepare("prefill", [32])
    x = torch.zeros(10_000, device="cuda")
    torch.cuda.synchronize()
    s = pre.stream(32)
    with torch.cuda.stream(s):
        add_one[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), BLOCK=1024)
    s.synchronize()
    assert float(x.sum()) == 10_000.0


def _mps_child(env_extra: dict) -> dict:
    code = ("import json, torch; torch.zeros(1, device='cuda'); "
            "from bullet_trt.spatial.partitioners import mps_daemon as d; "
            "print(json.dumps(dict(d.mps_client_evidence(0), is_client=d.is_mps_client(0))))")
    env = {k: v for k, v in os.environ.items() if k != mps_daemon.ENV_PCT}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@gpu
def test_mps_client_detection(tmp_path):
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control not on PATH")
    pipe, log = mps_daemon.private_dirs()
    started = False
    if not mps_daemon.mps_daemon_running(pipe):
        mps_daemon.start_mps_daemon(pipe, log)
        started = True
    try:
        inside = _mps_child({"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log})
        outside = _mps_child({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})  # no daemon there
        print(json.dumps({"inside": inside, "outside": outside}))
        assert inside["is_client"] is True and inside["device_attribute_mps_enabled"] is True
        assert outside["is_client"] is False
        code = ("import torch; torch.zeros(1, device='cuda'); from bullet_trt.spatial.partitioners import mps_daemon; "
                "mps_daemon.require_mps_client('decode')")
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=120)
        assert r.returncode != 0 and "needs the MPS daemon" in r.stderr, r.stderr
    finally:
        if started:
            mps_daemon.stop_mps_daemon(pipe)


@pytest.mark.gpu
@gpu
def test_green_split_disjoint_across_mps_clients():
    """Prefill on the group, decode on the remainder of one split, in two MPS clients.

    %smid is renumbered per MPS client (H200: [0-63] and [0-67] for disjoint partitions), so
    the doctor judges disjointness by GEMM throughput against the control (both on the group).
    The thresholds of that verdict are checked on fixed numbers in test_throughput_verdict;
    here the order of the phases and the verdict's states are asserted, not rates or times."""
    if not mps_daemon.mps_daemon_running():
        pytest.skip("no MPS daemon at CUDA_MPS_PIPE_DIRECTORY (scripts/gpu_run.sh starts one)")
    from bullet_trt.tools.doctor import _throughput_lines, measure_cross_process

    m = measure_cross_process(0, 64, 50_000, _probe().kind, True, gemm_n=4096, gemm_seconds=1.5)
    assert "verdict" in m, json.dumps(m, default=str)[:4000]
    print("\n".join(_throughput_lines(m["throughput"])))
    print(json.dumps({"smid": m["smid_verdict"], "verdict": m["verdict"]}, default=str))
    assert all(m["mps_clients"].values()), m["mps_clients"]
    rec = m["throughput"]["records"]
    assert all(r["iters"] > 0 for side in rec.values() for r in side.values()), rec
    for phase in ("split", "control"):  # run side by side: each began before the other ended
        pf, dc = rec["prefill"][phase], rec["decode"][phase]
        assert pf["start"] < dc["end"] and dc["start"] < pf["end"], (phase, pf, dc)
    v = m["verdict"]
    assert v["disjoint"] is True, v
    assert v["concurrent"] is True, v
