"""Stage `target`: build the embedded tiny Qwen3 target, or record a reference to a real target.

Inputs: params `base`, `target`. Outputs: `${base.target_dir}/` (tiny: a full Qwen3 checkpoint with the
real Qwen3 tokenizer + target.json; real: target.json + config.json), metrics `reports/target.json`.

    python -m stages.target --params params.yaml
"""

from pathlib import Path

from dflash.core import cli
from dflash.core.io import write_json
from dflash.core.validate import check_target


def main(params):
    from dflash.target import build as target

    check_target(params)  # before any work: a refused size leaves the previous target as it was

    if params.target.source == "tiny":
        metrics = target.build_tiny(params.target, params.base, params.base.target_dir)
    else:
        metrics = target.write_reference(params.target, params.base.target_dir, params.base.trust_remote_code)
    write_json(Path(params.base.reports_dir) / "target.json", metrics)
    print(metrics)


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
