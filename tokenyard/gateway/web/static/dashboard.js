// Live engine stats: poll /dashboard/live (same origin, the session cookie goes along) and update
// the table cells in place. No inline script anywhere: the CSP allows scripts from 'self' only.
"use strict";
(function () {
  async function refresh() {
    try {
      const resp = await fetch("/dashboard/live", { credentials: "same-origin", cache: "no-store" });
      if (!resp.ok) return;
      const body = await resp.json();
      for (const e of body.engines) {
        const row = document.querySelector('#live tr[data-engine="' + CSS.escape(e.engine) + '"]');
        if (!row) continue;
        for (const cell of row.querySelectorAll("td[data-k]")) {
          cell.textContent = String(e[cell.dataset.k]);
        }
      }
      document.getElementById("live-updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      // the gateway is restarting or the network dropped: try again at the next tick
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    refresh();
    setInterval(refresh, 5000);
  });
})();
