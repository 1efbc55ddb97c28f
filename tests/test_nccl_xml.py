"""NCCL's own topology XML (NCCL_TOPO_DUMP_FILE) read into the model: real dumps, and hostile files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.errors import InputError
from gputopo.model import is_link_code
from gputopo.system.machine import load_topology
from gputopo.topology import snapshot
from gputopo.topology.nccl_xml import parse_nccl_xml, read_system

XML_DIR = "nccl-topo"


def _files(shared: Path) -> list[Path]:
    return sorted(p for p in (shared / XML_DIR).glob("*.xml") if not p.name.endswith(".graph.xml"))


def _load(shared: Path, prefix: str):
    (path,) = [p for p in _files(shared) if p.name.startswith(prefix)]
    return load_topology(str(path)), read_system(path.read_text(), str(path))


def _row(topo, label: str) -> dict[str, str | None]:
    i = topo.matrix.index_of(label)
    return dict(zip(topo.matrix.labels, topo.matrix.cells[i], strict=True))


def test_every_dump_has_the_gpus_and_nics_its_meta_file_counts(shared_fixtures):
    files = _files(shared_fixtures)
    assert len(files) >= 7
    for path in files:
        meta = json.loads(path.with_suffix(".meta.json").read_text())
        system = read_system(path.read_text(), str(path))
        topo = load_topology(str(path))
        assert len(topo.gpus) == len(system.gpus) == meta["gpus"], path.name
        assert system.physical_nics == meta["nics"], path.name
        assert topo.gpu_indices == tuple(range(meta["gpus"])), path.name
        n = len(topo.matrix.labels)
        assert all(len(row) == n for row in topo.matrix.cells)
        for i in range(n):  # a path is the same both ways, and every cell is a code nvidia-smi prints
            for j in range(n):
                assert topo.matrix.cells[i][j] == topo.matrix.cells[j][i]
                assert topo.matrix.link(topo.matrix.labels[i], topo.matrix.labels[j]) is not None


def test_hand_written_azure_ndv4_pairs_two_gpus_and_two_nics_per_switch(shared_fixtures):
    topo, system = _load(shared_fixtures, "01_")
    assert any("numbered in PCI bus order" in w for w in topo.warnings)
    # GPU0 is bus 0001 (numaid 1, cpus 24-47) and shares switch ffff:ff:02.0 with GPU1 and NICs 0101/0102.
    assert topo.gpu(0).pci_bus_id == "00000001:00:00.0"
    assert (topo.gpu(0).numa_affinity, topo.gpu(0).cpu_affinity) == ("1", "24-47")
    row = _row(topo, "GPU0")
    assert row["GPU1"] == "PIX" and row["GPU2"] == "SYS"
    assert sorted(k for k, v in row.items() if k.startswith("NIC") and v == "PIX") == ["NIC2", "NIC3"]
    assert not any(
        (c or "").startswith("NV") for r in topo.matrix.cells for c in r
    )  # NV12 is not in the file
    assert all(n.name is None for n in topo.nics)
    assert any("CPU: AMD" in w and "--socket-gbps 16" in w for w in topo.warnings)


def test_hand_written_azure_ndv5_each_gpu_has_its_own_nic_and_sockets_split(shared_fixtures):
    topo, _ = _load(shared_fixtures, "02_")
    for g in range(8):
        row = _row(topo, f"GPU{g}")
        assert [k for k, v in row.items() if v == "PIX"] == [f"NIC{g}"]
    assert _row(topo, "GPU0")["NIC1"] == "PHB" and _row(topo, "GPU0")["NIC4"] == "SYS"
    assert any("Intel model 143 (Sapphire Rapids)" in w and "--socket-gbps 22" in w for w in topo.warnings)
    assert topo.gpu(0).pcie.gen_max == 5 and topo.gpu(0).pcie.width_max == 16  # "32.0 GT/s PCIe" x16


def test_ncv4_nvlink_bridge_pairs_and_a_socket_nic_and_unrecorded_link_speed(shared_fixtures):
    topo, system = _load(shared_fixtures, "03_")
    assert topo.gpu_link(0, 1).code == "NV12" and topo.gpu_link(2, 3).code == "NV12"
    assert topo.gpu_link(0, 2).code == "SYS"
    assert [n.name for n in system.nics] == ["eth0"] and topo.nics == ()  # a socket NIC: not in the matrix
    assert any("eth0 is a socket NIC" in w for w in topo.warnings)
    assert any("link speed not recorded" in w and "Gen3" in w for w in topo.warnings)
    assert topo.gpu(0).pcie.gen_max is None and topo.gpu(0).pcie.width_max == 16  # link_width="0" -> x16


def test_ibm_h100_nvswitch_totals_and_its_one_lane_emulated_switches(shared_fixtures):
    topo, _ = _load(shared_fixtures, "04_")
    assert {topo.gpu_link(a, b).code for a in range(8) for b in range(8) if a != b} == {"NV18"}  # 4+5+5+4
    assert _row(topo, "GPU0")["NIC0"] == "PIX" and topo.nics[0].name == "mlx5_7"
    slow = [w for w in topo.warnings if w.startswith("PCIe link at")]
    assert len(slow) == 8
    assert "0000:a1:00.0 runs Gen1 x1 (0.19 GB/s)" in slow[0] and "GPU0 (Gen5 x16 (48 GB/s))" in slow[0]
    assert "emulated switch" in slow[0]


def test_hgx_a100_gpu_to_nic_is_pxb_like_a_dgx_and_nvswitch_gives_nv12(shared_fixtures):
    topo, _ = _load(shared_fixtures, "05_")
    assert topo.gpu_link(0, 7).code == "NV12"  # 2 links to each of 6 NVSwitches
    names = {n.label: n.name for n in topo.nics}
    row = _row(topo, "GPU0")
    assert [names[k] for k, v in row.items() if v == "PXB"] == ["mlx5_bond_1"]
    assert row["NIC0"] == "PHB"  # mlx5_bond_0 hangs off a root port of CPU 0
    assert row["NIC3"] == "SYS"
    assert not [w for w in topo.warnings if w.startswith("PCIe link at")]  # all Gen4 x16


def test_h200_vm_lists_its_socket_nic_once(shared_fixtures):
    topo, system = _load(shared_fixtures, "07_")
    assert [n.name for n in system.nics] == ["eth0"] and topo.nics == ()
    assert system.nics[0].cpus == (0, 1)
    assert topo.gpu_link(0, 4).code == "NV18"
    assert topo.gpu(4).numa_affinity == "1" and topo.gpu(4).cpu_affinity == "96-191"
    assert not any(w.startswith("CPU:") for w in topo.warnings)  # no GPU pair crosses the sockets by PCIe


def test_nccl_2_30_dump_two_ports_of_one_card_and_gpus_on_two_sockets(shared_fixtures):
    topo, system = _load(shared_fixtures, "10_")
    assert topo.gpu_link(0, 1).code == "SYS"
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"] and system.physical_nics == 1
    assert _row(topo, "GPU0")["NIC0"] == "PHB" and _row(topo, "GPU1")["NIC0"] == "SYS"
    assert any("PHB and NODE" in w for w in topo.warnings)
    assert any(
        "Intel model 106 (Skylake to Ice Lake)" in w and "--socket-gbps 10" in w for w in topo.warnings
    )


def test_a_graph_file_is_named_for_what_it_is(shared_fixtures):
    (graph,) = (shared_fixtures / XML_DIR).glob("*.graph.xml")
    with pytest.raises(InputError, match="NCCL graph file"):
        load_topology(str(graph))


def test_xml_input_round_trips_through_a_json_snapshot(shared_fixtures, tmp_path):
    (path,) = [p for p in _files(shared_fixtures) if p.name.startswith("05_")]
    result = invoke("topo", "--input", str(path), "--json")
    assert result.exit_code == 0, result.output
    saved = tmp_path / "snap.json"
    saved.write_text(result.stdout)
    again = load_topology(str(saved))
    assert again.matrix == load_topology(str(path)).matrix
    assert snapshot.to_dict(again)["gpus"] == json.loads(result.stdout)["gpus"]


def test_recommend_launch_on_an_nccl_dump_names_the_pxb_nic(shared_fixtures):
    (path,) = [p for p in _files(shared_fixtures) if p.name.startswith("05_")]
    result = invoke(
        "recommend", "--n", "2", "--input", str(path), "--launch", "t.py", "--nnodes", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["best"]["gpus"] == [0, 1]
    assert doc["launch"]["env"]["NCCL_IB_HCA"] == "=mlx5_bond_1"


# --- hostile and broken files ------------------------------------------------------------------------------

GOOD = """<system version="1"><cpu numaid="0" affinity="000000ff">
<pci busid="0000:13:00.0" class="0x030200" link_speed="16 GT/s" link_width="16"><gpu dev="0" sm="80"/></pci>
</cpu></system>"""


def test_a_minimal_dump_reads():
    topo = parse_nccl_xml(GOOD, "t.xml")
    assert topo.gpu(0).pci_bus_id == "00000000:13:00.0" and topo.gpu(0).cpu_affinity == "0-7"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>'
            "<system version=\"1\"><cpu name='&lol2;'/></system>",
            "DOCTYPE",
        ),
        (
            '<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]><system version="1">&x;</system>',
            "DOCTYPE",
        ),
        ("<system version='1'><cpu>", "not well-formed XML (line 1"),
        ("<topology/>", "root element is <topology>"),
        ('<system version="1"/>', "no <cpu>"),
        (GOOD.replace('dev="0"', 'dev="zero"'), "line 2: <gpu dev='zero'> is not a number"),
        (
            GOOD.replace("</cpu>", '<pci busid="0000:14:00.0" class="0x030200"><gpu dev="0"/></pci></cpu>'),
            "dev=0",
        ),
        (GOOD.replace('busid="0000:13:00.0"', 'busid="nope"'), "without a valid busid"),
        ("<system version='1'>" + "<pci>" * 100 + "</pci>" * 100 + "</system>", "too deeply nested"),
        ('<system version="1"><cpu numaid="0"/></system>', "lists no GPU"),
    ],
)
def test_hostile_or_broken_xml_is_one_clear_input_error(text, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_nccl_xml(text, "t.xml")


def test_the_cli_gives_one_line_and_exit_2_for_an_entity_bomb(tmp_path):
    bomb = tmp_path / "bomb.xml"
    bomb.write_text(
        '<!DOCTYPE s [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]><system>&b;</system>'
    )
    result = invoke("topo", "--input", str(bomb))
    assert result.exit_code == 2
    assert "DOCTYPE" in result.stderr and "Traceback" not in result.output


def test_a_topo_paste_that_begins_with_html_tags_is_still_read_as_text(shared_fixtures):
    (paste,) = (shared_fixtures / "topo").glob("28_*.txt")
    assert paste.read_text().startswith("<p>")
    topo = load_topology(str(paste))
    assert topo.gpu_link(0, 1).code == "PHB"


def test_xml_is_recognised_by_its_start_whatever_the_file_is_called(tmp_path):
    path = tmp_path / "dump.txt"
    path.write_text("\ufeff\n  " + GOOD)
    assert load_topology(str(path)).gpu(0).pci_bus_id == "00000000:13:00.0"


@pytest.mark.parametrize(
    ("attrs", "gbps"),
    [
        ({"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "207"}, 40),
        ({"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "143"}, 22),
        ({"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "85"}, 10),
        ({"arch": "x86_64", "vendor": "GenuineIntel", "familyid": "6", "modelid": "79"}, 6),
        ({"arch": "x86_64", "vendor": "AuthenticAMD", "familyid": "143", "modelid": "49"}, 16),
        ({"arch": "arm64"}, 6),
        ({"arch": "ppc64"}, 32),
    ],
)
def test_the_socket_link_figure_follows_nccls_cpu_classes(attrs, gbps):
    from gputopo.topology.nccl_xml import _socket_note

    assert f"--socket-gbps {gbps} " in _socket_note((attrs,))


def test_an_unknown_cpu_gets_no_socket_figure():
    from gputopo.topology.nccl_xml import _socket_note

    assert _socket_note(({"arch": "x86_64", "vendor": "CentaurHauls"},)) is None
    assert _socket_note(()) is None


def test_damaged_dumps_give_a_topology_or_one_input_error_never_a_crash(shared_fixtures):
    """Cut and splice real dumps, and poison each kind of attribute: a Topology or an InputError, always."""
    import random

    rng = random.Random(16)
    poisons = [
        "",
        "-1",
        "inf",
        "nan",
        "1e999",
        "0x",
        "99999999999999999999",
        "ffff:ff:ff.f",
        "&amp;",
        "\u00e9",
    ]
    names = [
        "dev",
        "count",
        "sm",
        "speed",
        "link_width",
        "link_speed",
        "numaid",
        "affinity",
        "busid",
        "target",
    ]
    names += ["class", "tclass", "version", "name", "modelid"]
    mutants: list[str] = []
    for text in (p.read_text() for p in _files(shared_fixtures)):
        for name in names:
            for poison in poisons:
                mutants.append(re.sub(rf'\b{name}="[^"]*"', f'{name}="{poison}"', text, count=1))
        lines = text.splitlines()
        for _ in range(20):
            mutants.append(text[: rng.randrange(len(text))])
            k = rng.randrange(len(lines))
            mutants.append("\n".join(lines[:k] + lines[k + 1 + rng.randrange(2) :]))
    for mutated in mutants:
        try:
            topo = parse_nccl_xml(mutated, "damaged.xml")
        except InputError as exc:
            assert exc.message.startswith("damaged.xml")
            continue
        for row in topo.matrix.cells:  # what reads back is still a matrix topo -m could print
            assert len(row) == len(topo.matrix.labels)
            assert all(c is not None and is_link_code(c) for c in row)
    assert len(mutants) > 1000


def test_out_of_range_numbers_are_refused():
    with pytest.raises(InputError, match="out of range"):
        parse_nccl_xml(GOOD.replace('dev="0"', 'dev="-5"'), "t.xml")
    with pytest.raises(InputError, match="not a number"):
        parse_nccl_xml(GOOD.replace('dev="0"', 'dev="inf"'), "t.xml")
    many = '<nvlink target="0000:c0:00.0" count="40" tclass="0x068000"/>' * 2
    with pytest.raises(InputError, match="more than 64 NVLinks"):
        parse_nccl_xml(GOOD.replace('sm="80"/>', f'sm="80">{many}</gpu>'), "t.xml")
