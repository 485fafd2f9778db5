"""Synthetic conversations for the embedded demo: the tiny target's pre-training corpus and the
bundled sample dataset (which reproduces the 27B regeneration case's placeholder-response failure).

Every conversation comes from a small set of task families whose answers follow from the prompt
(arithmetic, counting, reversing, lookup tables, tiny code). A 4-layer target pre-trained on them
for a couple of CPU minutes answers in structured, learnable text, so a drafter trained on its
outputs has something to predict. Deterministic for a given seed; no torch.

Regenerate the bundled sample (checked in under data/sample/):
    python -m dflash.target.synthetic --out data/sample --seed 1234
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COUNTRIES = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Chile": "Santiago",
    "Cuba": "Havana",
    "Poland": "Warsaw",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Sweden": "Stockholm",
    "Mexico": "Mexico City",
    "India": "New Delhi",
    "China": "Beijing",
    "Brazil": "Brasilia",
    "Turkey": "Ankara",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Belgium": "Brussels",
    "Hungary": "Budapest",
    "Argentina": "Buenos Aires",
}
ANIMALS = {
    "dog": "barks",
    "cat": "meows",
    "cow": "moos",
    "duck": "quacks",
    "lion": "roars",
    "sheep": "bleats",
    "horse": "neighs",
    "owl": "hoots",
    "frog": "croaks",
    "snake": "hisses",
    "pig": "oinks",
    "goat": "bleats",
    "bee": "buzzes",
    "wolf": "howls",
    "mouse": "squeaks",
}
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "planet",
    "silver",
    "window",
    "candle",
    "forest",
    "pencil",
    "bridge",
    "rocket",
    "tiger",
    "orange",
    "summer",
    "winter",
    "castle",
    "dragon",
    "piano",
    "yellow",
    "market",
    "butter",
    "circle",
    "mirror",
    "anchor",
    "basket",
    "jungle",
    "lemon",
    "violet",
]
OPS = {"sum": "+", "difference": "-", "product": "*"}
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a careful assistant who thinks step by step.",
]
PLACEHOLDERS = ["OK.", "OK.", "OK.", "Sure.", "Done.", "OK", "Yes."]


def _task(rng: random.Random) -> tuple[str, str, str]:
    """One (prompt, reasoning, answer) triple from a random task family."""
    kind = rng.randrange(9)
    if kind == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return (f"What is {a} + {b}?", f"I need to add {a} and {b}. {a} + {b} = {a + b}.", f"{a} + {b} = {a + b}.")
    if kind == 1:
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        return (
            f"What is {a} times {b}?",
            f"I need to multiply {a} by {b}. {a} * {b} = {a * b}.",
            f"{a} times {b} is {a * b}.",
        )
    if kind == 2:
        a = rng.randint(1, 40)
        b = a + rng.randint(4, 12)
        seq = ", ".join(str(i) for i in range(a, b + 1))
        return (f"Count from {a} to {b}.", f"I will list the numbers from {a} to {b} in order.", seq + ".")
    if kind == 3:
        w = rng.choice(WORDS)
        letters = " ".join(w)
        rev = w[::-1]
        return (
            f'Reverse the word "{w}".',
            f"The letters of {w} are {letters}. In reverse order they are {' '.join(rev)}.",
            f'The word "{w}" reversed is "{rev}".',
        )
    if kind == 4:
        c = rng.choice(list(COUNTRIES))
        return (
            f"What is the capital of {c}?",
            f"The question asks for the capital city of {c}. The capital of {c} is {COUNTRIES[c]}.",
            f"The capital of {c} is {COUNTRIES[c]}.",
        )
    if kind == 5:
        a = rng.choice(list(ANIMALS))
        return (
            f"What sound does a {a} make?",
            f"A {a} is an animal. The sound a {a} makes is described as: it {ANIMALS[a]}.",
            f"A {a} {ANIMALS[a]}.",
        )
    if kind == 6:
        op = rng.choice(list(OPS))
        name = rng.choice(["combine", "calc", "compute", "apply", "merge"]) + f"_{op[:4]}"
        code = f"def {name}(a, b):\n    return a {OPS[op]} b"
        return (
            f"Write a Python function named {name} that returns the {op} of two numbers.",
            f"The function takes two arguments a and b and returns their {op}, which is a {OPS[op]} b.",
            f"```python\n{code}\n```",
        )
    if kind == 7:
        nums = [rng.randint(1, 50) for _ in range(rng.randint(3, 6))]
        s = ", ".join(str(n) for n in sorted(nums))
        return (
            f"Sort these numbers in ascending order: {', '.join(str(n) for n in nums)}.",
            f"I will order the numbers from smallest to largest: {s}.",
            f"Sorted in ascending order: {s}.",
        )
    w = rng.choice(WORDS)
    n = rng.randint(3, 8)
    return (
        f'Repeat the word "{w}" {n} times.',
        f"I need to write the word {w} exactly {n} times, separated by spaces.",
        " ".join([w] * n),
    )


def conversation(rng: random.Random, turns: int = 1, system: bool = False) -> list[dict]:
    """A messages-style conversation whose assistant turns carry `reasoning_content` and `content`."""
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(turns):
        prompt, reasoning, answer = _task(rng)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "reasoning_content": reasoning, "content": answer})
    return messages


def pretrain_corpus(n: int, seed: int) -> list[list[dict]]:
    """`n` conversations for the tiny target's pre-training (mostly single-turn, some with system)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = 1 if rng.random() < 0.85 else 2
        out.append(conversation(rng, turns=turns, system=rng.random() < 0.2))
    return out


