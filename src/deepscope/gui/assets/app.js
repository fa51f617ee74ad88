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

// A long dashboard (the Instruments tab) draws the charts in the window first: Plotly takes
// 15-40 ms a chart here, and a run switch redrew ten of them. `deepscope.lazyFigures` is the
// body of one clientside callback (widgets.lazy_figures) whose outputs are every chart's
// figure and its box's class, so a figure reaches its chart only through that callback:
// - a new answer (the figures store) hands each chart in the window its figure and keeps
//   the others' (their box gets the class "stale": blank, never the previous numbers);
// - scrolling towards a kept chart (half a window ahead), showing its tab, or printing sets
//   the view store, which runs the callback again to hand over what came near.
window.deepscope = (function () {
    var pending = {};    // chart id -> its newest figure, not handed over yet
    var stale = {};      // chart id -> its box has the class "stale"
    var answer = null;   // the figures store's value last seen
    var everything = false;  // the next pass hands over every kept figure (print, pictures)
    var view = null;     // the view store's id
    function near(id, ahead) {
        var el = document.getElementById(id);
        if (!el || el.closest(".pane-hidden")) { return false; }
        var box = el.getBoundingClientRect();
        var margin = ahead * window.innerHeight;
        return box.bottom > -margin && box.top < window.innerHeight + margin;
    }
    var queued = false;
    function check(ahead) {  // at most once a frame: run the callback when a kept chart is near
        if (queued || !view) { return; }
        queued = true;
        requestAnimationFrame(function () {
            queued = false;
            if (Object.keys(pending).some(function (id) {
                return everything || near(id, ahead);
            })) {
                window.dash_clientside.set_props(view, {data: Date.now()});
            }
        });
    }
    window.addEventListener("scroll", function () { check(0.5); }, {passive: true});
    window.addEventListener("resize", function () { check(0.5); });
    function drawAll() { everything = true; check(0); }
    window.addEventListener("beforeprint", drawAll);
    return {
        drawAll: drawAll,
        pending: function () { return Object.keys(pending); },
        // figures: {chart id: figure}; returns [figure per chart..., box class per chart...]
        lazyFigures: function (store, ids, figures, tab) {
            var skip = window.dash_clientside.no_update;
            var triggered = (window.dash_clientside.callback_context.triggered || [])
                .map(function (t) { return t.prop_id; });
            view = store;
            var ahead = 0.5;
            if (figures !== answer) {  // a new answer: what is in the window now, no more
                answer = figures;
                ahead = 0;
                ids.forEach(function (id) {
                    if (figures && id in figures) { pending[id] = figures[id]; }
                });
            }
            if (triggered.indexOf("tabs.value") >= 0) {
                // the pane is shown once the tab strip's own callback ran: look next frame
                check(0);
                return ids.map(function () { return skip; }).concat(
                    ids.map(function () { return skip; }));
            }
            var all = everything;
            everything = false;
            var out = ids.map(function (id) {
                if (!(id in pending) || !(all || near(id, ahead))) { return skip; }
                var figure = pending[id];
                delete pending[id];
                return figure;
            });
            var classes = ids.map(function (id) {
                var kept = id in pending;
                if (kept === !!stale[id]) { return skip; }
                stale[id] = kept;
                return kept ? "chart-box stale" : "chart-box";
            });
            return out.concat(classes);
        }
    };
})();
