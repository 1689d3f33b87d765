"""``report.md`` and ``report.json`` of ``make compile-check`` from its parts' records (plain
Python). A part is ok when it exited 0; the report lists every failure with its reason, and
planted regressions (``--plant``) under their own heading: they must fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compilecheck.limits import TARGETS

MiB = 1 << 20
PARTS = ("triton", "xla", "export")


def _mib(n: Any) -> str:
    return "-" if n is None else f"{int(n) / MiB:.1f}"


def triton_lines(data: dict[str, Any]) -> list[str]:
    s = data.get("summary", {})
    lines = [f"Triton {data.get('triton', '?')}: {s.get('kernels', 0)} kernels compiled ahead of time "
             f"({s.get('attention_plans', 0)} paged-attention plans, the KV write, split-KV combine and recurrent "
             f"kernels) in {data.get('seconds', '?')} s on {data.get('workers', '?')} processes; "
             f"{s.get('failed', 0)} failed.", "",
             "| target | chips | kernels | failed | max shared (limit) | max registers (limit) | max spills |",
             "|---|---|---:|---:|---|---|---:|"]
    for name, t in s.get("per_target", {}).items():
        lim = TARGETS[name]
        lines.append(f"| {name} | {lim.chips} | {t['compiled'] + t['failed']} | {t['failed']} | "
                     f"{t['max_shared'] / 1024:.0f} KB ({lim.shared_bytes // 1024} KB) | {t['max_registers']} "
                     f"({lim.regs_per_thread}) | {t['max_spill_bytes']} B |")
    for skip in data.get("skipped", []):
        lines.append(f"| {skip['target']} | {TARGETS[skip['target']].chips} | skipped: {skip['reason']} | | | | |")
    return lines + _failures([r for r in data.get("records", []) if not r["ok"]],
                             lambda r: f"{r['target']} {r['kernel']} `{r['plan']}`")


def xla_lines(data: dict[str, Any]) -> list[str]:
    if data.get("skipped"):
        return [f"Skipped: {data['skipped']}"]
    records = data.get("records", [])
    b = data.get("bounds", {})
    lines = [f"jax {data.get('jax', '?')}, libtpu {data.get('libtpu', '?')}: {len(records)} programs compiled "
             f"for TPUs with no TPU in {data.get('seconds', '?')} s; {sum(not r['ok'] for r in records)} failed. "
             f"Bounds: temp growth < {b.get('temp_growth_fraction', 0):.0%} of the smaller cache when it grows "
             f"{data.get('configuration', {}).get('growth', '?')}x; Pallas temp <= {_mib(b.get('pallas_temp_bound'))} "
             f"MiB; reference temp <= {b.get('reference_factor', '?')} x its float32 context gather + state + "
             f"{_mib(b.get('temp_slack'))} MiB. Figures per device.", "",
             "| chip | model | attention | program | blocks | cache MiB | alias MiB | temp MiB | bound MiB | "
             "compile s | result |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    from compilecheck.xla_checks import temp_bound

    for r in records:
        if r.get("role") != "forward" or r.get("planted"):
            continue
        bound = temp_bound(r) if "temp_bytes" in r else None
        result = "ok" if r["ok"] else "FAIL"
        lines.append(f"| {r['chip']} | {r['config']} | {r['kernel']} | {r['program']} | {r.get('num_blocks', '-')} | "
                     f"{_mib(r.get('cache_bytes'))} | {_mib(r.get('alias_bytes'))} | {_mib(r.get('temp_bytes'))} | "
                     f"{_mib(bound)} | {r.get('compile_seconds', '-')} | {result} |")
    samplers = [r for r in records if r.get("role") == "sampler"]
    if samplers:
        lines += ["", "| chip | sampler | rows | temp MiB | compile s | result |", "|---|---|---:|---:|---:|---|"]
        lines += [f"| {r['chip']} | {r['program']} | {r.get('num_reqs', '-')} | {_mib(r.get('temp_bytes'))} | "
                  f"{r.get('compile_seconds', '-')} | {'ok' if r['ok'] else 'FAIL'} |" for r in samplers]
    return lines + _failures([r for r in records if not r["ok"]],
                             lambda r: f"{r['chip']} {r['config']} {r['kernel']} {r['program']} "
                                       f"{r.get('num_blocks', '')}".rstrip())


def export_lines(data: dict[str, Any]) -> list[str]:
    records = data.get("records", [])
    lines = [f"{len(records)} programs exported with `jax.export` for {'/'.join(data.get('platforms', []))}, "
             f"serialized, reloaded and run on CPU against the jitted program in {data.get('seconds', '?')} s. "
             f"{data.get('registration', '')}.", "",
             "| program | serialized bytes | result |", "|---|---:|---|"]
    lines += [f"| {r['program']} | {r.get('bytes', '-')} | {'equal to the jitted program' if r['ok'] else 'FAIL'} |"
              for r in records]
    return lines + _failures([r for r in records if not r["ok"]], lambda r: r["program"])


def _failures(records: list[dict[str, Any]], name: Any) -> list[str]:
    planted = [r for r in records if r.get("planted")]
    real = [r for r in records if not r.get("planted")]
    lines = []
    if real:
        lines += ["", "**Failures:**", ""]
        lines += [f"* {name(r)}: {'; '.join(r.get('problems') or [r.get('error', '?')])[:600]}" for r in real]
    if planted:
        lines += ["", "**Planted regressions (`--plant`: each must fail):**", ""]
        lines += [f"* {name(r)}: FAIL: {'; '.join(r.get('problems') or [r.get('error', '?')])[:400]}"
                  for r in planted]
    return lines


SECTIONS = {"triton": ("Triton kernels for NVIDIA and AMD targets", triton_lines),
            "xla": ("XLA programs for TPU v5e / v6e (deviceless)", xla_lines),
            "export": ("XLA programs exported with jax.export", export_lines)}


def write_report(out: Path, machine: dict[str, Any]) -> tuple[Path, bool]:
    """report.md and report.json from ``out/parts/*.json``; (path of report.md, all parts ok)."""
    records = {}
    for name in PARTS:
        path = out / "parts" / f"{name}.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    ok = bool(records) and all(r["rc"] == 0 for r in records.values())
    lines = ["# graphrt compile check", "",
             f"**Machine:** {machine.get('cpu_count', '?')} CPU cores, no GPU or TPU needed.  ",
             f"**graphrt:** {machine.get('revision', '?')}; written {machine.get('date', '?')}"
             f"{'; with planted regressions' if machine.get('plant') else ''}.", "",
             "| part | result | seconds |", "|---|---|---:|"]
    for name, r in records.items():
        result = "ok" if r["rc"] == 0 else ("timed out" if r["rc"] == 124 else f"FAILED (exit {r['rc']})")
        lines.append(f"| {name} | {result} | {r['seconds']} |")
    for name, r in records.items():
        title, render = SECTIONS[name]
        lines += ["", f"## {title}", ""]
        data = r.get("data")
        lines += render(data) if data else ["```", r.get("output_tail", "")[-3000:].strip(), "```"]
    (out / "report.json").write_text(json.dumps({"machine": machine, "ok": ok, "parts": records}, indent=1))
    md = out / "report.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    return md, ok


__all__ = ["PARTS", "write_report"]
