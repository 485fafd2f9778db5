"""dflash/core/figures.py: charts become real pictures, every spec carries its data, and no rendering path
reaches the network: rendering works with Python's sockets disabled, inside a network namespace that has no
network at all (same bytes as outside), and opens no internet socket at the system-call level (strace, which also
sees the renderer's native code; a control run proves that the trace does see a socket)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from dflash.core import figures
from tests.helpers import REPO

# Renders one figure of every kind the stages use and the dvc plots template; prints a digest of all bytes.
RENDER_ALL = textwrap.dedent(
    """
    import hashlib, sys
    from dflash.core import figures as f
    rows = [{"k": k, "v": 1 / k, "s": s, "p": p} for k in (1, 2, 4, 8) for s in ("a", "b") for p in ("x", "y")]
    specs = [
        f.line_chart(rows, x="k", y="v", color="s", column="p", title="t", x_title="x", y_title="y", dash="s"),
        f.line_chart(rows, x="k", y="v", color="s", title="t", x_title="x", y_title="y", log_x=True, log_y=True),
        f.bar_chart([{"n": n, "c": n % 5} for n in range(60)], x="n", y="c", title="t", x_title="x", y_title="y",
                    log_x=True),
    ]
    digest = hashlib.sha256()
    for spec in specs:
        digest.update(f.render_png(spec))
    digest.update(f.plots_template().encode())
    print("DIGEST", digest.hexdigest())
    """
)
NO_SOCKETS = textwrap.dedent(
    """
    import socket
    def refuse(*a, **k):
        raise OSError("network blocked by the test")
    socket.socket = socket.create_connection = socket.getaddrinfo = refuse
    """
)


def _run(cmd: list[str], script: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cmd, sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def _digest(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-2000:]
    return next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("DIGEST"))


def _pixels(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def test_a_chart_becomes_a_non_blank_png():
    rows = [{"position": k, "acceptance": 1 / k, "engine": e} for k in range(1, 8) for e in ("dflash", "ngram")]
    spec = figures.line_chart(
        rows, x="position", y="acceptance", color="engine", title="t", x_title="x", y_title="y", y_domain=(0, 1)
    )
    png = figures.render_png(spec)
    assert png.startswith(figures.PNG_MAGIC)
    img = _pixels(png)
    assert img.width >= figures.WIDTH * figures.SCALE  # the plot area at SCALE, axes and legend on top
    colors = img.getcolors(maxcolors=1 << 16) or []
    assert len(colors) > 20, "lines, text and grid: many colours, not a blank page"
    white = max(count for count, c in colors if c == (255, 255, 255))
    assert white < 0.97 * img.width * img.height
    assert figures.data_uri(png).startswith("data:image/png;base64,iVBOR")


def test_a_spec_that_names_a_url_is_refused_before_rendering():
    spec = figures.line_chart([], x="a", y="b", title="t", x_title="x", y_title="y")
    spec["data"] = {"url": "http://127.0.0.1:9/data.csv"}
    with pytest.raises(ValueError, match=r"spec\.data\.url = 'http://127\.0\.0\.1:9/data\.csv'"):
        figures.render_png(spec)
    spec["data"] = {"values": []}
    spec["layer"] = [{"mark": "image", "encoding": {"url": {"value": "https://example.org/x.png"}}}]
    with pytest.raises(ValueError, match=r"layer\[0\]\.encoding\.url"):
        figures.render_png(spec)


def test_the_engine_is_told_to_allow_no_url():
    """The second guard: were a URL to slip past the spec check, vl-convert itself refuses it (allowed_base_urls=[])."""
    import vl_convert

    spec = {"data": {"url": "http://127.0.0.1:9/x.csv"}, "mark": "point"}
    with pytest.raises(ValueError, match="not allowed"):
        vl_convert.vegalite_to_png(spec, vl_version=figures.VEGA_LITE, allowed_base_urls=[])


def test_importing_the_module_loads_no_renderer():
    done = _run(
        [],
        "import sys, dflash.core.figures; print(sorted(m for m in ('vl_convert', 'pyarrow', 'PIL') if m in sys.modules))",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def digest_here() -> str:
    """The bytes of every figure kind as rendered in a plain subprocess."""
    return _digest(_run([], RENDER_ALL))


def test_rendering_works_with_python_sockets_disabled(digest_here):
    assert _digest(_run([], NO_SOCKETS + RENDER_ALL)) == digest_here


def test_rendering_in_a_network_namespace_gives_the_same_bytes(digest_here):
    """`unshare --net`: a namespace with no interface but a down loopback. Anything fetched would fail there and
    change (or break) the output; the bytes must equal those rendered outside it."""
    unshare = shutil.which("unshare")
    flags = next(
        (
            f
            for f in (["-n"], ["-rn"])
            if unshare and subprocess.run([unshare, *f, "true"], capture_output=True).returncode == 0
        ),
        None,
    )
    if flags is None:
        pytest.skip("unshare cannot create a network namespace here (needs root or user namespaces)")
    assert _digest(_run([unshare, *flags], RENDER_ALL)) == digest_here


def _inet_sockets(script: str, tmp_path) -> list[str]:
    trace = tmp_path / "trace.txt"
    done = _run(["strace", "-f", "-qq", "-e", "trace=socket,connect", "-o", str(trace)], script)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in trace.read_text().splitlines() if "AF_INET" in line]


@pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed (Debian package strace)")
def test_rendering_opens_no_internet_socket(tmp_path):
    control = "import socket; s = socket.socket(); s.settimeout(1); s.connect_ex(('127.0.0.1', 9))"
    assert _inet_sockets(control, tmp_path), "the trace must see a socket when one is opened"
    assert _inet_sockets(RENDER_ALL, tmp_path) == []


def test_the_dvc_plots_template_inlines_vega_and_is_current():
    """.dvc/plots_offline.html is what `make plots-offline` writes from the pinned vl-convert, and DVC uses it."""
    shipped = (REPO / ".dvc/plots_offline.html").read_text(encoding="utf-8")
    assert shipped == figures.plots_template(), "stale: run `make plots-offline` and commit .dvc/plots_offline.html"
    assert "{plot_divs}" in shipped and "{scripts}" not in shipped  # DVC's CDN <script src> tags go into {scripts}
    assert "<script src" not in shipped and "<link" not in shipped
    assert "window.vegaEmbed=" in shipped
    config = (REPO / ".dvc/config").read_text()
    assert "html_template = plots_offline.html" in config


def test_module_cli_writes_the_template(tmp_path):
    out = tmp_path / "t.html"
    assert figures.main(["dvc-template", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == (REPO / ".dvc/plots_offline.html").read_text(encoding="utf-8")
    assert figures.main(["nonsense"]) == 2
    assert os.path.getsize(out) > 500_000  # Vega, Vega-Lite and Vega-Embed are really in it
