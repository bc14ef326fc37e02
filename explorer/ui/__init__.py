"""The Streamlit UI, one module per page or panel. It reads traces (plain data) and never touches model tensors;
``app.py`` at the project root routes between the pages.

Pages: ``explorer_page`` (step a run, travel through its steps, save and replay traces), ``classroom_page``
(recorded lessons phase by phase), ``compare_page`` (two methods or settings side by side), ``bench_page`` (the
benchmark reports). Panels and parts: ``panels`` (one step or run from a trace), ``instruments_panel`` (the probe,
acceptance and the optimal tree), ``counterfactual_panel`` (the what-if of a step), ``sidebar`` (model pair,
method, sampling), ``common`` (the cached pair, examples, errors, settings -> ``MethodConfig``) and ``state`` (every
page's session state, declared once; the only module that touches ``st.session_state``)."""
