"""GUI latency on a long run: click -> output updated in a real browser (headless Chromium).

Records a 10,000-step run with the real recorder (every step recorded, plus per-layer
instrument values) unless one is already there, starts the GUI server on a free 127.0.0.1
port, and measures inside the page, from the click to the moment the DOM shows the new
output, over >= 30 clicks each (400 ms apart):

  step   "previous step" button; node: a node in the node list (a new tensor: its
         10,000-point history is queried and drawn)
  table  until the statistics table shows the new record (the first output)
  all    until the values chart and the over-steps chart (history, step marker) show it too

Run:  python benchmarks/gui_latency.py [--steps 10000] [--clicks 40] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import deepscope
from deepscope.instruments.base import QuantityValue

DEFAULT_DATA = Path(__file__).parent / "results" / "raw" / "gui_latency"
RUN = "long"
PAUSE_MS = 400  # between clicks, as a person clicks: each click starts from an idle page

# Resolves with {table, all}: milliseconds from the click until the statistics table shows
# the expected record, and until the values chart and the over-steps chart (history of the
# tensor, marker at the step) show it too.
MEASURE_JS = """
async ([selector, expect]) => {
    const gd = (id) => document.querySelector('#' + id + ' .js-plotly-plot');
    const marks = {};
    const check = (t) => {
        const table = document.querySelector('#stats-table table');
        if (!marks.table && table && table.dataset.tensor === expect.tensor
                && table.dataset.step === String(expect.step)) marks.table = t;
        const v = gd('values-chart');
        const vm = v && v.layout && v.layout.meta;
        const h = gd('over-steps');
        const hm = h && h.layout && h.layout.meta;
        const marker = h && h.layout && h.layout.shapes && h.layout.shapes[0];
        if (marks.table && vm && vm.step === expect.step && vm.tensor === expect.tensor
                && hm && hm.tensor === expect.tensor && marker && marker.x0 === expect.step) {
            marks.all = t;
        }
        return marks.all !== undefined;
    };
    const t0 = performance.now();
    return await new Promise((resolve) => {
        const observer = new MutationObserver(() => {
            if (check(performance.now() - t0)) { observer.disconnect(); resolve(marks); }
        });
        observer.observe(document.body, {subtree: true, childList: true, attributes: true,
                                         characterData: true});
        document.querySelector(selector).click();
        setTimeout(() => { observer.disconnect(); resolve({table: -1, all: -1}); }, 20000);
    });
}
"""


def record(path: Path, steps: int) -> None:
    """A small MLP trained for `steps` steps, every step recorded, per-layer GradNorm."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scope = deepscope.Scope(path, run=RUN, schedule=deepscope.every(1), max_samples=2,
                            overwrite=True, queue_size=512)
    scope.watch(model)
    started = time.perf_counter()
    for step in range(steps):
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        with scope.step(step, kind="train") as rec:
            rec.tensor("input", x, role="input")
            out = model(x)
            rec.tensor("output", out, role="output")
            losses = ((out - y) ** 2).mean(1)
            rec.loss(losses.mean(), per_sample=losses)
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
            rec.kpi("loss", losses.mean())
        scope.writer.submit_quantities([
            QuantityValue("GradNorm", step, name, float(p.grad.norm()))
            for name, p in model.named_parameters()])
        if step % 1000 == 999:
            print(f"  recorded {step + 1} steps ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    scope.close()


def ensure_run(data: Path, steps: int) -> None:
    run_dir = data / RUN
    if run_dir.exists():
        with deepscope.open_run(run_dir) as run:
            if len(run.steps()) >= steps:
                print(f"reusing {run_dir} ({len(run.steps())} recorded steps)")
                return
    print(f"recording {steps} steps into {run_dir} ...", flush=True)
    record(data, steps)


def summary(name: str, marks: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median / p95 / max of each mark over the clicks, printed and returned."""
    out = {}
    for mark in ("table", "all"):
        ordered = sorted(m[mark] for m in marks)
        p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
        row = out[mark] = {"clicks": len(ordered), "median_ms": statistics.median(ordered),
                           "p95_ms": p95, "max_ms": ordered[-1]}
        print(f"{name:<5} -> {mark:<6} clicks={row['clicks']:>3}  "
              f"median={row['median_ms']:7.1f} ms  p95={row['p95_ms']:7.1f} ms  "
              f"max={row['max_ms']:7.1f} ms")
    return out


def cold_history_ms(data: Path) -> float:
    """Server time of one uncached over-steps read (the one SQL query behind the chart a
    first click on a tensor needs), median over the run's tensors and both directions."""
    from deepscope.gui.data import ProjectData

    times = []
    project = ProjectData(data)
    for tensor in project.run(RUN).tensor_info():
        for direction in ("forward", "grad"):
            rd = ProjectData(data).run(RUN)  # a fresh reader: nothing cached
            started = time.perf_counter()
            rd.history(tensor, direction, 0, "train")
            times.append((time.perf_counter() - started) * 1000)
            rd.close()
    ms = statistics.median(times)
    print(f"server: over-steps history query, uncached: median {ms:.1f} ms "
          f"({len(times)} reads)")
    return ms


def measure(data: Path, clicks: int, browser_path: str) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from deepscope.gui.server import make_server

    server = make_server(data, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    with deepscope.open_run(data / RUN) as run:
        steps = run.steps()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            started = time.perf_counter()
            page.goto(url)
            page.wait_for_selector("#stats-table table", timeout=60_000)
            page.wait_for_function("document.querySelector('#over-steps .js-plotly-plot')"
                                   "?.layout?.meta?.tensor === 'output'", timeout=60_000)
            print(f"first load: {time.perf_counter() - started:.2f} s")
            page.wait_for_timeout(2500)  # let the first poll and its refresh settle
            step_ms = []
            for i in range(1, clicks + 1):  # walk back from the newest step
                page.wait_for_timeout(PAUSE_MS)
                expect = {"tensor": "output", "step": steps[-1 - i]}
                step_ms.append(page.evaluate(MEASURE_JS, ["#step-prev", expect]))
            node_ms = []
            for i in range(clicks):
                page.wait_for_timeout(PAUSE_MS)
                node = ("input", "output")[i % 2]
                expect = {"tensor": node, "step": steps[-1 - clicks]}
                node_ms.append(page.evaluate(
                    MEASURE_JS, [f'.node-btn[data-node="{node}"]', expect]))
            browser.close()
    finally:
        server.shutdown()
    if min(m["all"] for m in step_ms + node_ms) < 0:
        raise RuntimeError("a click did not update the output within 20 s")
    return {"step": summary("step", step_ms), "node": summary("node", node_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--clicks", type=int, default=40)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--browser", default="/usr/bin/chromium")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()
    if args.clicks < 30:
        parser.error("--clicks must be at least 30 for a meaningful p95")
    ensure_run(args.data, args.steps)
    result = measure(args.data, args.clicks, args.browser)
    result["cold_history_ms"] = cold_history_ms(args.data)
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, **result}, indent=2))


if __name__ == "__main__":
    main()
