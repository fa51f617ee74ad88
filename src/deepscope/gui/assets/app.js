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

// The Instruments tab's charts take their figures from one store ({chart id: figure}, see
// widgets.store_figures): a chart missing from it keeps what it shows.
window.deepscope = {
    figuresOf: function (ids, figures) {
        var skip = window.dash_clientside.no_update;
        return ids.map(function (id) { return figures && id in figures ? figures[id] : skip; });
    }
};
