"""GUI latency a person feels, on the demo's two runs, in a real browser (headless Chromium).

first load   page opened -> the dependency graph drawn (cytoscape has its nodes)
node         a node clicked (node list) -> every callback it started has answered and drawn
kind         another step kind chosen
iteration    another iteration chosen
step         "previous step" (the slider's buttons; the arrow keys do the same)
tab          Graph -> Instruments and back (each way counted)
run switch   another run chosen while the Instruments tab is shown (the page at its top: the
             charts in the window are drawn, those below it only when scrolled near; the
             server builds a run's answer on its first visit, later switches reuse it)
scroll       the page scrolled to its bottom just after a run switch on the Instruments tab
             (the charts below the window are drawn then)
catch-up     Instruments -> Graph just after a run switch there (a hidden tab catches up when
             shown; the Instruments tab before the switch is not counted)

"Settled" is measured in the page: from the click until no request to the server is pending,
the rendering frame after the click and after the last answer has run, and no long task
(>= 50 ms of the main thread, e.g. Plotly drawing charts) has ended for 250 ms (the periodic
poll for new steps is not counted). Targets (issue 21): first load <= 1.5 s, every click
p95 <= 300 ms.

Run:  python benchmarks/gui_clicks.py [--data DIR] [--clicks 20] [--out results.json]
(records the demo into DIR first unless it is there; on a shared machine run it alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_DATA = Path(__file__).parent / "results" / "raw" / "gui_clicks"
PAUSE_MS = 400  # between clicks, as a person clicks: each starts from an idle page
QUIET_MS = 250

# Counts the Dash requests in flight (not the poll) and when the last one was drawn.
TRACK_JS = """
window.__ds = {pending: 0, last: 0, t0: Infinity};
// Plotly draws after the answer's frame (dcc.Graph's promises): its long tasks count too.
// The observer's callback runs at low priority, after timers: `absorb(takeRecords())` in the
// settle check reads a long task that has just ended before deciding the page is quiet.
window.__ds.absorb = (entries) => entries.forEach((e) => {
    if (e.startTime >= window.__ds.t0) {
        window.__ds.last = Math.max(window.__ds.last, e.startTime + e.duration);
    }
});
window.__ds.tasks = new PerformanceObserver((list) => window.__ds.absorb(list.getEntries()));
window.__ds.tasks.observe({type: 'longtask'});
const plainFetch = window.fetch;
window.fetch = function (input, init) {
    const url = String((input && input.url) || input);
    const body = String((init && init.body) || '');
    if (!url.includes('_dash-update-component') || body.includes('"id":"poll"')) {
        return plainFetch.apply(this, arguments);
    }
    window.__ds.pending += 1;
    const done = () => requestAnimationFrame(() => setTimeout(() => {
        window.__ds.pending -= 1;
        window.__ds.last = performance.now();
    }, 0));
    return plainFetch.apply(this, arguments).then(
        (r) => r.clone().text().then(() => { done(); return r; }),
        (e) => { done(); throw e; });
};
"""

# Clicks the first element matching `selector` whose text contains `text` (selector "scroll":
# scrolls the page to its bottom); resolves with the milliseconds until the page settled (see
# the module docstring), or -1 after 20 s.
SETTLE_JS = """
async ([selector, text, quiet]) => {
    const el = selector === 'scroll' ? document.documentElement
        : [...document.querySelectorAll(selector)]
            .find((e) => !text || e.textContent.includes(text));
    if (!el) { return -2; }
    const t0 = performance.now();
    window.__ds.last = t0;
    window.__ds.t0 = t0;
    if (selector === 'scroll') { window.scrollTo(0, el.scrollHeight); } else { el.click(); }
    // the click's own rendering counts too (a tab switch may ask the server nothing)
    window.__ds.pending += 1;
    requestAnimationFrame(() => setTimeout(() => {
        window.__ds.pending -= 1;
        window.__ds.last = Math.max(window.__ds.last, performance.now());
    }, 0));
    return await new Promise((resolve) => {
        const tick = () => {
            window.__ds.absorb(window.__ds.tasks.takeRecords());
            const now = performance.now();
            if (now - t0 > 20000) { resolve(-1); return; }
            if (window.__ds.pending === 0 && now - window.__ds.last >= quiet) {
                resolve(window.__ds.last - t0);
                return;
            }
            setTimeout(tick, 10);
        };
        setTimeout(tick, 10);
    });
}
"""


def ensure_demo(data: Path) -> None:
    from deepscope.demo import run_demo

    if (data / "bugged").exists() and (data / "fixed").exists():
        print(f"reusing the demo in {data}")
        return
    print(f"recording the demo into {data} ...", flush=True)
    run_demo(data, progress=False)


def stats(name: str, ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    row = {"n": len(ordered), "median_ms": round(statistics.median(ordered), 1),
           "p95_ms": round(p95, 1), "max_ms": round(ordered[-1], 1),
           "all_ms": [round(v, 1) for v in ms]}  # in click order (the first may build)
    print(f"{name:<11} n={row['n']:>3}  median={row['median_ms']:7.1f} ms  "
          f"p95={row['p95_ms']:7.1f} ms  max={row['max_ms']:7.1f} ms", flush=True)
    return row


def measure(data: Path, clicks: int, browser_path: str, loads: int,
            only: set[str] | None = None) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from deepscope.gui.server import make_server

    server = make_server(data, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    out: dict[str, Any] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                         args=["--no-sandbox", "--disable-gpu"])
            context = browser.new_context(viewport={"width": 1600, "height": 1000})
            context.add_init_script(TRACK_JS)
            first = []
            for i in range(loads + 1):  # the first load fills the browser cache: not counted
                page = context.new_page()
                started = time.perf_counter()
                page.goto(url)
                page.wait_for_function("window.cy && cy.nodes().length > 0", timeout=60_000)
                if i:
                    first.append((time.perf_counter() - started) * 1000)
                if i < loads:
                    page.close()
            out["first_load"] = stats("first load", first)
            page.wait_for_timeout(2500)

            def settle(selector: str, text: str = "") -> float:
                page.wait_for_timeout(PAUSE_MS)
                ms = page.evaluate(SETTLE_JS, [selector, text, QUIET_MS])
                if ms < 0:
                    why = "not found" if ms == -2 else "no answer in 20 s"
                    raise RuntimeError(f"{selector} {text!r}: {why}")
                return ms

            def choose(dropdown: str, label: str) -> float:
                page.keyboard.press("Escape")
                page.click(f"#{dropdown}")
                page.wait_for_selector(f"[role=listbox] [role=option]:has-text('{label}')")
                return settle("[role=listbox] [role=option]", label)

            def want(kind: str) -> bool:
                return only is None or kind in only

            nodes = page.evaluate("cy.nodes().map(n => n.id())")
            if want("node"):
                out["node"] = stats("node", [
                    settle(f'.node-btn[data-node="{nodes[i % len(nodes)]}"]')
                    for i in range(clicks)])
            if want("kind"):
                out["kind"] = stats("kind", [choose("kind", ("len_01", "len_08")[i % 2])
                                             for i in range(clicks)])
            if want("iteration"):
                out["iteration"] = stats("iteration", [
                    choose("iteration", f"iteration {i % 2}") for i in range(clicks)])
            if want("step"):
                out["step"] = stats("step", [settle("#step-prev") for _ in range(clicks)])
            if want("tab"):
                out["tab"] = stats("tab", [settle("#tabs .tab", ("Instruments", "Graph")[i % 2])
                                           for i in range(2 * (clicks // 2))])
            if want("run_switch"):
                settle("#tabs .tab", "Instruments")
                out["run_switch"] = stats("run switch", [
                    choose("run", ("fixed", "bugged")[i % 2]) for i in range(clicks)])
            if want("scroll"):
                settle("#tabs .tab", "Instruments")
                scroll = []
                for i in range(clicks):
                    choose("run", ("fixed", "bugged")[i % 2])  # the run selector is at the top
                    scroll.append(settle("scroll"))
                out["scroll"] = stats("scroll", scroll)
            if want("catch_up"):
                catch_up = []
                for i in range(clicks):
                    settle("#tabs .tab", "Instruments")
                    choose("run", ("fixed", "bugged")[i % 2])
                    catch_up.append(settle("#tabs .tab", "Graph"))
                out["catch_up"] = stats("catch-up", catch_up)
            browser.close()
    finally:
        server.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--clicks", type=int, default=20)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--browser", default="/usr/bin/chromium")
    parser.add_argument("--only", help="measure only these clicks (comma-separated: node, kind, "
                        "iteration, step, tab, run_switch, scroll, catch_up); first load always")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()
    ensure_demo(args.data)
    only = set(args.only.split(",")) if args.only else None
    result = measure(args.data, args.clicks, args.browser, args.loads, only)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
