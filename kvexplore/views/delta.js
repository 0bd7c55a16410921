// The page's copy of apply() in kvexplore/views/delta.py: a figure patch applied to its base, the same steps on
// decoded values (typed arrays for numeric buffers). plot.py puts it before plot_figure.js, which calls applyPatch.
function applyValue(old, v) {
  if (v && typeof v === 'object' && !Array.isArray(v) && !ArrayBuffer.isView(v)) {
    if ('$splice' in v) {
      const [start, stop, items] = v['$splice'];
      if (ArrayBuffer.isView(old)) {
        const out = new old.constructor(start + items.length + (old.length - stop));
        out.set(old.subarray(0, start), 0);
        out.set(items, start);
        out.set(old.subarray(stop), start + items.length);
        return out;
      }
      return old.slice(0, start).concat(Array.from(items), old.slice(stop));
    }
    if ('$in' in v) {
      const [i, sub] = v['$in'];
      const out = old.slice();
      out[i] = applyValue(old[i], sub);
      return out;
    }
  }
  return v;
}

function applyChanges(base, changes) {
  const out = {};
  for (const [k, x] of Object.entries(base || {})) {
    const c = changes[k];
    if (!(c && typeof c === 'object' && c['$del'] === 1)) out[k] = x;
  }
  for (const [k, c] of Object.entries(changes || {})) {
    if (c && typeof c === 'object' && c['$del'] === 1) continue;
    out[k] = applyValue(base ? base[k] : undefined, c);
  }
  return out;
}

function applyPatch(base, patch) {
  if (!patch || !patch.data) return base;
  return {data: (base.data || []).map((t, i) => applyChanges(t, patch.data[i] || {})),
          layout: applyChanges(base.layout || {}, patch.layout || {})};
}
