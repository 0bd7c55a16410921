// The hidden PlotlyLoader's module (kvexplore/views/plot.py): the page's copy of plotly.js, asked of the kernel; the
// first loader to initialize runs it (as a classic script, with AMD and CommonJS hidden so that it defines
// window.Plotly); figures wait for it.
export default {
  initialize({ model }) {
    const g = globalThis;
    if (g.Plotly || g.__kvxPlotlyLoading) return;
    g.__kvxPlotlyLoading = true;
    model.on('msg:custom', (msg) => {
      if (!msg || typeof msg.plotly !== 'string' || g.Plotly) return;
      const s = document.createElement('script');
      s.textContent = '(function(define, module, exports){' + msg.plotly + '\n}).call(window);';
      document.head.appendChild(s);
    });
    model.send({want: 'plotly'});  // asked for, not synced: a saved notebook's widget state stays small
  },
  render({ el }) { el.style.display = 'none'; },
};
