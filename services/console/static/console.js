// Small progressive enhancements; every page works without this file.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  // Actions ask once more before they change a schedule.
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
  // Times on the page are UTC; a hover shows the reader's own local time too.
  for (const cell of document.querySelectorAll("td[data-utc]")) {
    const at = new Date(cell.dataset.utc);
    if (!Number.isNaN(at.getTime())) cell.title = "your time: " + at.toLocaleString();
  }
});
