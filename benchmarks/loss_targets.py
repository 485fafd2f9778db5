"""Experiment: which training loss target and slot weighting give the best drafter, per eval prompt set.

Grid (every point one `dvc exp run -n NAME -S ...` in the workspace, so anyone reruns any point with the same flags):
  data        generate.sampling greedy (temperature 0) or sampled (temperature 1.0, top_p 0.95: Qwen's thinking mode)
  loss        train.loss_target: tokens | target_argmax | target_kl
  weighting   train.position_weighting: decay | dpace
  eval        eval.temperature 0 and 1 (vLLM speculative decoding; rejection sampling at 1)
The points run in the workspace one after another, ordered so that consecutive points share every stage but the
last changed one (dvc.lock then reruns only those: eval between the two eval temperatures, train + eval between
weightings and losses, generate + tokenize + train + eval between the data settings), so the grid costs 2
generations, 12 trainings and 24 evaluations. (`--temp` / `--queue` would start each point from the committed
dvc.lock, and DVC's run-cache skips stages with `cache: false` or persistent outputs, which every stage here
has.) The experiment evaluates with the dflash engine only, 8 requests at a time and no PyTorch reference
(EVAL_FIXED), which changes no tau. Points that already ran (an experiment of the same name exists) are read
back, not rerun: a killed run resumes. The workspace ends holding the last point (`git checkout params.yaml
dvc.lock && dvc checkout` returns to the committed state).

Outputs: prints the table (tau per point and prompt set) and writes it as markdown to --out; the experiments stay
in the repo (`dvc exp show`, `dvc exp apply NAME`).

    python benchmarks/loss_targets.py --out reports/loss_targets.md            # the whole grid (~1-2 h on 2 CPU cores)
    python benchmarks/loss_targets.py --data sampled --eval-temps 0 --out /tmp/t.md   # a slice
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = {
    "greedy": ["generate.sampling.temperature=0.0", "generate.sampling.top_p=1.0"],
    "sampled": ["generate.sampling.temperature=1.0", "generate.sampling.top_p=0.95"],
}
LOSSES = ("tokens", "target_argmax", "target_kl")
WEIGHTINGS = ("decay", "dpace")
# tau only: the dflash engine, 8 requests at once (temperature 1 runs every output to its budget), no reference
EVAL_FIXED = ["eval.engines=[dflash]", "eval.reference=false", "eval.max_num_seqs=8", "eval.engine_timeout_s=3600"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _result(name: str) -> dict | None:
    """reports/eval.json of the experiment called `name`, or None when it has not run."""
    refs = [r for r in _git("for-each-ref", "--format=%(refname)", "refs/exps").split() if r.endswith(f"/{name}")]
    if not refs:
        return None
    return json.loads(_git("show", f"{refs[-1]}:reports/eval.json"))


def run_point(name: str, overrides: list[str], extra: list[str]) -> dict:
    done = _result(name)
    if done is not None:
        print(f"{name}: already ran (read back)", flush=True)
        return done
    cmd = [sys.executable, "-m", "dvc", "exp", "run", "-n", name]
    for o in [*overrides, *EVAL_FIXED, *extra]:
        cmd += ["-S", o]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    result = _result(name)
    if result is None:
        raise SystemExit(f"{name}: the experiment ran but no refs/exps/*/{name} holds its reports/eval.json")
    return result


def table(rows: list[dict]) -> str:
    sets = list(rows[0]["eval"]["prompt_sets"]) if rows else []
    head = ["data", "loss_target", "weighting", "eval T", *[f"tau {s}" for s in sets]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        taus = [r["eval"]["prompt_sets"][s]["tau"] for s in sets]
        cells = [r["data"], r["loss"], r["weighting"], str(r["eval_temp"]), *[f"{t:.3f}" if t else "-" for t in taus]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", default=list(DATA), choices=list(DATA))
    ap.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    ap.add_argument("--weightings", nargs="+", default=list(WEIGHTINGS), choices=WEIGHTINGS)
    ap.add_argument("--eval-temps", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("-S", dest="extra", action="append", default=[], help="more -S overrides for every point")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()
    rows = []
    for data, loss, weighting, temp in itertools.product(args.data, args.losses, args.weightings, args.eval_temps):
        name = f"lt-{data}-{loss}-{weighting}-t{temp:g}".replace("_", "-")
        overrides = [
            *DATA[data],
            f"train.loss_target={loss}",
            f"train.position_weighting={weighting}",
            f"eval.temperature={temp}",
        ]
        rows.append(
            {
                "data": data,
                "loss": loss,
                "weighting": weighting,
                "eval_temp": temp,
                "eval": run_point(name, overrides, args.extra),
            }
        )
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
