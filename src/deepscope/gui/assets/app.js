// deepscope GUI: small browser-side helpers (served locally with the app).

// Left / right arrow keys step through the recorded steps (like comgra's slider), unless the
// focus is in a control that uses the arrows itself (text fields, dropdowns, the slider) or
// the graph tab is hidden (every tab stays mounted; the page hides the others).
document.addEventListener("keydown", function (event) {
    if (event.key !== "ArrowLeft" && event.key !== "ArrowRight") { return; }
    if (event.altKey || event.ctrlKey || event.metaKey) { return; }
    var target = event.target;
    if (target && target.closest &&
            target.closest("input, textarea, select, [role=slider], [role=combobox], " +
                           "[role=listbox], [contenteditable=true], .dash-dropdown")) {
        return;
    }
    var button = document.getElementById(event.key === "ArrowLeft" ? "step-prev" : "step-next");
    if (button && !button.closest(".pane-hidden")) {
        event.preventDefault();
        button.click();
    }
});

// Cytoscape caches where its canvas sits on the page and refreshes that only on window
// resize or scroll. When content above the graph changes height, a click would land on the
// wrong node; refreshing just before the graph sees the press keeps taps exact.
// (dash-cytoscape exposes its instance as window.cy.)
["mousedown", "touchstart"].forEach(function (type) {
    document.addEventListener(type, function (event) {
        if (window.cy && event.target && event.target.closest &&
                event.target.closest("#graph")) {
            window.cy.resize();
        }
    }, true);
});

// Plotly (4.8 MB; evaluating it takes ~0.6 s of the main thread) is loaded once the dependency
// graph is drawn, not before: the graph is what the first page shows. dcc.Graph loads Plotly
// with `Promise.resolve(window.Plotly || <insert its script>)`, so until then `window.Plotly`
// is a promise that inserts the script itself; the script replaces it with the real Plotly.
// Without a drawn graph (a run without structure) Plotly loads after PLOTLY_WAIT_MS anyway.
(function () {
    var PLOTLY_WAIT_MS = 3000;
    if (window.Plotly) { return; }
    var started = Date.now();
    window.Plotly = new Promise(function (resolve, reject) {
        function load() {
            var script = document.createElement("script");
            script.src = window._dashPlotlyJSURL;
            script.onload = function () { resolve(); };
            script.onerror = reject;
            document.head.appendChild(script);
        }
        function wait() {
            var drawn = window.cy && window.cy.nodes().length > 0;
            if (window._dashPlotlyJSURL && (drawn || Date.now() - started > PLOTLY_WAIT_MS)) {
                load();
            } else {
                setTimeout(wait, 20);
            }
        }
        wait();
    });
})();

// Charts of a long dashboard (the Instruments tab) are drawn when they come near the window,
// not all at once: a run switch then draws what can be seen (Plotly takes 20-50 ms a chart
// here). `deepscope.lazyFigures(ids, figures)` is a clientside callback's body (see
// widgets.lazy_figures): it hands each chart on screen its figure now and keeps the others'
// until the page is scrolled towards them (half a window ahead), their tab is shown, or the
// page is printed (`drawAll`). A kept chart is blanked (class "stale"): it never shows the
// previous run's numbers.
window.deepscope = (function () {
    var pending = {};  // chart id -> its newest figure, not drawn yet
    function onScreen(el, ahead) {
        if (el.closest(".pane-hidden")) { return false; }
        var box = el.getBoundingClientRect();
        var margin = ahead * window.innerHeight;
        return box.bottom > -margin && box.top < window.innerHeight + margin;
    }
    function draw(all, ahead) {
        Object.keys(pending).forEach(function (id) {
            var el = document.getElementById(id);
            if (el && (all || onScreen(el, ahead))) {
                var figure = pending[id];
                delete pending[id];
                el.classList.remove("stale");
                window.dash_clientside.set_props(id, {figure: figure});
            }
        });
    }
    var queued = false;
    function drawShown(ahead) {  // at most once a frame
        if (queued || !Object.keys(pending).length) { return; }
        queued = true;
        requestAnimationFrame(function () { queued = false; draw(false, ahead || 0); });
    }
    function drawAhead() { drawShown(0.5); }  // scrolling: what is half a window ahead
    window.addEventListener("scroll", drawAhead, {passive: true});
    window.addEventListener("resize", drawAhead);
    function drawAll() { draw(true); }
    window.addEventListener("beforeprint", drawAll);
    return {
        drawShown: drawShown,
        drawAll: drawAll,
        lazyFigures: function (ids, figures) {
            var skip = window.dash_clientside.no_update;
            return ids.map(function (id) {
                var el = document.getElementById(id);
                if (!figures || !(id in figures)) { return skip; }
                if (!el || onScreen(el, 0)) {
                    delete pending[id];
                    if (el) { el.classList.remove("stale"); }
                    return figures[id];
                }
                pending[id] = figures[id];
                el.classList.add("stale");
                return skip;
            });
        }
    };
})();
