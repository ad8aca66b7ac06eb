"""Load a report in headless Chromium and say whether it rendered: `python -m report.render_check FILE`.

Prints JSON `{"console_errors": [...], "plots_expected": n, "plots_rendered": n, "ok": bool}` and exits
0 when every plot drew and the console stayed clean, 1 otherwise, 2 when no browser could be run.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: requests on fd 3,
replies on fd 4, NUL-separated JSON), which needs nothing beyond the standard library and, unlike
`--dump-dom`, reports console errors and uncaught exceptions as structured events. `--screenshot PNG`
also saves a full-page screenshot.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
)
# Counts the report's plot divs and those plotly finished drawing (a laid-out figure with its SVG).
PLOT_STATUS_EXPRESSION = """JSON.stringify((function () {
  const plots = Array.from(document.querySelectorAll('.ciera-plot'));
  const drawn = plots.filter(function (div) {
    return div._fullLayout !== undefined && div.querySelector('.plot-container .main-svg') !== null;
  });
  return {expected: plots.length, rendered: drawn.length, plotly: typeof Plotly !== 'undefined',
          height: document.documentElement.scrollHeight};
})())"""

# Layout problems inside one element (`check_render(layout_selector=...)`): plot divs that overlap each
# other or stick out of it, text of a plot's SVG (titles, tick labels, annotations) that overlaps other
# text or leaves its plot, a dropdown over text, a line hidden under another (the same path drawn later, at least as wide and
# solid or in the same dash: coinciding data must stay visible; a trace's own overlay, such as its
# measured points, shares its legend group and does not count), HTML that runs past the element's right
# edge, and tables that need scrolling.
LAYOUT_CHECK_EXPRESSION = """JSON.stringify((function (selector) {
  const root = document.querySelector(selector);
  if (!root) return ['no element matches ' + selector];
  const problems = [];
  const box = function (el) { return el.getBoundingClientRect(); };
  const hit = function (a, b) {
    return a.left + 1 < b.right && b.left + 1 < a.right && a.top + 1 < b.bottom && b.top + 1 < a.bottom;
  };
  const shown = function (el) {
    const style = getComputedStyle(el);
    const r = box(el);
    return style.display !== 'none' && style.visibility !== 'hidden' && style.opacity !== '0' &&
      r.width > 0 && r.height > 0;
  };
  const name = function (el) {
    return (el.id ? '#' + el.id : el.tagName.toLowerCase()) + ' "' + el.textContent.trim().slice(0, 40) + '"';
  };
  const outer = box(root);
  const plots = Array.from(root.querySelectorAll('.ciera-plot'));
  plots.forEach(function (plot, i) {
    const r = box(plot);
    if (r.left < outer.left - 1 || r.right > outer.right + 1) problems.push('#' + plot.id + ' sticks out of ' + selector);
    plots.slice(i + 1).forEach(function (other) {
      if (hit(r, box(other))) problems.push('#' + plot.id + ' overlaps #' + other.id);
    });
    const texts = Array.from(plot.querySelectorAll('svg.main-svg text')).filter(function (t) {
      return !t.closest('.hoverlayer') && t.textContent.trim() !== '' && shown(t);
    });
    texts.forEach(function (text, j) {
      const a = box(text);
      if (a.left < r.left - 1 || a.right > r.right + 1 || a.top < r.top - 1 || a.bottom > r.bottom + 1)
        problems.push('#' + plot.id + ': text "' + text.textContent.trim().slice(0, 40) + '" leaves the plot');
      texts.slice(j + 1).forEach(function (other) {
        if (hit(a, box(other))) problems.push('#' + plot.id + ': text "' + text.textContent.trim().slice(0, 40) +
          '" overlaps "' + other.textContent.trim().slice(0, 40) + '"');
      });
    });
    Array.from(plot.querySelectorAll('.updatemenu-header-group')).filter(shown).forEach(function (menu) {
      texts.forEach(function (text) {  // a closed dropdown is a box over whatever lies under it
        if (!menu.contains(text) && hit(box(menu), box(text)))
          problems.push('#' + plot.id + ': the dropdown covers "' + text.textContent.trim().slice(0, 40) + '"');
      });
    });
    const lines = Array.from(plot.querySelectorAll('.scatterlayer .trace')).map(function (trace) {
      const path = trace.querySelector('path.js-line');
      if (!path || !path.getAttribute('d')) return null;
      const style = getComputedStyle(path);
      const r = box(path);  // a flat line has no height: only a path with no extent at all is not drawn
      if (style.display === 'none' || style.visibility === 'hidden' || style.opacity === '0' ||
          (r.width === 0 && r.height === 0)) return null;
      const data = trace.__data__ && trace.__data__[0] && trace.__data__[0].trace;
      return {d: path.getAttribute('d'), width: parseFloat(style.strokeWidth) || 0,
              dash: (style.strokeDasharray || 'none').replace(/\\s+/g, ''),
              name: data ? String(data.name) : '?', group: data ? data.legendgroup : ''};
    }).filter(Boolean);
    lines.forEach(function (lower, k) {
      lines.slice(k + 1).forEach(function (upper) {  // document order is drawing order: later on top
        if (upper.d === lower.d && !(lower.group && lower.group === upper.group) &&
            upper.width + 0.01 >= lower.width && (upper.dash === 'none' || upper.dash === lower.dash))
          problems.push('#' + plot.id + ': line "' + lower.name + '" is hidden under "' + upper.name + '"');
      });
    });
  });
  Array.from(root.querySelectorAll('*')).forEach(function (el) {
    if (el.closest('svg') || el.closest('.ciera-plot') || !shown(el)) return;
    const scroller = el.parentElement && el.parentElement.closest('.table-wide, .table-scroll');
    if (scroller && root.contains(scroller)) return;
    if (box(el).right > outer.right + 1) problems.push(name(el) + ' runs past the right edge of ' + selector);
    if ((el.classList.contains('table-wide') || el.classList.contains('table-scroll')) &&
        el.scrollWidth > el.clientWidth + 1) problems.push(name(el) + ' needs horizontal scrolling');
  });
  return problems;
})(SELECTOR))"""


class BrowserUnavailable(RuntimeError):
    """No Chromium binary, or it would not start / speak the protocol."""


@dataclass
class RenderResult:
    console_errors: list[str] = field(default_factory=list)
    plots_expected: int = 0
    plots_rendered: int = 0
    plotly_loaded: bool = False
    layout_problems: list[str] = field(default_factory=list)  # only when a layout selector was given

    @property
    def ok(self) -> bool:
        return (
            not self.console_errors
            and not self.layout_problems
            and self.plotly_loaded
            and self.plots_rendered == self.plots_expected
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "console_errors": self.console_errors,
            "plots_expected": self.plots_expected,
            "plots_rendered": self.plots_rendered,
            "plotly_loaded": self.plotly_loaded,
            "layout_problems": self.layout_problems,
            "ok": self.ok,
        }


def find_chromium() -> str | None:
    override = os.environ.get("CIERA_CHROMIUM")
    if override:
        return override if Path(override).exists() else shutil.which(override)
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _DevToolsPipe:
    """Minimal DevTools client over the two pipes Chromium opens with --remote-debugging-pipe."""

    def __init__(self, to_browser_fd: int, from_browser_fd: int) -> None:
        self._write_fd = to_browser_fd
        self._read_fd = from_browser_fd
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError("no reply from Chromium")
            ready, _, _ = select.select([self._read_fd], [], [], remaining_s)
            if not ready:
                continue
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                raise BrowserUnavailable("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(
        self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 30
    ):
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            request["sessionId"] = session
        os.write(self._write_fd, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise BrowserUnavailable(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for_event(self, method: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if any(event.get("method") == method for event in self.events):
            return True
        while True:
            try:
                message = self._read_message(deadline)
            except TimeoutError:
                return False
            self.events.append(message)
            if message.get("method") == method:
                return True


def _console_errors(events: list[dict[str, Any]]) -> list[str]:
    """Errors the page produced: console.error calls, uncaught exceptions, error-level log entries."""
    errors: list[str] = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = [str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", [])]
            errors.append("console.error: " + " ".join(texts))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text", "")
            errors.append(f"exception: {description.splitlines()[0] if description else 'unknown'}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
    return errors


def _evaluate_json(devtools: _DevToolsPipe, session: str, expression: str) -> Any:
    reply = devtools.call(
        "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
    )
    return json.loads(reply.get("result", {}).get("value") or "null")


def _element_box_expression(selector: str) -> str:
    """The element's page box (document coordinates), for a screenshot clip; null when absent."""
    return (
        f"JSON.stringify((function () {{ const el = document.querySelector({json.dumps(selector)}); "
        "if (!el) return null; const r = el.getBoundingClientRect(); "
        "return {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height}; "
        "})())"
    )


