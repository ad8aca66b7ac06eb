"""Where a rank runs (`measure.placement`), the clocks (`measure.clock`) and the environment record,
on this CPU machine. The CUDA branch's *decision* is checked through `choose_placement` (a pure function);
nothing here pretends to execute on CUDA."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

torch = pytest.importorskip("torch")

from measure.clock import HostBoundaryClock, boundary_clock  # noqa: E402
from measure.placement import (  # noqa: E402
    BACKEND_ENV,
    CPU_PLACEMENT,
    Placement,
    PlacementError,
    backend_request,
    check_ds_accelerator,
    choose_placement,
    environment_record,
    local_rank_of,
    place_rank,
)
from measure.train import TrainConfig, TrainError, placed_config  # noqa: E402

CUDA = Placement("cuda:1", "nccl", 1, "CUDA available: 2 device(s)")


def test_no_cuda_places_on_cpu_with_gloo() -> None:
    placement = choose_placement(False, 3, {}, 0)
    assert (placement.device, placement.backend, placement.local_rank) == ("cpu", "gloo", 3)
    assert not placement.cuda and placement.ds_accelerator == "cpu"
    assert placement.note() == "ranks placed on the CPU with gloo (no CUDA device)"


def test_cuda_places_on_the_local_rank_gpu_with_nccl() -> None:
    placement = choose_placement(True, 1, {}, 2)
    assert (placement.device, placement.backend) == ("cuda:1", "nccl")
    assert placement.cuda and placement.ds_accelerator == "cuda" and placement.device_type == "cuda"
    assert "nccl" in placement.note() and f"{BACKEND_ENV}=gloo" in placement.note()
    assert choose_placement(True, 0, {BACKEND_ENV: "nccl"}, 1).backend == "nccl"
    assert choose_placement(True, 0, {BACKEND_ENV: "auto"}, 1).backend == "nccl"


def test_gloo_override_keeps_a_cuda_machine_on_cpu() -> None:
    placement = choose_placement(True, 0, {BACKEND_ENV: "gloo"}, 8)
    assert (placement.device, placement.backend) == ("cpu", "gloo")
    assert f"{BACKEND_ENV}=gloo" in placement.note()


def test_more_local_ranks_than_gpus_is_one_line() -> None:
    with pytest.raises(PlacementError, match=r"^LOCAL_RANK=2, but this node has 2 visible CUDA device"):
        choose_placement(True, 2, {}, 2)


@pytest.mark.parametrize("value", ["NCCL", "mpi", "cuda", "1"])
def test_bad_backend_value_names_variable_value_and_choices(value: str) -> None:
    with pytest.raises(PlacementError) as error:
        backend_request({BACKEND_ENV: value})
    message = str(error.value)
    assert "\n" not in message
    assert message == f"{BACKEND_ENV}={value!r}: expected one of auto, gloo, nccl"
    assert isinstance(error.value, TrainError)  # the CLI prints TrainError in one line, no traceback


def test_nccl_without_cuda_is_one_line() -> None:
    with pytest.raises(PlacementError, match=rf"^{BACKEND_ENV}=nccl, but CUDA is not available"):
        choose_placement(False, 0, {BACKEND_ENV: "nccl"}, 0)


def test_backend_request_defaults_and_local_rank() -> None:
    assert backend_request({}) == "auto" and backend_request({BACKEND_ENV: " "}) == "auto"
    assert local_rank_of({}) == 0 and local_rank_of({"LOCAL_RANK": "5"}) == 5
    with pytest.raises(PlacementError, match=r"^LOCAL_RANK='x': expected an integer >= 0$"):
        local_rank_of({"LOCAL_RANK": "x"})


def test_place_rank_on_this_machine_is_cpu_gloo(monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without CUDA")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    placement = place_rank({"LOCAL_RANK": "0"})
    assert (placement.device, placement.backend) == ("cpu", "gloo")


def test_train_says_the_placement_on_the_console(monkeypatch, capsys) -> None:
    """`ciera train` prints the placement before any rank starts (validate fails right after, cheaply)."""
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without CUDA")
    import measure.train as train_module

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(train_module, "validate", lambda cfg: (_ for _ in ()).throw(TrainError("stop")))
    with pytest.raises(TrainError, match="stop"):
        train_module.train(TrainConfig())
    assert "ciera train: ranks placed on the CPU with gloo (no CUDA device)" in capsys.readouterr().err


def test_ds_accelerator_must_match_the_placement() -> None:
    assert check_ds_accelerator(CPU_PLACEMENT, {}) == "cpu"
    assert check_ds_accelerator(CUDA, {"DS_ACCELERATOR": "cuda"}) == "cuda"
    with pytest.raises(PlacementError, match=r"^DS_ACCELERATOR='cpu', but the ranks are placed on cuda"):
        check_ds_accelerator(CUDA, {"DS_ACCELERATOR": "cpu"})


def test_ciera_on_cuda_takes_the_device_gather_and_says_so() -> None:
    cfg = TrainConfig(ciera=True)
    assert placed_config(cfg, CPU_PLACEMENT) == (cfg, None)
    placed, note = placed_config(cfg, CUDA)
    assert placed == dataclasses.replace(cfg, device_gather=True)
    assert note is not None and "device gather" in note
    placed.check()  # a valid configuration
    assert placed_config(dataclasses.replace(cfg, ciera=False), CUDA)[1] is None
    with pytest.raises(TrainError, match=r"^select is on, but on CUDA ranks CIERA runs its device path"):
        placed_config(dataclasses.replace(cfg, select=True), CUDA)


# ---------------------------------------------------------------------------------------- clocks


def test_cpu_boundary_clock_is_the_host_clock() -> None:
    clock = boundary_clock(CPU_PLACEMENT)
    assert isinstance(clock, HostBoundaryClock) and not clock.device
    before_s = time.perf_counter()
    start_s, now_s = clock.begin(), clock()
    assert before_s <= start_s <= now_s <= time.perf_counter()
    assert clock.finish()(now_s) == now_s


# ---------------------------------------------------------------------------------------- environment


def test_environment_record_on_cpu_says_no_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without CUDA")
    record = environment_record(CPU_PLACEMENT, {"LOCAL_WORLD_SIZE": "2"})
    assert record["device"] == "cpu" and record["backend"] == "gloo"
    assert record["driver"] == "no CUDA" and record["nccl"] == "no CUDA"
    assert record["gpus_per_node"] == 0 and record["local_world_size"] == 2
    assert record["cpu_cores"] >= 1 and record["cpu_model"]
    assert record["device_name"] == f"cpu: {record['cpu_model']}"
    assert record["torch_cuda"]  # torch's CUDA runtime version, or why there is none
    json.dumps(record)  # goes into JSON documents as is


def test_host_description_carries_the_environment() -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without CUDA")
    from measure.capture import host_description

    description = host_description()
    assert description["hardware"].startswith("cpu")
    assert description["backend"] == "gloo"
    versions = json.loads(description["versions"])
    assert versions["device"] == "cpu" and versions["nccl"] == "no CUDA" and versions["gpus_per_node"] == 0
    assert versions["host_cpus"] >= 1


class _KeyedClock(HostBoundaryClock):
    """CudaBoundaryClock's contract without a GPU: each boundary returns a key (a tick), and ``finish()``
    maps every key to its 'device' time (here: 1,000 + 10 x tick)."""

    def __init__(self) -> None:
        self.ticks = iter(range(1, 100))
        self.keys: list[float] = []

    def begin(self) -> float:
        return 0.5

    def __call__(self) -> float:
        self.keys.append(float(next(self.ticks)))
        return self.keys[-1]

    def finish(self):
        times_s = {key: 1000.0 + 10 * key for key in self.keys}
        return lambda value_s: times_s.get(value_s, value_s)


def test_event_recorder_reads_its_boundaries_with_the_clock_it_is_given_and_resolves_them() -> None:
    """On CUDA the recorder is given a CudaBoundaryClock (events, resolved at the iteration's end); a clock
    with the same contract stands in for it: every boundary comes from that clock, and every time the
    iteration keeps is the resolved one."""
    from measure.events import EventRecorder, finish_events

    clock = _KeyedClock()
    recorder = EventRecorder()  # not installed: no collective is wrapped, only the segments are recorded
    recorder.use_clock(clock)
    with recorder.iteration(0) as log:
        with recorder.phase("fwd"):
            pass
        with recorder.phase("optim"):
            pass
    assert log.start_s == 0.5 and log.end_s == float(max(event.end_s for event in finish_events(log)))
    boundaries = sorted({t for event in log.events for t in (event.start_s, event.end_s)})
    # The anchor, then resolved boundaries only: no key survives.
    assert boundaries == [0.5] + [1000.0 + 10 * key for key in clock.keys[: len(boundaries) - 1]]
    assert log.end_s == 1000.0 + 10 * clock.keys[-1]
    assert {event.stream for event in log.events} == {"compute", "optim"}
