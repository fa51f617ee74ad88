// deepscope GUI: small browser-side helpers (served locally with the app).

// Left / right arrow keys step through the recorded steps (like comgra's slider), unless the
// focus is in a control that uses the arrows itself (text fields, dropdowns, the slider).
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
    if (button) {
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
