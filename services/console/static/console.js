// Small progressive enhancements; every page works without this file.
"use strict";

/** How often a page refreshes itself while live (ms). */
const REFRESH_MS = 5000;

function enhance(root) {
  // Actions ask once more before they change a schedule.
  for (const form of root.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
  // Times on the page are UTC; a hover shows the reader's own local time too.
  for (const cell of root.querySelectorAll("td[data-utc]")) {
    const at = new Date(cell.dataset.utc);
    if (!Number.isNaN(at.getTime())) cell.title = "your time: " + at.toLocaleString();
  }
  const all = root.querySelector("#tick-all");
  if (all) {
    all.addEventListener("change", () => {
      for (const box of root.querySelectorAll("input[name=id]")) box.checked = all.checked;
    });
  }
}

/** Whether the reader is in the middle of something a refresh would undo. */
function busy(main) {
  const active = document.activeElement;
  if (active && main.contains(active) && active.matches("input, select, textarea, button")) {
    return true;
  }
  if (main.querySelector("input[type=checkbox]:checked, details[open]")) return true;
  const selection = window.getSelection();
  return Boolean(selection && !selection.isCollapsed);
}

async function refresh(main) {
  const response = await fetch(window.location.href, {
    headers: { "X-Cronbus-Refresh": "1" },
    credentials: "same-origin",
  });
  if (!response.ok) return;
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = page.querySelector("main");
  const clock = page.querySelector("#clock");
  if (!fresh || busy(main)) return;
  // An action's outcome is said once: the refreshed page does not repeat it.
  for (const notice of fresh.querySelectorAll("p.notice[role=status]")) notice.remove();
  main.replaceChildren(...fresh.childNodes);
  enhance(main);
  if (clock) document.querySelector("#clock").textContent = clock.textContent;
}

document.addEventListener("DOMContentLoaded", () => {
  enhance(document);
  const main = document.querySelector("main[data-live=on]");
  const toggle = document.querySelector("#live-toggle");
  if (!main || !toggle) return;
  let live = window.sessionStorage.getItem("cronbus-live") !== "off";
  const show = () => {
    toggle.setAttribute("aria-pressed", String(live));
    toggle.title = live ? "Refreshing every 5 s; click to pause" : "Paused; click to refresh live";
  };
  toggle.hidden = false;
  show();
  toggle.addEventListener("click", () => {
    live = !live;
    window.sessionStorage.setItem("cronbus-live", live ? "on" : "off");
    show();
  });
  window.setInterval(() => {
    if (live && document.visibilityState === "visible" && !busy(main)) {
      refresh(main).catch(() => {});
    }
  }, REFRESH_MS);
});
