"""Stage `audit_input`: pin what `audit.input` holds right now, so that `dvc repro` reruns the audit exactly when it changed.

Inputs: params `audit.input` (a file, a folder, a glob or hf:DATASET_ID) and, for hf:, `audit.hf_split`,
`audit.hf_revision`, `audit.hf_columns`. Output: `${base.reports_dir}/audit_input.json`, the input's manifest
(dflash/audit/manifest.py: the files with their sizes and sha256, or the hub id, split, revision and columns).
dvc.yaml runs this stage on every `dvc repro` (`always_changed`) and the audit stage depends on its output
instead of on the input itself, which DVC cannot hash when it is a glob or a hub id. Unchanged files are not
hashed again (a cache keyed by size, mtime and inode under $XDG_CACHE_HOME/dflash).

    python -m stages.audit_input --params params.yaml
    python -m stages.audit_input --params params.yaml -S 'audit.input=data/chats/*.jsonl'
"""

from pathlib import Path

from dflash.core import cli
from dflash.core.io import write_json

MANIFEST = "audit_input.json"  # in base.reports_dir; dvc.yaml names the same file


def main(params):
    from dflash.audit.manifest import HashCache, describe, input_manifest

    cache = HashCache.default()
    manifest = input_manifest(params.audit, cache)
    cache.save()
    out = Path(params.base.reports_dir) / MANIFEST
    write_json(out, manifest)
    print(f"audit_input: {describe(manifest)}; {cache.hashed} hashed (the others unchanged since last hashed) -> {out}")


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
