"""Benchmark the `audit_input` stage, which runs on every `dvc repro`: how long it takes to pin a large input the
first time (every byte hashed) and every later time (the hash cache: one stat per file), side by side.

Writes one JSONL-named file of --gb GB (incompressible bytes; sha256 runs at the same speed on any content) in
a temporary folder, then runs `python -m stages.audit_input` on it three times, each in its own process and
each timed from process start to exit (interpreter start and imports included, as under `dvc repro`):
cold (an empty hash cache), warm (the cache from the cold run), and touched (the file's mtime changed, the
bytes not: hashed again, same manifest). The file was just written, so it is read from the page cache: a file
read from disk adds the disk's read time to the cold and touched runs.

    python benchmarks/audit_input.py            # 1 GB
    python benchmarks/audit_input.py --gb 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_stage(data: Path, work: Path) -> tuple[float, dict]:
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "xdg")}
    cmd = [sys.executable, "-m", "stages.audit_input", "--params", "params.yaml"]
    cmd += ["-S", f"audit.input={data}", "-S", f"base.reports_dir={work / 'reports'}"]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, json.loads((work / "reports/audit_input.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the input file in GB (10^9 bytes)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "big.jsonl"
        size, block = int(args.gb * 1e9), os.urandom(1 << 20)
        with open(data, "wb") as fh:
            for offset in range(0, size, len(block)):
                fh.write(block[: min(len(block), size - offset)])
        cold, first = run_stage(data, work)
        warm, second = run_stage(data, work)
        os.utime(data)
        touched, third = run_stage(data, work)
        assert first == second == third, "the manifest changed without the bytes changing"
        print(f"input: {size:,} bytes, one file; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'run':<10}{'seconds':>10}{'GB/s hashed':>14}")
        for name, seconds, hashed in (("cold", cold, True), ("warm", warm, False), ("touched", touched, True)):
            rate = f"{size / 1e9 / seconds:.2f}" if hashed else "-"
            print(f"{name:<10}{seconds:>10.2f}{rate:>14}")


if __name__ == "__main__":
    main()
