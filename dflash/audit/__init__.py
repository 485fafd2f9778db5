"""Stage `audit`: raw conversations checked in seconds, before any GPU time.

  records.py   one row's RAW layout and the Python reader for rows Arrow refuses
  readers.py   files (jsonl / json array / parquet) -> RAW chunks, malformed rows named by file:line
  turns.py     ShareGPT -> OpenAI roles, tool calls, canonical per-turn JSON (vectorised)
  checks.py    the checks of one chunk and its kept rows
  state.py     running counts, duplicate keys and histograms across chunks
  report.py    audit.json, report.md, plots
  run.py       the stage: read, check, write, gates

May import: dflash.core, dflash.drafter. No torch.
"""
