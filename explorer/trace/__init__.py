"""The trace wing (bottom floor, no torch): a run as plain data (``records``: ``RunTrace``, ``StepTrace``,
``NodeTrace``; JSON with a schema version), reading files safely (``jsonfile``), a run's metrics (``metrics``) and the
Plotly figures of a step (``figures``). A trace replays with no model: in the app, the classroom and a page of its
own."""
