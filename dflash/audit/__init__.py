"""Stage `audit`: raw conversations checked in seconds, before any GPU time.

  records.py   one row's RAW layout, row_ref (what a row number means), the Python reader for rows Arrow refuses
  files.py     which files are inputs, by their names (extensions, .gz / .zst, save_to_disk folders), skipped files
  forms.py     what a file holds, from its bytes (gzip / zstd / plain, JSON array / lines, parquet / Arrow), opening it
  hub.py       audit.input hf:DATASET_ID: the split's Arrow files in the `datasets` cache (pinned revision, offline)
  readers.py   every input -> RAW chunks; JSONL here, malformed rows named FILE:line N
  tables.py    parquet / Arrow files / save_to_disk folders / hub splits -> RAW chunks (FILE row N), JSON-string columns
  json_array.py  a top-level JSON array, element by element, resynchronising after a syntax error
  turns.py     ShareGPT -> OpenAI roles, tool calls, canonical per-turn JSON (vectorised)
  checks.py    the checks of one chunk and its kept rows
  tokens.py    the token path: exact template_error / prompt_too_long from a byte bound, a seeded token sample
  counts.py    exact token counts from cached pieces (cut at guaranteed pre-token boundaries)
  state.py     running counts, duplicate keys and histograms across chunks
  report.py    audit.json, report.md, plots
  run.py       the stage: read, check, write, gates
  manifest.py  the input's identity for DVC (files + sha256 with a stat-keyed cache, or the hub id + revision):
               stage audit_input, whose output the audit depends on in place of a glob or an hf: id

May import: dflash.core; `datasets` lazily (hub.py only). No torch.
"""
