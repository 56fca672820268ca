// rlgate dashboard: each element with data-refresh is replaced, every data-every seconds, by the HTML the
// server renders for it (the same page with ?fragment=1). No library; nothing else runs.
"use strict";
for (const el of document.querySelectorAll("[data-refresh]")) {
  const every = 1000 * Number(el.dataset.every || 3);
  const tick = async () => {
    try {
      const answer = await fetch(el.dataset.refresh, { credentials: "same-origin", redirect: "error" });
      if (answer.ok) {
        el.innerHTML = await answer.text();
        el.dataset.refreshed = String(Date.now());
        el.classList.remove("stale");
      } else {
        el.classList.add("stale");
      }
    } catch (error) {
      el.classList.add("stale");
    }
    setTimeout(tick, every);
  };
  setTimeout(tick, every);
}
