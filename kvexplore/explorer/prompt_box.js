// The prompt box's view (kvexplore/explorer/prompt_box.py says why): a text area that sends its text, stamped, with
// every edit and with every click on a button that reads the prompt.
function render({ model, el }) {
  const box = document.createElement("textarea");
  box.className = "widget-input kvx-prompt-text";
  box.placeholder = model.get("placeholder");
  box.value = model.get("value");
  box.rows = 2;
  box.style.cssText = "width: 100%; height: 100%; box-sizing: border-box; resize: vertical;";
  const sent = [];  // texts sent to the kernel whose echo has not come back
  let last = 0;
  const send = (extra) => {  // stamps increase across this page's views (microseconds since the epoch)
    last = Math.max(last + 1, Math.floor((performance.timeOrigin + performance.now()) * 1000));
    model.send({ value: box.value, n: last, ...extra });
  };
  box.addEventListener("input", () => {
    if (sent[sent.length - 1] !== box.value) sent.push(box.value);
    send({});
  });
  const clicked = (event) => {  // a click on a button that reads the prompt: sent with the text, in one message
    const button = event.target instanceof Element ? event.target.closest("button") : null;
    if (!button || button.disabled) return;
    const name = model.get("clicks").find((b) => button.classList.contains("kvx-" + b));
    const root = button.closest(".kvx-explorer");
    if (!name || !root || !root.contains(el)) return;
    event.stopPropagation();
    event.preventDefault();
    send({ click: name });
  };
  document.addEventListener("click", clicked, true);
  const changed = () => {
    const value = model.get("value");
    const i = sent.indexOf(value);
    if (i >= 0) {
      sent.splice(0, i + 1);  // the kernel took this text from this box: what the user typed since stays
      return;
    }
    if (box.value !== value) box.value = value;
  };
  model.on("change:value", changed);
  el.classList.add("widget-textarea");
  el.appendChild(box);
  return () => {
    model.off("change:value", changed);
    document.removeEventListener("click", clicked, true);
  };
}
export default { render };
