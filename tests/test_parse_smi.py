"""``nvidia-smi topo -m`` / ``-p2p`` text parsing: real captured pastes, then one small input per variant.

The captured outputs live in ``../shared/fixtures/topo`` (read in place; skipped when absent). Each has a
``.meta.json`` giving the GPU count and NIC names, which the parse must reproduce exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import fixture_dir
from gputopo.errors import ParseError
from gputopo.model import Topology, is_link_code
from gputopo.topology.parse_smi import parse_p2p_text, parse_topo_text

_SHARED = fixture_dir()
TOPO_DIR = _SHARED / "topo" if _SHARED is not None else None
_ABSENT = pytest.mark.skip(reason="../shared/fixtures/topo is absent")


def _fixture_params(pattern: str) -> list:
    if TOPO_DIR is None or not TOPO_DIR.is_dir():
        return [pytest.param(None, marks=_ABSENT)]
    return [pytest.param(path, id=str(path.relative_to(TOPO_DIR))) for path in sorted(TOPO_DIR.glob(pattern))]


def _fixture(prefix: str) -> Path:
    """The fixture whose name starts with ``prefix`` (``"44_"``, ``"mp/01_"``); skip when absent."""
    if TOPO_DIR is None:
        pytest.skip("../shared/fixtures/topo is absent")
    found = sorted(TOPO_DIR.glob(f"{prefix}*.txt"))
    if not found:
        pytest.skip(f"fixture {prefix}* is absent")
    return found[0]


def _parse_fixture(prefix: str) -> Topology:
    path = _fixture(prefix)
    return parse_topo_text(path.read_text(encoding="utf-8"), source=str(path))


def _table(text: str) -> tuple[tuple[str, ...], tuple[tuple[str | None, ...], ...]]:
    """Labels and cells from a literal table in a test: ``-`` marks a cell the source does not show."""
    rows = [line.split() for line in text.strip().splitlines()]
    labels = tuple(row[0] for row in rows)
    cells = tuple(tuple(None if c == "-" else c for c in row[1:]) for row in rows)
    return labels, cells


def _key(path: Path) -> str:
    """``"44"`` for ``44_h800....txt``, ``"mp/01"`` for ``mp/01_....txt``."""
    assert TOPO_DIR is not None
    rel = path.relative_to(TOPO_DIR)
    return "/".join([*rel.parts[:-1], rel.name.split("_", 1)[0]])


# What each captured paste must produce beyond its meta.json. Warnings list one substring per expected
# warning; a fixture not named under EXPECTED_WARNINGS must parse without any warning.
EXPECTED_WARNINGS = {
    "00": [
        "the header's 'CPU' label is cut; read as CPU Affinity",
        "self cells printed as 'Χ' (U+03A7 GREEK CAPITAL LETTER CHI) were read as X",
        "GPU4, GPU5, GPU6, GPU7: CPU Affinity '32-6' looks cut",
    ],
    "01": ["header labels ran together ('GPU0GPU1GPU2GPU3GPU4GPU5GPU6GPU7mlx5_0')"],
    "16": ["NIC0, NIC1: no NIC Legend entry"],
    "38": ["the header does not name NUMA Affinity, but rows carry it"],
    "39": ["the header does not name NUMA Affinity, but rows carry it"],
    "43": ["GPU0, GPU1, GPU2, GPU3: CPU Affinity and NUMA Affinity ran together ('0-31,64-950')"],
    "44": [
        "the header has no column for NIC0, NIC1, NIC2, NIC3",
        "32 cell(s) the text does not show were filled from their mirror",
        "the self cell (X) of NIC0, NIC1, NIC2, NIC3 was not shown",
        "GPU0, GPU1, GPU2, GPU3: CPU Affinity '-31,64-95' looks cut",
        "GPU7: CPU Affinity '2-63,96-127' may be cut",
    ],
    "50": [
        "no row for GPU4, GPU5, GPU6, ..., mlx5_9 (22 in all): the paste looks cut",
        "88 cell(s) the text does not show were filled from their mirror",
        "the self cell (X) of GPU4, GPU5, GPU6, ..., mlx5_9 (22 in all) was not shown",
    ],
}
KNOWN_CLEAN = {
    "02", "04", "05", "06", "08", "09", "11", "13", "14", "15", "18", "19", "22", "23", "24", "26", "27",
    "28", "31", "32", "33", "35", "41", "46", "47", "49", "mp/01",
}  # fmt: skip

# (CPU Affinity, NUMA Affinity, GPU NUMA ID) of representative GPUs, as printed.
EXPECTED_AFFINITY: dict[str, dict[int, tuple[str | None, str | None, str | None]]] = {
    "00": {0: ("0-31", None, None), 7: ("32-6", None, None)},
    "01": {0: ("1-1", None, None), 7: ("1-1", None, None)},
    "02": {7: ("0-13", None, None)},
    "04": {6: ("0-19", None, None)},
    "05": {1: ("0-11", None, None)},
    "06": {0: ("0-5", None, None), 3: ("6-11", None, None)},
    "08": {0: ("0-23", None, None)},
    "09": {0: ("0-63", "0", None), 1: ("64-127", "1", None)},
    "11": {0: ("32-63,96-127", "1", "N/A")},
    "13": {3: ("0-79", "0", "N/A")},
    "14": {0: ("0-47,96-143", "0", "N/A"), 7: ("48-95,144-191", "1", "N/A")},
    "15": {0: ("0-15,32-47", "0", "N/A"), 4: ("16-31,48-63", "1", "N/A")},
    "16": {0: ("0-55,112-167", "0", "N/A"), 4: ("56-111,168-223", "1", "N/A")},
    "18": {1: ("0-63", "0", "N/A")},
    "19": {0: ("0-19", "0", "N/A")},
    "22": {0: ("0-31,64-95", "0", "N/A"), 7: ("32-63,96-127", "1", "N/A")},
    "23": {0: ("0-11", "N/A", None)},
    "24": {7: ("0-103", "0", "N/A")},
    "26": {0: ("0-11", None, None)},
    "27": {0: ("0-19,40-59", None, None), 4: ("20-39,60-79", None, None)},
    "28": {3: ("0-23", None, None)},
    "31": {0: ("0", "0-1", None)},
    "32": {1: ("0-23,48-71", "0", "N/A"), 2: ("24-47,72-95", "1", "N/A")},
    "33": {0: ("0,2,4,6,8,10", "0", None), 3: ("1,3,5,7,9,11", "1", None)},
    "35": {1: ("0-15", "0", "N/A")},
    "38": {0: ("0-23", "0", None), 4: ("48-71", "2", None)},
    "39": {0: ("0-23", "0", None), 7: ("24-47", "1", None)},
    "41": {
        0: ("48-63,176-191", "3", None),
        4: ("112-127,240-255", "7", None),
        6: ("80-95,208-223", "5", None),
    },
    "43": {0: ("0-31,64-95", "0", "N/A"), 4: ("32-63,96-127", "1", "N/A")},
    "44": {0: ("-31,64-95", "0", None), 7: ("2-63,96-127", "1", None)},
    "46": {2: ("96-111,224-239", "6", None), 3: ("112-127,240-255", "7", None)},
    "47": {4: ("0-31,64-95", "0", "N/A"), 5: ("32-63,96-127", "1", "N/A")},
    "49": {0: ("0-47,96-143", "0", "N/A")},
    "50": {0: ("0-23,48-71", None, None), 4: (None, None, None)},
    "mp/01": {0: ("0-13", "0", None), 1: ("14-27", "1", None)},
}


def _assert_well_formed(topo: Topology) -> None:
    """Square matrix of valid codes or None, X exactly on the diagonal, GPUs and NICs from the labels."""
    labels, cells = topo.matrix.labels, topo.matrix.cells
    assert len(cells) == len(labels) and all(len(row) == len(labels) for row in cells)
    for i, row in enumerate(cells):
        for j, cell in enumerate(row):
            if cell is None:
                continue
            assert is_link_code(cell), (labels[i], labels[j], cell)
            assert (cell == "X") == (i == j), (labels[i], labels[j], cell)
    assert [g.label for g in topo.gpus] == [label for label in labels if label.startswith("GPU")]
    assert [n.label for n in topo.nics] == [label for label in labels if not label.startswith("GPU")]
    assert topo.live is False


def _asymmetric_pairs(topo: Topology) -> list[tuple[str, str]]:
    labels, cells = topo.matrix.labels, topo.matrix.cells
    return [
        (labels[i], labels[j])
        for i in range(len(labels))
        for j in range(i + 1, len(labels))
        if cells[i][j] is not None and cells[j][i] is not None and cells[i][j] != cells[j][i]
    ]


# --- every captured paste -------------------------------------------------------------------------


@pytest.mark.parametrize("path", _fixture_params("*.txt") + _fixture_params("mp/*.txt"))
def test_captured_paste_matches_its_meta(path: Path) -> None:
    meta = json.loads(path.with_name(path.name[: -len(".txt")] + ".meta.json").read_text(encoding="utf-8"))
    topo = parse_topo_text(path.read_text(encoding="utf-8"), source=str(path))

    assert topo.source == str(path)
    assert len(topo.gpus) == meta["gpus"]
    assert [nic.name or nic.label for nic in topo.nics] == meta.get("nics", [])
    _assert_well_formed(topo)
    # Every GPU x GPU cell: symmetric, and shown unless the paste is visibly cut (then a warning says so).
    gpu_labels = [g.label for g in topo.gpus]
    for a in gpu_labels:
        for b in gpu_labels:
            if topo.matrix.code(a, b) is None:
                assert topo.warnings, f"{a}/{b} unknown without a warning"
    assert not _asymmetric_pairs(topo) or any("not symmetric" in w for w in topo.warnings)

    key = _key(path)
    if key in EXPECTED_WARNINGS:
        expected = EXPECTED_WARNINGS[key]
        assert len(topo.warnings) == len(expected), topo.warnings
        for text in expected:
            assert sum(text in w for w in topo.warnings) == 1, (text, topo.warnings)
    elif key in KNOWN_CLEAN:
        assert topo.warnings == ()
        assert all(cell is not None for row in topo.matrix.cells for cell in row)
        assert not _asymmetric_pairs(topo)
    for index, (cpu, numa, gpu_numa) in EXPECTED_AFFINITY.get(key, {}).items():
        gpu = topo.gpu(index)
        assert (gpu.cpu_affinity, gpu.numa_affinity, gpu.gpu_numa_id) == (cpu, numa, gpu_numa)
        assert (gpu.name, gpu.pci_bus_id, gpu.uuid) == (None, None, None)


def test_seed_box_with_greek_chi_and_cut_affinity_reads_literally() -> None:
    topo = _parse_fixture("00_")
    assert (topo.matrix.labels, topo.matrix.cells) == _table(
        """
        GPU0  X    NV4  NODE NODE SYS  SYS  SYS  SYS
        GPU1  NV4  X    NODE NODE SYS  SYS  SYS  SYS
        GPU2  NODE NODE X    NV4  SYS  SYS  SYS  SYS
        GPU3  NODE NODE NV4  X    SYS  SYS  SYS  SYS
        GPU4  SYS  SYS  SYS  SYS  X    NV4  NODE NODE
        GPU5  SYS  SYS  SYS  SYS  NV4  X    NODE NODE
        GPU6  SYS  SYS  SYS  SYS  NODE NODE X    NV4
        GPU7  SYS  SYS  SYS  SYS  NODE NODE NV4  X
        """
    )
    # The meta notes call the 5,6 pair SYS; the matrix as printed says NODE, and that is what is kept.
    assert topo.gpu_link(5, 6).code == "NODE" and topo.gpu_link(6, 7).code == "NV4"


def test_dgx1_with_run_together_header_keeps_soc_and_unsorted_nic_columns() -> None:
    topo = _parse_fixture("01_")
    assert (topo.matrix.labels, topo.matrix.cells) == _table(
        """
        GPU0    X   NV1 NV1 NV1 NV1 SOC SOC SOC PIX SOC PHB SOC
        GPU1    NV1 X   NV1 NV1 SOC NV1 SOC SOC PIX SOC PHB SOC
        GPU2    NV1 NV1 X   NV1 SOC SOC NV1 SOC PHB SOC PIX SOC
        GPU3    NV1 NV1 NV1 X   SOC SOC SOC NV1 PHB SOC PIX SOC
        GPU4    NV1 SOC SOC SOC X   NV1 NV1 NV1 SOC PIX SOC PHB
        GPU5    SOC NV1 SOC SOC NV1 X   NV1 NV1 SOC PIX SOC PHB
        GPU6    SOC SOC NV1 SOC NV1 NV1 X   NV1 SOC PHB SOC PIX
        GPU7    SOC SOC SOC NV1 NV1 NV1 NV1 X   SOC PHB SOC PIX
        mlx5_0  PIX PIX PHB PHB SOC SOC SOC SOC X   SOC PHB SOC
        mlx5_2  SOC SOC SOC SOC PIX PIX PHB PHB SOC X   SOC PHB
        mlx5_1  PHB PHB PIX PIX SOC SOC SOC SOC PHB SOC X   SOC
        mlx5_3  SOC SOC SOC SOC PHB PHB PIX PIX SOC PHB SOC X
        """
    )
    assert [(n.label, n.name) for n in topo.nics][:2] == [("mlx5_0", "mlx5_0"), ("mlx5_2", "mlx5_2")]


def test_hgx_a100_with_sparse_nic_legend_reads_literally() -> None:
    topo = _parse_fixture("22_")
    assert (topo.matrix.labels, topo.matrix.cells) == _table(
        """
        GPU0 X    NV12 NV12 NV12 NV12 NV12 NV12 NV12 PXB  SYS  SYS
        GPU1 NV12 X    NV12 NV12 NV12 NV12 NV12 NV12 PXB  SYS  SYS
        GPU2 NV12 NV12 X    NV12 NV12 NV12 NV12 NV12 NODE SYS  SYS
        GPU3 NV12 NV12 NV12 X    NV12 NV12 NV12 NV12 NODE SYS  SYS
        GPU4 NV12 NV12 NV12 NV12 X    NV12 NV12 NV12 SYS  PXB  NODE
        GPU5 NV12 NV12 NV12 NV12 NV12 X    NV12 NV12 SYS  PXB  NODE
        GPU6 NV12 NV12 NV12 NV12 NV12 NV12 X    NV12 SYS  NODE NODE
        GPU7 NV12 NV12 NV12 NV12 NV12 NV12 NV12 X    SYS  NODE NODE
        NIC0 PXB  PXB  NODE NODE SYS  SYS  SYS  SYS  X    SYS  SYS
        NIC1 SYS  SYS  SYS  SYS  PXB  PXB  NODE NODE SYS  X    NODE
        NIC2 SYS  SYS  SYS  SYS  NODE NODE NODE NODE SYS  NODE X
        """
    )
    assert [(n.label, n.name) for n in topo.nics] == [
        ("NIC0", "mlx5_0"),
        ("NIC1", "mlx5_3"),
        ("NIC2", "mlx5_bond_0"),
    ]


def test_terminal_cropped_h800_keeps_gpu_block_and_fills_nic_columns_from_the_nic_rows() -> None:
    topo = _parse_fixture("44_")
    assert (topo.matrix.labels, topo.matrix.cells) == _table(
        """
        GPU0 X    NV8  NV8  NV8  NV8  NV8  NV8  NV8  NODE NODE SYS  SYS
        GPU1 NV8  X    NV8  NV8  NV8  NV8  NV8  NV8  PIX  NODE SYS  SYS
        GPU2 NV8  NV8  X    NV8  NV8  NV8  NV8  NV8  NODE NODE SYS  SYS
        GPU3 NV8  NV8  NV8  X    NV8  NV8  NV8  NV8  NODE PIX  SYS  SYS
        GPU4 NV8  NV8  NV8  NV8  X    NV8  NV8  NV8  SYS  SYS  NODE NODE
        GPU5 NV8  NV8  NV8  NV8  NV8  X    NV8  NV8  SYS  SYS  NODE NODE
        GPU6 NV8  NV8  NV8  NV8  NV8  NV8  X    NV8  SYS  SYS  NODE NODE
        GPU7 NV8  NV8  NV8  NV8  NV8  NV8  NV8  X    SYS  SYS  PIX  PIX
        NIC0 NODE PIX  NODE NODE SYS  SYS  SYS  SYS  X    -    -    -
        NIC1 NODE NODE NODE PIX  SYS  SYS  SYS  SYS  -    X    -    -
        NIC2 SYS  SYS  SYS  SYS  NODE NODE NODE PIX  -    -    X    -
        NIC3 SYS  SYS  SYS  SYS  NODE NODE NODE PIX  -    -    -    X
        """
    )


def test_truncated_dgx2_keeps_the_rows_it_shows_and_names_all_sixteen_gpus() -> None:
    topo = _parse_fixture("50_")
    assert len(topo.matrix.labels) == 26
    nv6_row = ["NV6"] * 16
    for i in range(4):
        row = topo.matrix.cells[i]
        assert list(row[:16]) == nv6_row[:i] + ["X"] + nv6_row[i + 1 :]
    assert topo.matrix.cells[0][16:] == (
        "PIX",
        "PXB",
        "NODE",
        "NODE",
        "SYS",
        "SYS",
        "SYS",
        "SYS",
        "SYS",
        "SYS",
    )
    assert topo.matrix.cells[2][16:18] == ("PXB", "PIX")
    # The rows the paste lost: their cells to GPU0-3 come from GPU0-3's rows, X on the diagonal, the
    # rest unknown; a warning says so.
    cells = topo.matrix.cells
    for r in range(4, 26):
        for c in range(26):
            expected = cells[c][r] if c < 4 else "X" if c == r else None
            assert cells[r][c] == expected, (r, c)
    assert topo.gpu_link(4, 5) is None and topo.gpu_link(0, 15).code == "NV6"
    assert topo.gpu_link(15, 0).code == "NV6"
    assert any("filled from their mirror" in w and "GPU4/GPU0" in w for w in topo.warnings)


def test_fused_affinity_is_split_only_where_the_header_columns_say() -> None:
    topo = _parse_fixture("43_")
    assert [g.numa_affinity for g in topo.gpus] == ["0"] * 4 + ["1"] * 4


def test_edited_header_without_numa_label_still_reads_numa_values() -> None:
    topo = _parse_fixture("38_")
    assert [n.label for n in topo.nics] == ["NIC2", "NIC3", "NIC4", "NIC5"]
    assert topo.matrix.code("GPU1", "NIC2") == "PIX" and topo.matrix.code("NIC5", "GPU7") == "PIX"


# --- topo -p2p ------------------------------------------------------------------------------------

P2P_EXPECTED = {
    "p2p/01": (("GPU0", "GPU1"), (("X", "GNS"), ("GNS", "X"))),
    "p2p/02": (("GPU0", "GPU1"), (("X", "OK"), ("OK", "X"))),
    "p2p/03": (("GPU0", "GPU1"), (("X", "NS"), ("NS", "X"))),
}


@pytest.mark.parametrize("path", _fixture_params("p2p/*.txt"))
def test_p2p_captured_pastes(path: Path) -> None:
    meta = json.loads(path.with_name(path.name[: -len(".txt")] + ".meta.json").read_text(encoding="utf-8"))
    labels, cells = parse_p2p_text(path.read_text(encoding="utf-8"))
    assert len(labels) == meta["gpus"]
    assert all((cell == "X") == (i == j) for i, row in enumerate(cells) for j, cell in enumerate(row))
    if _key(path) in P2P_EXPECTED:
        assert (labels, cells) == P2P_EXPECTED[_key(path)]


def test_p2p_raw_tabs_with_trailing_tab_and_bare_x() -> None:
    text = (
        " \tGPU0\tGPU1\tGPU2\t\n"
        " GPU0\tX\tOK\tCNS\t\n"
        " GPU1\tOK\tX\tTNS\t\n"
        " GPU2\tCNS\tTNS\tX\t\n"
        "\n"
        "Legend:\n"
        "\n"
        "  X    = Self\n"
    )
    assert parse_p2p_text(text) == (
        ("GPU0", "GPU1", "GPU2"),
        (("X", "OK", "CNS"), ("OK", "X", "TNS"), ("CNS", "TNS", "X")),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (" \tGPU0\tGPU1\t\n GPU0\tX\tGNS\t\n", "no row for GPU1"),
        (" \tGPU0\tGPU1\t\n GPU0\tX\tGNS\t\n GPU1\tGNS\tX\tOK\n", "the row has 3 cells"),
        (" \tGPU0\tGPU1\t\n GPU0\tX\tYES\n GPU1\tGNS\tX\n", "found 'YES'"),
        (" \tGPU0\tGPU1\t\n GPU0\tGNS\tX\n GPU1\tGNS\tX\n", "expected the self cell X in column 1"),
        (
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV4\t X \t0-7\n",
            "looks like `nvidia-smi topo -m`",
        ),
        (" \tGPU0\tGPU1\t\n GPU0\tX\tNV4\n GPU1\tNV4\tX\n", "link code, not a P2P status"),
        ("nothing here\n", "no `nvidia-smi topo -p2p` matrix"),
    ],
)
def test_p2p_refuses_what_it_cannot_read(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_p2p_text(text)


# --- one small input per variant ------------------------------------------------------------------

# A 2-GPU NVLink box with one NIC, as driver 535+ prints it (raw tabs).
RAW = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tPIX\t0-31,64-95\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\t32-63,96-127\t1\t\tN/A\n"
    "NIC0\tPIX\tSYS\t X \t\t\t\t\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n"
)
RAW_CELLS = (("X", "NV18", "PIX"), ("NV18", "X", "SYS"), ("PIX", "SYS", "X"))


def _summary(topo: Topology) -> tuple:
    return (
        topo.matrix.labels,
        topo.matrix.cells,
        [(g.index, g.cpu_affinity, g.numa_affinity, g.gpu_numa_id) for g in topo.gpus],
        [(n.label, n.name) for n in topo.nics],
    )


RAW_SUMMARY = (
    ("GPU0", "GPU1", "NIC0"),
    RAW_CELLS,
    [(0, "0-31,64-95", "0", "N/A"), (1, "32-63,96-127", "1", "N/A")],
    [("NIC0", "mlx5_0")],
)


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line if line else line for line in text.splitlines(keepends=True))


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(RAW, id="raw-tabs"),
        pytest.param(RAW.expandtabs(8), id="tabs-expanded"),
        pytest.param(RAW.expandtabs(8).replace(" \n", "\n"), id="trailing-space-trimmed"),
        pytest.param(RAW.replace("\n", "\r\n"), id="crlf"),
        pytest.param(RAW.replace("\n", "   \n"), id="trailing-whitespace"),
        pytest.param(_indent(RAW, "        "), id="rst-indent-8-tabs"),
        pytest.param(_indent(RAW.expandtabs(8), "    "), id="markdown-indent-4"),
        pytest.param(_indent(RAW, "\t"), id="tab-indent"),
        pytest.param("```\n" + RAW.expandtabs(8) + "```\n", id="markdown-fence"),
        pytest.param("$ nvidia-smi topo -m\n" + RAW, id="prompt-before"),
        pytest.param(".. code-block:: text\n\n" + _indent(RAW.expandtabs(8), "   "), id="rst-code-block"),
        pytest.param(
            "root@node:~# nvidia-smi topo --matrix\r\n" + RAW.replace("\n", "\r\n"), id="prompt-crlf"
        ),
        pytest.param(_indent(RAW.expandtabs(8), "> "), id="blockquote"),
        pytest.param(
            RAW.replace("\tGPU0", "\x1b[4m\tGPU0", 1).replace("GPU NUMA ID", "GPU NUMA ID\x1b[0m"), id="ansi"
        ),
        pytest.param(
            RAW.replace("\tGPU0", "[4m\tGPU0", 1).replace("GPU NUMA ID", "GPU NUMA ID[0m"), id="ansi-esc-lost"
        ),
        pytest.param(RAW.expandtabs(8).replace("        GPU0", "GPU0", 1), id="header-unindented"),
        pytest.param(RAW.expandtabs(8).replace("        GPU0", "       GPU0", 1), id="header-indent-7"),
        pytest.param(RAW.replace("\t X \t", "\tX\t"), id="p2p-style-bare-x"),
        pytest.param(
            RAW.replace("NIC0\tPIX\tSYS\t X \t\t\t\t", "NIC0\tPIX\tSYS\t X"), id="nic-row-no-trailing-fields"
        ),
        pytest.param(
            RAW.replace("\nLegend:", "\n<p>Legend:").replace("\t", "&nbsp;" * 4) + "<br>\n", id="html"
        ),
        pytest.param(RAW.replace("Legend:\n\n", "Legend:\n"), id="no-blank-after-legend"),
        pytest.param(RAW.replace("\n  X ", "\nX ").replace("\n  SYS", "\nSYS"), id="legend-unindented"),
        pytest.param("\ufeff" + RAW, id="byte-order-mark"),
    ],
)
def test_paste_variants_read_the_same(variant: str) -> None:
    topo = parse_topo_text(variant)
    assert _summary(topo) == RAW_SUMMARY
    assert topo.warnings == ()


def test_legend_missing_entirely_still_reads_the_matrix_and_nic_names_are_unknown() -> None:
    topo = parse_topo_text(RAW.split("\n\nLegend:")[0] + "\n")
    assert topo.matrix.cells == RAW_CELLS
    assert topo.nics[0].name is None
    assert topo.warnings == ("NIC0: no NIC Legend entry, so the device name is unknown",)


def test_legend_wrapped_and_chopped_does_not_disturb_the_matrix() -> None:
    legend = (
        "\n"
        "Legend:\n"
        "\n"
        "  X    = Self\n"
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between\n"
        "  NUMA nodes (e.g., QPI/UPI)\n"
        "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typ\n"
        "\n"
        "NIC Legend:\n"
        "\n"
        "  NIC0: mlx5_0         \n"
    )
    topo = parse_topo_text(RAW.split("\nLegend:")[0] + legend)
    assert _summary(topo) == RAW_SUMMARY and topo.warnings == ()


def test_every_legend_generation_is_accepted() -> None:
    gen_a = (
        "Legend:\n"
        "\n"
        "  X   = Self\n"
        "  SOC = Path traverses a socket-level link (e.g. QPI)\n"
        "  PIX = Path traverses a PCIe internal switch\n"
    )
    gen_b = (
        "Legend:\n"
        "\n"
        "  X   = Self\n"
        "  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)\n"
    )
    gen_c = (
        "Legend:\n"
        "\n"
        "  X    = Self\n"
        "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges\n"
    )
    matrix = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSOC\t0-11\nGPU1\tSOC\t X \t0-11\n\n"
    for legend in (gen_a, gen_b, gen_c):
        topo = parse_topo_text(matrix + legend)
        assert topo.matrix.cells == (("X", "SOC"), ("SOC", "X")) and topo.warnings == ()


def test_values_of_exactly_7_and_15_chars_are_followed_by_one_space() -> None:
    text = (
        "\tGPU0\tGPU1\tmlx5_10\tmlx5_11\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV12\tSYS\tSYS\t112-127,240-255\t7\n"
        "GPU1\tNV12\t X \tSYS\tPIX\t0-15,128-143\t0\n"
        "mlx5_10\tSYS\tSYS\t X \tPIX\t\t\n"
        "mlx5_11\tSYS\tPIX\tPIX\t X \t\t\n"
    ).expandtabs(8)
    assert "mlx5_10 SYS" in text and "112-127,240-255 7" in text
    topo = parse_topo_text(text)
    assert topo.matrix.labels == ("GPU0", "GPU1", "mlx5_10", "mlx5_11")
    assert topo.matrix.cells[2] == ("SYS", "SYS", "X", "PIX")
    assert (topo.gpu(0).cpu_affinity, topo.gpu(0).numa_affinity) == ("112-127,240-255", "7")
    assert [(n.label, n.name) for n in topo.nics] == [("mlx5_10", "mlx5_10"), ("mlx5_11", "mlx5_11")]
    assert topo.warnings == ()


def test_old_driver_rdma_columns_need_no_legend() -> None:
    text = (
        "\tGPU0\tGPU1\tmlx4_0\tCPU Affinity\n"
        "GPU0\t X \tPIX\tPHB\t0-0,8-8\n"
        "GPU1\tPIX\t X \tPHB\t1-1,9-9\n"
        "mlx4_0\tPHB\tPHB\t X \n"
    )
    topo = parse_topo_text(text)
    assert [(n.label, n.name) for n in topo.nics] == [("mlx4_0", "mlx4_0")]
    assert topo.gpu(1).cpu_affinity == "1-1,9-9" and topo.gpu(1).numa_affinity is None
    assert topo.warnings == ()


def test_nic_legend_maps_two_digit_and_non_zero_based_nic_labels() -> None:
    text = (
        "\tGPU0\tNIC3\tNIC10\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tPIX\tSYS\t0-7\t0\t\tN/A\n"
        "NIC3\tPIX\t X \tSYS\n"
        "NIC10\tSYS\tSYS\t X \n\n"
        "NIC Legend:\n\n  NIC3: ibp14s0\n  NIC10: rocep32s0f0\n"
    ).expandtabs(8)
    topo = parse_topo_text(text)
    assert [(n.label, n.name) for n in topo.nics] == [("NIC3", "ibp14s0"), ("NIC10", "rocep32s0f0")]
    assert topo.matrix.code("NIC10", "NIC3") == "SYS"
    assert topo.warnings == ()


def test_column_order_follows_the_rows_not_the_names() -> None:
    text = (
        "\tGPU0\tmlx5_0\tmlx5_2\tmlx5_1\tCPU Affinity\n"
        "GPU0\t X \tPIX\tSYS\tPHB\t0-19\n"
        "mlx5_0\tPIX\t X \tSYS\tPHB\n"
        "mlx5_2\tSYS\tSYS\t X \tSYS\n"
        "mlx5_1\tPHB\tPHB\tSYS\t X \n"
    )
    topo = parse_topo_text(text)
    assert topo.matrix.labels == ("GPU0", "mlx5_0", "mlx5_2", "mlx5_1")
    assert topo.matrix.code("GPU0", "mlx5_1") == "PHB" and topo.matrix.code("mlx5_2", "mlx5_1") == "SYS"


@pytest.mark.parametrize(
    "code",
    [
        "NV1",
        "NV2",
        "NV3",
        "NV4",
        "NV6",
        "NV8",
        "NV12",
        "NV18",
        "NV24",
        "SOC",
        "SYS",
        "NODE",
        "PHB",
        "PXB",
        "PIX",
    ],
)
def test_every_link_code_is_kept_as_printed(code: str) -> None:
    topo = parse_topo_text(f"\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \t{code}\t0-7\nGPU1\t{code}\t X \t0-7\n")
    assert topo.matrix.code("GPU0", "GPU1") == code == topo.matrix.code("GPU1", "GPU0")


@pytest.mark.parametrize("lookalike", ["Χ", "χ", "Х", "х", "x", "×", "Ｘ"])
def test_self_cell_lookalikes_are_read_as_x_with_a_warning(lookalike: str) -> None:
    topo = parse_topo_text(RAW.replace(" X ", f" {lookalike} "))
    assert topo.matrix.cells == RAW_CELLS
    assert len(topo.warnings) == 1 and f"printed as '{lookalike}'" in topo.warnings[0]


def test_a_lookalike_x_off_the_diagonal_is_refused() -> None:
    with pytest.raises(ParseError, match=r"^line 3: GPU1: the self cell X is in column 3, not in column 2"):
        parse_topo_text(RAW.replace("GPU1\tNV18\t X \tSYS", "GPU1\tNV18\t X \tΧ"))


# --- affinity columns -----------------------------------------------------------------------------


@pytest.mark.parametrize("expand", [False, True], ids=["tabs", "expanded"])
def test_empty_cpu_affinity_under_slurm_leaves_cpu_unknown_and_keeps_numa(expand: bool) -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tSYS\t\t0\t\tN/A\n"
        "GPU1\tSYS\t X \t32-63\t1\t\tN/A\n"
    )
    topo = parse_topo_text(text.expandtabs(8) if expand else text)
    assert [(g.cpu_affinity, g.numa_affinity, g.gpu_numa_id) for g in topo.gpus] == [
        (None, "0", "N/A"),
        ("32-63", "1", "N/A"),
    ]
    assert topo.warnings == ()


def test_empty_cpu_affinity_with_two_affinity_columns() -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tSYS\t\t0\nGPU1\tSYS\t X \t0-31\t1\n"
    ).expandtabs(8)
    topo = parse_topo_text(text)
    assert [(g.cpu_affinity, g.numa_affinity) for g in topo.gpus] == [(None, "0"), ("0-31", "1")]


def test_newer_space_padded_affinity_columns() -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity      NUMA Affinity   GPU NUMA ID\n"
        "GPU0     X      NV18    0-55,112-167      0               N/A\n"
        "GPU1    NV18     X      56-111,168-223    1               N/A\n"
    )
    topo = parse_topo_text(text)
    assert [(g.cpu_affinity, g.numa_affinity, g.gpu_numa_id) for g in topo.gpus] == [
        ("0-55,112-167", "0", "N/A"),
        ("56-111,168-223", "1", "N/A"),
    ]
    assert topo.warnings == ()


def test_cpu_and_numa_run_together_are_split_by_column_position() -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity      NUMA Affinity   GPU NUMA ID\n"
        "GPU0     X      NV8     0-31,64-950               N/A\n"
        "GPU1    NV8      X      32-63,96-127      1               N/A\n"
    )
    topo = parse_topo_text(text)
    assert (topo.gpu(0).cpu_affinity, topo.gpu(0).numa_affinity, topo.gpu(0).gpu_numa_id) == (
        "0-31,64-95",
        "0",
        "N/A",
    )
    assert topo.warnings == (
        "GPU0: CPU Affinity and NUMA Affinity ran together ('0-31,64-950'); "
        "split where the header's columns put them",
    )


def test_run_together_values_without_column_evidence_stay_unknown() -> None:
    # Hand-squeezed spacing: nothing says where the NUMA value starts, so neither value is guessed.
    text = (
        "GPU0 GPU1 CPU Affinity NUMA Affinity GPU NUMA ID\n"
        "GPU0 X NV8 0-31,64-950 N/A\n"
        "GPU1 NV8 X 32-63,96-127 1 N/A\n"
    )
    topo = parse_topo_text(text)
    assert (topo.gpu(0).cpu_affinity, topo.gpu(0).numa_affinity, topo.gpu(0).gpu_numa_id) == (
        None,
        None,
        None,
    )
    assert topo.gpu(1).numa_affinity == "1"
    assert topo.warnings == (
        "GPU0: cannot tell which affinity column '0-31,64-950 N/A' belongs to; affinity left unknown",
    )


def test_numa_value_under_a_header_that_lost_its_label() -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity\n"
        "GPU0     X      NV18    0-23    0\n"
        "GPU1    NV18     X      24-47   1\n"
    )
    topo = parse_topo_text(text)
    assert [(g.cpu_affinity, g.numa_affinity) for g in topo.gpus] == [("0-23", "0"), ("24-47", "1")]
    assert len(topo.warnings) == 1 and "does not name NUMA Affinity" in topo.warnings[0]


def test_chopped_and_descending_affinities_are_kept_as_printed_with_warnings() -> None:
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV8\tNV8\t-31,64-95\t0\n"
        "GPU1\tNV8\t X \tNV8\t32-6\t1\n"
        "GPU2\tNV8\tNV8\t X \t32-63,96-127\t1\n"
    )
    topo = parse_topo_text(text)
    assert [g.cpu_affinity for g in topo.gpus] == ["-31,64-95", "32-6", "32-63,96-127"]
    assert topo.warnings == (
        "GPU0: CPU Affinity '-31,64-95' looks cut by the paste; kept as printed",
        "GPU1: CPU Affinity '32-6' looks cut by the paste; kept as printed",
    )


def test_bare_singletons_and_lists_from_a_cpuset_are_values() -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV4\t56\t0,5-11\n"
        "GPU1\tNV4\t X \t4,6,9,15,17\t3,1,7,5\n"
    )
    topo = parse_topo_text(text)
    assert [(g.cpu_affinity, g.numa_affinity) for g in topo.gpus] == [
        ("56", "0,5-11"),
        ("4,6,9,15,17", "3,1,7,5"),
    ]
    assert topo.warnings == ()


def test_numeric_gpu_numa_id_on_grace_hopper() -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV6\t0-71\t0\t\t4\n"
        "GPU1\tNV6\t X \t72-143\t1\t\t12\n"
    )
    assert [g.gpu_numa_id for g in parse_topo_text(text).gpus] == ["4", "12"]


# --- damaged pastes -------------------------------------------------------------------------------

FUSED_LAST_CELL = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV12\t{cell}\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tPHB0-115\t0\t\tN/A\n"
    "NIC0\tPHB\tPHB\t X \n"
)


def test_last_cell_run_into_the_affinity_is_recovered_from_a_unique_code_prefix() -> None:
    topo = parse_topo_text(FUSED_LAST_CELL.format(cell="PH0-115"))
    assert topo.matrix.cells == (("X", "NV12", "PHB"), ("NV12", "X", "PHB"), ("PHB", "PHB", "X"))
    assert [(g.cpu_affinity, g.numa_affinity) for g in topo.gpus] == [("0-115", "0"), ("0-115", "0")]
    assert (
        "GPU0: the last cell ran into the CPU affinity ('PH0-115'); read as PHB and '0-115'" in topo.warnings
    )
    assert (
        "GPU1: the last cell ran into the CPU affinity ('PHB0-115'); read as PHB and '0-115'" in topo.warnings
    )


@pytest.mark.parametrize("cell", ["P0-115", "N0-115", "NV120-115"])
def test_last_cell_run_into_the_affinity_is_refused_when_the_code_is_ambiguous(cell: str) -> None:
    with pytest.raises(ParseError, match=rf"line 2: GPU0: '{cell}' is a link code run into the CPU affinity"):
        parse_topo_text(FUSED_LAST_CELL.format(cell=cell))


def test_run_together_header_labels_are_split() -> None:
    text = (
        "\t    GPU0GPU1mlx5_0\tmlx5_1\tCPU Affinity\n"
        "GPU0\t X \tNV1\tPIX\tSOC\t0-9\n"
        "GPU1\tNV1\t X \tPIX\tSOC\t0-9\n"
        "mlx5_0\tPIX\tPIX\t X \tSOC\n"
        "mlx5_1\tSOC\tSOC\tSOC\t X\n"
    )
    topo = parse_topo_text(text)
    assert topo.matrix.labels == ("GPU0", "GPU1", "mlx5_0", "mlx5_1")
    assert topo.warnings == ("header labels ran together ('GPU0GPU1mlx5_0'); split at each device name",)


def test_header_lost_entirely_uses_row_order_with_a_warning() -> None:
    topo = parse_topo_text("GPU0\t X \tNV4\t0-7\nGPU1\tNV4\t X \t8-15\n")
    assert topo.matrix.labels == ("GPU0", "GPU1") and topo.matrix.cells == (("X", "NV4"), ("NV4", "X"))
    assert [g.cpu_affinity for g in topo.gpus] == ["0-7", "8-15"]
    assert any("no header line" in w for w in topo.warnings)


def test_nic_columns_cropped_from_the_header_and_rows() -> None:
    text = (
        "        GPU0    GPU1  CPU Affinity    NUMA Affinity\n"
        "GPU0     X      NV8   0-31            0\n"
        "GPU1    NV8      X    32-63           1\n"
        "NIC0    PIX     SYS\n"
        "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    )
    topo = parse_topo_text(text)
    assert topo.matrix.labels == ("GPU0", "GPU1", "NIC0")
    assert topo.matrix.cells == (("X", "NV8", "PIX"), ("NV8", "X", "SYS"), ("PIX", "SYS", "X"))
    assert topo.nics[0].name == "mlx5_0"
    assert topo.warnings == (
        "the header has no column for NIC0 (cropped?); their links are read from their own rows only",
        "2 cell(s) the text does not show were filled from their mirror, which it does show (the matrix "
        "is symmetric): GPU0/NIC0, GPU1/NIC0",
        "the self cell (X) of NIC0 was not shown and was filled in",
    )


def test_nic_cells_cropped_from_rows_under_a_whole_header() -> None:
    text = "\tGPU0\tGPU1\tNIC0\tCPU Affinity\nGPU0\t X \tNV8\t0-31\nGPU1\tNV8\t X \t32-63\nNIC0\tPIX\tSYS\n"
    topo = parse_topo_text(text)
    assert topo.matrix.cells == (("X", "NV8", "PIX"), ("NV8", "X", "SYS"), ("PIX", "SYS", "X"))
    assert [g.cpu_affinity for g in topo.gpus] == ["0-31", "32-63"]
    assert topo.warnings == (
        "GPU0, GPU1, NIC0: the rows show only the GPU columns (cropped?); their NIC cells are unknown",
        "2 cell(s) the text does not show were filled from their mirror, which it does show (the matrix "
        "is symmetric): GPU0/NIC0, GPU1/NIC0",
        "the self cell (X) of NIC0 was not shown and was filled in",
        "NIC0: no NIC Legend entry, so the device name is unknown",
    )


def test_one_row_short_of_a_cell_is_not_mistaken_for_a_crop() -> None:
    # GPU0 lost its NV8 cell, so its NIC cell PIX now stands under GPU1: refused, not read as cropped.
    text = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\n"
        "GPU0\t X \tPIX\t0-31\n"
        "GPU1\tNV8\t X \tSYS\t32-63\n"
        "NIC0\tPIX\tSYS\t X \n"
    )
    with pytest.raises(ParseError, match=r"^line 2: GPU0: the row has 2 cells but the header has 3 columns"):
        parse_topo_text(text)


def test_paste_cut_inside_the_last_row() -> None:
    text = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV4\tSYS\t0\nGPU1\tNV4\t X \tSYS\t0\nGPU2\tSYS\t"
    topo = parse_topo_text(text)
    assert topo.matrix.cells == (("X", "NV4", "SYS"), ("NV4", "X", "SYS"), ("SYS", "SYS", "X"))
    assert topo.warnings == (
        "GPU2: the row is cut after 1 of 3 cells; the rest are unknown",
        "1 cell(s) the text does not show were filled from their mirror, which it does show (the matrix "
        "is symmetric): GPU2/GPU1",
        "the self cell (X) of GPU2 was not shown and was filled in",
    )


def test_asymmetric_matrix_is_kept_as_printed_with_a_warning() -> None:
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
        "GPU0\t X \tNV4\tSYS\t0\n"
        "GPU1\tNV4\t X \tSYS\t0\n"
        "GPU2\tNODE\tSYS\t X \t0\n"
    )
    topo = parse_topo_text(text)
    assert topo.matrix.code("GPU0", "GPU2") == "SYS" and topo.matrix.code("GPU2", "GPU0") == "NODE"
    assert topo.warnings == (
        "the matrix is not symmetric: GPU0/GPU2 is SYS but GPU2/GPU0 is NODE; cells kept as printed",
    )


def test_repeated_rows_and_header_are_skipped_with_warnings() -> None:
    header, row0, row1 = RAW.split("\n")[:3]
    topo = parse_topo_text("\n".join([header, header, row0, row0, row1, *RAW.split("\n")[3:]]))
    assert topo.matrix.cells == RAW_CELLS
    assert topo.warnings == (
        "the header line is repeated; the copy was skipped",
        "GPU0: the row appears twice; the copy was skipped",
    )


def test_second_matrix_in_the_same_text_is_noted() -> None:
    topo = parse_topo_text(RAW + "\nAfter the reboot:\n\n" + RAW)
    assert topo.matrix.cells == RAW_CELLS
    assert topo.warnings == ("another matrix starts at line 18; only the first one was read",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            (
                "\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
                "GPU0\t X \tNV4\tSYS\t0\n"
                "GPU1\tNV4\tSYS\t X \t0\n"
                "GPU2\tSYS\tSYS\t X \t0\n"
            ),
            r"^line 3: GPU1: expected the self cell X in column 2, found 'SYS'",
            id="cells-shifted",
        ),
        pytest.param(
            (
                "\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
                "GPU0\t X \tNV4\t0\n"
                "GPU1\tNV4\t X \tSYS\t0\n"
                "GPU2\tSYS\tSYS\t X \t0\n"
            ),
            r"^line 2: GPU0: the row has 2 cells but the header has 3 columns",
            id="cell-missing",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\tSYS\t0\nGPU1\tNV4\t X \t0\n",
            r"^line 2: GPU0: the row has more cells than the header has columns",
            id="cell-extra",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNVX\t0\nGPU1\tNV4\t X \t0\n",
            r"^line 2: GPU0: 'NVX' is not an nvidia-smi link code",
            id="unknown-code",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\r\nGPU0\t X \tNV4\t0\r\nGPU1\tNV4\t X \tzero\r\n",
            r"^line 3: GPU1: 'zero' is not a CPU or NUMA affinity value",
            id="bad-affinity-crlf",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0\nGPU1\tNV4\t X \t0\nGPU1\tNV4\t X \t1\n",
            r"^line 4: GPU1: a second, different row",
            id="conflicting-rows",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\tNV4\t0\n",
            r"^line 1: the header names GPU1 twice",
            id="duplicate-label",
        ),
        pytest.param(
            "\tGPU0\tGPU00\tCPU Affinity\nGPU0\t X \tNV4\t0\nGPU00\tNV4\t X \t0\n",
            r"^line 2: GPU0: the row has more cells than the header has columns \('NV4' after column 1\)",
            id="leading-zero-label",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\n\nLegend:\n",
            r"^line 1: the matrix header is not followed",
            id="header-only",
        ),
        pytest.param(
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV" + "9" * 5000 + "\t0\n",
            r"is not an nvidia-smi link code",
            id="huge-nv",
        ),
    ],
)
def test_damage_that_would_shift_cells_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message) as caught:
        parse_topo_text(text)
    assert caught.value.exit_code == 2 and caught.value.hint


def test_error_line_numbers_count_the_lines_of_the_original_text() -> None:
    html = (
        "<p>&nbsp;&nbsp;GPU0    GPU1    CPU Affinity\n"
        "<br>\n"
        "GPU0     X      NV4     0-7\n"
        "<br>\n"
        "GPU1    NV4      X      zero\n"
    )
    with pytest.raises(ParseError, match=r"^line 5: GPU1"):
        parse_topo_text(html)


# --- not topo -m at all ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message", "hint"),
    [
        pytest.param("", "the text is empty", "save the output", id="empty"),
        pytest.param(" \n\t\n", "the text is empty", "save the output", id="blank"),
        pytest.param("\x00\x01\x02binary\xff", "binary", "text file", id="binary"),
        pytest.param('{"schema": "gputopo/topology/v1"}', "JSON", "--input", id="json"),
        pytest.param('[{"gpu": 0}]', "JSON", "--input", id="json-list"),
        pytest.param(
            "Mon Apr 15 17:54:26 2024\nno devices were found\n",
            "no `nvidia-smi topo -m` matrix",
            "nvidia-smi topo -m",
            id="prose",
        ),
        pytest.param(
            (
                "        GPU0    GPU1    CPU Affinity    Node Affinity\n"
                "GPU0     X      HT      0-63    0\n"
                "GPU1    HT       X      0-63    0\n"
                "\n"
                "Legend:\n"
                "  X  = Self\n"
                "  HT = Connection traversing MarsLink\n"
            ),
            "'HT' is not an nvidia-smi link code",
            "MetaX `mx-smi topo`",
            id="mx-smi",
        ),
        pytest.param(
            (
                "        GPU0    GPU1    CPU Affinity\n"
                "GPU0     X      MT4     0-63\n"
                "GPU1    MT4      X      0-63\n"
                "\n"
                "Legend:\n"
                "  MTx = Connection traversing x MTLinks\n"
            ),
            "'MT4' is not an nvidia-smi link code",
            "Moore Threads",
            id="moore-threads",
        ),
        pytest.param(
            (
                "         GPU 0/0|GPU 0/1|CPU Affinity\n"
                "GPU 0/0 |S      |MDF    |0-23,48-71\n"
                "GPU 0/1 |MDF    |S      |0-23,48-71\n"
            ),
            "no `nvidia-smi topo -m` matrix",
            "Intel `xpu-smi topology`",
            id="xpu-smi",
        ),
        pytest.param(
            "=== ROCm System Management Interface ===\nGPU0 GPU1\nGPU0 0 XGMI\nGPU1 XGMI 0\n",
            "line 3: GPU0: 'XGMI' is not an nvidia-smi link code",
            "AMD `rocm-smi`",
            id="rocm-smi",
        ),
        pytest.param(
            (
                " \tGPU0\tGPU1\t\n"
                " GPU0\tX\tGNS\t\n"
                " GPU1\tGNS\tX\t\n"
                "\n"
                "Legend:\n"
                "\n"
                "  X    = Self\n"
                "  OK   = Status Ok\n"
            ),
            "'GNS' is not an nvidia-smi link code",
            "`nvidia-smi topo -p2p`",
            id="p2p-output",
        ),
    ],
)
def test_text_that_is_not_topo_m_is_refused_with_a_hint(text: str, message: str, hint: str) -> None:
    with pytest.raises(ParseError, match=message) as caught:
        parse_topo_text(text)
    assert hint in (caught.value.hint or "")


def test_source_names_the_input_and_the_result_is_not_live() -> None:
    topo = parse_topo_text(RAW, source="saved/topo.txt")
    assert topo.source == "saved/topo.txt" and topo.live is False
    assert parse_topo_text(RAW).source == "text"
