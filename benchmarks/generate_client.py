"""Benchmark: the servers backend's client at cluster scale, against fake OpenAI servers that answer at once
with 1,500-token replies (benchmarks/fake_openai_servers.py, all of them in one process of their own).

For each in-flight level (default 256, 1,024, 4,096, 8,192 = `--servers` x max_num_seqs), a fresh process runs
the real client (dflash.generate.servers_backend.ServersDispatcher: rendering with the real Qwen3 tokenizer and chat
template, reply validation, the reasoning split, rows, zstd shard commits into a temp folder) over
`--conversations` single-turn conversations (default max(20,000, 5 x the level): the client renders up to 2 x the
level ahead, so fewer would leave the measured window without the rendering a steady state has), and reports:
  completions/s        completions between 10 % and 90 % of the run / the time between (ramp-up and drain out)
  in flight            the client's requests in flight, sampled every 0.1 s over the same window (mean)
  client CPU s / 1000  user + system CPU seconds of the client process per 1,000 completions (whole run)
  peak RSS             the client process's peak resident memory (tokenizer and interpreter included)
  servers CPU s / 1000 the fake servers' CPU seconds per 1,000 completions: they run on the same cores
`--baseline REV` runs the same measurement with the client of git revision REV (checked out into a temporary
`git worktree`, its own params.yaml) and prints both side by side: before / after in one run.

Goal (issue 27): >= 500 completions/s at 8,192 in flight, RSS <= 1 GB and not growing with the level.

    python benchmarks/generate_client.py --baseline 892a416
    python benchmarks/generate_client.py --levels 256,8192 --conversations 20000 --servers 8

Outputs: the table on stdout (nothing kept; temp folders are removed). One process per level, so each peak RSS
is that level's own. Run it under the heavy lock: flock /tmp/dflash-heavy.lock python benchmarks/...
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "at",
    "an",
    "which",
    "have",
    "not",
]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n single-turn conversations whose prompts render to about 150-250 Qwen3 tokens each, all distinct."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(140, 240)))
        out.append({"conversation_id": f"b{i:07d}", "messages": [{"role": "user", "content": text}], "tools": None})
    return out


def child(args: argparse.Namespace) -> None:
    """One level in this process, with the client of the tree this process imports from (REPO or --tree)."""
    sys.path.insert(0, args.tree)
    if args.no_uvloop:
        sys.modules["uvloop"] = None  # the stdlib event loop (uvloop's import then fails)
    from dflash.core.chat import template_kwargs
    from dflash.core.hf import load_tokenizer
    from dflash.core.loader import load_params

    try:
        client = importlib.import_module("dflash.generate.servers_backend")
    except ImportError:  # a tree from before the backends were named (--baseline, --tree): client.py
        client = importlib.import_module("dflash.generate.client")
    from dflash.generate.contract import WorkerConfig, count_prompts
    from dflash.generate.units import make_units
    from dflash.target.build import QWEN3_VOCAB_ROWS, qwen3_tokenizer_dir

    urls = args.urls.split(",")
    overrides = [
        f"generate.max_num_seqs={args.level // len(urls)}",
        f"generate.sampling.max_tokens={args.completion_tokens}",
        "generate.unit_size=64",
        "generate.request_timeout_s=600",
    ]
    g = load_params(Path(args.tree) / "params.yaml", overrides).generate
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir()))
    convs = conversations(args.conversations)
    fields = {
        "gparams": g,
        "model": str(qwen3_tokenizer_dir()),
        "model_name": "bench",
        "revision": "",
        "seed": 0,
        "trust_remote_code": False,
        "template_kwargs": template_kwargs(False, {}),
        "run_dir": args.run_dir,
        "run_hash": "bench",
        "vocab_size": QWEN3_VOCAB_ROWS,
    }
    cfg = WorkerConfig(**{k: v for k, v in fields.items() if k in WorkerConfig.__dataclass_fields__})
    d = client.ServersDispatcher(
        make_units(convs, 64),
        cfg,
        g,
        urls={u: "fake" for u in urls},
        model="m",
        tokenizer=tokenizer,
        total_prompts=count_prompts(convs),
        done=0,
    )

    def in_flight() -> int:  # the thread client kept a dict of futures; the asynchronous one counts per server
        return d.in_flight() if hasattr(d, "in_flight") else len(d.inflight)

    samples: list[tuple[float, int, int]] = []  # (time, completions so far, in flight)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(Exception):  # a list being replaced under us: skip the sample
                samples.append((time.time(), sum(s.stats.prompts for s in d.servers), in_flight()))

    sampler = threading.Thread(target=sample, daemon=True)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    sampler.start()
    d.run()
    stop.set()
    sampler.join()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    total = sum(s.stats.prompts for s in d.servers)
    lo = next(s for s in samples if s[1] >= 0.1 * total)
    hi = next((s for s in samples if s[1] >= 0.9 * total), samples[-1])
    window = [s for s in samples if lo[0] <= s[0] <= hi[0]]
    print(
        json.dumps(
            {
                "completions": total,
                "completions_per_s": (hi[1] - lo[1]) / max(1e-9, hi[0] - lo[0]),
                "in_flight": sum(s[2] for s in window) / max(1, len(window)),
                "cpu_s_per_1000": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / total * 1000,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            }
        )
    )


def start_servers(count: int, tokens: int) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "fake_openai_servers.py"), "--servers", str(count)]
        + ["--completion-tokens", str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    urls = [proc.stdout.readline().strip() for _ in range(count)]
    return proc, urls


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def measure(tree: str, level: int, args: argparse.Namespace, no_uvloop: bool = False) -> dict:
    servers, urls = start_servers(args.servers, args.completion_tokens)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [sys.executable, __file__, "--child", "--tree", tree, "--level", str(level), "--run-dir", run_dir]
            n = args.conversations or max(20000, 5 * level)
            cmd += ["--urls", ",".join(urls), "--conversations", str(n)]
            cmd += ["--completion-tokens", str(args.completion_tokens)] + (["--no-uvloop"] if no_uvloop else [])
            before = cpu_s(servers.pid)
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
            if out.returncode != 0:
                raise SystemExit(f"level {level} in {tree} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["servers_cpu_s_per_1000"] = (cpu_s(servers.pid) - before) / result["completions"] * 1000
            result["conversations"] = n
            return result
    finally:
        servers.kill()
        servers.wait()


@contextlib.contextmanager
def baseline_tree(rev: str):
    """A temporary git worktree of `rev` (its own dflash/ and params.yaml), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="dflash-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True
    )
    try:
        yield str(path)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="256,1024,4096,8192", help="requests in flight, comma-separated")
    parser.add_argument("--servers", type=int, default=8, help="fake servers (each level is split over them)")
    parser.add_argument("--conversations", type=int, default=0, help="0 = max(20000, 5 x the level)")
    parser.add_argument("--completion-tokens", type=int, default=1500)
    parser.add_argument("--baseline", default="", help="git revision whose client runs beside this one")
    parser.add_argument("--stdlib-loop", action="store_true", help="also run this client on the stdlib event loop")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(REPO), help=argparse.SUPPRESS)
    parser.add_argument("--level", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--urls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--no-uvloop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    levels = [int(x) for x in args.levels.split(",")]
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    sides = [(f"this tree ({rev.stdout.strip()})", str(REPO), False)]
    if args.stdlib_loop:
        sides.append(("this tree, stdlib event loop", str(REPO), True))
    rows = []
    with contextlib.ExitStack() as stack:
        if args.baseline:
            sides.insert(0, (f"baseline {args.baseline}", stack.enter_context(baseline_tree(args.baseline)), False))
        for level in levels:
            for name, tree, no_uvloop in sides:
                r = measure(tree, level, args, no_uvloop)
                rows.append((name, level, r))
                print(f"  measured {name} at {level}: {json.dumps(r)}", file=sys.stderr, flush=True)
    print(
        f"single-turn conversations, {args.completion_tokens}-token replies, {args.servers} fake servers in one "
        f"process on the same machine ({os.cpu_count()} cores shared by the client and the servers)"
    )
    head = ("client", "level", "conversations", "in flight", "completions/s", "client CPU s/1000", "peak RSS GB")
    head += ("servers CPU s/1000",)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, level, r in rows:
        print(
            f"| {name} | {level} | {r['conversations']} | {r['in_flight']:.0f} | {r['completions_per_s']:.0f} | "
            f"{r['cpu_s_per_1000']:.2f} | {r['peak_rss_gb']:.2f} | {r['servers_cpu_s_per_1000']:.2f} |"
        )


if __name__ == "__main__":
    main()
