"""The run report and the `dvc plots show` page in a real browser, offline: headless Chromium (Debian's `chromium`
package) driven over the DevTools protocol through a pipe. Every request the page makes is logged by the
browser's own network layer (Network.requestWillBeSent, fired before any connection is tried, so a request that
would fail offline is seen too); the page's Content-Security-Policy is bypassed while testing, so that what the
page's content asks for is what is logged, not what the policy lets through. Control pages prove the log sees
requests: a picture on a loopback address, and DVC's own template, which loads Vega from a CDN.

Chromium is found on PATH; where it is missing and the test runs as root with apt-get (CI's fresh machine), the
test installs it (Debian's package, about a minute) so that CI checks the page exactly as a developer does; it
skips, saying why, only where it can be neither found nor installed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, repo_params
from tests.helpers.dvc import report_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INLINE = ("data:",)  # what a self-contained page may "request": its own inline data


def _install_chromium() -> str | None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
    ):
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False).returncode != 0:
            return None
    return shutil.which("chromium")


@pytest.fixture(scope="module")
def chromium() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None) or _install_chromium()
    if not found:
        pytest.skip(
            "no Chromium: install Debian's package (apt-get install chromium); this test installs it itself only "
            "when it runs as root with apt-get"
        )
    return found


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (replies and events out), NUL-framed."""

    def __init__(self, binary: str, profile: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def fds() -> None:  # in the child: the protocol's fixed descriptors (copied first: either may be 3 or 4)
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",  # root in CI
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--window-size=1280,1600",
                "about:blank",
            ],
            pass_fds=(3, 4),  # kept open past close_fds, which runs after preexec_fn
            preexec_fn=fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError("no message from Chromium")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, session: str | None = None, timeout: float = 60, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        seen = len(self.events)
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method:
                    return e
            seen = len(self.events)
            self.events.append(self._read(max(0.1, deadline - time.monotonic())))

    def open(self, url: str) -> str:
        """A new tab on `url` with the network log on and the page's CSP bypassed; returns its session id."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for method in ("Network.enable", "Page.enable", "Runtime.enable"):
            self.send(method, session)
        self.send("Page.setBypassCSP", session, enabled=True)
        self.send("Page.navigate", session, url=url)
        self.wait_event("Page.loadEventFired")
        return session

    def evaluate(self, session: str, expression: str):
        result = self.send("Runtime.evaluate", session, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(json.dumps(result["exceptionDetails"])[:2000])
        return result["result"].get("value")

    def requests(self, session: str) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session
        ]

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.send("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._cmd_w)
        os.close(self._out_r)


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    b = Browser(chromium, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


# Per <img>: loaded, its size, and how many of its pixels are not the most common colour (the background).
IMAGE_STATS = """
(async () => {
  const out = [];
  for (const img of document.images) {
    await img.decode().catch(() => null);
    const c = document.createElement("canvas");
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    let ink = 0;
    if (c.width && c.height) {
      const ctx = c.getContext("2d");
      ctx.drawImage(img, 0, 0);
      const d = ctx.getImageData(0, 0, c.width, c.height).data;
      const counts = new Map();
      for (let i = 0; i < d.length; i += 4) {
        const k = (d[i] << 16) | (d[i + 1] << 8) | d[i + 2];
        counts.set(k, (counts.get(k) || 0) + 1);
      }
      ink = c.width * c.height - Math.max(...counts.values());
    }
    out.push({alt: img.alt, complete: img.complete, w: img.naturalWidth, h: img.naturalHeight, ink: ink});
  }
  return out;
})()
"""


def _external(urls: list[str]) -> list[str]:
    """Every request after the page itself (the first) that is not inline data: another local file counts too."""
    return [u for u in urls[1:] if not u.startswith(INLINE)]


def test_control_pages_show_that_the_log_sees_requests(browser, tmp_path):
    page = tmp_path / "control.html"
    page.write_text(
        '<html><head><meta http-equiv="Content-Security-Policy" content="default-src \'none\'"></head>'
        '<body><img src="http://127.0.0.1:9/x.png"></body></html>'
    )
    session = browser.open(page.as_uri())
    assert _external(browser.requests(session)) == ["http://127.0.0.1:9/x.png"]


def test_the_report_renders_offline_with_every_image_drawn(browser, tmp_path, chromium):
    overrides = report_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "stages.report", "--params", "params.yaml", *sum((["-S", o] for o in overrides), [])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "reports/report.html"
    session = browser.open(out.as_uri())
    requests = browser.requests(session)
    assert requests and requests[0] == out.as_uri()
    assert _external(requests) == [], "the page asked for something outside itself"
    stats = browser.evaluate(session, IMAGE_STATS)
    assert len(stats) >= 7, stats
    drawn = [s for s in stats if s["w"]]
    assert len(drawn) == len(stats) - 1, "all but the audit report's missing picture (left out by design)"
    for s in drawn:
        assert s["complete"] and s["h"] > 100, s
        assert s["ink"] > 0.02 * s["w"] * s["h"], f"{s['alt']}: blank ({s['ink']} pixels differ from the background)"
    title = browser.evaluate(session, "document.querySelector('h1').textContent")
    assert title == "dflash-pipeline run report"
    assert repo_params(overrides).base.reports_dir == str(tmp_path / "reports")


def _plots_page(out: Path, template: Path | None) -> Path:
    cmd = [str(REPO / ".venv/bin/dvc"), "plots", "show", "-o", str(out)]
    if template is not None:
        cmd += ["--html-template", str(template)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "index.html"


# Per DVC plot <div>: did Vega draw into it (a canvas or an svg with ink)?
PLOT_STATS = """
(async () => {
  await new Promise(r => setTimeout(r, 1500));
  return [...document.querySelectorAll("body > div[id]")].map(div => {
    const c = div.querySelector("canvas");
    let ink = 0;
    if (c && c.width) {
      const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      for (let i = 3; i < d.length; i += 4) if (d[i] > 0) ink++;
    }
    return {id: div.id, canvas: !!c, ink: ink, svg: !!div.querySelector("svg.marks")};
  });
})()
"""


def test_dvc_plots_show_works_offline_with_the_shipped_template(browser, tmp_path):
    """`dvc plots show` uses .dvc/plots_offline.html (.dvc/config): Vega is inside the page, every plot draws."""
    index = _plots_page(tmp_path / "offline", None)
    session = browser.open(index.as_uri())
    assert _external(browser.requests(session)) == []
    plots = browser.evaluate(session, PLOT_STATS)
    assert len(plots) >= 10, plots  # pilot sweep, tokenize, train's dvclive series, eval, plan
    for p in plots:
        assert p["canvas"] or p["svg"], p
        assert p["svg"] or p["ink"] > 1000, f"plot {p['id']} is blank"


def test_dvc_default_template_needs_the_network(browser, tmp_path):
    """Why the template exists: DVC's own page loads Vega from a CDN, so offline its plots stay blank."""
    default = tmp_path / "dvc-default.html"
    from dvc_render.html import PAGE_HTML

    default.write_text(PAGE_HTML)
    index = _plots_page(tmp_path / "default", default)
    session = browser.open(index.as_uri())
    assert any("cdn.jsdelivr.net" in u for u in _external(browser.requests(session)))


def test_screenshot_of_the_report(browser, tmp_path):
    """A picture of the page as a reader sees it (what docs/images/report-html.png shows), non-blank."""
    overrides = report_run(tmp_path)
    from dflash.report.stage import run

    out = run(repo_params(overrides), "params.yaml", REPO / "dvc.lock")
    session = browser.open(out.as_uri())
    shot = base64.b64decode(browser.send("Page.captureScreenshot", session, format="png")["data"])
    from io import BytesIO

    from PIL import Image

    img = Image.open(BytesIO(shot)).convert("RGB")
    assert img.width >= 1000 and len(img.getcolors(maxcolors=1 << 20) or []) > 50
