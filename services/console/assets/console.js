// Reach console: live updates by polling. A page whose <main> has data-live="MS" fetches
// itself every MS milliseconds and swaps in the new #live part, unless the person is typing
// in a form on it. No framework, no build step.
(function () {
  "use strict";
  // Filters submit as soon as they change.
  Array.prototype.forEach.call(document.querySelectorAll("form.filters select"), function (s) {
    s.addEventListener("change", function () { s.form.submit(); });
  });
  var main = document.querySelector("main[data-live]");
  var stamp = document.getElementById("live-stamp");
  if (!main) { return; }
  var every = parseInt(main.getAttribute("data-live"), 10);
  if (!(every > 0)) { return; }
  var busy = false;
  function editing() {
    var a = document.activeElement;
    return a && (a.tagName === "INPUT" || a.tagName === "TEXTAREA" || a.tagName === "SELECT");
  }
  function tick() {
    if (busy || document.hidden || editing()) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "Accept": "text/html" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (text) {
        var next = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        var here = document.getElementById("live");
        if (next && here && next.innerHTML !== here.innerHTML) { here.innerHTML = next.innerHTML; }
        if (stamp) { stamp.textContent = "live · updated " + new Date().toLocaleTimeString(); }
      })
      .catch(function () { if (stamp) { stamp.textContent = "live · offline, retrying"; } })
      .then(function () { busy = false; });
  }
  setInterval(tick, every);
})();
