"""Figures without a network: Vega-Lite charts rendered to PNG on this machine, and the offline page template of
`dvc plots show`. The one renderer every stage and the run report use.

Renderer: vl-convert (the `vl-convert-python` package): the Vega-Lite and Vega JavaScript that `dvc plots show`
runs in a browser, compiled into a native library with its own JavaScript engine, so a chart here looks like
DVC's and needs no browser, no display and no download. Every spec built here carries its data inline
(`data.values`); `render_png` refuses a spec that names a URL and tells the engine to allow none
(allowed_base_urls=[]), so no rendering path can reach the network (tests/unit/core/test_figures.py checks it
with the network removed). Fonts come from the system's font folders.

Inputs: rows of plain dicts (what the stages already write as plot data). Outputs: PNG files (`write_png`),
`data:` URIs for a self-contained page (`data_uri`), and the `dvc plots show --html-template` page that inlines
Vega (`plots_template`), written by

    python -m dflash.core.figures dvc-template .dvc/plots_offline.html

May import: dflash.core only; vl_convert is imported inside the functions that render (module import is light).
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCALE = 2.0  # pixels per CSS pixel of the chart: sharp on high-density screens, ~50-120 kB a figure
WIDTH, HEIGHT = 520, 260  # the plot area in CSS pixels (axes, title and legend come on top)
VEGA_LITE = "5.21"  # the Vega-Lite DVC's own templates are written for (their $schema is v5)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One look for every figure: white background (a transparent PNG vanishes on a dark page), quiet grid.
CONFIG = {
    "background": "white",
    "view": {"stroke": None},
    "axis": {"labelFontSize": 11, "titleFontSize": 12, "gridColor": "#e6e6e6"},
    "title": {"fontSize": 14, "anchor": "start", "subtitleFontSize": 11, "subtitleColor": "#555"},
    "legend": {"labelFontSize": 11, "titleFontSize": 11, "orient": "right"},
}


def _field(name: str, title: str, kind: str = "quantitative", **extra: Any) -> dict:
    return {"field": name, "type": kind, "title": title, **extra}


def _spec(rows: Sequence[dict], title: str, subtitle: str, layer: dict, **top: Any) -> dict:
    spec = {
        "$schema": f"https://vega.github.io/schema/vega-lite/v{VEGA_LITE.split('.')[0]}.json",
        "title": {"text": title, **({"subtitle": subtitle} if subtitle else {})},
        "data": {"values": [dict(r) for r in rows]},
        "config": CONFIG,
        **top,
    }
    spec.update(layer)
    return spec


def line_chart(
    rows: Sequence[dict],
    *,
    x: str,
    y: str,
    title: str,
    x_title: str,
    y_title: str,
    subtitle: str = "",
    color: str = "",
    color_title: str = "",
    column: str = "",
    column_title: str = "",
    log_x: bool = False,
    log_y: bool = False,
    y_domain: tuple[float, float] | None = None,
    points: bool = True,
    dash: str = "",
    dash_values: Sequence[str] = (),
    y_zero: bool = False,
) -> dict:
    """Lines with points of `y` over `x`: one series per value of `color`, one panel per value of `column`."""
    y_scale: dict[str, Any] = {"type": "log"} if log_y else {"zero": y_zero}
    if y_domain is not None:
        y_scale = {"domain": list(y_domain)}
    enc: dict[str, Any] = {
        "x": _field(x, x_title, scale={"type": "log", "base": 2} if log_x else {"zero": False}),
        "y": _field(y, y_title, scale=y_scale),
        "tooltip": [{"field": k, "type": "nominal" if k in (color, column) else "quantitative"} for k in (x, y)],
    }
    if color:
        enc["color"] = _field(color, color_title or color, "nominal", sort=None)
    if dash:  # the first value of `dash_values` solid, the next ones dashed
        dashes = [[1, 0], [6, 4], [2, 3]][: len(dash_values)]
        scale = {"domain": list(dash_values), "range": dashes} if dash_values else {}
        enc["strokeDash"] = _field(dash, dash, "nominal", legend=None, scale=scale)
    if log_x:  # ticks at the measured values only (GPU counts, concurrency levels), never at 1.5 GPUs
        enc["x"]["axis"] = {"values": sorted({r[x] for r in rows})}
    elif rows and all(isinstance(r[x], int) for r in rows):  # steps, positions: no tick at 2.5
        enc["x"]["axis"] = {"tickMinStep": 1, "format": "d"}
    mark = {"type": "line", "point": points, "strokeWidth": 2}
    if column:
        inner = {"mark": mark, "encoding": enc, "width": WIDTH // 2, "height": HEIGHT}
        order = list(dict.fromkeys(r[column] for r in rows))  # panels in the data's order (Vega would sort them)
        return _spec(
            rows,
            title,
            subtitle,
            {"facet": {"column": _field(column, column_title or column, "nominal", sort=order)}, "spec": inner},
            resolve={"scale": {"x": "shared", "y": "shared"}},
        )
    return _spec(rows, title, subtitle, {"mark": mark, "encoding": enc, "width": WIDTH, "height": HEIGHT})


def bar_chart(
    rows: Sequence[dict],
    *,
    x: str,
    y: str,
    title: str,
    x_title: str,
    y_title: str,
    subtitle: str = "",
    log_x: bool = False,
) -> dict:
    """A histogram whose bins are already counted (x = the exact value, y = its count): one thin bar per value on
    a numeric axis, so that a spike at one value (placeholder answers) stands out however wide the range."""
    top = max((r[x] for r in rows), default=1)
    x_enc = _field(x, x_title, scale={"zero": True})
    if log_x:  # symlog: 0 is a length too; ticks at 1-2-5 steps, which Vega's own symlog ticks do not give
        ticks = [0] + [m * 10**e for e in range(12) for m in (1, 2, 5) if m * 10**e <= top * 2]
        x_enc = _field(x, x_title, scale={"type": "symlog", "domainMin": 0}, axis={"values": ticks})
    enc = {
        "x": x_enc,
        "y": _field(y, y_title),
        "tooltip": [{"field": x, "type": "quantitative"}, {"field": y, "type": "quantitative"}],
    }
    mark = {"type": "bar", "size": 3, "color": "#4c78a8"}
    return _spec(rows, title, subtitle, {"mark": mark, "encoding": enc, "width": WIDTH, "height": HEIGHT})


def _urls(obj: Any, path: str = "spec") -> list[str]:
    """Every `url` a spec names (data, images, config): none may be there."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "url":
                found.append(f"{path}.url = {value!r}")
            else:
                found += _urls(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += _urls(value, f"{path}[{i}]")
    return found


def render_png(spec: dict) -> bytes:
    """The PNG of a Vega-Lite spec, rendered here with the network shut out (inline data only)."""
    urls = _urls(spec)
    if urls:
        raise ValueError(f"a figure must carry its data inline, not fetch it: {'; '.join(urls)}")
    import vl_convert

    png = vl_convert.vegalite_to_png(spec, vl_version=VEGA_LITE, scale=SCALE, allowed_base_urls=[])
    if not png.startswith(PNG_MAGIC):
        raise RuntimeError("vl-convert returned something that is not a PNG")
    return _compress(bytes(png))


def _compress(png: bytes) -> bytes:
    """The same pixels in a smaller file: vl-convert compresses lightly (~180 kB a chart); Pillow's optimizing
    PNG encoder gives ~35 kB, which keeps the committed figures and the one-page report small."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(png)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def write_png(path: str | Path, spec: dict) -> Path:
    """Render `spec` and write it atomically to `path` (a .png)."""
    from dflash.core.io import atomic_write

    atomic_write(path, render_png(spec))
    return Path(path)


def data_uri(png: bytes) -> str:
    """A PNG as a `data:` URI: the image travels inside the page, nothing is fetched to show it."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# The `dvc plots show` page, with Vega inlined instead of DVC's three <script src=...> tags from a CDN (its
# `{scripts}` placeholder is left out on purpose: DVC would put them there). vegaEmbed is wrapped so that the
# chart menu offers only what works offline (save as SVG / PNG, view the source): no "Open in Vega Editor".
PLOTS_TEMPLATE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot (offline)</title>
    <!-- Vega, Vega-Lite and Vega-Embed inlined (dflash/core/figures.py): this page fetches nothing. -->
    <script>
__BUNDLE__
    </script>
    <script>
        (function () {
            var embed = window.vegaEmbed;
            window.vegaEmbed = function (el, spec, opt) {
                var o = Object.assign({actions: {export: true, source: true, compiled: false, editor: false}}, opt || {});
                return embed(el, spec, o);
            };
        })();
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def plots_template() -> str:
    """The `dvc plots show --html-template` page: DVC's layout with Vega inlined (about 0.9 MB)."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
    for placeholder in ("{plot_divs}", "{scripts}", "{refresh_tag}", "</script"):
        if placeholder in bundle:  # DVC fills placeholders by plain replacement; a closing tag would end ours
            raise RuntimeError(f"the Vega bundle contains {placeholder!r}: it cannot be inlined as is")
    return PLOTS_TEMPLATE.replace("__BUNDLE__", bundle)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "dvc-template":
        print("usage: python -m dflash.core.figures dvc-template PATH", file=sys.stderr)
        return 2
    from dflash.core.io import atomic_write

    atomic_write(argv[1], plots_template())
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
