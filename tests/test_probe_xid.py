"""The probe listens for NVML Xid events while its ranks run: the listener (``system.xid_events``) over the
real nvidia-ml-py and the fake driver's event symbols, the words a crashed check gains, and a whole probe
on CPU ranks whose planted crash meets an Xid 79 on its GPU.

CPU stand-ins drive no GPU, so a plain ``gputopo probe --device cpu`` does not listen (an Xid on the
machine's GPUs would say nothing about CPU ranks); the whole-probe test asks ``run_probe`` to listen
(``listen_xid=True``), so stand-in N is matched with the fake driver's GPU N.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import fake_driver
from gputopo.health.xid import xid_event_words

needs_cc = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def machine(tmp_path: Path, *extra: str) -> Path:
    path = tmp_path / "machine.txt"
    gpus = [f"gpu {i} {fake_driver.bus(i)} {fake_driver.uuid(i)} {i} NVIDIA H100 80GB HBM3" for i in range(4)]
    path.write_text("\n".join(["driver 570.86.15", "cuda 12080", *gpus, *extra]) + "\n")
    return path


LISTEN = """
import json, time
from gputopo.system.xid_events import XidWatch
with XidWatch([0, 1, 2, 3]) as watch:
    end = time.monotonic() + 20
    while len(watch.events()) < {want} and watch.why_not is None and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(0.3)
print(json.dumps({{"events": [[e.gpu, e.xid] for e in watch.events()], "registered": list(watch.registered),
                  "why_not": watch.why_not}}))
"""


@needs_cc
def test_the_listener_reports_each_xid_on_its_gpu(driver: Path, tmp_path: Path) -> None:
    path = machine(tmp_path, "xid 2 79 3", "xid 0 48 1", "noevents 3")
    done = fake_driver.run_python(driver, path, LISTEN.format(want=2), timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["events"] == [[0, 48], [2, 79]]
    assert got["registered"] == [0, 1, 2] and got["why_not"] is None  # GPU3 has no event support


@needs_cc
def test_without_a_driver_the_listener_says_why_and_reports_nothing(driver: Path, tmp_path: Path) -> None:
    done = fake_driver.run_python(driver, tmp_path / "none.txt", LISTEN.format(want=1), timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["events"] == [] and got["why_not"].startswith("NVML could not start")


def test_the_crashed_ranks_gpu_comes_first_and_other_sets_gpus_are_left_out() -> None:
    t = time.mktime((2026, 11, 25, 12, 3, 7, 0, 0, -1))
    events = [(4, 13, t - 5), (5, 79, t), (0, 79, t), (None, 31, t)]
    assert xid_event_words(events, (4, 5), first=5) == (
        "Xid 79 on GPU5 at 12:03:07 (GPU has fallen off the bus); Xid 13 on GPU4 at 12:03:02 "
        "(graphics engine exception)"
    )
    assert xid_event_words(events, (2, 3), first=3) is None


PROBE = """
import json
from pathlib import Path
from gputopo.probe.plan.config import DeviceInventory, Fault, build_config
from gputopo.probe.plan.options import Mode
from gputopo.probe.pool.runner import run_probe
config = build_config(DeviceInventory("cpu", tuple(range(4))), ["2,3"], mode=Mode.DDP, model="tiny", steps=4,
                      inject=Fault.CRASH, inject_rank=1, report_dir=Path({reports!r}))
run = run_probe(config, listen_xid=True)
[ddp] = [c for c in run.sets[0].checks if c.name == "ddp"]
print(json.dumps({{"kind": ddp.kind, "detail": ddp.detail, "xid": ddp.metrics.get("xid_events")}}))
"""


@needs_cc
@pytest.mark.slow
def test_a_crashed_rank_names_the_xid_of_its_gpu(driver: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # Rank 1 of the set (2,3) dies (--inject crash); the driver reports Xid 79 on GPU3 meanwhile, and an
    # Xid 13 on GPU0, which is not the set's.
    path = machine(tmp_path, "xid 3 79 2", "xid 0 13 1")
    done = fake_driver.run_python(driver, path, PROBE.format(reports=str(tmp_path / "reports")), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = json.loads(done.stdout.splitlines()[-1])
    assert ddp["kind"] == "crashed"
    assert ddp["detail"].startswith("rank 1 exited with")
    assert "; NVML reported Xid 79 on GPU3 at " in ddp["detail"]
    assert "GPU0" not in ddp["detail"] and ddp["xid"].startswith("Xid 79 on GPU3 at ")


WARN = """
import json
from gputopo.probe.plan.config import DeviceInventory, build_config
from gputopo.probe.pool import runner
seen = {{}}
def stand_in(config, on_progress, plan, view, sick, watch):  # the ranks need CUDA: not started here
    seen.update(sick=sick, listening=watch is not None)
runner._run_probe = stand_in
lines = []
config = build_config(DeviceInventory("cuda", (0, 1, 2, 3), ("0", "1", "2", "3")), ["0,1", "2,3"])
runner.run_probe(config, on_warning=lines.append)
print(json.dumps({{"lines": lines, "sick": seen["sick"], "listening": seen["listening"]}}))
"""


@needs_cc
def test_a_probe_on_gpus_warns_once_per_sick_gpu_and_listens(driver: Path, tmp_path: Path) -> None:
    from test_health_reads import healthy

    # One live sample judges states (a clocks event bit needs two samples, so it is not used here).
    lines = [*(line for i in range(4) for line in healthy(i)), "remap 1 0 2 0 1", "eccerr 3 0 1 0 1"]
    path = tmp_path / "sick.txt"
    path.write_text("\n".join(["driver 570.86.15", "cuda 12080", *lines]) + "\n")
    done = fake_driver.run_python(driver, path, WARN.format(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["lines"] == [
        "GPU1 has a health problem: a row remapping failed on GPU1 (2 rows remapped for uncorrectable "
        "errors); its results may show the fault, not the set",
        "GPU3 has a health problem: 1 uncorrectable ECC errors on GPU3 since the driver loaded; its results "
        "may show the fault, not the set",
    ]
    assert sorted(got["sick"]) == ["1", "3"] and got["listening"] is True
