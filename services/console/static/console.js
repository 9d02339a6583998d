// Small progressive enhancements; every page works without this file.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  // Actions ask once more before they change a schedule.
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
  // Changing the state filter applies it at once.
  for (const select of document.querySelectorAll("select[data-autosubmit]")) {
    select.addEventListener("change", () => select.form.submit());
  }
});
