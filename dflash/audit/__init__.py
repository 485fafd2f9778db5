"""Stage `audit`: raw conversations checked in seconds, before any GPU time.

  records.py   one row's RAW layout, row_ref (what a row number means), the Python reader for rows Arrow refuses
  files.py     which files are inputs (extensions, .gz / .zst), opening them, skipped folder files
  readers.py   files (jsonl / parquet) -> RAW chunks, malformed rows named FILE:line N / FILE row N
  json_array.py  a top-level JSON array, element by element, resynchronising after a syntax error
  turns.py     ShareGPT -> OpenAI roles, tool calls, canonical per-turn JSON (vectorised)
  checks.py    the checks of one chunk and its kept rows
  tokens.py    the token path: exact template_error / prompt_too_long from a byte bound, a seeded token sample
  counts.py    exact token counts from cached pieces (cut at guaranteed pre-token boundaries)
  state.py     running counts, duplicate keys and histograms across chunks
  report.py    audit.json, report.md, plots
  run.py       the stage: read, check, write, gates

May import: dflash.core, dflash.drafter. No torch.
"""
