"""The probe's failed checks as findings (pure): ``probe_findings`` turns a ``gputopo/probe/v1``
document's failed checks into problems with the probe's remedy, ``per_gpu_findings`` the per-GPU check's
slow, corrupt or undecided GPUs into one finding each. ``gputopo doctor`` judges its probes with them and
``gputopo probe`` names an ACS-redirecting bridge as the likely cause of wrong data with them.

Both live here together: ``per_gpu_findings`` is what ``probe_findings`` calls for the per-GPU check, and
moving one without the other would close an import circle through the other's old home.
"""

from __future__ import annotations

from typing import Any

from gputopo.findings import NOTE, PROBLEM, Finding


def probe_findings(
    probe: dict[str, Any] | None, redirected: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
) -> list[Finding]:
    """A problem for every failed check, with the probe's remedy. Wrong data on a set with a pair whose
    PCIe path crosses an ACS-redirecting bridge (``redirected``) names that bridge as the likely cause."""
    out = []
    behind = {frozenset((a, b)): bridges for a, b, bridges in redirected}
    for s in (probe or {}).get("sets", []):
        where = "GPUs " + ",".join(str(g) for g in s["gpus"])
        pairs = [
            (a, b) for i, a in enumerate(s["gpus"]) for b in s["gpus"][i + 1 :] if frozenset((a, b)) in behind
        ]
        for c in s["checks"]:
            if c["name"] == "gpu" and c.get("kind") not in ("hung", "crashed"):
                out += per_gpu_findings(c)  # one per GPU found slow, corrupt or undecided (pass or fail)
            elif c["verdict"] == "fail":
                what = f"{c['name']} check failed ({c.get('kind')}): {c.get('detail')}"
                if pairs and c.get("kind") in ("corrupt", "nan", "diverged"):
                    bridges = sorted({br for a, b in pairs for br in behind[frozenset((a, b))]})
                    what += (
                        f"; the likely cause: ACS redirects P2P between "
                        f"{', '.join(f'GPU{a}-GPU{b}' for a, b in pairs)} at bridge {', '.join(bridges)} "
                        "(see that bridge's finding)"
                    )
                out.append(Finding(where, what, c.get("remedy") or "see the probe report"))
    return out


_UNDECIDED_SPEED_REMEDY = (
    "Nothing to do for it now: run `gputopo probe --mode gpu` again when the machine is quieter to decide."
)


def per_gpu_findings(check: dict[str, Any]) -> list[Finding]:
    """The per-GPU check's slow or corrupt GPUs, one finding each (``drain`` for a corrupt GPU); a GPU
    whose speed is undecided (a difference this machine's noise swallows) is a note, not a problem."""
    out = []
    for row in (check.get("metrics") or {}).get("rows") or []:
        verdict = row.get("verdict")
        if verdict in ("slow", "corrupt", "undecided"):
            action = "drain" if verdict == "corrupt" else "monitor"
            what = f"per-GPU check: {verdict}: {row.get('why')}"
            remedy = check.get("remedy") or "see the probe report"
            if row.get("undecided_about") == "speed":
                what, remedy = f"per-GPU check: {row.get('why')}", _UNDECIDED_SPEED_REMEDY
            severity = NOTE if row.get("undecided_about") == "speed" else PROBLEM
            out.append(
                Finding(
                    f"GPU{row['gpu']}", what, remedy, severity, row["gpu"], category="compute", action=action
                )
            )
    return out