def _tool_conversation(rng: random.Random, placeholder: bool) -> list[dict]:
    city = rng.choice(list(COUNTRIES.values()))
    temp = rng.randint(-5, 35)
    call = {
        "id": f"call_{rng.randrange(10**6):06d}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    final = "OK." if placeholder else f"It is {temp} degrees in {city} right now."
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"city": city, "celsius": temp})},
        {"role": "assistant", "content": final},
    ]


def sample_dataset(seed: int, n_sharegpt: int = 240, n_messages: int = 120) -> tuple[list, list[str]]:
    """The bundled sample: (ShareGPT rows, OpenAI-messages JSONL lines incl. malformed ones).

    Reproduces the 27B regeneration case's failure: ~85% of assistant turns are placeholders ("OK."), with multi-turn,
    system-prompt and tool-call conversations, a few duplicates, shape errors and malformed rows.
    """
    rng = random.Random(seed)
    role_of = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = []
    for i in range(n_sharegpt):
        conv = conversation(rng, turns=1 if rng.random() < 0.8 else rng.randint(2, 3), system=rng.random() < 0.2)
        placeholder = rng.random() < 0.85
        turns = []
        for m in conv:
            if m["role"] == "assistant":
                value = rng.choice(PLACEHOLDERS) if placeholder else f"{m['content']}"
            else:
                value = m["content"]
            turns.append({"from": role_of[m["role"]], "value": value})
        sharegpt.append({"id": f"sg-{i:04d}", "conversations": turns})
    # Shape problems a real scrape has: a duplicate prompt, an empty prompt, a conversation that opens
    # with the assistant, an unknown role.
    sharegpt.append({"id": "sg-dup", "conversations": [dict(t) for t in sharegpt[3]["conversations"]]})
    sharegpt.append(
        {"id": "sg-empty", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "OK."}]}
    )
    sharegpt.append(
        {
            "id": "sg-gpt-first",
            "conversations": [
                {"from": "gpt", "value": "Hello!"},
                {"from": "human", "value": "Count from 3 to 9."},
                {"from": "gpt", "value": "OK."},
            ],
        }
    )
    sharegpt.append(
        {
            "id": "sg-odd-role",
            "conversations": [
                {"from": "narrator", "value": "Once upon a time."},
                {"from": "human", "value": "What is 4 + 5?"},
                {"from": "gpt", "value": "OK."},
            ],
        }
    )

    lines = []
    for i in range(n_messages):
        if rng.random() < 0.08:
            messages = _tool_conversation(rng, placeholder=rng.random() < 0.85)
        else:
            conv = conversation(rng, turns=1 if rng.random() < 0.8 else 2, system=rng.random() < 0.25)
            placeholder = rng.random() < 0.85
            messages = []
            for m in conv:
                if m["role"] == "assistant":
                    messages.append(
                        {"role": "assistant", "content": rng.choice(PLACEHOLDERS) if placeholder else m["content"]}
                    )
                else:
                    messages.append(m)
        lines.append(json.dumps({"id": f"msg-{i:04d}", "messages": messages}, ensure_ascii=False))
    # Malformed rows, each of a different kind, at fixed places so tests can name their lines.
    lines.insert(10, '{"id": "msg-broken", "messages": [{"role": "user", "content": "What is 2 + 2?"}')
    lines.insert(20, json.dumps({"id": "msg-nomessages", "conversation": []}))
    lines.insert(30, json.dumps({"id": "msg-nocontent", "messages": [{"role": "user"}]}))
    return sharegpt, lines


def write_sample(out: Path, seed: int) -> None:
    sharegpt, lines = sample_dataset(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    # One line of invalid UTF-8, as scraped data sometimes has.
    bad = b'{"id": "msg-badutf8", "messages": [{"role": "user", "content": "caf\xe9?"}]}\n'
    parts = raw.split(b"\n")
    parts.insert(40, bad.rstrip(b"\n"))
    (out / "messages.jsonl").write_bytes(b"\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/sample")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    write_sample(Path(args.out), args.seed)


if __name__ == "__main__":
    main()
