"""Benchmark the audit: vectorised (dflash.audit) vs a naive per-row Python loop doing the same checks.

Generates N synthetic OpenAI-`messages` JSONL conversations (single- and multi-turn, system prompts,
tool calls, ~30% placeholder answers, ~2% duplicate prompts, a few malformed lines), audits them with
`dflash.audit.run.run_audit` (no tokenizer: the token path is optional and reported separately), then
runs a naive loop (json.loads, normalize, the same checks, canonical JSON, sha256 id, dedup, Arrow
output) over the first --naive-rows rows, and prints rows/s for both and the ratio.

    python benchmarks/audit.py                 # 1M conversations (goal: < 30 s on 2 cores, >= 10x naive)
    python benchmarks/audit.py --rows 200000 --naive-rows 50000
    python benchmarks/audit.py --rows 100000 --tokenizer artifacts/target   # + the token path on 20K rows
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from dflash.core.io import write_arrow  # noqa: E402
from dflash.core.loader import load_params  # noqa: E402
from dflash.target.synthetic import PLACEHOLDERS, conversation  # noqa: E402

ROLES = {"system", "user", "assistant", "tool"}


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
            if i % 40 == 3:
                call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
                messages[-1:] = [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": "42"},
                    messages[-1],
                ]
            fh.write(json.dumps({"id": i, "messages": messages}, ensure_ascii=False) + "\n")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic conversations (default 1M)")
    parser.add_argument("--naive-rows", type=int, default=100_000, help="rows the naive loop reads (default 100K)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", default="", help="also time the token path on --token-rows rows with this tokenizer folder"
    )
    parser.add_argument("--token-rows", type=int, default=20_000, help="rows for the token path (default 20K)")
    args = parser.parse_args()

    from dflash.audit.run import run_audit

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "synthetic.jsonl"
        t0 = time.perf_counter()
        synth(data, args.rows, args.seed)
        size = data.stat().st_size
        print(f"generated {args.rows} rows ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")

        params = load_params(
            Path(__file__).resolve().parents[1] / "params.yaml",
            [f"audit.input={data}", f"audit.out={tmp}/out", "audit.tokenizer=none"],
        )
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = run_audit(params.audit, params.base)
        fast_s, fast_cpu = time.perf_counter() - t0, time.process_time() - c0
        fast = args.rows / fast_s
        print(
            f"audit (vectorised): {args.rows} rows in {fast_s:.2f} s wall ({fast_cpu:.2f} s CPU) = {fast:,.0f} rows/s "
            f"(kept {metrics['num_kept']}, rejected {metrics['num_rejected']}, malformed {metrics['num_malformed']}, "
            f"placeholders {metrics['placeholder_response_frac']:.1%})"
        )

        n_naive = min(args.naive_rows, args.rows)
        placeholders = {"".join(ch for ch in t.lower() if ch.isalnum()) for t in params.audit.placeholder_texts}
        (Path(tmp) / "naive").mkdir()
        t0, c0 = time.perf_counter(), time.process_time()
        counts = naive(data, n_naive, placeholders, Path(tmp) / "naive")
        naive_s, naive_cpu = time.perf_counter() - t0, time.process_time() - c0
        slow = n_naive / naive_s
        print(
            f"naive per-row loop: {n_naive} rows in {naive_s:.2f} s wall ({naive_cpu:.2f} s CPU) = {slow:,.0f} rows/s ({counts})"
        )
        per_row = (fast_cpu / args.rows, naive_cpu / n_naive)
        print(
            f"CPU per row: audit {per_row[0] * 1e6:.1f} us, naive {per_row[1] * 1e6:.1f} us ({per_row[1] / per_row[0]:.1f}x)"
        )
        print(f"speed-up: {fast / slow:.1f}x; 1M rows would take {1e6 / fast:.1f} s (goal < 30 s, >= 10x)")

        if args.tokenizer:
            subset = Path(tmp) / "subset.jsonl"
            with open(data, "rb") as src, open(subset, "wb") as dst:
                for _, line in zip(range(args.token_rows), src, strict=False):
                    dst.write(line)
            params = load_params(
                Path(__file__).resolve().parents[1] / "params.yaml",
                [f"audit.input={subset}", f"audit.out={tmp}/tok", f"audit.tokenizer={args.tokenizer}"],
            )
            t0 = time.perf_counter()
            metrics = run_audit(params.audit, params.base)
            tok_s = time.perf_counter() - t0
            print(
                f"audit with tokenizer (chat template render + token counts): {args.token_rows} rows in {tok_s:.2f} s = "
                f"{args.token_rows / tok_s:,.0f} rows/s (loss-mask spike {metrics['response_length_spike_frac']:.1%} at "
                f"{metrics['response_length_spike_value']} tokens)"
            )


if __name__ == "__main__":
    main()
