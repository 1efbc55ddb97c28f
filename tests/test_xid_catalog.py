"""NVIDIA's Xid catalogue as data (health/xid_catalog.json) and the NVLink5 Xids 144-150 decoded from their
registers with its "XID 144-150 Decode" sheet
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from importlib import resources

import pytest

import fake_driver
from gputopo.findings import NOTE, PROBLEM
from gputopo.health import xid
from gputopo.health.xid_catalog import EITHER, V1, V2, bucket_words, catalog, decode_nvlink5

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
GPUS = [(0, "00000000:18:00.0")]


def _doc() -> dict:  # type: ignore[type-arg]
    return json.loads(resources.files("gputopo.health").joinpath("xid_catalog.json").read_text())


def findings(line: str, driver: str | None = None) -> list:  # type: ignore[type-arg]
    found = xid.scan(f"[ 10000.0] {line}\n", None, uptime_s=10_800.0, now=NOW)
    return xid.xid_findings(found, GPUS, driver=driver)


# --- the data file and the table ---------------------------------------------------------------------------


def test_the_data_file_holds_every_code_1_to_172_and_equals_the_table() -> None:
    doc = _doc()
    assert doc["source"] == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
    codes = [e["xid"] for e in doc["xids"]]
    assert codes == list(range(1, 173))
    for e in doc["xids"]:
        ours = xid.XID_TABLE[e["xid"]]
        assert e["mnemonic"] and e["description"], e
        assert (e["gputopo"]["kind"], e["gputopo"]["severity"], e["gputopo"]["action"]) == (
            ours.kind,
            ours.severity,
            ours.action,
        ), f"Xid {e['xid']}: xid_catalog.json and health.xid.XID_TABLE disagree"
        for bucket in (e["immediate"], e["investigatory"]):
            assert bucket is None or bucket in doc["buckets"], (e["xid"], bucket)
        # Where the catalogue gives no bucket, the data says so rather than inventing one.
        assert e["immediate"] is not None or "no resolution" in e["note"], e
    for row in doc["decode"]["rows"]:
        assert row["immediate"] in doc["buckets"] and row["investigatory"] in doc["buckets"], row


def test_codes_the_catalogue_knows_are_no_longer_unknown_notes() -> None:
    for code in (8, 46, 151, 159, 167):
        (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, pid=1, x")
        assert f.rule != "xid_unknown", code
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 46, pid=1, GPU stopped processing")
    assert (f.severity, f.action) == (PROBLEM, "reset")  # the catalogue: RESET_GPU
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 8, pid=1, x")
    assert (f.severity, f.rule) == (NOTE, "xid_application")  # RESTART_APP
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 2, pid=1, x")
    assert f.severity == NOTE and "unused on Ampere" in f.remedy
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 173, pid=1, a code past the catalogue")
    assert f.rule == "xid_unknown"


def test_power_smoothing_xids_162_165_are_notes_with_the_catalogues_words() -> None:
    for code in range(162, 166):
        assert catalog()[code].mnemonic.startswith("PSHC_")
        (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, Power smoothing event")
        assert (f.severity, f.action) == (NOTE, "monitor"), code
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 165, Power smoothing event")
    assert "replace the GPU if the swings are not acceptable" in f.remedy
    (f,) = findings("NVRM: Xid (PCI:0000:18:00): 163, Power smoothing event")
    assert "No GPU reset".lower() in f.remedy.lower()


# --- the decode sheet's own rows ---------------------------------------------------------------------------


def _rows() -> list[dict]:  # type: ignore[type-arg]
    return list(_doc()["decode"]["rows"])


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{r['xid']}-{r['unit']}-{r['reason']}")
def test_every_row_of_the_decode_sheet_decodes_to_its_bucket_in_both_layouts(row: dict) -> None:  # type: ignore[type-arg]
    reason = int(row["reason"], 2) << 20
    status = int(row.get("status_bit") or row.get("status_value") or "0", 16)
    for driver, unit, version in (
        ("570.124.06", int(row["v1"], 2), V1),
        ("575.57.08", int(row["v2"], 2), V2),
    ):
        text = (
            f"{row['unit'].split('/')[0]} Fatal XC0 i0 Link 07 ({reason | unit:#010x} {status:#010x} 0x0 0x0)"
        )
        d = decode_nvlink5(row["xid"], text, driver)
        assert d.decoded, (row, driver, d.why)
        assert (d.immediate, d.investigatory, d.version, d.link) == (
            row["immediate"],
            row["investigatory"],
            version,
            7,
        )
        if "promoted" in row:  # IntrInfo[10] (V1) or [7] (V2) promotes the row to its "Action 2"
            bit = 1 << (10 if version == V1 else 7)
            name = row["unit"].split("/")[0]
            text = f"{name} Nonfatal XC0 i0 Link 07 ({reason | unit | bit:#010x} {status:#010x})"
            assert decode_nvlink5(row["xid"], text, driver).immediate == row["promoted"]


# --- real lines from public reports ------------------------------------------------------------------------

# (Xid, the line's text after the code, the layout its registers follow, the sheet's immediate and
# investigatory buckets, the name gpud and NVSentinel give it)
REAL_LINES = [
    # https://github.com/leptonai/gpud/pull/1174 (a GB200's NETIR interrupt, link -1)
    (149, "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     V1, "RESET_GPU", "SYMPATHETIC_REPORT_SOLO", "Xid 149.0"),
    # https://github.com/leptonai/gpud/pull/1174 and https://github.com/leptonai/gpud/pull/1160
    # (link-down reason 100101 = 37: the peer went down; gpud's tests name it "XID 149.37")
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V1, "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Xid 149.37"),
    # https://github.com/leptonai/gpud/pull/1174
    (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 "
     "0x00000004)", V1, "IGNORE", "CONTACT_SUPPORT", "Xid 145.0"),
    # https://github.com/leptonai/gpud/pull/1160 (the R575 layout: the unit in IntrInfo[6:0])
    (144, "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V2, "IGNORE", "CONTACT_SUPPORT", "Xid 144.0"),
    # https://github.com/NVIDIA/NVSentinel/issues/1357 (an R575+ layout line, cut before its ")"; DCGM's
    # diagnostic called it fatal, the sheet says XID_154_EVAL: non-fatal)
    (145, "RLW_SRC_TRACK Nonfatal XC1 i0 Link 17 (0x04084507 0x00000004 0x00000000 0x00000000 0x00000000 "
     "0x00000000", V2, "XID_154_EVAL", "IGNORE", "Xid 145.0"),
    # https://github.com/leptonai/gpud/pull/1160 (link-down reason 100110 = 38, gpud's "XID 149.38")
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V1, "IGNORE", "INVESTIGATE_SW/USER", "Xid 149.38"),
    # gpud's xid tests (leptonai/gpud #1160, "subcode 4 (cartridge error)"): reason 000100
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V1, "RESET_GPU", "INVESTIGATE_LINK_SI", "Xid 149.4"),
    # NVSentinel's syslog-health-monitor tests (two spaces after the unit, as the driver pads it): reason
    # 100001 = 33
    (149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V1, "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Xid 149.33"),
    # A NIXL fault-injection note on driver 570.158.01 (Xid 149, then 45, then 154 "GPU Reset Required"):
    # reason 010110 = 22
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x016415c6 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", V1, "RESET_GPU", "INVESTIGATE_SW_USER", "Xid 149.22"),
    # gpud's xid tests: Xid 150's unit field is 0 in both layouts
    (150, "MSE_WATCHDOG Fatal XC0 i0 Link 00 (0x00000000 0x00000000 0x00000000 0x00000000)",
     EITHER, "RESET_GPU", "CONTACT_SUPPORT", "Xid 150.0"),
]  # fmt: skip


@pytest.mark.parametrize("code,text,version,immediate,investigatory,name", REAL_LINES)
@pytest.mark.parametrize("driver", ["570.158.01", "580.65.06", None])
def test_real_nvlink5_lines_decode_alike_on_any_driver_to_the_sheets_bucket(
    code: int, text: str, version: str, immediate: str, investigatory: str, name: str, driver: str | None
) -> None:
    d = decode_nvlink5(code, text, driver)
    assert d.decoded, d.why
    assert (d.immediate, d.investigatory, d.name) == (immediate, investigatory, name)
    if version != EITHER or driver is None:  # a tie is broken by the driver, with the same verdict
        assert d.version == version
    (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, {text}", driver)
    assert f.what.startswith(name + " ") and investigatory in f.what and text in f.what
    assert "not decoded" not in f.what and "subcode" not in f.what
    if immediate == "RESET_GPU":
        assert (f.severity, f.action) == (PROBLEM, "reset")
    else:  # the IGNORE-bucket lines: a note, never a drain
        assert (f.severity, f.action) == (NOTE, "none")


def test_a_peer_devices_fault_says_the_far_end_reported_it() -> None:
    line = REAL_LINES[1][1]
    (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): 149, {line}", "570.133.20")
    assert "Xid 149.37" in f.what and "link-down reason 100101" in f.what and "on link 0" in f.what
    assert "unit NETIR_LINK_EVT" in f.what
    assert bucket_words("INVESTIGATE_PEER_DEVICE") in f.remedy and "switch tray" in f.remedy


def test_a_line_in_the_other_layout_than_the_running_driver_is_decoded_and_says_so() -> None:
    # The unit field moved at R575; a journal from before a driver upgrade (or another host's log) keeps
    # the old layout, and the printed unit name tells which.
    d = decode_nvlink5(149, REAL_LINES[1][1], "580.65.06")
    assert d.decoded and d.version == V1 and d.driver_layout == V2
    assert "logged before a driver upgrade or on another host" in d.words()
    d = decode_nvlink5(144, REAL_LINES[3][1], "570.86.15")
    assert d.decoded and d.unit == "SAW_MVB" and d.version == V2 and d.driver_layout == V1
    assert decode_nvlink5(149, REAL_LINES[1][1], "570.86.15").driver_layout == ""


def test_the_driver_only_breaks_a_tie_between_the_layouts() -> None:
    line = "MSE Degraded Fatal XC0 i0 Link 03 (0x00000000 0xffffffff)"
    assert decode_nvlink5(150, line, "570.86.15").version == V1
    assert decode_nvlink5(150, line, "580.65.06").version == V2
    d = decode_nvlink5(150, line)
    assert d.decoded and d.version == EITHER and d.immediate == "RESET_GPU"


def test_the_printed_unit_must_be_the_rows_unit() -> None:
    # 0x025001c6 is NETIR_LINK_EVT's field in the old layout; printed as another unit, no row reads it.
    d = decode_nvlink5(149, "NETIR_BER_EVENT Nonfatal XC0 i0 Link 00 (0x025001c6 0x00000000)")
    assert not d.decoded
    assert "layout before R575: unit field" in d.why and "layout R575 or later: unit field" in d.why
    assert not decode_nvlink5(149, "SAW_MVB Fatal XC0 i0 Link 0 (0x025001c6 0x0)").decoded


@pytest.mark.parametrize(
    "text",
    [
        "NETIR_LINK_DOWN Nonfatal XC1 i2 Link 17 (0xdeadbeef)",  # one register (NVSentinel's tests)
        "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000040)",  # a bit the sheet has no row for
        "something the driver never wrote",
    ],
)
def test_an_undecodable_line_says_not_decoded_and_is_judged_by_its_codes_bucket(text: str) -> None:
    code = 149 if "NETIR" in text else 144
    (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, {text}", "580.65.06")
    assert "not decoded" in f.what and text in f.what
    assert (f.severity, f.action) == (PROBLEM, "reset")  # the sheet's rows for it ask for a reset
    assert "ask for a reset" in f.remedy


def test_an_undecodable_line_of_a_code_the_sheet_always_ignores_is_a_note() -> None:
    # Every row of Xid 147 (TREX) and 148 (NVLPW_CTRL) says IGNORE: not decoding one is no reason to drain.
    for code, text in ((147, "TREX Nonfatal XC0 i0 Link 2 (0x0000000e 0x00000040)"), (148, "NVLPW junk")):
        (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, {text}", "580.65.06")
        assert "not decoded" in f.what and (f.severity, f.action) == (NOTE, "none"), f
    d = decode_nvlink5(147, "TREX Nonfatal XC0 i0 Link 2 (0x0000000e 0x00000040)")
    assert "layout before R575" in d.why and "layout R575 or later" in d.why  # both layouts were tried


def test_one_finding_per_gpu_and_code_judged_by_its_most_urgent_line() -> None:
    log = "".join(
        f"[ 1000{n}.0] NVRM: Xid (PCI:0000:18:00): 149, {t}\n"
        for n, t in enumerate((REAL_LINES[5][1], REAL_LINES[1][1], REAL_LINES[5][1]))
    )
    (f,) = xid.xid_findings(xid.scan(log, None, uptime_s=10_800.0, now=NOW), GPUS, driver="570.133.20")
    assert f.severity == PROBLEM and "INVESTIGATE_PEER_DEVICE" in f.what and "3 times" in f.what


# --- check --list-rules ------------------------------------------------------------------------------------


def test_list_rules_lists_the_catalogue_text_and_json() -> None:
    env = {**os.environ, "PYTHONPATH": str(fake_driver.SRC)}

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gputopo", "check", "--list-rules", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = run()
    assert "Xid 149 NVLINK_NETIR_ERROR" in text and "decided per line" in text
    assert "Xid 164 PSHC_LOW_LIFETIME" in text
    rows = {r["xid"]: r for r in json.loads(run("--json"))["xids"]}
    assert sorted(rows) == list(range(1, 173)) + [] or set(range(1, 173)) <= set(rows)
    assert rows[79]["immediate"] == "RESTART_BM" and rows[79]["action"] == "drain"
    assert rows[167]["immediate"] is None and "no resolution" in rows[167]["catalogue_note"]


# --- check reads the driver version from NVML and decodes by it ----------------------------------------


def test_check_decodes_an_old_layout_nvlink5_line_alike_on_a_570_and_a_580_driver(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_health_reads import healthy

    driver = fake_driver.build(tmp_path / "driver")
    log = tmp_path / "kern.log"
    # gpud #1160's line: link-down reason 100110, IGNORE in the layout before R575, whatever driver runs.
    log.write_text(f"NVRM: Xid (PCI:0000:28:00): 149, {REAL_LINES[5][1]}\n")
    verdicts = {}
    for version in ("570.86.15", "580.65.06"):
        machine = tmp_path / f"machine-{version}.txt"
        machine.write_text("\n".join([f"driver {version}", "cuda 12080", *healthy(0), *healthy(1)]) + "\n")
        done = fake_driver.run(
            driver, machine, "check", "--json", "--sample-s", "0.2", "--kernel-log", str(log)
        )
        (f,) = [f for f in json.loads(done.stdout)["findings"] if "Xid 149" in f["what"]]
        verdicts[version] = (done.returncode, f["severity"], "not decoded" in f["what"], f["what"][:10])
    assert verdicts == {
        "570.86.15": (0, NOTE, False, "Xid 149.38"),
        "580.65.06": (0, NOTE, False, "Xid 149.38"),
    }


# --- remedies and DCGM parity (issue 42) ---------------------------------------------------------------


def test_xid_45_alone_says_restart_the_fabric_manager_and_with_another_follows_that() -> None:
    # The catalogue's WORKFLOW_XID_45: "Solo: RESTART_FM Not Solo: IGNORE (follow other Xid)". The line is
    # the NIXL fault-injection note's ("CUDA channels killed, caused by previous Xid 149") shape.
    line45 = "NVRM: Xid (PCI:0000:18:00): 45, pid=4242, name=python, Ch 00000008"
    (f,) = findings(line45)
    assert f.severity == NOTE and "restart the fabric manager" in f.remedy
    assert "nvidia-fabricmanager" in f.remedy and "WORKFLOW_XID_45" in f.remedy
    log = (
        f"[ 9000.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.\n[ 9001.0] {line45}\n"
    )
    out = xid.xid_findings(xid.scan(log, None, uptime_s=10_800.0, now=NOW), GPUS)
    (f45,) = [x for x in out if x.what.startswith("Xid 45")]
    assert "follows Xid 79 on this GPU" in f45.remedy and "fabric manager" not in f45.remedy
    # An Xid 79 on another GPU does not count: 45 is alone on its own GPU.
    other = [(0, "00000000:18:00.0"), (1, "00000000:2A:00.0")]
    log = f"[ 9000.0] NVRM: Xid (PCI:0000:2a:00): 79, pid=1, x\n[ 9001.0] {line45}\n"
    out = xid.xid_findings(xid.scan(log, None, uptime_s=10_800.0, now=NOW), other)
    (f45,) = [x for x in out if x.what.startswith("Xid 45")]
    assert "restart the fabric manager" in f45.remedy


def test_the_parity_text_says_what_dcgm_really_does_for_92_and_93() -> None:
    # NVIDIA/DCGM modules/health/DcgmHealthWatch.cpp at 72fa3fe, BuildXidMappings: no 92 at all; 93 only
    # with DCGM_CHIP_ARCH_VOLTA (line 3434).
    assert xid.XID_TABLE[92].dcgm == "none" and "maps no Xid 92" in xid.XID_TABLE[92].why
    assert "DCGM warns" not in xid.XID_TABLE[92].remedy
    assert "only on Volta" in xid.XID_TABLE[93].why
    assert xid.dcgm_xid_source(93).endswith("line 3434 at 72fa3fe")
    assert "maps no such code" in xid.dcgm_xid_source(92)


def test_xid_167_and_169_have_rows_of_their_own_169_as_62() -> None:
    for code in (167, 169):
        (f,) = findings(f"NVRM: Xid (PCI:0000:18:00): {code}, pid=1, x")
        assert (f.severity, f.action, f.rule) == (PROBLEM, "reset", "xid_hardware"), code
    assert (xid.XID_TABLE[169].severity, xid.XID_TABLE[169].action) == (
        xid.XID_TABLE[62].severity,
        xid.XID_TABLE[62].action,
    )
    assert "62" in xid.XID_TABLE[169].why
