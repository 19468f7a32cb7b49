// Renders the formulas pymdownx.arithmatex leaves in the page (\( … \) inline, \[ … \] displayed) with the
// vendored KaTeX, on every page Material shows (document$ emits on each, instant navigation included).
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: true,
  });
});