def check_render(
    html_path: str | os.PathLike[str],
    timeout_s: float = 60.0,
    screenshot_path: str | os.PathLike[str] | None = None,
    window_width_px: int = 1400,
    layout_selector: str | None = None,
) -> RenderResult:
    """Open the file in headless Chromium, wait for every plot, collect console errors; with
    `layout_selector` (a CSS selector, e.g. "#validation"), also the layout problems inside that element
    (LAYOUT_CHECK_EXPRESSION), and the screenshot, if asked for, is of that element only."""
    chromium = find_chromium()
    if chromium is None:
        raise BrowserUnavailable(
            "no Chromium found (tried " + ", ".join(CHROMIUM_NAMES) + "; or set CIERA_CHROMIUM)"
        )
    page_url = Path(html_path).resolve().as_uri()
    to_browser_read, to_browser_write = os.pipe()
    from_browser_read, from_browser_write = os.pipe()

    def connect_pipes() -> None:  # runs in the child: DevTools expects fd 3 (in) and fd 4 (out)
        os.dup2(to_browser_read, 3)
        os.dup2(from_browser_write, 4)

    with tempfile.TemporaryDirectory(prefix="ciera-chromium-") as profile_dir:
        command = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile_dir}",
            f"--window-size={window_width_px},1000",
        ]
        try:
            browser = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(3, 4),
                preexec_fn=connect_pipes,
            )
        except OSError as error:
            raise BrowserUnavailable(f"cannot start {chromium}: {error}") from None
        finally:
            os.close(to_browser_read)
            os.close(from_browser_write)
        devtools = _DevToolsPipe(to_browser_write, from_browser_read)
        try:
            target = devtools.call("Target.createTarget", {"url": "about:blank"}, timeout_s=timeout_s)
            session = devtools.call(
                "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
            )["sessionId"]
            for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
                devtools.call(domain, session=session)
            devtools.call("Page.navigate", {"url": page_url}, session=session, timeout_s=timeout_s)
            devtools.wait_for_event("Page.loadEventFired", timeout_s)
            result = RenderResult()
            deadline = time.monotonic() + timeout_s
            while True:
                reply = devtools.call(
                    "Runtime.evaluate",
                    {"expression": PLOT_STATUS_EXPRESSION, "returnByValue": True},
                    session=session,
                )
                status = json.loads(reply.get("result", {}).get("value") or "{}")
                result.plots_expected = int(status.get("expected", 0))
                result.plots_rendered = int(status.get("rendered", 0))
                result.plotly_loaded = bool(status.get("plotly", False))
                if result.plots_rendered >= result.plots_expected or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if layout_selector is not None:
                result.layout_problems = _evaluate_json(
                    devtools,
                    session,
                    LAYOUT_CHECK_EXPRESSION.replace("SELECTOR", json.dumps(layout_selector)),
                )
            if screenshot_path is not None:
                height_px = min(int(status.get("height", 1000)), 16000)
                devtools.call(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": window_width_px, "height": height_px, "deviceScaleFactor": 1, "mobile": False},
                    session=session,
                )
                time.sleep(1.0)  # plotly's responsive resize runs on the window resize event
                params: dict[str, Any] = {"format": "png"}
                if layout_selector is not None:
                    clip = _evaluate_json(devtools, session, _element_box_expression(layout_selector))
                    if clip:
                        params["clip"] = {**clip, "scale": 1}
                shot = devtools.call("Page.captureScreenshot", params, session=session, timeout_s=timeout_s)
                Path(screenshot_path).write_bytes(base64.b64decode(shot["data"]))
            # Drain events that arrived after the last reply (late errors from deferred rendering).
            devtools.wait_for_event("ciera.never", 0.5)
            result.console_errors = _console_errors(devtools.events)
            return result
        except TimeoutError as error:
            raise BrowserUnavailable(f"Chromium did not answer: {error}") from None
        finally:
            try:
                devtools.call("Browser.close", timeout_s=5)
            except (BrowserUnavailable, TimeoutError, OSError):
                pass
            os.close(to_browser_write)
            os.close(from_browser_read)
            try:
                browser.wait(timeout=10)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m report.render_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("html", type=Path, help="report HTML file")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the page (default 60)"
    )
    parser.add_argument("--screenshot", type=Path, default=None, help="also save a full-page PNG here")
    parser.add_argument("--width", type=int, default=1400, help="window width in px (default 1400)")
    parser.add_argument(
        "--layout",
        metavar="SELECTOR",
        default=None,
        help="also check the layout inside this element (overlapping plots or text, overflow), e.g. "
        "'#validation'; the screenshot is then of that element",
    )
    arguments = parser.parse_args(argv)
    if not arguments.html.is_file():
        print(f"error: {arguments.html}: no such file", file=sys.stderr)
        return 2
    try:
        result = check_render(
            arguments.html, arguments.timeout, arguments.screenshot, arguments.width, arguments.layout
        )
    except BrowserUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json()))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
